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

import torch.distributed as dist
from torch.utils.data import default_collate, get_worker_info

from orchmllm.data import exchange as ex
from orchmllm.data import stats as st
from orchmllm.data.lengths import LengthFn, example_length
from orchmllm.data.planners import BalancePlanner, warn_on_layout_mismatch

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
        length_fn: ``length_fn(example) -> int``, an example's length (cost unit).
        length_column: Or the key of each example holding its length (pass exactly one).
        planner: ``planner(meta, src, num_ranks) -> Rearrangement`` replacing the default
            ``BalancePlanner(policy, cost)``.
        policy: The balancing policy (``orchmllm.POLICIES``).
        cost: An ``orchmllm.CostModel`` for the policy (None: its default).
        group: The CPU (gloo) group for the collectives (default: a new one, all ranks).
        timeout: Seconds a collective may wait for the other ranks.

    Returns (each call): the collated balanced batch; ``last_step`` and ``last_stats``
    (:mod:`orchmllm.data.stats`) describe the step.

    Raises:
        ValueError: Not exactly one of ``length_fn``/``length_column``; a bad length
            (naming the item's position in this rank's batch and the step).
        RuntimeError: Sent to DataLoader worker processes (``num_workers > 0``): use
            ``BalancedDataLoader(your_dataloader)``, which keeps the workers. The DataLoader
            cannot be checked when it is built (it is the user's); with the ``spawn`` or
            ``forkserver`` start method the error comes as its iterator starts (the
            collator refuses to be pickled), with ``fork`` from the worker's first batch,
            before any batch reaches the training loop.
        PeerFailed: Another rank failed to prepare the step.

    Collective: every rank's DataLoader must produce the same number of batches (e.g.
    with ``DistributedSampler``), and each call runs on every rank.
    """

    def __init__(
        self,
        collate_fn: Callable[[list], Any] | None = None,
        *,
        length_fn: LengthFn | None = None,
        length_column: str | None = None,
        planner: ex.Planner | None = None,
        policy: str = "greedy",
        cost: Any = None,
        group: dist.ProcessGroup | None = None,
        timeout: float = 600.0,
    ) -> None:
        if (length_fn is None) == (length_column is None):
            raise ValueError("pass exactly one of length_fn= or length_column=")
        self.collate_fn = collate_fn or default_collate
        self.length_fn = length_fn
        self.length_column = length_column
        self.planner = planner or BalancePlanner(policy=policy, cost=cost)
        warn_on_layout_mismatch(self.collate_fn, self.planner)
        self._group = ex.Group(
            group if group is not None else ex.new_cpu_group(timeout=timeout, owner=self),
            timeout=timeout,
        )
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
            rows = [  # the collate function never sees dataset indices: name the position
                [
                    example_length(
                        e,
                        index=f"item {i} of this rank's batch {self.step}",
                        length_column=self.length_column,
                        length_fn=self.length_fn,
                    )
                ]
                for i, e in enumerate(examples)
            ]
            return list(examples), rows

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
