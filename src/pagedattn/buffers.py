"""The decode plan's buffers: :class:`DecodePlan`, its sizes and record layouts, and their
allocation (made by :func:`pagedattn.plan_decode`, in ``plan.py``; the work list's NumPy twin
is in ``reference.py``).

A :class:`DecodePlan` holds device tensors only. All of its sizes follow from the batch size,
the program count, the query length and the head counts, never from a value read back from
the GPU, so making a plan never syncs and a whole decode step can be captured in a CUDA graph
and replayed with new ``seq_lens``.

Record layouts (int32, all views of one buffer ``plan.metadata``):

``work_indptr[num_programs + 1]``
    Works of program ``p`` are rows ``work_indptr[p] : work_indptr[p + 1]`` of ``works``.
``works[max_works, 8]``
    ``(program, seq, kv_head, q_head_start, q_head_end, token_start, token_end, partial_slot)``:
    program ``program`` attends query heads ``q_head_start:q_head_end`` (all query heads of
    ``kv_head``) of sequence ``seq`` over KV tokens ``token_start:token_end``.
    ``partial_slot`` is -1 when the work covers its whole sequence (it writes ``out``),
    else the row of ``partial_out`` / ``partial_lse`` it writes.
``reduces[max_reduces, 4]``
    ``(seq, kv_head, first_slot, num_slots)`` per cut (sequence, kv head): its partials are
    slots ``first_slot : first_slot + num_slots`` in token order; the merged result goes to
    ``out`` rows of ``seq``, heads of ``kv_head``. ``seq == -1`` marks an unused record.

``partition`` (one element)
    The partition size the scheduler used for this step (see ``partition_size``).
``planned_lens[batch]``
    The ``seq_lens`` the plan was made from (the decode kernel compares them with the ones it
    is given: a sequence whose length changed gets NaN rows and a stale-plan fault).
``faults[batch]``
    Per sequence, a bit set of fault codes (``_kernels/records.py``): the scheduler sets the
    length faults and clears the rest; the decode kernel adds capacity, page-id and stale-plan
    faults. :meth:`DecodePlan.faults` reads them.
``planned_rows[batch, 2]`` (a plan made with ``query_start_loc`` only)
    Each sequence's query rows ``(start, end)`` as the scheduler found them in
    ``query_start_loc``, or ``(-1, -1)`` where they are no valid range (a fault); the kernels
    compare them with the ones they are given.
``run_counts[...]`` (a plan with run slots only, see below)
    The reducer's arrival counts (:func:`run_counts`), zero between launches: zeroed when the
    plan is allocated, and each put back to 0 by the reducer program that counts the last
    arrival.

Every sequence has at least one partition: a padding slot (length 0) or an invalid length
counts as one partition of no tokens, whose work writes zeros (padding) or NaN (invalid).

A batch-invariant plan (``plan_decode(batch_invariant=True)``) cuts each sequence into
chunks that depend only on its length (:func:`invariant_chunks`): one work per chunk and kv
head, a partial per chunk when there are several, whatever the batch and the grid.

Partial buffers (float32): ``partial_out[max_partials, query_len * group, head_dim]`` and
``partial_lse[max_partials, query_len * group]`` (LSE in log2 units; -inf for a row that saw
no key in its range, which causal masking or a sliding window can cause). The scheduler's
slots come first; a plan of few records (:func:`run_slots`) keeps ``REDUCE_RUNS`` more a
record from ``run_slot`` on, where the reducer merges runs of a record's partials.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch

from ._kernels import records, schedule
from ._kernels.schedule import AUTO_SMALL
from .launch import REDUCE_RUN_RECORDS, REDUCE_RUNS, next_power_of_2
from .signature import address_int, signature_int

WORK_FIELDS = records.WORK_FIELDS.value
REDUCE_FIELDS = records.REDUCE_FIELDS.value
ROWS_FIELDS = records.ROWS_FIELDS.value
# A batch-invariant plan cuts a sequence into at most this many chunks (see invariant_chunks).
INVARIANT_MAX_CHUNKS = schedule.INVARIANT_MAX_CHUNKS.value


class WorkItem(NamedTuple):
    """One work of the list (:meth:`DecodePlan.work_items`): decode ``program`` attends
    sequence ``seq``'s tokens ``token_start:token_end`` for ``kv_head``, into partial slot
    ``partial_slot`` (-1: straight into ``out``)."""

    program: int
    seq: int
    kv_head: int
    token_start: int
    token_end: int
    partial_slot: int


class Fault(NamedTuple):
    """A sequence the kernels could not attend since the plan was filled (its output rows
    and LSE are NaN), and why."""

    seq: int
    code: int  # one bit of ``pagedattn._kernels.records.FAULT_*``
    reason: str

    def __str__(self) -> str:
        return f"sequence {self.seq}: {self.reason}"


def plan_sizes(
    batch: int, num_programs: int, num_kv_heads: int, batch_invariant: bool = False
) -> tuple[int, int, int]:
    """Upper bounds ``(max_works, max_partials, max_reduces)`` from host-known sizes only.

    Per KV head, ``programs_per_head - 1`` range boundaries each cut at most one sequence once:
    works <= batch + boundaries; cut pieces <= 2 * boundaries; cut sequences <= boundaries.
    A batch-invariant plan has at most ``INVARIANT_MAX_CHUNKS`` chunks (works, partials) per
    sequence, whatever the grid, and any sequence may be cut.
    """
    if batch_invariant:
        chunks = num_kv_heads * batch * INVARIANT_MAX_CHUNKS
        return chunks, chunks, num_kv_heads * batch
    per_head = num_programs // num_kv_heads
    boundaries = per_head - 1
    max_works = num_kv_heads * (batch + boundaries)
    max_reduces = num_kv_heads * min(batch, boundaries)
    max_partials = num_kv_heads * 2 * boundaries + run_slots(max_reduces, batch_invariant)
    return max_works, max_partials, max_reduces


def run_slots(max_reduces: int, batch_invariant: bool) -> int:
    """Partial slots a plan keeps after the scheduler's for the reducer's runs
    (``ReduceLaunchConfig.groups``): ``REDUCE_RUNS`` a record where the plan has at most
    ``REDUCE_RUN_RECORDS`` records (a batch-invariant plan's merge order is fixed: none)."""
    if batch_invariant or max_reduces > REDUCE_RUN_RECORDS:
        return 0
    return max_reduces * REDUCE_RUNS


def run_counts(max_reduces: int, rows: int, head_dim: int, batch_invariant: bool) -> int:
    """Arrival counts a plan with run slots keeps in its metadata: one a record and reducer
    tile of at least min(16, rows) rows x 16 columns."""
    if not run_slots(max_reduces, batch_invariant):
        return 0
    block_r = min(16, next_power_of_2(rows))
    return max_reduces * -(-rows // block_r) * -(-head_dim // 16)


@dataclasses.dataclass
class DecodePlan:
    """Work list, reduce maps and partial buffers for one decode step (device tensors).

    Made by :func:`pagedattn.plan_decode`; reuse it for every layer of the step. Two buffers
    hold everything: ``metadata`` (int32: ``work_indptr``, ``works``, ``reduces``, in that
    order) and ``partials`` (float32: ``partial_out``, then ``partial_lse``). The named
    fields below are views of them, made on first use (the kernels take the two buffers and
    offsets, so a fresh plan costs two allocations and no views; see the module docstring for
    the record layouts).
    """

    batch: int
    query_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    kv_dtype: torch.dtype
    kv_scale: str | None
    num_programs: int
    # Tokens per partition, or None: the scheduler picks 128, 256 or one partition a sequence
    # on the GPU each step from the lengths (``reference.auto_partition_size``);
    # ``step_partition_size()`` reads what it picked.
    partition_size: int | None
    metadata: torch.Tensor  # int32, all records below
    partials: torch.Tensor  # float32, partial outputs then partial LSEs
    max_works: int
    max_partials: int
    max_reduces: int
    # Made with ``query_start_loc``: ``query_len`` is the most query rows a sequence may have,
    # and ``metadata`` ends with ``planned_rows``.
    ragged: bool = False
    # Chunks that depend only on each sequence's length (see ``invariant_chunks``).
    batch_invariant: bool = False

    # The step's shape a plan is made for (paged_decode checks them against its inputs), and
    # everything it is made for (plan_decode's reuse= compares them in this order).
    SHAPE_FIELDS = (
        "batch",
        "query_len",
        "num_q_heads",
        "num_kv_heads",
        "head_dim",
        "page_size",
        "kv_dtype",
        "kv_scale",
    )
    SIZE_FIELDS = (
        *SHAPE_FIELDS,
        "num_programs",
        "partition_size",
        "device",
        "ragged",
        "batch_invariant",
    )

    # A plan's sizes as the custom ops take them: SIZE_FIELDS but the device (the tensors
    # carry it).
    OP_FIELDS = tuple(name for name in SIZE_FIELDS if name != "device")

    def op_sizes(self) -> tuple:
        """The values of ``OP_FIELDS``, as ``torch.ops.pagedattn.*`` take them."""
        return tuple(getattr(self, name) for name in self.OP_FIELDS)

    @functools.cached_property
    def sizes_key(self) -> tuple:
        """The values of ``SIZE_FIELDS``."""
        return tuple(getattr(self, name) for name in self.SIZE_FIELDS)

    @functools.cached_property
    def sizes_sig(self) -> int:
        """:attr:`sizes_key` as a small int (``signature.signature_int``), for call keys."""
        return signature_int(("plan", *self.sizes_key))

    @functools.cached_property
    def sig_at(self) -> int:
        """:attr:`sizes_sig` at the plan's buffers' :attr:`addresses`
        (``signature.address_int``), for the keys of calls bound to them."""
        return address_int(self.sizes_sig, self.addresses)

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def rows(self) -> int:
        """Query rows per kv head (``query_len * group``): the rows of one partial."""
        return self.query_len * self.group

    @property
    def device(self) -> torch.device:
        return self.metadata.device

    @property
    def works_offset(self) -> int:
        """Element offset of ``works`` in ``metadata``."""
        return self.num_programs + 1

    @property
    def reduces_offset(self) -> int:
        """Element offset of ``reduces`` in ``metadata``."""
        return self.works_offset + self.max_works * WORK_FIELDS

    @property
    def partition_offset(self) -> int:
        """Element of ``metadata`` where the scheduler writes the step's partition size."""
        return self.reduces_offset + self.max_reduces * REDUCE_FIELDS

    @property
    def planned_lens_offset(self) -> int:
        """Element offset of ``planned_lens`` (the lengths the plan was made from)."""
        return self.partition_offset + 1

    @property
    def faults_offset(self) -> int:
        """Element offset of ``faults`` (a bit set of fault codes per sequence)."""
        return self.planned_lens_offset + self.batch

    @property
    def planned_rows_offset(self) -> int:
        """Element offset of ``planned_rows`` (a ragged plan's query rows per sequence)."""
        return self.faults_offset + self.batch

    @property
    def run_counts_offset(self) -> int:
        """Element offset of the reducer's arrival counts (see :func:`run_counts`)."""
        return self.planned_rows_offset + (ROWS_FIELDS * self.batch if self.ragged else 0)

    @property
    def run_slot(self) -> int:
        """The first partial slot of the reducer's runs (see :func:`run_slots`)."""
        return self.max_partials - run_slots(self.max_reduces, self.batch_invariant)

    @property
    def metadata_size(self) -> int:
        """Elements of ``metadata``."""
        counts = run_counts(self.max_reduces, self.rows, self.head_dim, self.batch_invariant)
        return self.run_counts_offset + counts

    @property
    def max_seq_len(self) -> int:
        """The longest sequence this plan accepts (longer ones are faults)."""
        return records.max_seq_len_supported(self.batch)

    @functools.cached_property
    def planned_lens(self) -> torch.Tensor:  # [batch] int32
        return self.metadata.as_strided((self.batch,), (1,), self.planned_lens_offset)

    def faults(self) -> list[Fault]:
        """The faults recorded since the plan was last filled (by ``plan_decode``), one per
        (sequence, reason), in sequence order. Copies to the host: syncs."""
        codes = self.metadata[self.faults_offset : self.faults_offset + self.batch].tolist()
        return [
            Fault(seq, bit, reason)
            for seq, code in enumerate(codes)
            if code
            for bit, reason in records.FAULT_REASONS.items()
            if code & bit
        ]

    def __repr__(self) -> str:
        kv = str(self.kv_dtype).replace("torch.", "")
        if self.kv_scale is not None:
            kv += f" ({self.kv_scale})"
        partition = self.partition_size or "picked per step"
        extra = "".join(
            text
            for on, text in (
                (self.ragged, ", ragged query rows"),
                (self.batch_invariant, ", batch-invariant"),
            )
            if on
        )
        return (
            f"DecodePlan(batch={self.batch}, query_len={self.query_len}, "
            f"heads={self.num_q_heads}/{self.num_kv_heads} (group {self.group}), "
            f"head_dim={self.head_dim}, page_size={self.page_size}, kv={kv}, "
            f"num_programs={self.num_programs}, partition_size={partition}, "
            f"max_works={self.max_works}, max_partials={self.max_partials}{extra}, "
            f"device={self.device})"
        )

    @functools.cached_property
    def record_views(self) -> tuple[torch.Tensor, ...]:
        """``metadata`` from ``works``, from ``planned_lens`` and from ``faults`` on, and
        ``partials`` from ``partial_lse`` on: for kernels that take each as a pointer of its
        own (made once a plan, not per launch)."""
        metadata, partials = self.metadata, self.partials
        return (
            metadata[self.works_offset :],
            metadata[self.planned_lens_offset :],
            metadata[self.faults_offset :],
            partials[self.lse_offset :],
        )

    @functools.cached_property
    def addresses(self) -> tuple[int, ...]:
        """The addresses of ``metadata``, :attr:`record_views` (works, planned lengths,
        faults), ``partials`` and the partial LSEs: what direct launches pass for them."""
        works, planned_lens, faults, partial_lse = self.record_views
        buffers = (self.metadata, works, planned_lens, faults, self.partials, partial_lse)
        return tuple(t.data_ptr() for t in buffers)

    @property
    def min_partition_size(self) -> int:
        """The smallest partition size a step of this plan can have (decode tiles fit it)."""
        return self.partition_size or int(AUTO_SMALL.value)

    def step_partition_size(self) -> int:
        """The partition size of the last scheduled step (a host read: syncs)."""
        return int(self.metadata[self.partition_offset])

    @property
    def lse_offset(self) -> int:
        """Element offset of ``partial_lse`` in ``partials``."""
        return self.max_partials * self.rows * self.head_dim

    @functools.cached_property
    def work_indptr(self) -> torch.Tensor:  # [num_programs + 1]
        return self.metadata.as_strided((self.num_programs + 1,), (1,), 0)

    @functools.cached_property
    def works(self) -> torch.Tensor:  # [max_works, 8]
        return self.metadata.as_strided(
            (self.max_works, WORK_FIELDS), (WORK_FIELDS, 1), self.works_offset
        )

    @functools.cached_property
    def reduces(self) -> torch.Tensor:  # [max_reduces, 4]
        return self.metadata.as_strided(
            (self.max_reduces, REDUCE_FIELDS), (REDUCE_FIELDS, 1), self.reduces_offset
        )

    @functools.cached_property
    def partial_out(self) -> torch.Tensor:  # float32 [max_partials, query_len * group, head_dim]
        rows, d = self.rows, self.head_dim
        return self.partials.as_strided((self.max_partials, rows, d), (rows * d, d, 1), 0)

    @functools.cached_property
    def partial_lse(self) -> torch.Tensor:  # float32 [max_partials, query_len * group]
        return self.partials.as_strided(
            (self.max_partials, self.rows), (self.rows, 1), self.lse_offset
        )

    def work_items(self) -> list[WorkItem]:
        """The work list as host-side named tuples (copies to the host: for tests and debugging)."""
        indptr = self.work_indptr.cpu().numpy()
        works = self.works[: int(indptr[-1])].cpu().numpy()
        return [
            WorkItem(int(w[0]), int(w[1]), int(w[2]), int(w[5]), int(w[6]), int(w[7]))
            for w in works
        ]

    def reduce_items(self) -> list[tuple[int, int, int, int]]:
        """Used reduce records ``(seq, kv_head, first_slot, num_slots)`` (copies to the host)."""
        reduces = self.reduces.cpu().numpy()
        return [tuple(int(x) for x in r) for r in reduces if r[0] >= 0]


def allocate_plan(
    *,
    batch: int,
    query_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    kv_dtype: torch.dtype,
    kv_scale: str | None,
    num_programs: int,
    partition_size: int | None,
    device: torch.device,
    ragged: bool = False,
    batch_invariant: bool = False,
) -> DecodePlan:
    """Allocates a plan's buffers (contents undefined until the scheduler fills them): two
    allocations, no views (each torch call costs host time, and a serving loop may make a
    plan every step)."""
    max_works, max_partials, max_reduces = plan_sizes(
        batch, num_programs, num_kv_heads, batch_invariant
    )
    n_meta = (
        num_programs + 1 + max_works * WORK_FIELDS + max_reduces * REDUCE_FIELDS + 1 + 2 * batch
    )
    if ragged:
        n_meta += ROWS_FIELDS * batch
    rows = query_len * (num_q_heads // num_kv_heads)
    n_counts = run_counts(max_reduces, rows, head_dim, batch_invariant)
    n_partials = max_partials * rows * (head_dim + 1)
    metadata = torch.empty(n_meta + n_counts, dtype=torch.int32, device=device)
    partials = torch.empty(n_partials, dtype=torch.float32, device=device)
    if n_counts:
        metadata[n_meta:].zero_()  # the reducer's arrival counts start at 0
    # What torch._dynamo.mark_static_address(t, guard=False) sets (without importing Dynamo
    # into every process): the buffers live as long as the plan, like a module's parameters,
    # so torch.compile(mode="reduce-overhead") replays its CUDA graph on them in place (the
    # ops write them) instead of skipping the graph for mutated inputs; a new plan re-records.
    # (Buffers made inside a compiled function are the graph's own: nothing to mark.)
    if not torch.compiler.is_compiling():
        metadata._dynamo_static_input_type = partials._dynamo_static_input_type = "unguarded"
    return DecodePlan(
        batch=batch,
        query_len=query_len,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        kv_dtype=kv_dtype,
        kv_scale=kv_scale,
        num_programs=num_programs,
        partition_size=partition_size,
        metadata=metadata,
        partials=partials,
        max_works=max_works,
        max_partials=max_partials,
        max_reduces=max_reduces,
        ragged=ragged,
        batch_invariant=batch_invariant,
    )
