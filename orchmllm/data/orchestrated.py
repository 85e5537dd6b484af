"""The prefetching loader wired to the MLLM Global Orchestrator (paper sections 6-7).

Each step the background thread collates the local mini-batch into a
:class:`~orchmllm.dist.orchestrator.LocalBatch`, all-gathers its segment table (the only
metadata the orchestrator needs) and computes every phase's plan with
:func:`~orchmllm.planner.step_plan.plan_step`, all while the previous step trains. The training
loop gets ``PlannedBatch(batch, plan, info, stats, assembly)`` and calls
``orchestrator.run(batch.batch, encoders, plan=batch.plan, assembly=batch.assembly)``: only
the all-to-alls (and the encoders) remain on the critical path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from orchmllm.data import stats as st
from orchmllm.data.loader import DATALOADER_KEYWORDS, BalancedDataLoader
from orchmllm.data.options import LoaderOptions, PlanningOptions, SamplingOptions
from orchmllm.data.synthetic import as_example
from orchmllm.dist.orchestrator import LocalBatch, Orchestrator
from orchmllm.dist.topology import Topology
from orchmllm.planner.assembly import Assembly
from orchmllm.planner.assembly import assembly as rank_assembly
from orchmllm.planner.cost import CostModel
from orchmllm.planner.plan import Rearrangement
from orchmllm.planner.step_options import EncoderPhase, StepOptions
from orchmllm.planner.step_plan import StepPlan, plan_step


class _Collate:
    def __init__(self, phases: Sequence[EncoderPhase], to_example: Callable[[Any], Mapping]):
        self.phases, self.to_example = tuple(phases), to_example

    def __call__(self, rows: list) -> LocalBatch:
        return LocalBatch.from_examples([self.to_example(r) for r in rows], self.phases)


def _segment_table(batch: LocalBatch) -> np.ndarray:
    return batch.metadata


class OrchestratorPlanner:
    """``plan_step`` with an orchestrator's options (computed on rank 0 alone and broadcast
    when they make the plan more than a function of the gathered rows: ``placement="ilp"``).

    The phases' cost models may change during a run (costs learned from it:
    :mod:`orchmllm.dist.calibrator`): :meth:`set_costs` schedules new ones from a step on, which
    every rank names alike and the prefetcher has not begun, and the loader plans each step
    with :meth:`at` that step, so every rank plans every step with the same costs."""

    def __init__(self, orchestrator: Orchestrator, options: StepOptions | None = None) -> None:
        self.options = orchestrator.options if options is None else options
        self._orchestrator = orchestrator
        self._schedule: tuple[tuple[tuple[int, int], StepOptions], ...] = ()

    def set_costs(self, costs: Mapping[str, CostModel | None], *, epoch: int, step: int) -> None:
        """Plan with ``costs`` (phase name or ``"llm"`` -> a cost model; None: the policy's
        default) from ``step`` of ``epoch`` on (and every later epoch); other phases keep
        theirs.

        Raises:
            ValueError: a name that is no phase of the options.
        """
        changed = self.at(epoch, step).options.with_costs(costs)
        kept = tuple(e for e in self._schedule if e[0] < (epoch, step))
        self._schedule = (*kept, ((epoch, step), changed))  # one assignment: thread-safe

    def at(self, epoch: int, step: int) -> OrchestratorPlanner:
        """The planner that plans ``step`` of ``epoch`` (itself while nothing is scheduled)."""
        options = self.options
        for start, scheduled in self._schedule:
            if start <= (epoch, step):
                options = scheduled
        return self if options is self.options else OrchestratorPlanner(self._orchestrator, options)

    @property
    def deterministic(self) -> bool:
        return self.options.deterministic

    @property
    def signature(self) -> StepOptions:
        """What decides the plans (compared across ranks in the loader's step header)."""
        return self.options

    def step_stats(self, plan: StepPlan, batch: LocalBatch) -> dict[str, float]:
        """The step's metrics per phase (:mod:`orchmllm.data.stats`) known when planning:
        balance and planning time from the plan, the length units each phase's move
        carries, and the bytes of the inputs it moves (raw encoder inputs; for ``llm``
        token ids and loss mask). Encoder outputs' bytes are known only once encoded:
        ``Orchestrator.run`` reports them in ``LLMBatch.stats``."""
        rpn = self.options.ranks_per_node
        out: dict[str, float] = {}
        for p in self.options.phases:
            pp = plan.phases[p.name]
            x = batch.raw[p.name]  # [raw rows, feature_dim], also with no rows
            row_bytes = x.shape[1] * x.element_size()
            out.update(_phase_stats(p.name, pp.stats, pp.encoder, pp.raw, pp.raw, row_bytes, rpn))
        text_bytes = batch.input_ids.element_size() + batch.loss_mask.element_size()
        out.update(
            _phase_stats(
                "llm", plan.llm_stats, plan.llm, plan.seq_len, plan.text_len, text_bytes, rpn
            )
        )
        return out

    def __call__(self, rows: np.ndarray, src: np.ndarray, num_ranks: int) -> StepPlan:
        return plan_step(rows, src, self.options, num_ranks=num_ranks)

    @staticmethod
    def assembly(plan: StepPlan, rank: int) -> Assembly:
        """This rank's assembly of its LLM sequences (the loader computes it in its
        background thread, so that ``Orchestrator.run`` need not)."""
        return rank_assembly(plan, rank)


def _phase_stats(
    name: str,
    stats: Mapping[str, float],
    move: Rearrangement,
    lengths: np.ndarray,
    rows: np.ndarray,
    row_bytes: int,
    ranks_per_node: int | None,
) -> dict[str, float]:
    """One phase's metrics: ``lengths`` per item (what ``tokens_moved`` counts), ``rows``
    per item on the wire, ``row_bytes`` each."""
    moved = move.src_rank != move.dst_rank
    traffic = move.traffic(sizes=rows, ranks_per_node=ranks_per_node)
    values = (
        stats["imbalance_before"],
        stats["imbalance_after"],
        st.slowest(stats["loads_before"]),
        st.slowest(stats["loads_after"]),
        int(lengths[moved].sum()),
        traffic["intra"] * row_bytes,
        traffic["inter"] * row_bytes,
        stats["plan_ms"],
    )
    return st.named(name, values)


def orchestrated_loader(
    source: Any,
    orchestrator: Orchestrator,
    *,
    batch_size: int | None = None,
    to_example: Callable[[Any], Mapping] = as_example,
    sampling: SamplingOptions | None = None,
    options: LoaderOptions | None = None,
    topology: Topology | None = None,
    **dataloader_kwargs: Any,
) -> BalancedDataLoader:
    """A loader that plans every phase of each step ahead of it, for the orchestrator.

    A :class:`~orchmllm.data.loader.BalancedDataLoader` in ``mode="local"``: each rank's
    sampled mini-batch is collated as it is (nothing moves in the loader) and, in the
    background thread while the previous step trains, the orchestrator's per-phase plans
    for the step and this rank's assembly of its LLM sequences are computed;
    ``orchestrator.run(planned.batch, encoders, plan=planned.plan,
    assembly=planned.assembly)`` then only moves data and runs the encoders. Normalise the
    loss by the global count of prediction targets (``StepPlan.num_targets``, or
    ``orchmllm.global_num_items``), never per rank.

    Args:
        source: The dataset, as for ``BalancedDataLoader`` (a map-style dataset is sampled
            like ``DistributedSampler``; an iterable holds this rank's shard).
        orchestrator: Its options (phases, mode, policies, placement) decide the plans.
        batch_size: Examples each rank samples per step.
        to_example: Turns a dataset row into the schema dict (:mod:`orchmllm.schema`).
        sampling: A :class:`~orchmllm.data.options.SamplingOptions` (shuffle, seed, ...).
        options: A :class:`~orchmllm.data.options.LoaderOptions` (prefetch, workers,
            pinning, name, metrics).
        topology: The process groups the loader gathers on (None: a topology of its own,
            as every loader builds). Pass the orchestrator's to save a gloo group: its
            ``run`` with the prefetched plan only moves data on the data-parallel group,
            but then do not call ``orchestrator.run`` without a plan (or ``plan_batch``)
            while the loader prefetches: both would gather on the one metadata group.
        **dataloader_kwargs: ``DataLoader``'s own keywords (``shuffle``, ``num_workers``,
            ... :data:`~orchmllm.data.loader.DATALOADER_KEYWORDS`), as
            ``BalancedDataLoader`` takes them.

    Returns:
        The loader. Each iteration yields per step a :class:`PlannedBatch` whose ``batch``
        is this rank's ``LocalBatch``, ``plan`` the step's ``StepPlan`` (equal on every
        rank), ``assembly`` this rank's :class:`~orchmllm.planner.assembly.Assembly` of it and
        ``stats`` the per-phase metrics (vision, audio, ..., llm).

    Raises:
        ValueError: As ``BalancedDataLoader``.
        TypeError: A keyword that is not one of ``DataLoader``'s the loader takes.
    """
    unknown = sorted(set(dataloader_kwargs) - set(DATALOADER_KEYWORDS))
    if unknown:
        raise TypeError(
            f"orchestrated_loader got unexpected keyword arguments {unknown}; besides its own "
            f"it takes DataLoader's {list(DATALOADER_KEYWORDS)}"
        )
    return BalancedDataLoader(
        source,
        batch_size=batch_size,
        collate_fn=_Collate(orchestrator.phases, to_example),
        mode="local",
        sampling=sampling,
        planning=PlanningOptions(
            planner=OrchestratorPlanner(orchestrator), batch_meta_fn=_segment_table
        ),
        options=options,
        topology=topology,
        **dataloader_kwargs,
    )
