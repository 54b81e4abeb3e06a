"""pagedattn: Triton kernels for paged-attention decode in LLM serving."""

from . import _backend  # noqa: F401  (before Triton: picks its interpreter without a GPU)
from ._version import __version__
from .cache import (
    PagedCache,
    append_kv,
    block_table_to_indptr,
    build_paged_cache,
    indptr_to_block_table,
    quantize_kv,
)
from .decode import paged_decode
from .mla import append_mla, mla_decode, plan_mla
from .plan import DecodePlan, WorkItem, plan_decode

# The custom ops (torch.ops.pagedattn.*), so torch.compile traces the calls above.
from . import ops  # noqa: F401  isort: skip

__all__ = [
    "DecodePlan",
    "PagedCache",
    "WorkItem",
    "__version__",
    "append_kv",
    "append_mla",
    "block_table_to_indptr",
    "build_paged_cache",
    "indptr_to_block_table",
    "mla_decode",
    "paged_decode",
    "plan_decode",
    "plan_mla",
    "quantize_kv",
]
