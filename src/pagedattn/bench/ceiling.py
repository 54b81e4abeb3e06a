"""The GPU's memory-bandwidth ceilings, measured in the same run as the benchmark.

- Read: a Triton kernel that streams a large buffer once and reduces it (one partial sum per
  program, so nothing is optimised away), persistent grid of SMs x k programs; best of a few
  launch configurations, each timed as a ``do_bench`` median. Decode's floor is its KV bytes
  over this number.
- Copy: ``dst.copy_(src)``, counting bytes read plus bytes written.

PEERS.md measured about 4.5 TB/s read and 4.2-4.3 TB/s copy on one H200.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

READ_BYTES = 4 * 2**30  # far beyond L2, long enough that launch cost vanishes
COPY_BYTES = 2 * 2**30  # per side: 4 GiB of traffic per copy


@dataclasses.dataclass(frozen=True)
class ReadConfig:
    block: int  # float32 elements per program per loop step
    num_warps: int
    programs_per_sm: int


# Each keeps 32-64 KB in flight per SM, enough to cover HBM latency at full bandwidth.
READ_CONFIGS = (
    ReadConfig(block=2048, num_warps=8, programs_per_sm=4),
    ReadConfig(block=4096, num_warps=8, programs_per_sm=4),
    ReadConfig(block=8192, num_warps=8, programs_per_sm=2),
    ReadConfig(block=4096, num_warps=4, programs_per_sm=8),
)


@dataclasses.dataclass(frozen=True)
class Ceilings:
    read_gbps: float
    copy_gbps: float
    read_config: ReadConfig | None = None


@triton.jit
def _read_kernel(
    x_ptr,  # float32 [n_elements]
    partial_ptr,  # float32 [NUM_PROGRAMS]: one sum per program
    n_elements,
    BLOCK: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    EVEN: tl.constexpr,  # n_elements % BLOCK == 0: no mask, full-width loads
):
    pid = tl.program_id(0)
    num_blocks = tl.cdiv(n_elements, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for block in tl.range(pid, num_blocks, NUM_PROGRAMS):
        offsets = tl.cast(block, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if EVEN:
            acc += tl.load(x_ptr + offsets)
        else:
            acc += tl.load(x_ptr + offsets, mask=offsets < n_elements, other=0.0)
    tl.store(partial_ptr + pid, tl.sum(acc, axis=0))


def read_partials(x: torch.Tensor, config: ReadConfig, num_programs: int) -> torch.Tensor:
    """Launch the read kernel over contiguous float32 ``x``; returns the per-program sums."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(
            f"x: expected contiguous float32, got {x.dtype} (contiguous: {x.is_contiguous()})"
        )
    partials = torch.empty(num_programs, dtype=torch.float32, device=x.device)
    n = x.numel()
    _read_kernel[(num_programs,)](
        x,
        partials,
        n,
        BLOCK=config.block,
        NUM_PROGRAMS=num_programs,
        EVEN=n % config.block == 0,
        num_warps=config.num_warps,
    )
    return partials


def measure_read_gbps(
    nbytes: int = READ_BYTES, configs=READ_CONFIGS, device: str | torch.device = "cuda"
) -> tuple[float, ReadConfig]:
    """Best read bandwidth (GB/s, 1e9 bytes) over ``configs``, and the config that gave it."""
    import triton.testing

    device = torch.device(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    x = torch.rand(nbytes // 4, dtype=torch.float32, device=device)  # random, never zeros
    results = []
    for config in configs:
        programs = sms * config.programs_per_sm
        ms = triton.testing.do_bench(
            lambda config=config, programs=programs: read_partials(x, config, programs),
            warmup=10,
            rep=150,
            return_mode="median",
        )
        results.append((x.numel() * 4 / (ms * 1e-3) / 1e9, config))
    return max(results, key=lambda r: r[0])


def measure_copy_gbps(nbytes: int = COPY_BYTES, device: str | torch.device = "cuda") -> float:
    """Device-to-device ``copy_`` bandwidth, bytes read + written (GB/s, 1e9 bytes)."""
    import triton.testing

    src = torch.rand(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=150, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def measure_ceilings(device: str | torch.device = "cuda") -> Ceilings:
    read_gbps, config = measure_read_gbps(device=device)
    torch.cuda.empty_cache()  # the buffers above are gone; give their memory to the sweep
    copy_gbps = measure_copy_gbps(device=device)
    torch.cuda.empty_cache()
    return Ceilings(read_gbps=read_gbps, copy_gbps=copy_gbps, read_config=config)
