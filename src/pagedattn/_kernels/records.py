"""The plan's int32 records: field offsets and fault codes, named once for every kernel.

``plan.metadata`` holds, in this order: ``work_indptr[num_programs + 1]``,
``works[max_works, WORK_FIELDS]``, ``reduces[max_reduces, REDUCE_FIELDS]``, the step's
partition size (one element), ``planned_lens[batch]`` (the lengths the plan was made from),
``faults[batch]`` (a bit set of ``FAULT_*`` codes per sequence) and, for a plan made with
``query_start_loc``, ``planned_rows[batch, ROWS_FIELDS]`` (each sequence's query rows as the
plan found them; ``ROWS_INVALID`` where they were not a valid range). ``pagedattn.plan``
turns these into offsets and views; the kernels take the buffer and the offsets.
"""

import triton.language as tl

# -- a work: one program's pass over one (sequence, kv head) token range --
WORK_PROGRAM = tl.constexpr(0)
WORK_SEQ = tl.constexpr(1)
WORK_KV_HEAD = tl.constexpr(2)
WORK_Q_HEAD_START = tl.constexpr(3)
WORK_Q_HEAD_END = tl.constexpr(4)
WORK_TOKEN_START = tl.constexpr(5)
WORK_TOKEN_END = tl.constexpr(6)
WORK_PARTIAL_SLOT = tl.constexpr(7)  # -1: the work writes ``out`` itself
WORK_FIELDS = tl.constexpr(8)

# -- a reduce record: the partials of one cut (sequence, kv head), in token order --
REDUCE_SEQ = tl.constexpr(0)  # -1: unused record
REDUCE_KV_HEAD = tl.constexpr(1)
REDUCE_FIRST_SLOT = tl.constexpr(2)
REDUCE_NUM_SLOTS = tl.constexpr(3)
REDUCE_FIELDS = tl.constexpr(4)

# -- a sequence's query rows in a plan made with query_start_loc: q rows start : end --
ROWS_START = tl.constexpr(0)  # ROWS_INVALID: not a valid range (FAULT_QUERY_ROWS)
ROWS_END = tl.constexpr(1)
ROWS_FIELDS = tl.constexpr(2)
ROWS_INVALID = tl.constexpr(-1)

# -- fault codes (bits of ``faults[seq]``); the scheduler sets the length ones and clears the
# rest each step, the decode kernel adds the others --
FAULT_NEGATIVE_LENGTH = tl.constexpr(1)
FAULT_SHORT_LENGTH = tl.constexpr(2)  # 0 < length < query_len (or its query_start_loc rows)
FAULT_LENGTH_LIMIT = tl.constexpr(4)  # above what the scheduler's int32 counts can hold
FAULT_CAPACITY = tl.constexpr(8)  # more tokens than the block table's columns hold
FAULT_PAGE_ID = tl.constexpr(16)  # a page id outside [0, num_pages) among the used pages
FAULT_STALE_PLAN = tl.constexpr(32)  # length (or query rows) differ from the planned ones
# query_start_loc does not give the sequence a range of q's rows after every earlier
# sequence's (negative, decreasing, past q's rows, or more than query_len rows): its rows
# cannot be placed, so nothing is written for it
FAULT_QUERY_ROWS = tl.constexpr(64)

FAULT_REASONS = {
    FAULT_NEGATIVE_LENGTH.value: "negative length",
    FAULT_SHORT_LENGTH.value: "length between 1 and query_len - 1 (or its query rows - 1)",
    FAULT_LENGTH_LIMIT.value: "length above the supported maximum for this batch size",
    FAULT_CAPACITY.value: "length beyond the block table's capacity (columns x page_size)",
    FAULT_PAGE_ID.value: "a page id outside [0, num_pages) among the pages it uses",
    FAULT_STALE_PLAN.value: (
        "length differs from the one the plan was made from (stale plan; or its "
        "query_start_loc rows do)"
    ),
    FAULT_QUERY_ROWS.value: (
        "query_start_loc gives it no range of q's rows after the earlier sequences' with at "
        "most query_len rows (nothing written)"
    ),
}

# The smallest partition (tokens); decode tiles are at least this long.
MIN_PARTITION = 16
# Lengths above max_seq_len_supported are refused (FAULT_LENGTH_LIMIT) so that the
# scheduler's int32 partition counts cannot pass 2^30 over a batch.
COUNT_LIMIT = 1 << 30


def max_seq_len_supported(batch: int) -> int:
    """The longest sequence a plan for ``batch`` sequences accepts (well beyond any cache that
    fits in a GPU's memory: 2^30 tokens at batch 1, about 2^21 at batch 8192)."""
    return min(COUNT_LIMIT, MIN_PARTITION * (COUNT_LIMIT // max(batch, 1) - 1))
