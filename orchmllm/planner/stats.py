"""Statistics of a plan: how even it is (max/mean load, gap to the lower bound) and how many
tokens it moves. :func:`orchmllm.balance` reports them in ``Assignment.stats``, computed on
first read; token counts are exact integers, also for lengths near 2**63."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import numpy as np

from orchmllm.planner.cost import CostModel

__all__ = ["LazyStats", "exact_total", "lower_bound", "plan_stats"]

_INT64_MAX = np.iinfo(np.int64).max


def exact_total(lengths: np.ndarray, longest: int) -> int:
    """Exact sum of int64 lengths in ``[0, longest]``: an int64 sum overflows from 2**63
    tokens, so larger ones are summed as 32-bit halves (each half-sum fits int64 below 2**31
    items)."""
    if lengths.size == 0 or longest <= _INT64_MAX // lengths.size:
        return int(lengths.sum())
    return (int((lengths >> 32).sum()) << 32) + int((lengths & 0xFFFFFFFF).sum())


def _ratio(top: float, base: float) -> float:
    return float(top / base) if base > 0 else 1.0


def lower_bound(lengths: np.ndarray, loads: np.ndarray, cost: CostModel) -> float:
    """A load no plan's busiest rank goes below: the mean load, or the costliest item alone."""
    single = cost.batch_cost(lengths[[int(np.argmax(lengths))]]) if lengths.size else 0.0
    return max(float(loads.mean()), single)


class LazyStats(Mapping):
    """Read-only statistics computed on first read: most callers of ``balance`` only use
    ``dst``, and the statistics cost more than the plan at small sizes. ``known``: entries
    already computed (placement, movement bound); computed ones win on a shared key."""

    def __init__(self, compute: Callable[[], dict[str, float]], known: dict | None = None):
        self._compute, self._known, self._all = compute, known or {}, None

    def _items(self) -> dict[str, float]:
        if self._all is None:
            self._all = {**self._known, **self._compute()}
        return self._all

    def __getitem__(self, key: str) -> float:
        return self._items()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())

    def __repr__(self) -> str:
        return repr(self._items())


def plan_stats(
    lengths: np.ndarray,
    longest: int | None,
    dst: np.ndarray,
    loads: np.ndarray,
    src: np.ndarray | None,
    d: int,
    cost: CostModel,
) -> dict[str, float]:
    """``imbalance_after`` and ``gap_to_lb`` of ``loads``; with ``src`` also
    ``imbalance_before``, ``tokens_moved`` and ``tokens_kept`` (``longest``: the longest length,
    None to compute it)."""
    if longest is None:
        longest = int(lengths.max(initial=0))
    top = float(loads.max(initial=0.0))
    stats = {
        "imbalance_after": _ratio(top, float(loads.mean())),
        "gap_to_lb": _ratio(top, lower_bound(lengths, loads, cost)),
    }
    if src is not None:
        before = cost.loads(lengths, src, d)
        kept = exact_total(lengths[dst == src], longest)
        stats["imbalance_before"] = _ratio(float(before.max()), float(before.mean()))
        stats["tokens_moved"] = float(exact_total(lengths, longest) - kept)
        stats["tokens_kept"] = float(kept)
    return stats
