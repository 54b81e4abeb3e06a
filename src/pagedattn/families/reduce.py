"""The split reducer's launch, shared by both kernel families: merges the partials of sequences
cut across programs into ``out`` in a fixed order (deterministic)."""

from __future__ import annotations

import torch

from .._kernels.reduce import _reduce_kernel
from ..buffers import DecodePlan, run_slots
from ..launch import (
    REDUCE_RUN_RECORDS,
    SLOT,
    BoundLaunch,
    ReduceLaunchConfig,
    SlotLaunch,
    device_target,
    invariant_reduce_config,
    pdl_enabled,
    reduce_launch_config,
    sm_count,
)


class ReduceStep:
    """The reducer's launch prepared for one call signature (the plan's sizes, ``out``'s and
    ``lse``'s shapes and strides, sinks and ragged rows or not); called with that call's
    tensors ``(plan, out, lse, sinks, query_start_loc)``, it merges the partials the decode
    kernel left in ``plan`` into ``out`` (and ``lse``), adding each head's sink once per cut
    sequence and placing rows by ``query_start_loc`` for a ragged plan. ``config`` None:
    :func:`pagedattn.launch.reduce_launch_config`, or for a batch-invariant plan
    :func:`pagedattn.launch.invariant_reduce_config`. A plan that can cut no sequence
    (``max_reduces == 0``) launches nothing. Benchmarks time it by itself; it checks no
    arguments."""

    __slots__ = ("args", "launch")

    def __init__(
        self,
        plan: DecodePlan,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        config: ReduceLaunchConfig | None = None,
        *,
        sinks: torch.Tensor | None = None,
        query_start_loc: torch.Tensor | None = None,
    ):
        self.launch = None
        if plan.max_reduces == 0:
            return
        rows = plan.rows
        if config is not None:
            red = config
        elif plan.batch_invariant:
            red = invariant_reduce_config(rows=rows, head_dim=plan.head_dim)
        else:
            red = reduce_launch_config(
                rows=rows,
                head_dim=plan.head_dim,
                records=plan.max_reduces,
                sm_count=sm_count(out.device),
                target=device_target(out.device),
            )
        red.check(plan.head_dim, rows)
        if red.groups > 1 and not run_slots(plan.max_reduces, plan.batch_invariant):
            raise ValueError(
                f"launch_config.reduce: groups={red.groups} needs a plan of at most "
                f"{REDUCE_RUN_RECORDS} records that is not batch-invariant (it keeps the runs' "
                f"partials), got one of {plan.max_reduces} records"
                + (", batch-invariant" if plan.batch_invariant else "")
            )
        pdl = pdl_enabled(out.device)
        self.launch = BoundLaunch(
            _reduce_kernel,
            (plan.max_reduces * red.groups, -(-rows // red.block_r), plan.head_dim // red.block_d),
            num_warps=red.num_warps,
            launch_pdl=pdl,
            QUERY_LEN=plan.query_len,
            GROUP=plan.group,
            HEAD_DIM=plan.head_dim,
            BLOCK_R=red.block_r,
            BLOCK_D=red.block_d,
            SLOT_BLOCK=red.slot_block,
            NUM_STAGES=red.num_stages,
            GROUPS=red.groups,
            WRITE_LSE=lse is not None,
            HAS_SINKS=sinks is not None,
            RAGGED=plan.ragged,
            PDL=pdl,
        )
        # The integer arguments: fixed by the plan's sizes and out's and lse's strides.
        self.args = (
            plan.reduces_offset,
            plan.run_counts_offset,
            plan.lse_offset,
            plan.run_slot,
            out.stride(0),
            out.stride(1),
            lse.stride(0) if lse is not None else 0,
            out.shape[0],
            plan.planned_rows_offset,
        )

    def __call__(self, plan, out, lse, sinks, query_start_loc) -> None:
        launch = self.launch
        if launch is None:
            return
        # (The LSE is never written without WRITE_LSE.)
        launch(*self._args(plan, out, out if lse is None else lse, sinks, query_start_loc))

    @property
    def bindable(self) -> bool:
        """Whether :meth:`bind` can bind it (it launches nothing, or directly)."""
        return self.launch is None or self.launch.direct is not None

    def bind(self, plan, sinks, query_start_loc) -> SlotLaunch | None:
        """The direct launch bound to the plan's (and ``sinks``', ``query_start_loc``'s)
        addresses, slots: the output, the LSE (the output's address where none is written).
        None where it launches nothing. Only once :attr:`bindable`."""
        if self.launch is None:
            return None
        return SlotLaunch(self.launch.direct, self._args(plan, SLOT, SLOT, sinks, query_start_loc))

    def _args(self, plan, out, lse, sinks, query_start_loc) -> tuple:
        """The reducer's runtime arguments, in its parameter order."""
        reduces, counts, lse_offset, run_slot, out_tok, out_head, lse_tok, rows, planned = self.args
        metadata, partials = plan.metadata, plan.partials
        return (
            metadata, reduces, counts, partials, lse_offset, run_slot, out, out_tok, out_head,
            lse, lse_tok,
            metadata if query_start_loc is None else query_start_loc,  # read if RAGGED
            rows, planned,
            partials if sinks is None else sinks,  # read if HAS_SINKS
        )  # fmt: skip
