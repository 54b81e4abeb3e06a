"""Every implementation the benchmark runs, registered in one place: :data:`PROVIDERS`.

A provider says whether it can run here (``available``) and on a case (``supports``), and
``prepare(inputs)`` returns a :class:`Prepared`: called with one KV copy it gives the zero-arg
step function that is timed, and it carries the host time of any planning done outside the
timed region (``plan_host_us``).

- ``pagedattn``: the whole step, ``plan_decode`` + ``paged_decode`` (our plan runs on the GPU
  and is graph-capturable, so it belongs inside the timed step).
- ``pagedattn-decode``: ``paged_decode`` alone with a precomputed plan.
- ``pagedattn-tuned``: the whole step with the host-side ``max_seq_len`` hint (the tuning
  table's grid, and the partition size the hint picks for small batches).
- ``flashinfer``: ``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores) for query_len 1,
  ``BatchPrefillWithPagedKVCacheWrapper`` (causal) for query_len > 1, both in CUDA-graph mode;
  ``plan()`` (host work plus a sync) runs outside the timed region and is reported apart.
- ``flashinfer-fa3``: the same wrappers with ``backend="fa3"``: FlashInfer's own
  FlashAttention-3 templates for Hopper (JIT-compiled from the wheel), sm_90 only. FA3 reads an
  FP8 cache only with an FP8 query, so this one takes 16-bit caches (bf16 query) and skips FP8
  cases, which ``flashinfer-fa3-fp8`` runs.
- ``flashinfer-fa3-fp8``: FA3 on an FP8 cache as engines run it: the query quantised to e4m3
  with one per-tensor scale (amax / 448; done before the timed step, which starts from the FP8
  query), the query, K and V scales given to the kernel as float32 per-head tensors (each
  head the tensor's scale), which folds them into its softmax scale and output; the
  probabilities are FP8 too, so its error bound is XQA's. Per-tensor scales only. FlashInfer's
  FA3 scheduler makes one work per (query head, sequence, 128-row query tile): the query heads
  of a KV head are not packed into one tile, and a sequence is not split across CTAs.
- ``pagedattn-triton``: the whole step on the portable family (``backend="triton"``), beside
  ``pagedattn``, which takes the Hopper family where it covers the case.
- ``pagedattn-gluon``: the whole step on the Hopper family (``backend="gluon"``, its plans of
  two programs an SM), on the cases that family covers.
- ``xqa``: TensorRT-LLM's XQA decode kernel through FlashInfer
  (``trtllm_batch_decode_with_kv_cache(..., backend="xqa")``): FP8 KV with one per-tensor
  scale each, pages of 16..128 tokens; a page-1024 cache is offered as the same bytes at page
  128 through an expanded block table (NHD). It takes a bf16 query and computes with FP8 query
  and probabilities, so its error bound is looser (about 3e-2 measured).
- ``torch-reference``: the float64 truth every output is checked against; never timed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import torch

import pagedattn
from pagedattn.cache import FP8_MAX
from pagedattn.reference import paged_decode_torch

from .cases import KV_DTYPES, Q_DTYPES, Case
from .timing import host_time_us

PLAN_SAMPLES = 7  # host-time samples of a plan() call; the median is reported
# FlashInfer's split-KV partial results live in this buffer; its prefill path under CUDA graphs
# overflowed 256 MB at batch >= 16 and worked with 8 GiB (PEERS.md).
FLASHINFER_WORKSPACE_BYTES = 8 * 2**30


@dataclasses.dataclass(frozen=True)
class KVCopy:
    """One copy of the KV cache (with its scales) for the timing rotation."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


@dataclasses.dataclass
class Inputs:
    """Everything a provider needs for one case; ``copies[0]`` is the cache the reference saw."""

    case: Case
    q: torch.Tensor  # [batch * query_len, num_q_heads, head_dim]
    block_table: torch.Tensor  # int32 [batch, max_pages_per_seq]
    seq_lens: torch.Tensor  # int32 [batch]
    copies: list[KVCopy]
    kv_layout: str = "NHD"

    @property
    def device(self) -> torch.device:
        return self.q.device


@dataclasses.dataclass
class Prepared:
    """``prepared(copy)`` -> a zero-arg step over that KV copy returning the output tensor."""

    make_step: Callable[[KVCopy], Callable[[], torch.Tensor]]
    plan_host_us: float | None = None
    note: str = ""

    def __call__(self, copy: KVCopy) -> Callable[[], torch.Tensor]:
        return self.make_step(copy)


class Provider:
    """Base: always available, supports every case, timed."""

    name = ""
    is_peer = False  # a peer is what ours is compared with (ratio_vs_<peer> columns)
    timed = True
    # ‖out − ref‖ / ‖ref‖ beyond which an output is WRONG and not timed, per KV dtype; None:
    # the run's bounds.
    error_bounds: dict[str, float] | None = None

    def available(self) -> tuple[bool, str]:
        return True, ""

    def version(self) -> str:
        return ""

    def supports(self, case: Case) -> tuple[bool, str]:
        return True, ""

    def prepare(self, inputs: Inputs) -> Prepared:
        raise NotImplementedError


class PagedAttnProvider(Provider):
    """Ours; ``with_plan`` times plan + decode, else decode with a precomputed plan.

    ``tuned`` gives the planner the host-side ``max_seq_len`` hint, so the grid comes from the
    tuning table (shipped per device, or the user's) and small batches get a smaller partition
    size; otherwise the default grid and partition are used.
    """

    is_peer = False

    def __init__(self, name: str, *, with_plan: bool, tuned: bool = False, backend="auto"):
        self.name = name
        self.with_plan = with_plan
        self.tuned = tuned
        self.backend = backend

    def available(self) -> tuple[bool, str]:
        if self.backend != "gluon":
            return True, ""
        reason = pagedattn.backend.hopper_reason(torch.device("cuda"))
        return reason is None, f"the Hopper family needs {reason}"

    def supports(self, case: Case) -> tuple[bool, str]:
        if self.backend != "gluon":
            return True, ""
        reason = pagedattn.backend.hopper_shape_reason(
            kv_dtype=KV_DTYPES[case.kv_dtype],
            query_len=case.query_len,
            head_dim=case.head_dim,
            page_size=case.page_size,
            group=case.num_q_heads // case.num_kv_heads,
        )
        return reason is None, reason or ""

    def version(self) -> str:
        return pagedattn.__version__

    def prepare(self, inputs: Inputs) -> Prepared:
        case = inputs.case
        plan_args = case.plan_kwargs()
        if self.tuned:
            plan_args["max_seq_len"] = max(case.seq_lens())
        seq_lens, q, table = inputs.seq_lens, inputs.q, inputs.block_table
        # Plans made for the family asked for (its grid): pagedattn-gluon's, two programs an SM.
        with pagedattn.backend.using_backend(self.backend):
            plan = pagedattn.plan_decode(seq_lens, **plan_args)
        out = torch.empty_like(q)

        def replan():
            return pagedattn.plan_decode(seq_lens, **plan_args, reuse=plan)

        def make_step(copy: KVCopy) -> Callable[[], torch.Tensor]:
            def decode() -> torch.Tensor:
                return pagedattn.paged_decode(
                    q,
                    copy.k_cache,
                    copy.v_cache,
                    table,
                    seq_lens,
                    plan=plan,
                    k_scale=copy.k_scale,
                    v_scale=copy.v_scale,
                    kv_layout=inputs.kv_layout,
                    out=out,
                    backend=self.backend,
                )

            if not self.with_plan:
                return decode

            def step() -> torch.Tensor:
                replan()
                return decode()

            return step

        replan()  # compile the scheduler before its host time is taken
        return Prepared(make_step, plan_host_us=host_time_us(replan, PLAN_SAMPLES))


def quantize_query(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q8, scale)``: ``q`` as e4m3 with one float32 scale, ``amax(|q|) / 448`` (shape
    ``[1]``), so that ``q8.float() * scale`` approximates ``q``. No host sync."""
    scale = (q.abs().amax().float() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q8 = (q.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q8, scale.reshape(1)


class FlashInferProvider(Provider):
    """FlashInfer's paged decode / prefill wrappers, imported only when used."""

    name = "flashinfer"
    is_peer = True
    backend = "auto"  # the wrappers' backend; "auto": FlashInfer picks per device and dtypes
    # One zeroed float workspace per device, shared by the providers that run these wrappers
    # (one case and one provider run at a time).
    _workspaces: ClassVar[dict[torch.device, torch.Tensor]] = {}

    def __init__(self):
        self._workspace: torch.Tensor | None = None

    def _module(self):
        import flashinfer

        return flashinfer

    def available(self) -> tuple[bool, str]:
        try:
            self._module()
        except ImportError as exc:
            return False, f"flashinfer not installed ({exc})"
        except Exception as exc:  # a broken install must not stop the others
            return False, f"flashinfer failed to import: {type(exc).__name__}: {exc}"
        return True, ""

    def version(self) -> str:
        try:
            return str(self._module().__version__)
        except Exception:
            return ""

    def supports(self, case: Case) -> tuple[bool, str]:
        if case.kv_scale == "per_token":
            return False, "unsupported: FlashInfer takes per-tensor FP8 scales only"
        return True, ""

    def workspace(self, device: torch.device) -> torch.Tensor:
        """One zeroed float workspace, reused by every wrapper (one case runs at a time)."""
        found = self._workspaces.get(device)
        if found is None:
            self._workspaces.clear()  # a buffer on another device is not needed any more
            found = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._workspaces[device] = found
        return found

    def query(self, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The query the wrappers are given, and its scale (None: the query as it is)."""
        return inputs.q, None

    def run_scales(
        self, case: Case, copy: KVCopy, q_scale: torch.Tensor | None
    ) -> tuple[tuple, dict]:
        """``run()``'s scale arguments for one KV copy: positional, then keywords. Python
        floats: FlashInfer folds ``k_scale`` into ``sm_scale`` and multiplies the output by
        ``v_scale`` after the kernel (``.item()`` syncs, so it runs here, not in the step)."""
        if copy.k_scale is None:
            return (), {}
        return (), dict(k_scale=float(copy.k_scale.item()), v_scale=float(copy.v_scale.item()))

    def prepare(self, inputs: Inputs) -> Prepared:
        flashinfer = self._module()
        case = inputs.case
        device = inputs.device
        page_size = case.page_size
        kv_indptr, kv_indices = pagedattn.block_table_to_indptr(
            inputs.block_table, inputs.seq_lens, page_size
        )
        last_page_len = ((inputs.seq_lens - 1) % page_size + 1).to(torch.int32)
        query, q_scale = self.query(inputs)
        out_dtype, kv_dtype = Q_DTYPES[case.q_dtype], KV_DTYPES[case.kv_dtype]
        shape = (case.num_q_heads, case.num_kv_heads, case.head_dim, page_size)
        types = dict(q_data_type=query.dtype, kv_data_type=kv_dtype, o_data_type=out_dtype)
        workspace = self.workspace(device)
        graph_buffers = dict(
            paged_kv_indptr_buf=torch.empty_like(kv_indptr),
            paged_kv_indices_buf=torch.empty_like(kv_indices),
            paged_kv_last_page_len_buf=torch.empty_like(last_page_len),
        )
        if case.query_len == 1:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace,
                inputs.kv_layout,
                use_cuda_graph=True,
                use_tensor_cores=True,  # the CUDA-core path rejects 16 q heads per KV head
                paged_kv_indptr_buffer=graph_buffers["paged_kv_indptr_buf"],
                paged_kv_indices_buffer=graph_buffers["paged_kv_indices_buf"],
                paged_kv_last_page_len_buffer=graph_buffers["paged_kv_last_page_len_buf"],
                backend=self.backend,
            )

            def plan():
                wrapper.plan(kv_indptr, kv_indices, last_page_len, *shape, **types)

            kind = "decode (tensor cores)"
        else:
            qo_indptr = torch.arange(
                0,
                (case.batch + 1) * case.query_len,
                case.query_len,
                dtype=torch.int32,
                device=device,
            )
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                workspace,
                inputs.kv_layout,
                use_cuda_graph=True,
                qo_indptr_buf=torch.empty_like(qo_indptr),
                **graph_buffers,
                backend=self.backend,
            )

            def plan():
                wrapper.plan(
                    qo_indptr, kv_indptr, kv_indices, last_page_len, *shape, causal=True, **types
                )

            kind = "prefill (causal)"
        plan()  # JIT-compiles the module on first use
        plan_host_us = host_time_us(plan, PLAN_SAMPLES)
        out = torch.empty_like(inputs.q)

        def make_step(copy: KVCopy) -> Callable[[], torch.Tensor]:
            args, scales = self.run_scales(case, copy, q_scale)
            kv = (copy.k_cache, copy.v_cache)

            def step() -> torch.Tensor:
                return wrapper.run(query, kv, *args, out=out, **scales)

            return step

        if self.backend != "auto":
            kind += f", {self.backend}"
        return Prepared(make_step, plan_host_us=plan_host_us, note=kind)


class FlashInferFA3Provider(FlashInferProvider):
    """FlashInfer's FA3 backend (its Hopper templates) through the same wrappers; 16-bit KV
    with a 16-bit query (``fp8_query=False``) or FP8 KV with an FP8 query (``True``)."""

    backend = "fa3"

    def __init__(self, name: str, *, fp8_query: bool):
        super().__init__()
        self.name = name
        self.fp8_query = fp8_query
        # Its FP8 query and probabilities: XQA's bound (the query's rounding counts too).
        self.error_bounds = {"fp8": XQAProvider.error_bounds["fp8"]} if fp8_query else None

    def available(self) -> tuple[bool, str]:
        ok, why = super().available()
        if not ok:
            return ok, why
        if not torch.cuda.is_available():
            return False, "FlashInfer's FA3 backend needs a CUDA GPU"
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) != (9, 0):
            return False, f"FlashInfer's FA3 backend runs on sm_90 only, not sm_{major}{minor}"
        return True, ""

    def supports(self, case: Case) -> tuple[bool, str]:
        if not self.fp8_query:
            if case.kv_dtype == "fp8":
                return False, (
                    "unsupported: FA3 reads an FP8 cache only with an FP8 query "
                    "(flashinfer-fa3-fp8 runs it)"
                )
            return True, ""
        if case.kv_dtype != "fp8":
            return False, "unsupported: FP8 KV only (flashinfer-fa3 runs 16-bit caches)"
        if case.kv_scale != "per_tensor":
            return False, "unsupported: FA3 takes a scale per head, not per token"
        return True, ""

    def query(self, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.fp8_query:
            return inputs.q, None
        return quantize_query(inputs.q)

    def run_scales(
        self, case: Case, copy: KVCopy, q_scale: torch.Tensor | None
    ) -> tuple[tuple, dict]:
        """FP8: the query, K and V scales as float32 tensors of one scale per head (query heads
        for the query, KV heads for K and V), positional, as FA3 takes them; the kernel folds
        them in (no host sync, no work after it). 16-bit: none."""
        if not self.fp8_query:
            return (), {}

        def per_head(scale: torch.Tensor, heads: int) -> torch.Tensor:
            return scale.reshape(1).float().expand(heads).contiguous()

        kv_heads = case.num_kv_heads
        return (
            per_head(q_scale, case.num_q_heads),
            per_head(copy.k_scale, kv_heads),
            per_head(copy.v_scale, kv_heads),
        ), {}


class XQAProvider(FlashInferProvider):
    """XQA through FlashInfer (PEERS: FlashInfer 0.6.6's Hopper FP8 kernel)."""

    name = "xqa"
    is_peer = True
    error_bounds: ClassVar[dict[str, float]] = {"fp8": 6e-2}
    MAX_PAGE = 128
    WORKSPACE_BYTES = 1 << 30  # semaphores (zeroed once) and split partials

    def supports(self, case: Case) -> tuple[bool, str]:
        if case.kv_dtype != "fp8" or case.kv_scale != "per_tensor":
            return False, "unsupported: XQA's Hopper kernel takes FP8 KV with per-tensor scales"
        if case.page_size < 16 or (
            case.page_size > self.MAX_PAGE and case.page_size % self.MAX_PAGE
        ):
            return False, f"unsupported: pages of 16..{self.MAX_PAGE} tokens (or multiples of 128)"
        return True, ""

    def workspace(self, device: torch.device) -> torch.Tensor:
        if self._workspace is None or self._workspace.device != device:
            self._workspace = None
            self._workspace = torch.zeros(self.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    def prepare(self, inputs: Inputs) -> Prepared:
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache

        case = inputs.case
        device = inputs.device
        if inputs.kv_layout != "NHD":
            raise ValueError("xqa provider: expected an NHD cache")
        table, page = inputs.block_table, case.page_size
        split = max(1, page // self.MAX_PAGE)  # a page of P tokens = P/128 pages of 128 (NHD)
        if split > 1:
            sub = torch.arange(split, dtype=torch.int32, device=device)
            table = (table[:, :, None] * split + sub).reshape(table.shape[0], -1)
            page = self.MAX_PAGE
        seq_lens = inputs.seq_lens.view(torch.uint32)
        max_seq_len = max(case.seq_lens())
        sm_scale = case.head_dim**-0.5
        mask = None
        if case.query_len > 1:
            # Causal over the new tokens: bit j of row i set when j <= i (uint16 words).
            rows = torch.arange(case.query_len, device=device)
            bits = (rows[None, :] <= rows[:, None]).to(torch.int64)  # [i, j]
            words = torch.zeros(case.query_len, 2, dtype=torch.int64, device=device)
            for j in range(case.query_len):
                words[:, j // 16] |= bits[:, j] << (j % 16)
            mask = words.to(torch.uint16).expand(case.batch, -1, -1).contiguous()
        workspace = self.workspace(device)
        out = torch.empty_like(inputs.q)

        def make_step(copy: KVCopy) -> Callable[[], torch.Tensor]:
            shape = (-1, page, case.num_kv_heads, case.head_dim)
            kv = (copy.k_cache.view(shape), copy.v_cache.view(shape))
            # Python floats (an .item() syncs, so here, not in the step).
            k_scale, v_scale = float(copy.k_scale.item()), float(copy.v_scale.item())

            def step() -> torch.Tensor:
                return trtllm_batch_decode_with_kv_cache(
                    inputs.q,
                    kv,
                    workspace,
                    table,
                    seq_lens,
                    max_seq_len,
                    bmm1_scale=k_scale * sm_scale,
                    bmm2_scale=v_scale,
                    out=out,
                    kv_layout="NHD",
                    backend="xqa",
                    q_len_per_req=case.query_len,
                    mask=mask,
                )

            return step

        return Prepared(make_step, note=f"xqa, page {page}")


class ReferenceProvider(Provider):
    """The float64 reference: correctness only, never timed."""

    name = "torch-reference"
    timed = False

    def prepare(self, inputs: Inputs) -> Prepared:
        def make_step(copy: KVCopy) -> Callable[[], torch.Tensor]:
            def step() -> torch.Tensor:
                return paged_decode_torch(
                    inputs.q,
                    copy.k_cache,
                    copy.v_cache,
                    inputs.block_table,
                    inputs.seq_lens,
                    k_scale=copy.k_scale,
                    v_scale=copy.v_scale,
                    kv_layout=inputs.kv_layout,
                )

            return step

        return Prepared(make_step)


PROVIDERS: dict[str, Provider] = {
    p.name: p
    for p in (
        PagedAttnProvider("pagedattn", with_plan=True),
        PagedAttnProvider("pagedattn-decode", with_plan=False),
        PagedAttnProvider("pagedattn-tuned", with_plan=True, tuned=True),
        PagedAttnProvider("pagedattn-triton", with_plan=True, backend="triton"),
        PagedAttnProvider("pagedattn-gluon", with_plan=True, backend="gluon"),
        FlashInferProvider(),
        XQAProvider(),
        FlashInferFA3Provider("flashinfer-fa3", fp8_query=False),
        FlashInferFA3Provider("flashinfer-fa3-fp8", fp8_query=True),
        ReferenceProvider(),
    )
}
REFERENCE = "torch-reference"


def peers() -> list[str]:
    """Names of the providers ours is compared with, in registry order."""
    return [name for name, p in PROVIDERS.items() if p.is_peer]


def ours() -> list[str]:
    return [name for name, p in PROVIDERS.items() if not p.is_peer and p.timed]
