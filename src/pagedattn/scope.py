"""What each kernel family covers, in shapes: the facts both the family choice (``backend``)
and the families themselves read, kept below both."""

from __future__ import annotations

import torch

from ._kernels.limits import (
    HOPPER_HEAD_DIMS,
    HOPPER_MAX_QUERY_LEN,
    HOPPER_MAX_ROWS,
    HOPPER_MIN_PAGE,
    HOPPER_TRANSPOSED_ROWS,
)


def hopper_shape_reason(*, kv_dtype, query_len, head_dim, page_size, group) -> str | None:
    """What the Hopper family expects of a step's shape that this one lacks, or None."""
    rows = query_len * group
    needs = (
        (
            kv_dtype in (torch.float8_e4m3fn, torch.bfloat16, torch.float16),
            f"kv dtype float8_e4m3fn, bfloat16 or float16, got {kv_dtype}",
        ),
        (
            query_len <= HOPPER_MAX_QUERY_LEN and rows <= HOPPER_MAX_ROWS,
            f"query_len at most {HOPPER_MAX_QUERY_LEN} and query_len x query heads per kv head"
            f" at most {HOPPER_MAX_ROWS}, got {query_len} x {group}",
        ),
        (
            head_dim in HOPPER_HEAD_DIMS
            and (
                head_dim <= 128
                or (kv_dtype == torch.float8_e4m3fn and rows <= HOPPER_TRANSPOSED_ROWS)
            ),
            f"head_dim one of {HOPPER_HEAD_DIMS} (256 with FP8 KV and at most "
            f"{HOPPER_TRANSPOSED_ROWS} query rows a kv head), got {head_dim} with {kv_dtype} "
            f"and {query_len} x {group} rows",
        ),
        (page_size >= HOPPER_MIN_PAGE, f"page_size at least {HOPPER_MIN_PAGE}, got {page_size}"),
    )
    return next((f"expected {what}" for ok, what in needs if not ok), None)
