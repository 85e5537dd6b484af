"""``mode="move"``: each rank loads what it sampled, then the examples move to their ranks.

For streams and ``DataLoader`` sources, where a rank can read only its own shard: the local
examples' metadata rows are gathered, the plan is made, and the examples travel to their
destination ranks as bytes in one all-to-all (the move path of
:class:`~orchmllm.dist.dispatcher.MovePath`), then are collated there.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from orchmllm.data import exchange as ex
from orchmllm.data import stats as st
from orchmllm.data.strategies.base import EpochState, ExchangeStrategy, Step, step_stats


class MoveExchange(ExchangeStrategy):
    """Gather the local examples' rows, plan, move the examples, collate the balanced set."""

    mode = "move"

    def produce(self, ep: EpochState, step: int) -> Step:
        assert ep.batches is not None
        setup = self.setup
        t0 = time.perf_counter()

        def prepare() -> tuple[list | None, Sequence[Sequence[int]]]:
            mine = next(ep.batches, None)
            if mine is None:
                return None, []
            return mine.examples, setup.steps.rows(mine)

        ep.next_gather = step + 1
        planner = ex.planner_at(setup.planner, ep.epoch, step)
        done = ex.balance_step(setup.group, planner, prepare, step=step, move=True)
        if done is None:
            raise StopIteration
        batch: Any = self.after_gather(ep, lambda: setup.collate(done.examples))
        stats = st.phase_stats(
            "batch",
            done.plan,
            done.meta[:, 0],
            cost=setup.stats_cost,
            plan_ms=1e3 * done.plan_s,
            item_bytes=done.gathered.meta[:, 0],
            ranks_per_node=setup.ranks_per_node,
        )
        info = done.info(epoch=ep.epoch, step=step, prep_s=time.perf_counter() - t0)
        return Step(batch, info, step_stats(info, stats))
