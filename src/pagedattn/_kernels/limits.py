"""Numbers the host and the kernels both need, with no imports: the Hopper family's scope in
shapes (which calls the backend choice sends to it, and what its kernel is built for) and the
change of logarithm base the kernels' softmax works in."""

# The Hopper family's scope in shapes (the rest of a call is judged at decode time).
HOPPER_HEAD_DIMS = (64, 128, 256)  # 256: FP8 KV, at most 16 query rows a kv head
HOPPER_MAX_QUERY_LEN = 8
HOPPER_MAX_ROWS = 64  # query_len x query heads per kv head: one warpgroup MMA's M
HOPPER_TRANSPOSED_ROWS = 16  # rows of its transposed form (the MMAs' N), head_dim 256's only
HOPPER_MIN_PAGE = 8  # shorter pages would break the bulk copies' 8-row swizzle atoms

# log2(e): the kernels' softmax runs in log2 units, so sm_scale goes to them times this.
LOG2E = 1.4426950408889634

# Multi-head latent attention (pagedattn.mla): a cached row is the latent (the value, the
# output's width) then the rotary key; scores run over the whole row.
MLA_HEAD_DIM_V = 512
MLA_ROPE_DIM = 64
