"""BalancedCollator: balancing for users who keep their own DataLoader.

Replace ``collate_fn=my_collate`` with ``collate_fn=BalancedCollator(my_collate,
length_column="n_tokens")``. Each call gathers the local examples' lengths on a CPU group,
plans, moves the examples to their destination ranks (one all-to-all of their bytes) and
collates the balanced set. It runs synchronously in the loader's main process, so the
DataLoader must use ``num_workers=0``; for worker processes and planning hidden behind
the step, wrap the DataLoader in :class:`~orchmllm.data.loader.BalancedDataLoader`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.utils.data import get_worker_info
from torch.utils.data._utils.collate import default_collate

from orchmllm.data import exchange as ex
from orchmllm.data.lengths import LengthFn, example_length
from orchmllm.data.planners import BalancePlanner


class BalancedCollator:
    """``collate_fn`` wrapper returning the rebalanced batch (collective: every rank's
    DataLoader must produce the same number of batches, e.g. with DistributedSampler)."""

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
        self._group = ex.Group(
            group if group is not None else ex.new_cpu_group(timeout=timeout), timeout=timeout
        )
        self.step = 0
        self.last_step: ex.StepInfo | None = None

    def __call__(self, examples: list) -> Any:
        if get_worker_info() is not None:
            raise RuntimeError(
                "BalancedCollator runs collectives and cannot run in DataLoader workers; use "
                "num_workers=0, or BalancedDataLoader(your_dataloader) to keep the workers"
            )
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
        self.last_step = done.info(epoch=0, step=self.step, prep_s=time.perf_counter() - t0)
        self.step += 1
        return batch
