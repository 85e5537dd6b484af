"""``mode="index"``: the ranks exchange dataset indices and lengths only.

A map-style dataset whose lengths are known before loading is planned on them alone; each
rank then loads and collates exactly the examples assigned to it (in DataLoader workers if
``num_workers``), so no example crosses the network. The plans are made where the loading
asks for indices, ahead of the loading by ``prefetch_factor * num_workers`` steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import NamedTuple

from orchmllm.data import exchange as ex
from orchmllm.data import stats as st
from orchmllm.data.exchange import StepInfo
from orchmllm.data.strategies.base import EpochState, ExchangeStrategy, Step, step_stats
from orchmllm.planner.plan import Rearrangement


class _Planned(NamedTuple):
    gathered: ex.Gathered
    plan: Rearrangement
    t0: float
    plan_s: float


class IndexExchange(ExchangeStrategy):
    """Plan on the sampled indices' lengths, then load this rank's balanced share."""

    mode = "index"
    plans_before_loading = True

    def begin(self, ep: EpochState, sampled: list[list[int]] | None) -> None:
        """The workers start here, in the caller's thread, and their batch sampler plans the
        steps they load first (every rank alike; the rest plan in the prefetch thread)."""
        assert sampled is not None  # index mode samples a map-style dataset up front
        ep.sampled = sampled
        ep.loaded = self.setup.steps.reader(self._plan_steps(ep))

    def _plan_steps(self, ep: EpochState) -> Iterator[list[int]]:
        """The batch sampler: per step, gather the ranks' sampled (index, length) rows, plan,
        and yield the indices this rank loads."""
        setup = self.setup
        g, lengths = setup.group, setup.steps.lengths
        assert lengths is not None
        for step in range(ep.start, len(ep.sampled)):
            t0 = time.perf_counter()
            rows = [[i, int(lengths[i])] for i in ep.sampled[step]]
            ep.next_gather = step + 1
            planner = ex.planner_at(setup.planner, ep.epoch, step)
            try:
                gathered = ex.gather_step(g, rows, step=step, planner=planner)
                plan = ex.run_planner(g, planner, gathered.meta[:, 1:], gathered.src)
                plan = ex.check_rearrangement(plan, g, len(gathered.src))
            except BaseException:
                ep.planning_failed = True
                raise
            ep.planned.append(_Planned(gathered, plan, t0, time.perf_counter() - t0))
            yield gathered.meta[plan.items_at(g.rank), 0].tolist()

    def produce(self, ep: EpochState, step: int) -> Step:
        assert ep.loaded is not None
        batch, error = None, None
        try:
            batch = self.setup.finish(next(ep.loaded))
        except Exception as exc:
            if ep.planning_failed:  # a collective error: raised on every rank already
                raise
            error = exc
        # Loaded after the plan: every rank says whether it loaded its share, so a failure
        # (the dataset or the collate function raised) is raised at this step on every rank,
        # naming the rank, before any rank trains on the step.
        ex.gather_step(self.setup.group, [], error=error, step=step)
        gathered, plan, t0, plan_s = ep.planned.popleft()
        meta = gathered.meta[:, 1:]
        info = StepInfo(
            ep.epoch,
            step,
            meta,
            gathered.src,
            gathered.meta[:, 0],
            plan,
            plan_s,
            time.perf_counter() - t0,
            gathered.bytes_sent,
            0,
        )
        stats = st.phase_stats(
            "batch", plan, meta[:, 0], cost=self.setup.stats_cost, plan_ms=1e3 * plan_s
        )
        return Step(batch, info, step_stats(info, stats))

    def pending_exchange(self, ep: EpochState, step: int) -> bool:
        """A step planned but not confirmed (its load-status exchange) is still owed."""
        return ep.num_steps is not None and step < ep.num_steps
