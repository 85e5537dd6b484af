"""Planners: gathered per-item metadata -> plan.

The loader calls a planner in its background thread on the metadata every rank gathered
(see :data:`orchmllm.data.exchange.Planner`). Single-phase balancing returns a
:class:`~orchmllm.plan.Rearrangement` the loader executes itself; any other planner
(e.g. the multimodal orchestrator's per-phase plans) is handed to the training loop.

Most plans are a pure function of the gathered metadata, so every rank computes the same
plan itself. A plan that is not (see :func:`plan_is_deterministic`) is computed on one rank
and broadcast by :func:`orchmllm.data.exchange.agreed_plan`; a planner says which it is
with its ``deterministic`` attribute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from orchmllm.balance import balance, plan_is_deterministic
from orchmllm.plan import Rearrangement


@dataclass(frozen=True)
class BalancePlanner:
    """Single-phase plan: ``orchmllm.balance`` on column 0 of the metadata (the length)."""

    policy: str = "greedy"
    cost: Any = None  # orchmllm.cost.CostModel or None (the policy's default)
    ranks_per_node: int | None = None
    placement: str = "none"

    @property
    def deterministic(self) -> bool:
        return plan_is_deterministic(placement=self.placement, policies=(self.policy,))

    def __call__(self, meta: np.ndarray, src: np.ndarray, num_ranks: int) -> Rearrangement:
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
