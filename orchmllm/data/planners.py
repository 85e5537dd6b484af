"""Planners: gathered per-item metadata -> plan. Pure functions of their input.

The loader calls a planner in its background thread on the metadata every rank gathered
(see :data:`orchmllm.data.exchange.Planner`), so every rank computes the same plan
without another exchange. Single-phase balancing returns a
:class:`~orchmllm.plan.Rearrangement` the loader executes itself; any other planner
(e.g. the multimodal orchestrator's per-phase plans) is handed to the training loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from orchmllm.plan import Rearrangement


@dataclass(frozen=True)
class BalancePlanner:
    """Single-phase plan: ``orchmllm.balance`` on column 0 of the metadata (the length)."""

    policy: str = "greedy"
    cost: Any = None  # orchmllm.cost.CostModel or None (the policy's default)
    ranks_per_node: int | None = None
    placement: str = "none"

    def __call__(self, meta: np.ndarray, src: np.ndarray, num_ranks: int) -> Rearrangement:
        from orchmllm.balance import balance  # the balancing core loads lazily

        meta = np.asarray(meta, dtype=np.int64)
        src = np.asarray(src, dtype=np.int64)
        if meta.shape[0] == 0:
            return Rearrangement.from_assignment(src, src, num_ranks=num_ranks)
        result = balance(
            meta[:, 0],
            num_ranks,
            self.policy,
            src=src,
            cost=self.cost,
            ranks_per_node=self.ranks_per_node,
            placement=self.placement,
        )
        return Rearrangement.from_assignment(src, result.dst, num_ranks=num_ranks)
