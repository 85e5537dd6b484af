"""Context parallelism in the balance: items longer than a rank can hold are cut into pieces.

``balance(..., context_parallel=N)`` may cut an item into ``k <= N`` pieces on ``k`` ranks of
one *group*. Groups are blocks of ``N`` consecutive ranks (``[0, N)``, ``[N, 2N)``, ...), so
``N`` must divide ``num_ranks``; with ``ranks_per_node``, ``N`` must divide it (every group
inside one node, where the gather of keys and values is cheapest) or be a multiple of it
(a group is whole nodes; then an item in at most ``ranks_per_node`` pieces goes on the ranks
of one node of its group, so its gather stays inside the node). The split decision and the
placement run in the C++ core (``cpp/context_parallel.hpp``): an item is split when its cost
exceeds the budget (``max_load_per_rank``) or when splitting lowers the slowest rank; the
pieces go first, the whole items are balanced around them by LPT. Pieces cost
:meth:`orchmllm.planner.cost.CostModel.piece_costs`: packed cost models only.

The record (:class:`Pieces`): one row per token range, ``(item, rank, start, end)``. A piece is
the part of an item on one rank and uses load-balanced causal chunking: the item is cut in
``2k`` chunks, the ``j``-th of the piece's ranks (ascending) holds chunk ``j`` and chunk
``2k-1-j``, so a piece is two ranges (one for the middle rank, whose two chunks touch). Sorted
by start, an item's ranges are contiguous, do not overlap and cover ``[0, length)``. Every
piece holds at least one token; the pieces' tokens differ by at most one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

import orchmllm._core as _core
from orchmllm.planner.cost import CostModel, imbalance
from orchmllm.planner.stats import exact_total
from orchmllm.schema import is_integer

__all__ = ["Pieces", "Split", "check_context_parallel", "largest_pieces", "plan_split"]

# The policies whose plan the context-parallel core computes: LPT on the packed cost model.
SPLIT_POLICIES = ("greedy", "greedy_cost")


@dataclass(frozen=True)
class Pieces:
    """Where the pieces of split items go: int64 arrays, one row per token range, rows
    ordered by item, then by ``start``.

    Attributes:
        item: the item the range belongs to (its index in ``lengths``).
        rank: the rank that computes it.
        start: first token of the range.
        end: one past its last token.
    """

    item: np.ndarray
    rank: np.ndarray
    start: np.ndarray
    end: np.ndarray

    @classmethod
    def empty(cls) -> Pieces:
        """No item split (``balance`` without ``context_parallel``)."""
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z.copy(), z.copy(), z.copy())

    def same_as(self, other: Pieces) -> bool:
        """Whether ``other`` holds the same rows (the plans' check across ranks)."""
        return all(
            np.array_equal(getattr(self, f), getattr(other, f))
            for f in ("item", "rank", "start", "end")
        )

    @property
    def items(self) -> np.ndarray:
        """The split items, ascending."""
        return np.unique(self.item)

    def of(self, item: int) -> Pieces:
        """The rows of one item."""
        at = self.item == item
        return Pieces(self.item[at], self.rank[at], self.start[at], self.end[at])


class Split(NamedTuple):
    """The core's answer (``_core.context_parallel``)."""

    dst: np.ndarray  # rank per item, -1 for a split item
    loads: np.ndarray
    pieces: Pieces
    feasible: bool  # every rank within the budget
    split: bool  # a split plan won over the whole-item portfolio
    lower_bound: float  # no plan with pieces of at most N has a lighter busiest rank


def check_context_parallel(value: Any, num_ranks: int, ranks_per_node: int | None) -> int:
    """``context_parallel`` as an int in ``[1, num_ranks]`` that cuts the ranks into whole
    groups (it divides ``num_ranks``; with ``ranks_per_node`` it divides it or is a multiple
    of it), else a ValueError naming the argument and the value."""
    if not is_integer(value) or value < 1:
        raise ValueError(f"context_parallel must be an integer >= 1, got {value!r}")
    n = int(value)
    if n > num_ranks or num_ranks % n:
        raise ValueError(
            f"context_parallel={n} must divide num_ranks={num_ranks} (groups of "
            f"context_parallel consecutive ranks)"
        )
    if ranks_per_node is not None and ranks_per_node % n and n % ranks_per_node:
        raise ValueError(
            f"context_parallel={n} must divide ranks_per_node={ranks_per_node} or be a multiple "
            f"of it (a group inside one node, or whole nodes)"
        )
    return n


def check_split_request(
    policy: str, padded: bool, placement: str, max_items: int | None, backend: str
) -> None:
    """Refuse what ``context_parallel > 1`` does not combine with, naming it."""
    if padded:
        raise ValueError(
            f"context_parallel needs a packed cost model; policy={policy!r} balances a padded "
            f"one (use greedy or greedy_cost)"
        )
    if policy not in SPLIT_POLICIES:
        raise ValueError(
            f"context_parallel > 1 plans with LPT on the packed cost: policy must be one of "
            f"{SPLIT_POLICIES}, got {policy!r}"
        )
    if placement != "none":
        raise ValueError(f"context_parallel > 1 needs placement='none', got {placement!r}")
    if max_items is not None:
        raise ValueError(
            f"context_parallel > 1 does not take max_items_per_rank (got {max_items!r}): "
            f"pieces have no item count yet"
        )
    if backend != "cpp":
        raise ValueError(
            f"context_parallel > 1 runs in the C++ core: backend='cpp', got {backend!r}"
        )


def plan_split(
    lengths: np.ndarray,
    num_ranks: int,
    group: int,
    ranks_per_node: int | None,
    cost: CostModel,
    budget: float,
    steps: int,
) -> Split:
    """The context-parallel plan of checked ``lengths`` (C++ core, GIL released)."""
    c, node = cost, ranks_per_node or 0
    dst, loads, item, rank, start, end, feasible, split, lower = _core.context_parallel(
        lengths, num_ranks, group, node, c.alpha, c.beta, c.const, c.multiplier, budget, steps
    )
    pieces = Pieces(item, rank, start, end)
    return Split(dst, loads, pieces, bool(feasible), bool(split), float(lower))


def largest_pieces(lengths: np.ndarray, group: int, cost: CostModel) -> np.ndarray:
    """Each item's heaviest piece when cut in as many pieces as it may be (``min(group,
    length)``, at least 1), without ``const``: what the budget must hold at the least."""
    k = np.clip(np.minimum(lengths, group), 1, None)
    return cost.piece_costs(lengths, -(-lengths // k), k)


def split_stats(
    lengths: np.ndarray,
    plan: Split,
    src: np.ndarray | None,
    d: int,
    cost: CostModel,
) -> dict[str, float]:
    """``imbalance_after``, ``gap_to_lb`` (against the split plans' lower bound), ``items_split``
    and ``pieces``; with ``src`` also ``imbalance_before``, ``tokens_moved`` and
    ``tokens_kept`` (a range counts as kept on its item's source rank)."""
    top = float(plan.loads.max(initial=0.0))
    p = plan.pieces
    ranks_used = np.unique(p.item * d + p.rank)
    stats = {
        "imbalance_after": imbalance(plan.loads),
        "gap_to_lb": top / plan.lower_bound if plan.lower_bound > 0 else 1.0,
        "items_split": float(p.items.size),
        "pieces": float(ranks_used.size),
    }
    if src is not None:
        before = cost.loads(lengths, src, d)
        whole = plan.dst >= 0
        longest = int(lengths.max(initial=0))
        kept = exact_total(lengths[whole & (plan.dst == src)], longest)
        kept += int((p.end - p.start)[p.rank == src[p.item]].sum())
        stats["imbalance_before"] = imbalance(before)
        stats["tokens_moved"] = float(exact_total(lengths, longest) - kept)
        stats["tokens_kept"] = float(kept)
    return stats
