"""Launch parameters of the decode kernels, and where they come from.

Resolution order for the grid: explicit ``num_programs`` > tuning table > default
(one program per SM). Tile shapes come from :func:`decode_launch_config`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

DEFAULT_PARTITION = 256  # tokens per partition (the seed's)
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
    """Tile shape for the decode kernel; ``block_n`` never exceeds the partition."""
    block_n = 128 if head_dim <= 128 else 64
    num_warps = 4 if rows <= 16 else 8
    return DecodeLaunchConfig(block_n=block_n, num_warps=num_warps, num_stages=3)


@functools.cache
def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SM_COUNT


def default_num_programs(device: torch.device, num_kv_heads: int, grid_multiplier: int = 1) -> int:
    """SMs x multiplier, rounded up to a multiple of ``num_kv_heads``."""
    n = sm_count(device) * grid_multiplier
    return -(-n // num_kv_heads) * num_kv_heads
