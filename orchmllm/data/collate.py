"""BalancedCollator: balancing for users who keep their own DataLoader.

Replace ``collate_fn=my_collate`` with ``collate_fn=BalancedCollator(my_collate,
length_column="n_tokens")``. Each call gathers the local examples' lengths on a CPU group,
plans, moves the examples to their destination ranks (one all-to-all of their bytes) and
collates the balanced set. It runs synchronously in the DataLoader's main process:
``pin_memory`` works as usual, but worker processes cannot run collectives, so the
DataLoader must use ``num_workers=0``. For workers (and persistent workers) and planning
hidden behind the step, wrap the DataLoader instead:
``BalancedDataLoader(DataLoader(..., num_workers=4), length_column="n_tokens")``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torch.utils.data import default_collate, get_worker_info

from orchmllm.data import exchange as ex
from orchmllm.data import stats as st
from orchmllm.data.lengths import LengthFn, example_length
from orchmllm.data.options import PlanningOptions, given
from orchmllm.data.planners import BalancePlanner, warn_on_layout_mismatch
from orchmllm.dist.topology import Topology

_NOT_IN_WORKERS = (
    "BalancedCollator runs collectives and cannot run in DataLoader workers; use "
    "num_workers=0, or BalancedDataLoader(your_dataloader) to keep the workers"
)


class BalancedCollator:
    """A ``collate_fn`` that returns this rank's balanced batch instead of its own.

    Each call is one step: the ranks' batches together form the global batch, which is
    rebalanced so that every rank gets about the same work; the global batch itself is
    unchanged, so normalise the loss by the global count of loss-bearing items
    (``orchmllm.global_num_items``), not per rank.

    Args:
        collate_fn: Collates the balanced examples (default: torch's ``default_collate``).
        length_column: The key of each example holding its length (cost unit).
        length_fn: Or ``length_fn(example) -> int``, an example's length (pass exactly one
            of the two, or a planning ``meta_fn``).
        planning: How the plan is made (:class:`~orchmllm.data.options.PlanningOptions`:
            policy, cost, a planner of your own and its per-example ``meta_fn`` rows; not
            ``batch_meta_fn``, which needs ``BalancedDataLoader(mode="local")``).
        topology: The job's process groups (:class:`orchmllm.dist.topology.Topology`): the
            collator talks on its gloo metadata group only, with its timeout. None builds
            one over the default group that this collator owns (dropping the collator
            destroys it), as :class:`~orchmllm.data.loader.BalancedDataLoader` does.

    Returns (each call): the collated balanced batch; ``last_step`` and ``last_stats``
    (:mod:`orchmllm.data.stats`) describe the step.

    Raises:
        ValueError: Not exactly one of ``length_fn``, ``length_column`` and a ``meta_fn``;
            a ``batch_meta_fn``; a bad length (naming the item's position in this rank's
            batch and the step).
        TypeError: ``planning`` is not a :class:`~orchmllm.data.options.PlanningOptions`.
        RuntimeError: Sent to DataLoader worker processes (``num_workers > 0``): use
            ``BalancedDataLoader(your_dataloader)``, which keeps the workers. The DataLoader
            cannot be checked when it is built (it is the user's); with the ``spawn`` or
            ``forkserver`` start method the error comes as its iterator starts (the
            collator refuses to be pickled), with ``fork`` from the worker's first batch,
            before any batch reaches the training loop.
        PeerFailed: Another rank failed to prepare the step.

    Collective: construct it on every rank together; every rank's DataLoader must produce
    the same number of batches (e.g. with ``DistributedSampler``), and each call runs on
    every rank.
    """

    def __init__(
        self,
        collate_fn: Callable[[list], Any] | None = None,
        *,
        length_column: str | None = None,
        length_fn: LengthFn | None = None,
        planning: PlanningOptions | None = None,
        topology: Topology | None = None,
    ) -> None:
        plan = given(planning, PlanningOptions, "planning")
        if plan.batch_meta_fn is not None:
            raise ValueError(
                "batch_meta_fn needs BalancedDataLoader(mode='local'); the collator moves "
                "examples, planned on one row each (length_fn=, length_column= or meta_fn=)"
            )
        rows_from = {
            "length_fn": length_fn,
            "length_column": length_column,
            "meta_fn": plan.meta_fn,
        }
        named = [name for name, value in rows_from.items() if value is not None]
        if len(named) != 1:
            raise ValueError(
                "pass exactly one of length_fn=, length_column= or a planning meta_fn=; "
                f"got {named}"
            )
        self.collate_fn = collate_fn or default_collate
        self.length_fn = length_fn
        self.length_column = length_column
        self.meta_fn = plan.meta_fn
        self.planner = plan.planner or BalancePlanner(policy=plan.policy, cost=plan.cost)
        warn_on_layout_mismatch(self.collate_fn, self.planner)
        self.topology = topology if topology is not None else Topology.build()
        self._group = ex.Group(self.topology)
        self.step = 0
        self.last_step: ex.StepInfo | None = None
        self.last_stats: dict[str, float] = {}

    def __getstate__(self) -> None:
        # Pickled means sent to a worker process (spawn/forkserver start): fail there, as the
        # iterator starts, rather than at the worker's first batch.
        raise RuntimeError(_NOT_IN_WORKERS)

    def __call__(self, examples: list) -> Any:
        if get_worker_info() is not None:  # forked workers never pickle the collator
            raise RuntimeError(_NOT_IN_WORKERS)
        t0 = time.perf_counter()

        def prepare() -> tuple[list, list[list[int]]]:
            return list(examples), [self._row(i, e) for i, e in enumerate(examples)]

        done = ex.balance_step(self._group, self.planner, prepare, step=self.step, move=True)
        assert done is not None  # this rank had examples
        batch = self.collate_fn(done.examples)
        info = done.info(epoch=0, step=self.step, prep_s=time.perf_counter() - t0)
        phase = st.phase_stats(
            "batch",
            done.plan,
            done.meta[:, 0],
            cost=st.planner_cost(self.planner),
            plan_ms=1e3 * done.plan_s,
            item_bytes=done.gathered.meta[:, 0],
            ranks_per_node=getattr(self.planner, "ranks_per_node", None),
        )
        self.last_step, self.last_stats = info, {"step": self.step, **phase}
        self.step += 1
        return batch

    def _row(self, i: int, example: Any) -> list[int]:
        """The metadata row of the ``i``-th example of this rank's batch: its length, or the
        planning ``meta_fn``'s row."""
        if self.meta_fn is not None:
            return [int(v) for v in self.meta_fn(example)]
        # The collate function never sees dataset indices: name the position.
        where = f"item {i} of this rank's batch {self.step}"
        length = example_length(
            example, index=where, length_column=self.length_column, length_fn=self.length_fn
        )
        return [length]
