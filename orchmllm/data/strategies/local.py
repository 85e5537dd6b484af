"""``mode="local"``: nothing moves in the loader; the batch as sampled comes with its plan.

The local batch is collated as sampled and yielded with the planner's output, computed in
the prefetch thread: for :class:`~orchmllm.dist.dispatcher.BatchDispatcher` (``dispatch(...,
plan=plan)``) or for the multimodal orchestrator, whose planner also gives this rank's
assembly and the per-phase metrics (:func:`~orchmllm.data.orchestrated.orchestrated_loader`),
which then moves data per phase on the device.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from orchmllm.data import exchange as ex
from orchmllm.data import sources as sr
from orchmllm.data import stats as st
from orchmllm.data.exchange import StepInfo
from orchmllm.data.strategies.base import EpochState, ExchangeStrategy, Step, step_stats
from orchmllm.planner.plan import Rearrangement


@dataclass(frozen=True)
class PlannedBatch:
    """What ``mode="local"`` yields: the batch as sampled on this rank, and its plan.

    Attributes:
        batch: This rank's local mini-batch, collated, as sampled (nothing moved yet).
        plan: The planner's output for the step, identical on every rank: a
            :class:`~orchmllm.planner.plan.Rearrangement` (execute it with
            ``BatchDispatcher.dispatch(..., plan=plan)``) or, from
            :func:`~orchmllm.data.orchestrated.orchestrated_loader`, a ``StepPlan`` (pass it
            to ``Orchestrator.run(batch, encoders, plan=plan, assembly=assembly)``).
        info: The step's record (:class:`~orchmllm.data.exchange.StepInfo`).
        stats: The step's balance metrics (see :mod:`orchmllm.data.stats`).
        assembly: This rank's share of the plan, computed in the background thread with it
            when the planner has an ``assembly(plan, rank)`` method (from
            :func:`~orchmllm.data.orchestrated.orchestrated_loader`: the
            :class:`~orchmllm.planner.assembly.Assembly` of this rank's LLM sequences, so that
            ``Orchestrator.run`` only moves data and runs the encoders); else None.
    """

    batch: Any
    plan: Any
    info: StepInfo
    stats: dict[str, float] = field(default_factory=dict)
    assembly: Any = None


class LocalExchange(ExchangeStrategy):
    """Collate the local batch, gather its rows, plan; yield both as a :class:`PlannedBatch`."""

    mode = "local"

    def produce(self, ep: EpochState, step: int) -> Step:
        assert ep.batches is not None
        setup = self.setup
        t0 = time.perf_counter()

        def prepare() -> tuple[Any, Sequence[Sequence[int]]]:
            mine = next(ep.batches, None)
            if mine is None:
                return None, []
            return self._collated(mine)

        ep.next_gather = step + 1
        planner = ex.planner_at(setup.planner, ep.epoch, step)
        done = ex.balance_step(setup.group, planner, prepare, step=step, move=False)
        if done is None:
            raise StopIteration
        batch = done.examples  # collated before the gather
        stats = self._stats(done, batch)
        assembly = self.after_gather(ep, lambda: self._assembly(done.plan))
        info = done.info(epoch=ep.epoch, step=step, prep_s=time.perf_counter() - t0)
        stats = step_stats(info, stats)
        return Step(PlannedBatch(batch, done.plan, info, stats, assembly), info, stats)

    def _collated(self, mine: sr.Local) -> tuple[Any, Sequence[Sequence[int]]]:
        """The local batch collated, and its rows (the batch's own, or per example)."""
        setup = self.setup
        if setup.batch_meta_fn is not None:
            batch = setup.collate(mine.examples)
            return batch, np.asarray(setup.batch_meta_fn(batch), dtype=np.int64)
        rows = setup.steps.rows(mine)
        return setup.collate(mine.examples), rows

    def _assembly(self, plan: Any) -> Any:
        """This rank's share of ``plan``, when the planner says how to compute it."""
        share = getattr(self.setup.planner, "assembly", None)
        return None if share is None else share(plan, self.setup.group.rank)

    def _stats(self, done: ex.BalancedStep, batch: Any) -> dict[str, float]:
        """The planner's own metrics if it has them (the orchestrator's, per phase), else
        the single phase's; the loader moves nothing, so no bytes here."""
        own = getattr(self.setup.planner, "step_stats", None)
        if own is not None:
            return own(done.plan, batch)
        if isinstance(done.plan, Rearrangement):
            return st.phase_stats(
                "batch",
                done.plan,
                done.meta[:, 0],
                cost=self.setup.stats_cost,
                plan_ms=1e3 * done.plan_s,
            )
        return {}
