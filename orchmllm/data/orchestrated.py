"""The prefetching loader wired to the MLLM Global Orchestrator (paper sections 6-7).

Each step the background thread collates the local mini-batch into a
:class:`~orchmllm.orchestrator.LocalBatch`, all-gathers its segment table (the only
metadata the orchestrator needs) and computes every phase's plan with
:func:`~orchmllm.step_plan.plan_step`, all while the previous step trains. The training
loop gets ``PlannedBatch(batch, plan, info)`` and calls
``orchestrator.run(batch.batch, encoders, plan=batch.plan)``: only the all-to-alls remain
on the critical path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from orchmllm.data.loader import BalancedDataLoader
from orchmllm.data.synthetic import as_example
from orchmllm.orchestrator import LocalBatch, Orchestrator
from orchmllm.step_plan import EncoderPhase, StepOptions, StepPlan, plan_step


class _Collate:
    def __init__(self, phases: Sequence[EncoderPhase], to_example: Callable[[Any], Mapping]):
        self.phases, self.to_example = tuple(phases), to_example

    def __call__(self, rows: list) -> LocalBatch:
        return LocalBatch.from_examples([self.to_example(r) for r in rows], self.phases)


def _segment_table(batch: LocalBatch) -> np.ndarray:
    return batch.metadata


class OrchestratorPlanner:
    """``plan_step`` with an orchestrator's options (computed on rank 0 alone and broadcast
    when they make the plan more than a function of the gathered rows: ``placement="ilp"``)."""

    def __init__(self, orchestrator: Orchestrator) -> None:
        self.options = orchestrator.options

    @property
    def deterministic(self) -> bool:
        return self.options.deterministic

    @property
    def signature(self) -> StepOptions:
        """What decides the plans (compared across ranks in the loader's step header)."""
        return self.options

    def __call__(self, rows: np.ndarray, src: np.ndarray, num_ranks: int) -> StepPlan:
        return plan_step(rows, src, self.options, num_ranks=num_ranks)


def orchestrated_loader(
    source: Any,
    orchestrator: Orchestrator,
    *,
    batch_size: int | None = None,
    to_example: Callable[[Any], Mapping] = as_example,
    prefetch: int = 2,
    **kwargs: Any,
) -> BalancedDataLoader:
    """A :class:`BalancedDataLoader` in ``mode="local"`` yielding ``PlannedBatch`` whose
    ``batch`` is a ``LocalBatch`` and ``plan`` the orchestrator's ``StepPlan``.

    ``source`` and ``kwargs`` as for :class:`BalancedDataLoader` (sampling, seed, timeout,
    group); ``to_example`` turns a dataset row into the schema dict.
    """
    return BalancedDataLoader(
        source,
        batch_size=batch_size,
        mode="local",
        collate_fn=_Collate(orchestrator.phases, to_example),
        batch_meta_fn=_segment_table,
        planner=OrchestratorPlanner(orchestrator),
        prefetch=prefetch,
        **kwargs,
    )
