"""Launch parameters of the decode kernels, and where they come from.

Resolution order for the grid: explicit ``num_programs`` > tuning table > default
(``DEFAULT_GRID_MULTIPLIER`` programs per SM). Tile shapes come from
:func:`decode_launch_config`. Figures behind the defaults: ``benchmarks/NOTES.md``.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

DEFAULT_PARTITION = 256  # tokens per partition (the seed's)
# Two programs per SM: on the H200 (FP8, 16/1 heads, 128 x 8192) one program per SM reached
# 32% of the read ceiling and two 49-54%; three or four were no better (2026-11-30 sweep).
DEFAULT_GRID_MULTIPLIER = 2
# Programs-per-SM stand-in when running through the interpreter on CPU: small, so CI is fast.
CPU_SM_COUNT = 4


@dataclasses.dataclass(frozen=True)
class DecodeLaunchConfig:
    block_n: int  # KV tokens per tile (capped at the partition size)
    num_warps: int
    num_stages: int
    tma: bool = True  # bulk tensor copies of page-contiguous tiles where the cache allows
    unmasked_loop: bool = True  # full tiles skip masks; only the tail tiles are masked
    qk_fp16: bool = True  # a bf16 query meets FP8 keys in fp16 (exact; cheaper conversion)


def decode_launch_config(
    *, head_dim: int, rows: int, kv_dtype: torch.dtype, partition_size: int
) -> DecodeLaunchConfig:
    """Tile shape for the decode kernel (the caller caps ``block_n`` at the partition size and,
    on the bulk-copy path, the page size). Measured on the H200: 128-token tiles with 4 warps
    and 3 stages beat 64-token tiles and 8 warps at query_len 1 and 4 (NOTES.md)."""
    block_n = 128 if head_dim <= 128 else 64
    return DecodeLaunchConfig(block_n=block_n, num_warps=4, num_stages=3)


@functools.cache
def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@functools.cache
def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SM_COUNT


def default_num_programs(
    device: torch.device, num_kv_heads: int, grid_multiplier: int = DEFAULT_GRID_MULTIPLIER
) -> int:
    """SMs x multiplier, rounded up to a multiple of ``num_kv_heads``."""
    n = sm_count(device) * grid_multiplier
    return -(-n // num_kv_heads) * num_kv_heads
