"""Exact smallest makespan under a per-rank item cap, for small instances.

:func:`orchmllm.balance` steers its caps with heuristics first; when they miss a load cap,
only an exact answer can tell "no plan exists" from "the heuristic missed one". This is
that answer: a depth-first branch and bound in the C++ core (``cpp/exact.cpp``), bounded by a
count of search nodes, never a clock, so every rank reaches the same result.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

import orchmllm._core as _core

# Items x ranks at most: beyond it the search rarely proves anything within its node budget.
EXACT_MAX_CELLS = 1024
# Search nodes before giving up without a proof (a count, so deterministic; a node costs
# O(ranks), so this bounds the search's time at any size it runs at).
EXACT_NODE_LIMIT = 1_000_000


class ExactMakespan(NamedTuple):
    """``dst``: the best plan found; ``proven``: no plan has a lighter busiest rank."""

    dst: np.ndarray
    proven: bool


def min_makespan(weights: np.ndarray, num_ranks: int, *, max_items: int) -> ExactMakespan:
    """Fewest max load of additive ``weights`` on ``num_ranks`` ranks with at most
    ``max_items`` items each (``max_items * num_ranks >= len(weights)``), exactly when
    ``proven``.

    The search starts from longest-processing-time under the cap. Up to 64 integer weights
    (``cpp/exact.cpp``): bin completion decides capacities from the floor up (the floor, then
    bisection), and pairs of ranks and chains of three rebalanced exactly by subset sums find
    the plans at the floor that many items per rank hide from it. Otherwise, and with what
    budget is left, it places items heaviest first, trying ranks in index order and skipping
    a rank in the same (load, count) state as an earlier one (its plans mirror the earlier
    one's); a branch stops when the ranks with room cannot hold what is left below the best
    plan. It ends at the floor (mean or heaviest item, rounded up for integer weights), which
    proves the plan optimal at once.
    """
    w = np.ascontiguousarray(weights, dtype=np.float64)
    dst, proven, _ = _core.min_makespan(w, int(num_ranks), int(max_items), EXACT_NODE_LIMIT)
    return ExactMakespan(np.asarray(dst, dtype=np.int64), bool(proven))
