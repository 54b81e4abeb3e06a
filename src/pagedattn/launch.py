"""Launch parameters of the kernels (scheduler, decode, reducer) as frozen configs, and the
defaults they are made from.

Resolution order for the grid: explicit ``num_programs`` > tuning table (``tuning/``) >
default (:func:`default_grid_multiplier` programs per SM). Tile shapes come from
:func:`decode_launch_config` and :func:`reduce_launch_config`, the scheduler's from
:func:`schedule_launch`; each is overridden by an argument of the entry points, never by
module state. Figures behind the defaults: ``docs/performance-log.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import os
import warnings

import torch

from ._kernels.common import interpreting, pdl_supported, programs_per_sm

DEFAULT_PARTITION = 256  # tokens per partition (the seed's)
# Programs per SM. Measured on the H200 (FP8, 16/1 heads, 128 x 8192, head_dim chunks of 64;
# docs/performance-log.md, "Grid size and programs per SM"): with <= 16 query rows per kv head,
# 2-warp programs four to an SM reach 72% of the read ceiling (two per SM: 54-64%); with more rows,
# 4-warp programs two to an SM reach 53% (four per SM: 50%).
DEFAULT_GRID_MULTIPLIER = 2
SMALL_ROWS_GRID_MULTIPLIER = 4
SMALL_ROWS = 16  # query rows per kv head (query_len x group) served by the small-row config
# Partial elements (rows x columns x partials) a reducer program merges per step at most.
REDUCE_STEP_ELEMENTS = 2048
# Plans of at most REDUCE_RUN_RECORDS cut sequences keep scratch for REDUCE_RUNS runs a
# record (``ReduceLaunchConfig.groups``): a record's partials merged by up to that many programs.
REDUCE_RUN_RECORDS = 8
REDUCE_RUNS = 16
# Programs-per-SM stand-in when running through the interpreter on CPU: small, so CI is fast.
CPU_SM_COUNT = 4


@dataclasses.dataclass(frozen=True)
class ReduceLaunchConfig:
    """Tile of the split reducer: one program merges ``block_r`` rows x ``block_d`` columns of
    one cut sequence's partials, ``slot_block`` partials per step (``num_stages`` > 1
    pipelines the steps' loads). ``groups`` > 1: a record's partials are cut into up to that
    many runs of whole steps, each merged by its own program, and the runs then merged by
    the last of them to finish (a plan of at most ``REDUCE_RUN_RECORDS`` records; tiles of at
    least 16 columns and min(16, rows) rows)."""

    block_r: int
    block_d: int
    slot_block: int
    num_stages: int = 1
    num_warps: int = 4
    groups: int = 1

    def check(self, head_dim: int, rows: int = 1) -> ReduceLaunchConfig:
        """Returns itself after checking that its sizes are powers of two that suit
        ``head_dim`` and ``rows`` (with runs: at most ``REDUCE_RUNS``, tiles of at least 16
        columns and min(16, rows) rows); raises ValueError otherwise."""
        sizes = dict(
            block_r=self.block_r, block_d=self.block_d, slot_block=self.slot_block,
            groups=self.groups,
        )  # fmt: skip
        bad = {k: v for k, v in sizes.items() if v < 1 or v & (v - 1)}
        runs_bad = self.groups > 1 and (
            self.groups > REDUCE_RUNS
            or self.block_d < 16
            or self.block_r < min(16, next_power_of_2(rows))
        )
        if bad or runs_bad or head_dim % self.block_d:
            raise ValueError(
                f"launch_config.reduce: expected powers of two with block_d dividing "
                f"head_dim={head_dim}; groups > 1 only up to {REDUCE_RUNS}, with block_d >= 16 "
                f"and block_r >= min(16, rows={rows}); got {sizes}"
            )
        return self


@dataclasses.dataclass(frozen=True)
class DecodeLaunchConfig:
    """Tile shape and pipelining of the portable decode kernel, and the reducer's tile;
    ``paged_decode(..., launch_config=)`` takes one (for tuners), :func:`decode_launch_config`
    makes the default."""

    block_n: int  #: KV tokens per tile (capped at the partition size)
    num_warps: int
    num_stages: int
    tma: bool = True  #: bulk tensor copies when a page holds a whole tile and strides allow
    unmasked_loop: bool = True  #: full tiles skip masks; only the tail tiles are masked
    qk_fp16: bool = True  #: a bf16 query meets FP8 keys in fp16 (exact; cheaper conversion)
    #: FP8 keys enter Q K^T as stored (e4m3 tensor cores), a bf16 query as two e4m3 terms;
    #: like qk_fp16, it applies to FP8 keys with a bf16 query only (ignored otherwise)
    qk_fp8: bool = False
    #: Q, K, V and the accumulator are cut along head_dim into chunks this wide (1, 2 or 4
    #: chunks), so one chunk of the converted K/V tile is live in registers at a time.
    head_chunk: int = 64
    maxnreg: int | None = None  #: register cap per thread (more programs fit per SM; may spill)
    #: Pipeline stages of the masked tail loop (the last tile or two of a work). 2 issues a
    #: tile's K/V bulk copies together (a buffer of shared memory and more registers); 1
    #: needs no buffer and reads the masked tile with plain loads instead (a bulk copy
    #: outside a pipelined loop is waited for before the next is issued)
    tail_stages: int = 1
    reduce: ReduceLaunchConfig | None = None  #: the reducer's tile (None takes the default)


def default_grid_multiplier(rows: int) -> int:
    """Programs per SM for ``rows`` query rows per kv head (``query_len x group``)."""
    return SMALL_ROWS_GRID_MULTIPLIER if rows <= SMALL_ROWS else DEFAULT_GRID_MULTIPLIER


# -- targets: what the launch configs depend on in a GPU --

# Shared memory (LDS) one program may use on the AMD targets the portable family is built for
# (CDNA3: MI300, gfx942; CDNA4: MI350, gfx950); ``scripts/kernel_digest.py --target`` checks it.
AMD_SHARED_BYTES = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}
# AMD decode tile: 64 tokens (fewer where a K tile would pass AMD_TILE_BYTES), 4 waves (256
# lanes), 2 stages (the AMD backend's default: K/V tiles double-buffered in LDS). Chosen on
# build facts alone, nothing has run on AMD hardware: every decode build of `kernel_digest.py
# --target gfx942` then takes at most 32 KB of LDS (two programs a CU) and at most 4 VGPRs
# spilled; 128-token tiles at query_len 4 x 16 heads took 48 KB and spilled, bf16 64-token
# tiles at head_dim 256 all 64 KB.
AMD_BLOCK_N = 64
AMD_TILE_BYTES = 16 * 1024
AMD_WARPS = 4
AMD_STAGES = 2


@dataclasses.dataclass(frozen=True)
class Target:
    """The GPU kind a launch is made for, as far as the launch configs go: ``backend`` "cuda"
    (NVIDIA; also the interpreter, which takes NVIDIA's configs) or "hip" (AMD), and ``arch``
    ("sm_90", "gfx942", ...). AMD targets are wave64 and take neither bulk tensor copies nor
    NVIDIA's inline assembly (programmatic dependent launch, trace stamps)."""

    backend: str = "cuda"
    arch: str = ""

    @property
    def amd(self) -> bool:
        return self.backend == "hip"

    @property
    def warp_size(self) -> int:
        return 64 if self.amd else 32

    @property
    def fnuz_type(self) -> bool:
        """Whether Triton has an e4m3fnuz type (``tl.float8e4b8``) here: its AMD backend does
        (native on gfx942), its NVIDIA backend and the interpreter do not."""
        return self.amd

    @property
    def shared_bytes(self) -> int | None:
        """Shared memory one program may use, where it is known (AMD_SHARED_BYTES)."""
        return AMD_SHARED_BYTES.get(self.arch)


@functools.cache
def device_target(device: torch.device) -> Target:
    """``device``'s Target: with a ROCm build of torch (``torch.version.hip``) an AMD GPU named
    by the first field of its ``gcnArchName`` ("gfx942:sramecc+:xnack-" -> "gfx942"); a CUDA
    GPU by its compute capability; the CPU (the interpreter) as NVIDIA."""
    if device.type != "cuda" or interpreting():
        return Target()
    if torch.version.hip is not None:
        arch = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
        return Target("hip", arch)
    major, minor = torch.cuda.get_device_capability(device)
    return Target("cuda", f"sm_{major}{minor}")


def target_warps(warps: int, target: Target | None) -> int:
    """The scheduler's and the reducer's ``warps`` (NVIDIA's 32 lanes, as measured on the H200)
    on ``target`` with as many lanes: half as many wave64 warps on AMD (at least one), so a lane
    holds the share of the tile it holds on NVIDIA (their tiles are sized in elements)."""
    if target is None or target.warp_size == 32:
        return warps
    return max(1, warps * 32 // target.warp_size)


def decode_launch_config(
    *,
    head_dim: int,
    rows: int,
    kv_dtype: torch.dtype,
    partition_size: int,
    kv_scale: str | None = None,
    target: Target | None = None,
) -> DecodeLaunchConfig:
    """Tile shape for the decode kernel (the caller caps ``block_n`` at the partition size, and
    uses bulk copies only when a page holds a whole tile). Measured on the H200
    (docs/performance-log.md, "Tile shapes and pipelining"): 128-token FP8 tiles cut into 64-wide
    head_dim chunks; 2 warps for <= 16 rows, else 4 warps and, for FP8, 5 stages (with the page-id
    load in the loop, Triton double-buffers the tiles from 5 on). 16-bit caches take 64-token tiles:
    128-token ones need 74 KB of shared memory, so only 3 of the 4 programs per SM fit (two waves).

    ``qk_fp8`` (FP8 keys as stored in Q K^T) where it was measured faster (docs/performance-log.md,
    "Q·K^T numerics and FP8 tensor cores", "Per-token scales"): 33-64 rows (one warpgroup tile of 64
    rows) and head_dim 128; 4-12% at q_len 3-4 x 16 heads with per-tensor scales. With per-token
    scales, 5 stages would take 117 KB of shared memory (one program per SM), so 4 (a single
    buffer): 8-9% faster than the exact path's 5 stages at >= 134 MB. Not for <= 32 rows (no FP8
    tensor-core path) or 128 rows (slower).

    ``tail_stages`` 2 (the masked tail tile's bulk copies issued together) for more than 16 rows: at
    q_len 4 x 16 heads over the seed's shapes, 0.89-0.97x the time with per-token scales; per-tensor
    0.97x in geometric mean, from 0.91x (small batches) to 1.03-1.04x at the largest shapes
    (docs/performance-log.md, "Tile shapes and pipelining"). Not for <= 16 rows: 59 more registers
    and 16 KB more shared memory would leave 3 programs per SM instead of 4.

    ``target`` (None: NVIDIA's configs, as above): an AMD one takes ``AMD_BLOCK_N`` tokens
    (fewer for K tiles over ``AMD_TILE_BYTES``: 16-bit caches at head_dim 256), ``AMD_WARPS``
    waves and ``AMD_STAGES`` stages for every step, with plain loads (no bulk copies) and FP8
    keys converted (no ``qk_fp8``). e4m3fnuz caches take e4m3fn's
    configs but ``qk_fp8`` (its query terms are e4m3fn)."""
    if target is not None and target.amd:
        block_n = min(AMD_BLOCK_N, AMD_TILE_BYTES // (head_dim * kv_dtype.itemsize))
        return DecodeLaunchConfig(
            block_n=block_n, num_warps=AMD_WARPS, num_stages=AMD_STAGES, tma=False
        )
    fp8 = kv_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
    block_n = 128 if head_dim <= 128 and fp8 else 64
    if rows <= SMALL_ROWS:
        return DecodeLaunchConfig(block_n=block_n, num_warps=2, num_stages=3)
    qk_fp8 = kv_dtype == torch.float8_e4m3fn and head_dim == 128 and 32 < rows <= 64
    stages = (4 if qk_fp8 and kv_scale == "per_token" else 5) if fp8 else 3
    return DecodeLaunchConfig(
        block_n=block_n, num_warps=4, num_stages=stages, qk_fp8=qk_fp8, tail_stages=2
    )


def default_partition(*, batch: int, max_seq_len: int | None, programs_per_head: int) -> int:
    """Tokens per partition. The seed's 256, unless the host-side ``max_seq_len`` hint shows
    that 256-token partitions would leave programs idle (``batch * cdiv(max_seq_len, 256) <
    programs_per_head``): then about one partition per program, but at most 32 per sequence, as a
    power of two in 64..512. Measured on the H200 (docs/performance-log.md, "Partition size and load
    balance"): 1 x 1024 decode 11.3 -> 8.1 µs (64 tokens), 64 x 1024 14.4 -> 13.0 (128), 1 x 32768
    21.0 ->
    20.0 (512)."""
    if max_seq_len is None:
        return DEFAULT_PARTITION
    if batch * -(-max_seq_len // DEFAULT_PARTITION) >= programs_per_head:
        return DEFAULT_PARTITION
    want = max(-(-max_seq_len // 32), -(-batch * max_seq_len // programs_per_head))
    return min(max(next_power_of_2(want), 64), 512)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1). Plain Python: ``triton.next_power_of_2`` is a
    constexpr function whose host-side call costs microseconds."""
    return 1 << (n - 1).bit_length()


def reduce_launch_config(
    *, rows: int, head_dim: int, records: int, sm_count: int, target: Target | None = None
) -> ReduceLaunchConfig:
    """Reducer tile for ``records`` possible cut sequences (the plan's bound); at most 2048
    partial elements (rows x columns x partials) per step, not pipelined.

    Up to 16 rows (``SMALL_ROWS``): all rows x as many columns (16 to head_dim) as leave about
    one program per SM over the records, partials to fill the step: every program waits for the
    whole decode grid, so fewer of them end a step sooner (whole step, query_len 1: 128 x 1024
    20.4 -> 18.5 µs, 256 x 1024 27.6 -> 26.5, 128 x 8192 78.2 -> 76.6, 64 x 8192 44.1 -> 44.4;
    one record keeps 16 columns x 8 partials, the tile measured fastest alone;
    docs/performance-log.md, "The reducer"). More rows: about one program per SM in all; many
    records keep all rows and 32+ columns, few records split the rows down to 16 and then take
    16 columns, so the merge spreads over many programs (q_len 4, 16 rows x 4: 64 x 8192 4.37 ->
    3.97 µs with 64 x 32 x 1, 16 x 32768 6.80 -> 5.05 with 16 x 16 x 8; steps 18 and 35).
    """
    num_warps = target_warps(ReduceLaunchConfig.num_warps, target)
    all_rows = block_r = next_power_of_2(rows)
    block_d = head_dim
    if rows <= SMALL_ROWS:
        while block_d > 16 and records * (head_dim // block_d) < sm_count:
            block_d //= 2
    else:
        target = -(-sm_count // max(records, 1))

        def programs():
            return -(-rows // block_r) * (head_dim // block_d)

        while programs() < target and block_d > 32:
            block_d //= 2
        while programs() < target and block_r > 16:
            block_r //= 2
        if block_r < all_rows:
            block_d = 16
    while block_r * block_d > REDUCE_STEP_ELEMENTS and block_d > 16:
        block_d //= 2
    slot_block = max(1, min(64, REDUCE_STEP_ELEMENTS // (block_r * block_d)))
    # Few records: runs while the programs still fit about one an SM.
    groups = 1
    if records <= REDUCE_RUN_RECORDS:
        per_record = -(-rows // block_r) * (head_dim // block_d)
        while groups < REDUCE_RUNS and records * per_record * groups * 2 <= sm_count:
            groups *= 2
    return ReduceLaunchConfig(
        block_r=block_r,
        block_d=block_d,
        slot_block=slot_block,
        groups=groups,
        num_warps=num_warps,
    )


def invariant_reduce_config(*, rows: int, head_dim: int) -> ReduceLaunchConfig:
    """The reducer's tile for a batch-invariant plan: one for every batch size and device (the
    order of the merge's float32 operations follows the tile), the one
    :func:`reduce_launch_config` picks for a single record: up to 16 rows spread over
    ``head_dim / 16`` programs (so up to 16 chunks merge in two steps), more rows on a
    single SM."""
    if rows <= SMALL_ROWS:
        red = reduce_launch_config(rows=rows, head_dim=head_dim, records=1, sm_count=head_dim // 16)
    else:
        red = reduce_launch_config(rows=rows, head_dim=head_dim, records=1, sm_count=1)
    return dataclasses.replace(red, groups=1)


@dataclasses.dataclass(frozen=True)
class ScheduleLaunchConfig:
    """Launch parameters of the GPU scheduler; ``plan_decode(..., schedule_config=)`` takes
    one (for tests and benchmarks), :func:`schedule_launch` resolves it for a step.

    ``block``: sequences a scheduler program holds at once (a larger batch is scanned in
    chunks of this size). A program writes its works straight from the registers that hold
    the batch when it is at most ``whole`` sequences (and one block), else from windows of
    ``window`` consecutive sequences reloaded (a decode program touches about batch /
    programs + 2 of them). ``locals``: decode programs whose works one scheduler program
    writes (None: :func:`schedule_locals`); ``warps``: warps per scheduler program (None:
    :func:`schedule_warps`)."""

    block: int = 2048
    window: int = 32
    whole: int = 256
    locals: int | None = None
    warps: int | None = None


@dataclasses.dataclass(frozen=True)
class ScheduleLaunch:
    """A scheduler launch resolved for one step (the kernel's BLOCK_B, WINDOW, LOCALS)."""

    block_b: int
    window: int  # 0: straight from the registers
    locals: int
    warps: int
    grid: int


def schedule_launch(
    config: ScheduleLaunchConfig | None,
    *,
    batch: int,
    num_programs: int,
    num_kv_heads: int,
    sm_count: int,
    target: Target | None = None,
) -> ScheduleLaunch:
    """Resolves ``config`` (None: the defaults) for a step; raises ValueError where its
    ``locals`` does not divide the programs of a kv head. ``target``: see :func:`target_warps`
    (None: NVIDIA's)."""
    config = config or ScheduleLaunchConfig()
    block_b = min(config.block, next_power_of_2(max(batch, 16)))
    locals_ = config.locals or schedule_locals(
        batch=batch,
        block_b=block_b,
        num_programs=num_programs,
        num_kv_heads=num_kv_heads,
        sm_count=sm_count,
    )
    per_head = num_programs // num_kv_heads
    if per_head % locals_:
        raise ValueError(
            f"schedule_config.locals={locals_}: expected a divisor of the programs per kv head "
            f"({per_head})"
        )
    grid = num_programs // locals_
    warps = config.warps or target_warps(
        schedule_warps(block_b=block_b, num_programs=grid, sm_count=sm_count), target
    )
    window = 0 if batch <= min(block_b, config.whole) else config.window
    return ScheduleLaunch(block_b=block_b, window=window, locals=locals_, warps=warps, grid=grid)


def schedule_locals(
    *, batch: int, block_b: int, num_programs: int, num_kv_heads: int, sm_count: int
) -> int:
    """Decode programs whose works one scheduler program writes. One, unless the batch is
    scanned in chunks of ``block_b``; then as many (a power of two, at most 8, dividing the programs
    of a kv head) as leave about two scheduler programs per SM: every scheduler program scans the
    whole batch, so fewer of them do less of the same work, while each writes the works of its
    decode programs one after the other. Measured on the H200 (docs/performance-log.md, "The
    scheduler"), decode programs per scheduler program 1 / 2 / 4: batch 8192 at 528 decode programs
    21.6 / 17.0 / 21.2 µs, at 264 13.1 / 15.3 / 22.5, at 132
    11.1 / 15.7 / 23.5; one block (batch 1024 x 528) 4.9 / 5.0 / 6.2."""
    if batch <= block_b:
        return 1
    per_head = num_programs // num_kv_heads
    n = 1
    while n < 8 and 4 * n * sm_count <= num_programs and per_head % (2 * n) == 0:
        n *= 2
    return n


def schedule_warps(*, block_b: int, num_programs: int, sm_count: int) -> int:
    """Warps of a scheduler program holding ``block_b`` sequences at once. One warp up to 64
    (no cross-warp exchange); above, 4 up to 1024 sequences and 8 beyond, but no more than
    about 8 warps per SM in all for ``num_programs`` scheduler programs (every program scans
    the whole batch, so with 4 programs per SM fewer warps each win). Measured on the H200
    (docs/performance-log.md, "The scheduler"): batch 8192 with 528 programs 33.2 µs at 8 warps,
    27.0 at 2; batch 256 x 528 3.83 -> 3.53; with 132 programs 8 warps stay the best at batch
    8192 (14.7 vs 15.9 at 4)."""
    if block_b <= 64:
        return 1
    by_size = 4 if block_b <= 1024 else 8
    per_sm = max(1, 8 * sm_count // max(num_programs, 1))
    return max(1, min(by_size, 1 << (per_sm.bit_length() - 1)))


def head_chunks(config: DecodeLaunchConfig, head_dim: int) -> int:
    """How many head_dim chunks the kernel uses: 1, 2 or 4 (a chunk >= head_dim is one)."""
    chunk = min(config.head_chunk, head_dim)
    chunks = head_dim // chunk
    if chunk * chunks != head_dim or chunks not in (1, 2, 4):
        raise ValueError(
            f"launch_config.head_chunk={config.head_chunk} with head_dim={head_dim}: expected "
            f"a width that cuts head_dim into 1, 2 or 4 equal chunks"
        )
    return chunks


@functools.cache
def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@functools.cache
def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SM_COUNT


def default_num_programs(device: torch.device, num_kv_heads: int, grid_multiplier: int) -> int:
    """SMs x multiplier, rounded up to a multiple of ``num_kv_heads``."""
    n = sm_count(device) * grid_multiplier
    return -(-n // num_kv_heads) * num_kv_heads


def _pdl_from_env(value: str | None) -> bool:
    """``PAGEDATTN_PDL``: unset, empty, 1/true/yes/on leave PDL on (the default); 0/false/no/off
    turn it off; anything else leaves it on with a warning."""
    text = (value or "").strip().lower()
    if text in ("0", "false", "no", "off"):
        return False
    if text not in ("", "1", "true", "yes", "on"):
        warnings.warn(
            f"PAGEDATTN_PDL: expected 1 or 0, got {value!r}; programmatic dependent launch "
            "stays on",
            stacklevel=2,
        )
    return True


# Programmatic dependent launch (PDL) of the scheduler, the decode kernel and the reducer, on
# sm_90+ unless PAGEDATTN_PDL=0 is in the environment: each kernel may launch while the one
# before it finishes and waits for its results before reading anything. A persistent grid
# launched early lands on whichever SMs are free, so the decode kernel is launched early only
# where its programs fill every SM exactly (pdl_places_evenly; without that guard bf16 KV at
# q_len 1, batch 128 ran 1.10-1.16x slower). Whole step with PDL against without, seed grid:
# 0.981x in geometric mean; decode + reduce with the reducer on PDL: 0.93-1.00x
# (`pagedattn bench` A/B, docs/performance-log.md, "Programmatic dependent launch").
_PDL = _pdl_from_env(os.environ.get("PAGEDATTN_PDL"))


def pdl_enabled(device: torch.device) -> bool:
    """Whether :func:`pagedattn.plan_decode`, :func:`pagedattn.paged_decode` and the reducer use
    programmatic dependent launch on ``device``: on sm_90+ unless ``PAGEDATTN_PDL=0``
    (benchmarks record it with their results). The decode kernel is then launched early only
    where its grid fills every SM exactly."""
    return _PDL and pdl_supported(device)


def cache_strides(cache: torch.Tensor, kv_layout: str) -> tuple[int, int, int, int]:
    """Strides as (page, slot, head, dim) whatever the layout."""
    s = cache.stride()
    return (s[0], s[1], s[2], s[3]) if kv_layout == "NHD" else (s[0], s[2], s[1], s[3])


def scale_strides(scale: torch.Tensor | None, kv_layout: str) -> tuple[int, int, int]:
    if scale is None or scale.dim() != 3:
        return (0, 0, 0)
    s = scale.stride()
    return (s[0], s[1], s[2]) if kv_layout == "NHD" else (s[0], s[2], s[1])


# Per decode-kernel specialisation: how many of its programs fit on one SM at once.
_programs_per_sm: dict[tuple, int | None] = {}


def pdl_places_evenly(kernel, args: tuple, launch: dict, plan, dtypes: tuple) -> bool:
    """Whether a decode kernel (either family's) may be launched early (PDL) without uneven
    SM shares: only when its programs fill every SM exactly (the grid is SMs x the programs
    that fit on one), so wherever they are placed first, each SM ends with the same number.
    Asks the CUDA occupancy API once per specialisation (compiling the early-launched
    variant, ``kernel.warmup(*args, **launch, launch_pdl=True)``, without launching it).

    The specialisation's key: the kernel, ``launch`` (its constexprs and options, in the
    fixed order the caller builds them) and ``dtypes``, those of the query, the cache and the
    output (the scales' and the LSE's follow from the constexprs); a few values, as this runs
    on every call."""
    sms = sm_count(plan.device)
    if plan.num_programs % sms:
        return False
    key = (kernel, plan.device.index, *dtypes, *launch.values())
    fits = _programs_per_sm.get(key, -1)
    if fits == -1:
        compiled = kernel.warmup(*args, grid=(plan.num_programs,), **launch, launch_pdl=True)
        fits = _programs_per_sm[key] = programs_per_sm(compiled)
    return fits is not None and fits * sms == plan.num_programs


def decode_launch(kernel, args: tuple, plan, dtypes: tuple, *, pdl_flag: bool, **launch):
    """A decode kernel's (either family's) :class:`BoundLaunch` over the plan's grid, launched
    early (programmatic dependent launch, while the scheduler runs) only where its programs
    fill every SM exactly (:func:`pdl_places_evenly`; ``args``, ``dtypes``: see there).
    ``pdl_flag``: the kernel takes a ``PDL`` constexpr saying whether it was."""
    flag = {"PDL": True} if pdl_flag else {}
    pdl = pdl_enabled(plan.device) and pdl_places_evenly(
        kernel, args, {**launch, **flag}, plan, dtypes
    )
    if pdl_flag:
        launch["PDL"] = pdl
    return BoundLaunch(kernel, (plan.num_programs,), **launch, launch_pdl=pdl)


class BoundLaunch:
    """One kernel launch fixed but for its runtime arguments: the kernel, grid, constexprs and
    launch options. The first call goes through Triton's JIT (which compiles or finds the
    kernel); later calls go through :attr:`direct` (Triton's C launcher with everything fixed
    packed once, :class:`DirectLaunch`) where this Triton allows it, else through the compiled
    handle's ``[grid]`` (host time: docs/performance-log.md, "Host time"). Under the
    interpreter every call goes through the JIT.

    A caller keeps one per call signature: everything Triton specialises the runtime arguments
    on (dtypes, 16-byte alignment of tensors; the value of ints: 1, divisible by 16, 32 or 64
    bits) must be fixed by that signature (``pagedattn.checks.tensor_key`` covers tensors;
    the ints a caller passes follow from shapes and strides). Arguments are passed
    positionally in the kernel's parameter order; the constexprs, all of them, by keyword
    here, and the kernel takes them last. A kernel that takes bulk-copy descriptors gets, once
    :attr:`direct` is set, each descriptor as :meth:`DirectLaunch.descriptor` expands it.
    """

    __slots__ = ("compiled", "constexprs", "direct", "grid", "kernel", "options", "values")

    def __init__(self, kernel, grid: tuple, *, num_warps: int, launch_pdl: bool = False, **named):
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))  # the compiled handle takes three
        self.options = {k: named.pop(k) for k in ("num_stages", "maxnreg") if k in named}
        self.options["num_warps"] = num_warps
        self.options["launch_pdl"] = launch_pdl
        self.constexprs = named
        self.values = ()
        self.compiled = None
        self.direct: DirectLaunch | None = None

    def __call__(self, *args) -> None:
        direct = self.direct
        if direct is not None:
            direct(*args)
            return
        compiled = self.compiled
        if compiled is not None:
            compiled[self.grid](*args, *self.values)
            return
        result = self.kernel[self.grid](*args, **self.constexprs, **self.options)
        if not interpreting():
            # The compiled handle takes the constexprs positionally, in parameter order.
            self.values = tuple(self.constexprs[name] for name in constexpr_names(self.kernel))
            self.compiled = result
            self.direct = DirectLaunch.make(result, self.grid, self.values)


# Triton releases whose C launcher DirectLaunch is written for (the arguments of the launcher's
# ``launch`` and the tensor-descriptor wrapper around it are Triton's internals).
DIRECT_TRITON = ("3.6.",)


class DirectLaunch:
    """A compiled kernel's launch through Triton's C launcher with everything fixed packed once:
    grid, function handle, launch options and metadata, constexpr values. Per call it reads
    the current device's stream and calls the launcher, skipping what ``compiled[grid](...)``
    does besides (a closure per call, the launch-metadata dictionary, the enter and exit hooks
    when none is registered, the scratch allocators when the kernel needs none, and each
    bulk-copy descriptor's encoding, which :meth:`descriptor` does once an address). The
    launch stays visible to profilers: it is the same ``cuLaunchKernelEx``, and Triton's launch
    hooks, when registered, are called as Triton calls them.

    Made by :meth:`make` from a compiled kernel, or None where this Triton or the kernel
    needs Triton's own path (another release, global or profile scratch memory)."""

    __slots__ = ("compiled", "descriptors", "grid", "head", "launcher", "metas", "quiet", "tail")

    # Descriptors kept per launch (by cache address) before all are forgotten.
    MAX_DESCRIPTORS = 1024

    @classmethod
    def make(cls, compiled, grid: tuple, values: tuple) -> DirectLaunch | None:
        import triton

        run = getattr(compiled, "run", None)  # (None: not a compiled kernel, a stand-in's)
        if run is None or not triton.__version__.startswith(DIRECT_TRITON):
            return None
        metadata = compiled.metadata
        if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
            return None
        launcher = run.launch
        # With tensor descriptors, Triton wraps its C launcher in a function that encodes each
        # descriptor per call; the C launcher is the wrapper's ``launcher``.
        code = getattr(launcher, "__code__", None)
        if code is not None:
            if "launcher" not in code.co_freevars:
                return None
            launcher = launcher.__closure__[code.co_freevars.index("launcher")].cell_contents
        signature = compiled.src.signature
        count = sum(str(kind).startswith("tensordesc") for kind in signature.values())
        metas = getattr(metadata, "tensordesc_meta", None) or [None] * count
        head = (
            compiled.function,
            run.launch_cooperative_grid,
            run.launch_pdl,
            None,  # global scratch
            None,  # profile scratch
            compiled.packed_metadata,
        )
        return cls(compiled, grid, launcher, head, values, metas)

    @classmethod
    def around(cls, bound: BoundLaunch, launcher) -> DirectLaunch:
        """A direct launch of ``bound`` through ``launcher``, a stand-in for a compiled kernel's
        (to run the host path without a GPU: the CPU measurements and tests). ``launcher``
        gets what Triton's would; descriptors are encoded as Triton encodes them where it has
        no descriptor metadata (no GPU call)."""
        values = tuple(bound.constexprs[name] for name in constexpr_names(bound.kernel))
        head = (
            0,
            False,
            bound.options["launch_pdl"],
            None,
            None,
            (bound.options["num_warps"], 1, 0),
        )
        return cls(None, bound.grid, launcher, head, values, [None, None])

    def __init__(self, compiled, grid, launcher, head, tail, metas):
        self.compiled = compiled
        self.grid = grid
        self.launcher = launcher
        self.head = head
        self.tail = tail
        self.metas = tuple(metas)
        self.descriptors: dict = {}
        self.quiet = (*head, None, None, None)  # the head, then no launch metadata or hooks

    def __call__(self, *args) -> None:
        self.on(_raw_stream(_current_device()), *args)

    def on(self, stream: int, *args) -> None:
        """The launch on ``stream`` (a raw stream, :func:`current_stream`)."""
        if hooks_quiet():
            self.launcher(*self.grid, stream, *self.quiet, *args, *self.tail)
            return
        enter = _RUNTIME_KNOBS.launch_enter_hook
        exit_hook = _RUNTIME_KNOBS.launch_exit_hook
        launch_metadata = self.compiled.launch_metadata(self.grid, stream, *args, *self.tail)
        self.launcher(
            *self.grid, stream, *self.head, launch_metadata, enter, exit_hook, *args, *self.tail
        )

    def descriptor(self, index: int, key, make, *make_args) -> tuple:
        """The launcher's arguments for the kernel's ``index``-th descriptor parameter:
        ``make(*make_args)``'s descriptor encoded once per ``key`` (the caller's: the cache's
        address, for a launch whose signature fixes the rest of the descriptor) and kept, at
        most ``MAX_DESCRIPTORS`` of them. What is kept holds no reference to the cache: its
        address as an int, the encoded descriptor, its shape and strides."""
        found = self.descriptors.get((index, key))
        if found is None:
            found = _encode(make(*make_args), self.metas[index])
            self.descriptors[(index, key)] = found
            if len(self.descriptors) > self.MAX_DESCRIPTORS:
                self.descriptors.clear()
                self.descriptors[(index, key)] = found
        return found


class DecodeLaunch:
    """What both families' prepared decode launches (a decode kernel's ``launch`` and its
    ``reduce`` step) share: called with a call's tensors, the step bound to their addresses
    launches (:meth:`bind`), or, before the first call has compiled the kernel (or where this
    Triton launches through its own path), Triton's JIT (the family's ``jit``, which takes
    Triton's JIT forms of the arguments)."""

    __slots__ = ()
    contiguous_q = False  # (whether the query goes to the kernel made contiguous first)

    def bind(
        self, k_cache, v_cache, block_table, seq_lens, plan, k_scale, v_scale, sinks,
        query_start_loc, trace,
    ) -> BoundStep | None:  # fmt: skip
        """The step's launches bound to these tensors' addresses (descriptors encoded), or
        None where they launch only through Triton's JIT yet."""
        direct = self.launch.direct
        if direct is None or not self.reduce.bindable:
            return None
        args = self.slot_args(
            direct, k_cache, v_cache, block_table, seq_lens, plan, k_scale, v_scale, sinks,
            query_start_loc, trace,
        )  # fmt: skip
        reduce = self.reduce.bind(plan, sinks, query_start_loc)
        return BoundStep(SlotLaunch(direct, args), reduce, self.contiguous_q)

    def __call__(
        self, q, k_cache, v_cache, block_table, seq_lens, plan, k_scale, v_scale, sinks,
        query_start_loc, out, lse, trace,
    ) -> None:  # fmt: skip
        fixed = (k_cache, v_cache, block_table, seq_lens, plan, k_scale, v_scale, sinks)
        bound = self.bind(*fixed, query_start_loc, trace)
        direct = self.launch.direct
        if bound is not None:
            bound(q, out, lse)
        elif direct is None:
            self.jit(q, *fixed, query_start_loc, out, lse, trace)
        else:
            # The decode kernel launches directly, the reducer not (where Triton gives it no
            # direct launch): each its own way.
            decode = SlotLaunch(direct, self.slot_args(direct, *fixed, query_start_loc, trace))
            decode.hooked(
                current_stream(), q.contiguous() if self.contiguous_q else q, out,
                out if lse is None else lse,
            )  # fmt: skip
            self.reduce(plan, out, lse, sinks, query_start_loc)


def current_stream() -> int:
    """The current device's current stream, raw, as the direct launches take it."""
    return _raw_stream(_current_device())


# A per-call argument of a :class:`SlotLaunch` (the query, the output, the LSE).
SLOT = object()


def hooks_quiet() -> bool:
    """Whether no launch hook is registered with Triton (then a direct launch passes none)."""
    enter = _RUNTIME_KNOBS.launch_enter_hook
    exit_hook = _RUNTIME_KNOBS.launch_exit_hook
    # (Triton 3.6 keeps its launch hooks in chains; with none registered, none is called.)
    return not (getattr(enter, "calls", True) or getattr(exit_hook, "calls", True))


class SlotLaunch:
    """A direct launch with every argument fixed but a few (``SLOT`` in ``args``, filled in
    order per call): what follows from the tensors that come back call after call (caches,
    block table, lengths, scales, a plan's buffers) packed once, tensors as their addresses, so
    a call passes Triton's C launcher its arguments in one go. Its keeper keys it by those
    tensors' addresses (``signature.tensor_sig_at``): one made for other memory is never
    taken."""

    __slots__ = ("args", "direct", "launcher", "parts")

    def __init__(self, direct: DirectLaunch, args: tuple):
        args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
        cuts = [i for i, a in enumerate(args) if a is SLOT]
        ends = [-1, *cuts, len(args)]
        pieces = [args[start + 1 : end] for start, end in itertools.pairwise(ends)]
        # The launcher's own arguments before the stream and around the kernel's.
        pieces[0] = (*direct.quiet, *pieces[0])
        pieces[-1] = (*pieces[-1], *direct.tail)
        self.parts = (tuple(direct.grid), *pieces)
        self.args = args
        self.direct = direct
        self.launcher = direct.launcher

    def __call__(self, stream: int, *values) -> None:
        """The launch on ``stream`` with ``values`` in its slots (none or two; a decode step
        launches its three inline, :class:`BoundStep`)."""
        if not hooks_quiet():
            self.hooked(stream, *values)
        elif values:
            a, b = values
            grid, p0, p1, p2 = self.parts
            self.launcher(*grid, stream, *p0, a, *p1, b, *p2)
        else:
            grid, p0 = self.parts
            self.launcher(*grid, stream, *p0)

    def hooked(self, stream: int, *values) -> None:
        """The launch on ``stream`` through :meth:`DirectLaunch.on` (hooks called)."""
        filled = iter(values)
        self.direct.on(stream, *(next(filled) if a is SLOT else a for a in self.args))


class BoundStep:
    """A decode step's launches bound to one set of addresses: the decode kernel's
    (:class:`SlotLaunch`, slots: query, output, LSE) and the reducer's (slots: output, LSE;
    None where the plan cuts no sequence). Called with the query, the output and the LSE
    (None: not written), all checked by the caller."""

    __slots__ = ("contiguous_q", "debug", "decode", "dense_q", "reduce", "return_lse")

    def __init__(self, decode: SlotLaunch, reduce: SlotLaunch | None, contiguous_q: bool):
        self.decode = decode
        self.reduce = reduce
        self.contiguous_q = contiguous_q
        # (The caller's: whether its calls return the LSE, read faults back, and whether their
        # queries are laid out as contiguous tensors of their shape.)
        self.return_lse = self.debug = self.dense_q = False

    def __call__(self, q, out, lse) -> None:
        if self.contiguous_q:
            q = q.contiguous()  # (kept until launched)
        stream = _raw_stream(_current_device())
        q_at = q.data_ptr()
        out_at = out.data_ptr()
        lse_at = out_at if lse is None else lse.data_ptr()
        decode, reduce = self.decode, self.reduce
        if not hooks_quiet():
            decode.hooked(stream, q_at, out_at, lse_at)
            if reduce is not None:
                reduce.hooked(stream, out_at, lse_at)
            return
        # (Both SlotLaunch calls, inline: no hook registered.)
        grid, p0, p1, p2, p3 = decode.parts
        decode.launcher(*grid, stream, *p0, q_at, *p1, out_at, *p2, lse_at, *p3)
        if reduce is not None:
            grid, p0, p1, p2 = reduce.parts
            reduce.launcher(*grid, stream, *p0, out_at, *p1, lse_at, *p2)


def _encode(desc, meta) -> tuple:
    """A descriptor as Triton's launcher takes it (its ``make_tensordesc_arg``), with any
    tensor in it replaced by its address."""
    from triton.backends.nvidia.driver import make_tensordesc_arg

    return tuple(
        a.data_ptr() if isinstance(a, torch.Tensor) else a for a in make_tensordesc_arg(desc, meta)
    )


def _knobs():
    from triton import knobs

    return knobs.runtime


_RUNTIME_KNOBS = _knobs()
_current_device = torch._C._cuda_getDevice if torch.cuda.is_available() else (lambda: 0)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0)


def constexpr_names(kernel) -> tuple[str, ...]:
    """The names of a kernel's constexpr parameters, in order (under the interpreter too,
    whose kernels have no ``params``)."""
    signature = inspect.signature(getattr(kernel, "fn", kernel))
    return tuple(p.name for p in signature.parameters.values() if "constexpr" in str(p.annotation))
