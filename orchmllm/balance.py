"""Post-balancing: which rank should compute which item, so the slowest rank finishes sooner.

``balance()`` is the public entry point: it validates the input, runs one policy in the C++
core (``orchmllm._core``, GIL released) and returns an :class:`Assignment` with per-rank loads
and statistics. Every policy but ``greedy_stay`` is also written plainly in Python below (its
record's ``reference``); tests check that both give the same ``dst`` and the benchmark
measures the speed-up.

Policies (packed = batch cost is additive over items; padded = cost depends on count x max):

- ``identity``: no balancing, ``dst = src``.
- ``greedy`` (paper Alg. 1): longest first into the least-loaded rank, load = sum of lengths.
- ``greedy_cost``: the same on per-item costs ``alpha*l + beta*l^2`` of a packed cost model;
  for packed batches this is Alg. 1 generalised exactly to the quadratic objective.
- Both are followed by a bounded local search (``refine=True``, the default): at most
  ``REFINE_STEPS_PER_RANK * num_ranks`` steps, each the best single move or swap of one item
  between the heaviest and the lightest rank that lowers the heavier of the two below the old
  maximum; it stops when no such step exists. It never raises the maximum load and costs
  O(items on the two ranks + log d) per step. In ``benchmarks/balance_bench.py`` Alg. 1 alone
  ends up to 1.1% above the lower bound at 16 items per rank (LLaVA image patches, 512 ranks),
  with the refinement at most 0.4%, for up to about 3 ms more at 153,600 items. It is on by
  default because the slowest rank sets the step time; ``refine=False`` is the paper's Alg. 1
  exactly.
- With ``refine=True`` both are a portfolio (C++ ``lpt``, reference :func:`ref_lpt`): refined
  LPT always; refined Karmarkar-Karp when items x ranks <= ``_core.PORTFOLIO_KK_WORK`` (2^20);
  refined MULTIFIT (bisection on first-fit decreasing, at most ``_core.MULTIFIT_ROUNDS``
  rounds) when items <= ``_core.PORTFOLIO_MULTIFIT_ITEMS`` (4096). The lightest maximum load
  wins, ties in that order; the others are skipped once the best reaches the lower bound
  (mean, heaviest item, d-th + (d+1)-th heaviest). So on every instance up to those sizes the
  default is never worse than LPT, KK or MULTIFIT; above them it is refined LPT, which keeps
  983,040 items within about 2x numpy's argsort.
- ``greedy_tolerance`` (Alg. 4): ranks whose length sums are within ``tolerance`` x the mean
  rank sum of the smallest count as tied; the one with the smallest sum of squares wins.
- ``kk`` / ``kk_equal``: Karmarkar-Karp largest differencing (verl's baseline), on item costs
  (lengths without a cost model); ``kk_equal`` gives every rank n/d items (+-1).
- ``binary_search`` (Alg. 2, padded): minimises max ``count*max(l)``. The search cuts the
  length-sorted items into contiguous runs, which is optimal for any cost monotone in count
  and max, so Alg. 2 is exact for its objective. Batch k goes to rank k; trailing ranks may
  be empty.
- ``padded_cost`` (padded, beyond the paper): the same search on the full padded cost
  ``alpha*b*max + beta*b*max^2 + const``, i.e. exact for the measured cost, not its proxy.
- ``conv`` (Alg. 5, padded): the paper leaves its bound ``b`` undefined. Here ``b`` is the
  objective Alg. 1 reaches (its largest batch sum, about the packed lower bound): longest
  first, a batch grows while ``count x its longest item <= b`` (the paper writes the current
  item's length, which in descending order underestimates the padding), new batches open
  until ``num_ranks`` exist, and the remaining shorter items go to the smallest length sum.
- ``greedy_stay``: movement-aware greedy (``orchmllm.placement.movement_aware_dst``): within
  ``tolerance`` (default 0.5%) of the default ``greedy``'s makespan while keeping most items
  on their source rank; with ``ranks_per_node`` the moved items stay on their node where they
  fit. Its statistics add ``tokens_moved_lower_bound``, the fewest tokens any plan with the
  same makespan must move (``orchmllm.placement.movement_lower_bound``).

Caps are steered, not only checked: ``max_items_per_rank`` (items per rank) and
``max_load_per_rank`` (a memory budget in the policy's cost) hold for every policy but
``identity`` whenever the heuristics below or, on small instances, an exact search find a plan.
The policy plans first (the greedy and padded ones enforce the item cap as they go); a plan
over a cap is replaced by the capped ``greedy_cost`` portfolio (packed) or the exact
``padded_cost`` (padded), then, for packed policies on at most ``EXACT_MAX_CELLS`` items x
ranks, by the exact minimum makespan under the item cap (``orchmllm.exact``: a branch and
bound in the C++ core with a node limit). ``greedy_stay``'s fallbacks are placed whole on the
ranks holding most of their tokens. When nothing fits, :class:`InfeasibleCapError` (a
``ValueError``) names the smallest value that works: exact for padded policies and small
packed instances, else the lightest plan found and the floor no plan goes below.
``identity`` moves nothing, so its caps are checked. ``stats["caps_steered"]`` says whether a
fallback replaced the policy's plan.

Every fact about a policy (its cost kind, whether it enforces caps, is refined, is a pure
function of its inputs, its C++ function and its Python reference) is one :class:`Policy`
record in ``REGISTRY``; ``POLICIES``, ``PADDED_POLICIES`` and :func:`plan_is_deterministic`
are read from it. Edges: lengths must fit int64 and ``num_ranks`` is at most ``MAX_RANKS``;
all-zero lengths carry no load to balance, so the policies that ignore ``src`` deal them out
by count (item ``i`` to rank ``i % num_ranks``), while ``identity`` and ``greedy_stay`` leave
them where they are; integer arithmetic on lengths is exact (128-bit in the C++ core), and a
cost model that overflows float64 on the lengths is refused.
"""

from __future__ import annotations

import bisect
import heapq
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from orchmllm import _core
from orchmllm.cost import CostModel
from orchmllm.exact import EXACT_MAX_CELLS, min_makespan
from orchmllm.placement import (
    MAX_RANKS,
    REFINE_STEPS_PER_RANK,
    check_num_ranks,
    movement_aware_dst,
    movement_lower_bound,
    place_batches,
)
from orchmllm.schema import is_integer

# POLICIES and PADDED_POLICIES are read from REGISTRY, at the end of this module.
PLACEMENTS = ("none", "ilp", "assign", "auto")
# Placements whose result depends on more than the inputs: ``ilp`` is time-limited (CBC's
# CPU-time limit, scaled by the machine's load), so a busy rank can stop the solve at another
# point and reach another placement than its peers.
CLOCKED_PLACEMENTS = frozenset({"ilp"})
BACKENDS = ("cpp", "python")
# greedy_tolerance: sums within this fraction of the mean rank sum count as tied.
DEFAULT_TOLERANCE = 0.01
_INT64_MAX = np.iinfo(np.int64).max
_PACKED = CostModel("packed")


@dataclass(frozen=True)
class Assignment:
    """Result of :func:`balance`: where every item goes, and how even the plan is.

    Attributes:
        dst: int64 ``(n,)`` destination rank of every item, in input order.
        loads: float64 ``(num_ranks,)`` cost of each destination batch under the policy's cost
            model (after placement, indexed by the rank the batch was placed on).
        stats: float statistics, read-only and computed on first read: ``imbalance_after``
            (max/mean load), ``gap_to_lb`` (max load / max(mean load, costliest single
            item)); with ``src`` also ``imbalance_before``, ``tokens_moved``, ``tokens_kept``;
            with a cap ``caps_steered`` (1.0 when a fallback replaced the policy's plan); for
            ``greedy_stay`` ``tokens_moved_lower_bound``; with placement the placement
            statistics.
    """

    dst: np.ndarray
    loads: np.ndarray
    stats: Mapping[str, float] = field(default_factory=dict)


def balance(
    lengths: Any,
    num_ranks: int,
    policy: str = "greedy",
    *,
    src: Any = None,
    cost: CostModel | None = None,
    ranks_per_node: int | None = None,
    placement: str = "none",
    max_items_per_rank: int | None = None,
    max_load_per_rank: float | None = None,
    tolerance: float | None = None,
    refine: bool = True,
    backend: str = "cpp",
) -> Assignment:
    """Plan where every item goes so that the most loaded rank is as light as possible.

    Args:
        lengths: tokens per item (non-negative integers, 1-D).
        num_ranks: ranks to balance over.
        policy: one of ``POLICIES`` (module docstring).
        src: current rank of every item (needed by ``identity``, ``greedy_stay`` and a
            placement; adds movement statistics).
        cost: the cost model balanced (``None``: the policy's default, :func:`default_cost`).
        ranks_per_node: ranks per node, for ``greedy_stay`` and ``placement``.
        placement: ``none``, or how batches are permuted over ranks to keep traffic inside
            nodes (``orchmllm.placement``).
        max_items_per_rank: at most this many items on any rank (module docstring: caps).
        max_load_per_rank: at most this cost on any rank, e.g. a memory budget in tokens.
        tolerance: ``greedy_tolerance``'s window (fraction of the mean rank sum, default
            ``DEFAULT_TOLERANCE``), or ``greedy_stay``'s makespan slack over ``greedy``.
        refine: the move/swap local search after ``greedy``/``greedy_cost`` (default on);
            ``False`` keeps the paper's Alg. 1 exactly.
        backend: ``python`` runs the plain Python reference instead of the C++ core (same
            result, for tests and benchmarks).

    Returns:
        An :class:`Assignment`: ``dst`` per item, ``loads`` per rank, ``stats``.

    Raises:
        InfeasibleCapError: a cap no plan meets, or none was found for (a ``ValueError``).
        ValueError: any other bad argument, named with its value.
    """
    if (
        type(lengths) is np.ndarray
        and lengths.dtype == np.int64
        and lengths.ndim == 1
        and type(num_ranks) is int
        and 1 <= num_ranks <= MAX_RANKS
        and policy == "greedy"
        and src is cost is ranks_per_node is max_items_per_rank is max_load_per_rank is None
        and tolerance is None
        and placement == "none"
        and refine is True
        and backend == "cpp"
    ):
        # The default call, validated in the core (it answers None where the checks below
        # would raise or deal out by count); statistics are computed when first read.
        fast = _core.greedy_lengths(lengths, num_ranks, REFINE_STEPS_PER_RANK * num_ranks)
        if fast is not None:
            dst, loads = fast
            job = (lengths, None, dst, loads, None, num_ranks, _PACKED)
            return Assignment(dst=dst, loads=loads, stats=_LazyStats(partial(_stats, *job)))
    l = _lengths(lengths)
    n = l.size
    d = check_num_ranks(num_ranks)
    record = _policy(policy)
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    s = None if src is None else _src(src, n, d)
    if ranks_per_node is not None:
        ranks_per_node = _count("ranks_per_node", ranks_per_node)
    if placement != "none" and (s is None or ranks_per_node is None):
        raise ValueError(f"placement={placement!r} needs src and ranks_per_node")
    if s is None and record.needs_src:
        raise ValueError(f"src is required for policy={policy!r}, got None")
    cost = _cost(cost, record)
    longest = int(l.max(initial=0))
    _check_finite(longest, n, d, cost)
    check_caps(max_items_per_rank, max_load_per_rank)
    cap = n
    if max_items_per_rank is not None:
        cap = int(max_items_per_rank)
        if cap * d < n:
            least = -(-n // d)
            raise InfeasibleCapError(
                f"max_items_per_rank={cap} cannot hold {n} items on {d} ranks; "
                f"the smallest value that works is {least}",
                argument="max_items_per_rank", value=cap, smallest=float(least),
                proven=True, lower_bound=float(least),
            )  # fmt: skip
    if tolerance is not None and not (isinstance(tolerance, numbers.Real) and tolerance >= 0):
        raise ValueError(f"tolerance must be a number >= 0, got {tolerance!r}")
    if not isinstance(refine, bool | np.bool_):
        raise ValueError(f"refine must be True or False, got {refine!r}")

    dst = plan_dst(
        policy,
        l,
        d,
        cost=cost,
        cap=cap,
        tolerance=tolerance,
        src=s,
        ranks_per_node=ranks_per_node,
        refine=bool(refine),
        backend=backend,
    )
    stats: dict[str, float] = {}
    if max_items_per_rank is not None or max_load_per_rank is not None:
        caps = _Caps(cap, max_items_per_rank, max_load_per_rank)
        steered = _steer_caps(record, dst, l, d, cost, caps, s, ranks_per_node, backend)
        stats["caps_steered"] = float(steered is not dst)
        dst = steered
    loads = cost.loads(l, dst, d)
    if placement != "none":
        placed = place_batches(
            l, s, dst, num_ranks=d, ranks_per_node=ranks_per_node, method=placement
        )
        dst = np.asarray(placed.dst, dtype=np.int64)
        permuted = np.empty_like(loads)
        permuted[np.asarray(placed.perm, dtype=np.int64)] = loads
        loads = permuted
        stats.update({k: float(v) for k, v in placed.stats.items()})
    if policy == "greedy_stay":
        w = cost.item_costs(l)
        makespan = float(np.bincount(dst, weights=w, minlength=d).max(initial=0.0))
        stats["tokens_moved_lower_bound"] = movement_lower_bound(w, s, d, makespan, sizes=l)
    job = (l, longest, dst, loads, s, d, cost)
    return Assignment(dst=dst, loads=loads, stats=_LazyStats(partial(_stats, *job), stats))


# ---------------------------------------------------------------------------------------------
# validation


def check_caps(max_items_per_rank: Any, max_load_per_rank: Any) -> None:
    """Refuse a per-rank cap that is no valid value, whatever the batch (whether a plan can meet
    it is :func:`balance`'s question), so that a dispatcher can refuse it when it is built.

    Args:
        max_items_per_rank: None, or an integer >= 1.
        max_load_per_rank: None, or a number > 0 (``inf`` caps nothing).

    Raises:
        ValueError: naming the cap and the value.
    """
    if max_items_per_rank is not None:
        _count("max_items_per_rank", max_items_per_rank)
    load = max_load_per_rank
    if load is not None and not (
        isinstance(load, numbers.Real) and not isinstance(load, bool | np.bool_) and load > 0
    ):
        raise ValueError(f"max_load_per_rank must be a number > 0, got {load!r}")


def _count(name: str, value: Any) -> int:
    if not is_integer(value) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _int_array(name: str, value: Any) -> np.ndarray:
    try:
        a = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a 1-D integer array, got {value!r}") from e
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.dtype.kind == "i":
        return a.astype(np.int64, copy=False)
    if a.dtype.kind == "f":
        bad = ~np.isfinite(a) | (a != np.round(a))
        if bad.any():
            raise ValueError(f"{name} must be integers, got {a[bad][0]!r} at {np.argmax(bad)}")
    elif a.dtype == object:  # Python ints beyond int64 (or mixed with other objects)
        bad = np.array([not is_integer(x) for x in a])
        if bad.any():
            raise ValueError(f"{name} must be integers, got {a[bad][0]!r} at {np.argmax(bad)}")
    elif a.dtype.kind != "u":
        raise ValueError(f"{name} must be integers, got dtype {a.dtype}")
    # Checked before the cast, which would wrap 2**63 and above to negative values.
    wide = np.asarray((a >= 2**63) | (a < -(2**63)), dtype=bool)
    if wide.any():
        at = int(np.argmax(wide))
        # numpy may have rounded a list's big int to float: show the caller's own value
        shown = value[at] if isinstance(value, list | tuple) else a[at]
        raise ValueError(f"{name} must be int64 values (below 2**63), got {shown} at {at}")
    return a.astype(np.int64)


def _lengths(lengths: Any) -> np.ndarray:
    l = _int_array("lengths", lengths)
    if l.size and l.min() < 0:
        raise ValueError(f"lengths must be >= 0, got {l[l < 0][0]} at {np.argmax(l < 0)}")
    return l


def _src(src: Any, n: int, d: int) -> np.ndarray:
    s = _int_array("src", src)
    if s.size != n:
        raise ValueError(f"src must have one entry per item ({n}), got {s.size}")
    if s.size and (s.min() < 0 or s.max() >= d):
        bad = (s < 0) | (s >= d)
        raise ValueError(f"src must be in [0, {d}), got {s[bad][0]} at {np.argmax(bad)}")
    return s


def _policy(name: Any) -> Policy:
    if name not in REGISTRY:
        raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
    return REGISTRY[name]


def default_cost(policy: str) -> CostModel:
    """The cost a policy balances when given none: padded batches for padded policies, else
    packed tokens."""
    return CostModel("padded" if _policy(policy).padded else "packed")


def _cost(cost: CostModel | None, policy: Policy) -> CostModel:
    kind = "padded" if policy.padded else "packed"
    if cost is None:
        return default_cost(policy.name)
    if not isinstance(cost, CostModel):
        raise ValueError(f"cost must be a CostModel or None, got {cost!r}")
    if policy.name != "identity" and cost.kind != kind:
        raise ValueError(f"cost must be kind={kind!r} for policy={policy.name!r}, got {cost!r}")
    if cost.alpha < 0 or cost.beta < 0:
        raise ValueError(f"cost must have alpha >= 0 and beta >= 0, got {cost!r}")
    return cost


def _check_finite(longest: int, n: int, d: int, cost: CostModel) -> None:
    """Refuse a cost that overflows float64 on ``n`` lengths up to ``longest`` (loads and sums
    would be inf): ``n`` items of the longest length bound every rank's load and their sum,
    for both kinds."""
    x = float(longest)
    bound = cost.multiplier * (cost.alpha * n * x + cost.beta * n * x * x + cost.const * d)
    if not math.isfinite(bound):
        raise ValueError(
            f"cost overflows float64 on lengths up to {longest} ({n} items, {d} ranks): {cost!r}"
        )


class InfeasibleCapError(ValueError):
    """A per-rank cap of :func:`balance` that no plan meets, or none was found for.

    A ``ValueError``, so callers that catch bad arguments catch it too; the attributes let a
    caller retry with a cap that works.

    Args:
        message: the error text, naming the cap, its value and the smallest value that works.

    Attributes:
        argument: the cap, ``"max_items_per_rank"`` or ``"max_load_per_rank"``.
        value: what was passed for it.
        smallest: the smallest value that works: exact when ``proven``, else the busiest
            rank's load in the lightest plan found.
        proven: whether ``smallest`` is proven minimal: always for the item cap, ``identity``
            and padded policies; for packed ones when the exact search (small instances)
            completes.
        lower_bound: the floor no plan goes below (equal to ``smallest`` when ``proven``).
    """

    def __init__(
        self, message: str, *, argument: str, value: float, smallest: float,
        proven: bool, lower_bound: float,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.argument, self.value, self.smallest = argument, value, smallest
        self.proven, self.lower_bound = proven, lower_bound


class _Caps(NamedTuple):
    items: int  # the item cap in force (n when none was given)
    max_items: int | None  # as given
    max_load: float | None


def _steer_caps(
    record: Policy,
    dst: np.ndarray,
    lengths: np.ndarray,
    d: int,
    cost: CostModel,
    caps: _Caps,
    src: np.ndarray | None,
    ranks_per_node: int | None,
    backend: str,
) -> np.ndarray:
    """``dst`` if it meets the caps, else the first plan that does among, in order: the
    capped portfolio ``greedy_cost`` (packed policies) or the exact ``padded_cost`` (padded
    ones); for packed policies on at most ``EXACT_MAX_CELLS`` items x ranks, the exact
    minimum makespan under the item cap (:func:`orchmllm.exact.min_makespan`). Plans of a
    policy that plans from ``src`` are first placed whole on the ranks holding most of their
    tokens (``place_batches(method="assign")``), so fallbacks still move little. Raises
    :class:`InfeasibleCapError` when none fits, naming the smallest value that works.
    ``identity`` moves nothing, so its caps are only checked."""

    def fits(plan: np.ndarray) -> bool:
        if int(np.bincount(plan, minlength=d).max(initial=0)) > caps.items:
            return False
        return caps.max_load is None or float(cost.loads(lengths, plan, d).max()) <= caps.max_load

    if fits(dst):
        return dst
    if record.name == "identity":
        _raise_identity_caps(dst, lengths, d, cost, caps)

    def placed(plan: np.ndarray) -> np.ndarray:
        if not record.needs_src:
            return plan
        kw = {"num_ranks": d, "ranks_per_node": ranks_per_node or 1, "method": "assign"}
        return np.asarray(place_batches(lengths, src, plan, **kw).dst, dtype=np.int64)

    fallback = "padded_cost" if record.padded else "greedy_cost"
    best = dst
    if record.name != fallback:
        best = placed(plan_dst(fallback, lengths, d, cost=cost, cap=caps.items, backend=backend))
        if fits(best):
            return best
    # The item cap alone always fits by now (every fallback enforces it): the load cap is left.
    best_loads = cost.loads(lengths, best, d)
    best_load = float(best_loads.max())
    proven = record.padded  # padded_cost is exact for its cost (module docstring)
    if not record.padded and lengths.size * d <= EXACT_MAX_CELLS:
        exact = min_makespan(cost.item_costs(lengths), d, max_items=caps.items)
        exact_loads = cost.loads(lengths, exact.dst, d)
        if exact_loads.max() < best_load:
            best, best_loads, best_load = placed(exact.dst), exact_loads, float(exact_loads.max())
        proven = exact.proven
        if fits(best):
            return best
    lower = best_load if proven else _lower_bound(lengths, best_loads, cost)
    under = "" if caps.max_items is None else f" with max_items_per_rank={caps.max_items}"
    if proven:
        why = f"no plan{under} has a lighter busiest rank: the smallest value that works is"
    else:
        why = (
            f"no plan{under} was found under it (an exact search runs up to {EXACT_MAX_CELLS} "
            f"items x ranks) and no plan goes below {lower:.10g}; the smallest value found is"
        )
    raise InfeasibleCapError(
        f"max_load_per_rank={caps.max_load} is too small for policy={record.name!r}: "
        f"{why} {best_load:.10g}",
        argument="max_load_per_rank", value=caps.max_load, smallest=best_load,
        proven=proven, lower_bound=lower,
    )  # fmt: skip


def _raise_identity_caps(
    dst: np.ndarray, lengths: np.ndarray, d: int, cost: CostModel, caps: _Caps
) -> None:
    """policy='identity' keeps every item where it is, so the smallest caps that work for it
    are the ones its batches already have."""
    need = int(np.bincount(dst, minlength=d).max(initial=0))
    if need > caps.items:
        argument, value, smallest = "max_items_per_rank", caps.max_items, float(need)
    else:
        argument, value = "max_load_per_rank", caps.max_load
        smallest = float(cost.loads(lengths, dst, d).max())
    raise InfeasibleCapError(
        f"{argument}={value} is below what policy='identity' (which moves nothing) needs: "
        f"the smallest value that works for it is {smallest:.10g}",
        argument=argument, value=value, smallest=smallest, proven=True, lower_bound=smallest,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# statistics


def _total(lengths: np.ndarray, longest: int) -> int:
    """Exact sum of int64 lengths in ``[0, longest]``: an int64 sum overflows from 2**63
    tokens, so larger ones are summed as 32-bit halves (each half-sum fits int64 below 2**31
    items)."""
    if lengths.size == 0 or longest <= _INT64_MAX // lengths.size:
        return int(lengths.sum())
    return (int((lengths >> 32).sum()) << 32) + int((lengths & 0xFFFFFFFF).sum())


def _ratio(top: float, base: float) -> float:
    return float(top / base) if base > 0 else 1.0


def _lower_bound(lengths: np.ndarray, loads: np.ndarray, cost: CostModel) -> float:
    single = cost.batch_cost(lengths[[int(np.argmax(lengths))]]) if lengths.size else 0.0
    return max(float(loads.mean()), single)


class _LazyStats(Mapping):
    """Read-only statistics computed on first read: most callers of :func:`balance` only use
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

    def __iter__(self):
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())

    def __repr__(self) -> str:
        return repr(self._items())


def _stats(
    lengths: np.ndarray,
    longest: int | None,
    dst: np.ndarray,
    loads: np.ndarray,
    src: np.ndarray | None,
    d: int,
    cost: CostModel,
) -> dict[str, float]:
    if longest is None:
        longest = int(lengths.max(initial=0))
    top = float(loads.max(initial=0.0))
    stats = {
        "imbalance_after": _ratio(top, float(loads.mean())),
        "gap_to_lb": _ratio(top, _lower_bound(lengths, loads, cost)),
    }
    if src is not None:
        before = cost.loads(lengths, src, d)
        kept = _total(lengths[dst == src], longest)
        stats["imbalance_before"] = _ratio(float(before.max()), float(before.mean()))
        stats["tokens_moved"] = float(_total(lengths, longest) - kept)
        stats["tokens_kept"] = float(kept)
    return stats


# ---------------------------------------------------------------------------------------------
# dispatch


def plan_is_deterministic(*, placement: str = "none", policies: Iterable[str] = ()) -> bool:
    """Whether a plan with these options is a pure function of the gathered metadata, so
    every rank can compute it itself (otherwise one rank computes it for all)."""
    clocked = placement in CLOCKED_PLACEMENTS
    return not clocked and all(_policy(p).deterministic for p in policies)


class _Job(NamedTuple):
    """What :func:`plan_dst` hands a policy's ``call``: validated inputs, ``steps`` of the
    local search already decided."""

    lengths: np.ndarray
    num_ranks: int
    cost: CostModel
    cap: int
    steps: int
    tolerance: float | None
    src: np.ndarray | None
    ranks_per_node: int | None


def plan_dst(
    policy: str,
    lengths: np.ndarray,
    d: int,
    *,
    cost: CostModel,
    cap: int,
    tolerance: float | None = None,
    src: np.ndarray | None = None,
    ranks_per_node: int | None = None,
    refine: bool = True,
    backend: str = "cpp",
) -> np.ndarray:
    """The policy's ``dst`` alone, on inputs :func:`balance` has validated (int64 lengths,
    a cost of the policy's kind, ``cap * d >= n``). The benchmark times the C++ core against
    the Python reference here, without the validation and statistics both share."""
    record = REGISTRY[policy]
    n = lengths.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if not record.needs_src and np.count_nonzero(lengths) == 0:
        return np.arange(n, dtype=np.int64) % d  # nothing to balance: deal out by count
    steps = REFINE_STEPS_PER_RANK * d if refine and record.refined else 0
    fn = record.reference if backend == "python" and record.reference else record.cpp
    job = _Job(lengths, d, cost, cap, steps, tolerance, src, ranks_per_node)
    return np.asarray(record.call(fn, job), dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# Python reference: the same algorithms as cpp/, written plainly (same tie-breaking, same
# floating-point operation order), for tests and the speed comparison.


def _desc(key: list) -> list[int]:
    return sorted(range(len(key)), key=lambda i: (-key[i], i))


def _fill_least_loaded(w, order, load, count, cap, dst) -> None:
    heap = [(load[r], r) for r in range(len(load)) if count[r] < cap]
    heapq.heapify(heap)
    for i in order:
        _, r = heapq.heappop(heap)
        dst[i] = r
        load[r] += w[i]
        count[r] += 1
        if count[r] < cap:
            heapq.heappush(heap, (load[r], r))


def _around(neg: list[float], target: float) -> list[int]:
    # Positions nearest to target in weights sorted descending (given negated): the first of
    # the run just above target, and the first at or below it.
    below = bisect.bisect_left(neg, -target)
    above = [bisect.bisect_left(neg, neg[below - 1])] if below > 0 else []
    return above + ([below] if below < len(neg) else [])


def _refine(w, order, dst, load, count, cap, max_steps) -> None:
    d = len(load)
    lists = [[] for _ in range(d)]  # per rank, weight descending then index ascending
    for i in order:
        lists[dst[i]].append(i)
    for _ in range(max_steps):
        h = max(range(d), key=lambda r: (load[r], -r))
        l = min(range(d), key=lambda r: (load[r], r))
        if h == l or count[h] <= 1:
            break
        lh, ll = load[h], load[l]
        half = (lh - ll) * 0.5
        hs, ls = lists[h], lists[l]
        neg_h, neg_l = [-w[i] for i in hs], [-w[j] for j in ls]
        steps = []  # (new max of the pair, item leaving h, item leaving l or -1)
        if count[l] < cap:
            moves = [hs[a] for a in _around(neg_h, half)]
            steps += [(max(lh - w[i], ll + w[i]), i, -1) for i in moves if w[i] > 0]
        for i in hs:
            partners = [ls[b] for b in _around(neg_l, w[i] - half)]
            steps += [
                (max((lh - w[i]) + w[j], (ll - w[j]) + w[i]), i, j) for j in partners if w[j] < w[i]
            ]
        steps = [s for s in steps if s[0] < lh]
        if not steps:
            break
        _, i, j = min(steps)
        hs.remove(i)
        dst[i] = l
        if j < 0:
            load[h], load[l] = lh - w[i], ll + w[i]
            count[h] -= 1
            count[l] += 1
        else:
            ls.remove(j)
            bisect.insort(hs, j, key=lambda k: (-w[k], k))
            dst[j] = h
            load[h], load[l] = (lh - w[i]) + w[j], (ll - w[j]) + w[i]
        bisect.insort(ls, i, key=lambda k: (-w[k], k))


def ref_lpt(weights: np.ndarray, num_ranks: int, cap: int, max_steps: int = 0) -> np.ndarray:
    """LPT; with ``max_steps > 0`` the refined portfolio of ``greedy`` (see ``cpp/balance.hpp``):
    refined LPT, then on small instances refined KK and MULTIFIT, the lightest maximum load
    winning, ties to the earlier candidate; candidates stop once one reaches the lower bound
    (mean, heaviest item, d-th plus (d+1)-th heaviest; rounded up for integer weights)."""
    w = [float(x) for x in weights]
    n, d = len(w), num_ranks
    dst = [0] * n
    load, count, order = [0.0] * d, [0] * d, _desc(w)
    _fill_least_loaded(w, order, load, count, cap, dst)
    if max_steps <= 0:
        return np.array(dst, dtype=np.int64)
    _refine(w, order, dst, load, count, cap, max_steps)
    best = max(load)
    total = 0.0
    for i in order:
        total += w[i]
    if n < 2 or d < 2:
        return np.array(dst, dtype=np.int64)
    bound = max(total / d, w[order[0]])
    if n > d:
        bound = max(bound, w[order[d - 1]] + w[order[d]])
    integral = all(x == math.floor(x) for x in w)
    if integral:
        bound = math.ceil(bound)
    if not best > bound:
        return np.array(dst, dtype=np.int64)
    candidates = []
    if n * d <= _core.PORTFOLIO_KK_WORK:
        candidates.append(lambda: [int(r) for r in ref_karmarkar_karp(weights, d, False)])
    if n <= _core.PORTFOLIO_MULTIFIT_ITEMS:
        candidates.append(lambda: ref_multifit(w, order, d, cap))
    for make in candidates:
        if not best > bound:
            break
        plan = make()
        if plan is None:
            continue
        load, count = [0.0] * d, [0] * d
        for i in order:
            load[plan[i]] += w[i]
            count[plan[i]] += 1
        if max(count) > cap:
            continue
        _refine(w, order, plan, load, count, cap, max_steps)
        if max(load) < best:
            best, dst = max(load), plan
    return np.array(dst, dtype=np.int64)


def _first_fit(w, order, d, cap, bound) -> list[int] | None:
    load, count, dst = [0.0] * d, [0] * d, [0] * len(w)
    for i in order:
        fits = [r for r in range(d) if count[r] < cap and load[r] + w[i] <= bound]
        if not fits:
            return None
        dst[i] = fits[0]
        load[fits[0]] += w[i]
        count[fits[0]] += 1
    return dst


def ref_multifit(w: list[float], order: list[int], d: int, cap: int) -> list[int] | None:
    """MULTIFIT (Coffman, Garey and Johnson): bisection on the capacity of first-fit
    decreasing, from the lower bound max(total/d, heaviest) to max(2 total/d, heaviest),
    at most ``MULTIFIT_ROUNDS`` rounds; ``None`` when no capacity fits (a tight count cap)."""
    total = 0.0
    for i in order:
        total += w[i]
    lo = max(total / d, w[order[0]])
    hi = max(2.0 * total / d, w[order[0]])
    found = _first_fit(w, order, d, cap, lo)
    if found is not None:
        return found
    integral = all(x == math.floor(x) for x in w)  # then capacities < 1 apart plan alike
    for rounds in range(_core.MULTIFIT_ROUNDS):
        mid = hi if rounds == 0 else lo + (hi - lo) / 2
        if rounds > 0 and (not lo < mid < hi or (integral and hi - lo < 1.0)):
            break
        plan = _first_fit(w, order, d, cap, mid)
        if plan is not None:
            hi, found = mid, plan
        elif rounds == 0:
            return None
        else:
            lo = mid
    return found


def ref_greedy_tolerance(
    lengths: np.ndarray, num_ranks: int, tolerance: float, cap: int
) -> np.ndarray:
    l = [int(x) for x in lengths]
    total, square, count = [0.0] * num_ranks, [0.0] * num_ranks, [0] * num_ranks
    dst = [0] * len(l)
    for i in _desc(l):
        open_ranks = [r for r in range(num_ranks) if count[r] < cap]
        lowest = min(total[r] for r in open_ranks)
        window = [r for r in open_ranks if total[r] - lowest <= tolerance]
        best = min(window, key=lambda r: (square[r], total[r], r))
        x = float(l[i])
        dst[i] = best
        total[best] += x
        square[best] += x * x
        count[best] += 1
    return np.array(dst, dtype=np.int64)


def _least_batches(lengths, ascending, cap, bound, cost: Callable, dst=None) -> int:
    batches = count = 0
    for i in ascending:
        if batches == 0 or count >= cap or cost(count + 1, lengths[i]) > bound:
            batches += 1
            count = 0
        count += 1
        if dst is not None:
            dst[i] = batches - 1
    return batches


def ref_binary_search(lengths: np.ndarray, num_ranks: int, cap: int) -> np.ndarray:
    l = [int(x) for x in lengths]
    asc = sorted(range(len(l)), key=lambda i: (l[i], i))
    longest = l[asc[-1]]
    left, right = longest, longest * -(-len(l) // num_ranks)
    while left < right:
        mid = left + (right - left) // 2
        if _least_batches(l, asc, cap, mid, lambda b, x: b * x) <= num_ranks:
            right = mid
        else:
            left = mid + 1
    dst = [0] * len(l)
    _least_batches(l, asc, cap, left, lambda b, x: b * x, dst)
    return np.array(dst, dtype=np.int64)


def ref_padded_cost(
    lengths: np.ndarray,
    num_ranks: int,
    alpha: float,
    beta: float,
    const: float,
    multiplier: float,
    cap: int,
) -> np.ndarray:
    l = [int(x) for x in lengths]
    asc = sorted(range(len(l)), key=lambda i: (l[i], i))

    def cost(b: int, x: int) -> float:
        b, x = float(b), float(x)
        return multiplier * (alpha * b * x + beta * b * x * x + const)

    longest = l[asc[-1]]
    lo, hi = cost(1, longest), cost(-(-len(l) // num_ranks), longest)
    if _least_batches(l, asc, cap, lo, cost) <= num_ranks:
        hi = lo
    while True:
        mid = lo + (hi - lo) / 2
        if not lo < mid < hi:
            break
        if _least_batches(l, asc, cap, mid, cost) <= num_ranks:
            hi = mid
        else:
            lo = mid
    dst = [0] * len(l)
    _least_batches(l, asc, cap, hi, cost, dst)
    return np.array(dst, dtype=np.int64)


def ref_conv(lengths: np.ndarray, num_ranks: int, cap: int) -> np.ndarray:
    w = [float(x) for x in lengths]
    greedy = ref_lpt(lengths.astype(np.float64), num_ranks, cap)
    sums = [0.0] * num_ranks
    for i, r in enumerate(greedy):
        sums[r] += w[i]
    bound = max(sums)
    load, count = [0.0] * num_ranks, [0] * num_ranks
    dst = [0] * len(w)
    order = _desc(w)
    cur = k = 0
    first = 0.0
    while k < len(order):
        i = order[k]
        if count[cur] > 0 and (count[cur] >= cap or (count[cur] + 1) * first > bound):
            if cur + 1 >= num_ranks:
                break
            cur += 1
        if count[cur] == 0:
            first = w[i]
        dst[i] = cur
        load[cur] += w[i]
        count[cur] += 1
        k += 1
    _fill_least_loaded(w, order[k:], load, count, cap, dst)
    return np.array(dst, dtype=np.int64)


def ref_karmarkar_karp(weights: np.ndarray, num_ranks: int, equal_counts: bool) -> np.ndarray:
    # A subset is (sum, smallest item index, items); the empty subset is (0.0, -1, []).
    w = [float(x) for x in weights]
    n, d = len(w), num_ranks
    empty = (0.0, -1, [])
    if equal_counts:
        total = -(-n // d) * d
        w += [0.0] * (total - n)
        order = _desc(w)
        states = [
            sorted([(w[i], i, [i]) for i in order[c * d : (c + 1) * d]], key=lambda s: s[:2])
            for c in range(total // d)
        ]
    else:
        states = [[empty] * (d - 1) + [(w[i], i, [i])] for i in range(n)]
    heap = [(-(s[-1][0] - s[0][0]), k) for k, s in enumerate(states)]
    heapq.heapify(heap)
    while len(heap) > 1:
        a = states[heapq.heappop(heap)[1]]
        b = states[heapq.heappop(heap)[1]]
        merged = []
        for x, y in zip(reversed(a), b, strict=True):
            if x[1] < 0 or y[1] < 0:
                merged.append(y if x[1] < 0 else x)
            else:
                merged.append((x[0] + y[0], min(x[1], y[1]), x[2] + y[2]))
        merged.sort(key=lambda s: s[:2])
        states.append(merged)
        heapq.heappush(heap, (-(merged[-1][0] - merged[0][0]), len(states) - 1))
    dst = np.zeros(n, dtype=np.int64)
    for rank, (_, _, items) in enumerate(states[heap[0][1]]):
        for i in items:
            if i < n:
                dst[i] = rank
    return dst


# ---------------------------------------------------------------------------------------------
# the registry: how each policy's function is called, and one record per policy


def _keep(fn: None, job: _Job) -> np.ndarray:
    return job.src.copy()


def _lpt_lengths(fn: Callable, job: _Job) -> np.ndarray:
    return fn(job.lengths.astype(np.float64), job.num_ranks, job.cap, job.steps)


def _lpt_costs(fn: Callable, job: _Job) -> np.ndarray:
    return fn(job.cost.item_costs(job.lengths), job.num_ranks, job.cap, job.steps)


def _tolerance_window(fn: Callable, job: _Job) -> np.ndarray:
    fraction = DEFAULT_TOLERANCE if job.tolerance is None else float(job.tolerance)
    total = _total(job.lengths, int(job.lengths.max()))
    window = fraction * float(total) / job.num_ranks
    return fn(job.lengths, job.num_ranks, window, job.cap)


def _lengths_capped(fn: Callable, job: _Job) -> np.ndarray:
    return fn(job.lengths, job.num_ranks, job.cap)


def _padded(fn: Callable, job: _Job) -> np.ndarray:
    c = job.cost
    return fn(job.lengths, job.num_ranks, c.alpha, c.beta, c.const, c.multiplier, job.cap)


def _karmarkar_karp(fn: Callable, job: _Job, *, equal_counts: bool) -> np.ndarray:
    return fn(job.cost.item_costs(job.lengths), job.num_ranks, equal_counts)


def _stay(fn: Callable, job: _Job) -> np.ndarray:
    extra = {} if job.tolerance is None else {"tolerance": float(job.tolerance)}
    w = job.cost.item_costs(job.lengths)
    return fn(
        w, job.src, job.num_ranks, sizes=job.lengths, ranks_per_node=job.ranks_per_node, **extra
    )


@dataclass(frozen=True)
class Policy:
    """One balancing policy and every fact other code asks about it.

    ``cpp``: the function that runs it in the C++ core; ``reference``: its plain Python
    version, same arguments (``None``: there is none, and ``backend="python"`` runs ``cpp``
    too); ``call(fn, job)`` runs either on a validated :class:`_Job`. ``padded``: its cost
    model is kind ``padded`` (count x longest), else ``packed`` (additive). ``capped``: it
    enforces ``max_items_per_rank`` while planning (the others are steered after it).
    ``refined``: ``refine=True`` adds the move/swap local search. ``deterministic``: the plan
    is a pure function of the inputs, so every rank can compute it itself (all policies so far;
    a clocked one would not be). ``needs_src``: it plans from where the items are (``src`` is
    required, and all-zero lengths stay where they are).
    """

    name: str
    cpp: Callable | None
    reference: Callable | None
    call: Callable[[Callable | None, _Job], np.ndarray]
    padded: bool = False
    capped: bool = False
    refined: bool = False
    deterministic: bool = True
    needs_src: bool = False


# Read-only: the one place a policy is declared. greedy_stay's function is the placement
# module's movement_aware_dst, which validates its own options and runs _core.movement_aware.
REGISTRY: Mapping[str, Policy] = MappingProxyType(
    {
        p.name: p
        for p in (
            Policy("identity", None, None, _keep, needs_src=True),
            Policy("greedy", _core.lpt, ref_lpt, _lpt_lengths, capped=True, refined=True),
            Policy(
                "binary_search",
                _core.binary_search,
                ref_binary_search,
                _lengths_capped,
                padded=True,
                capped=True,
            ),
            Policy(
                "greedy_tolerance",
                _core.greedy_tolerance,
                ref_greedy_tolerance,
                _tolerance_window,
                capped=True,
            ),
            Policy("conv", _core.conv, ref_conv, _lengths_capped, padded=True, capped=True),
            Policy("greedy_cost", _core.lpt, ref_lpt, _lpt_costs, capped=True, refined=True),
            Policy(
                "kk",
                _core.karmarkar_karp,
                ref_karmarkar_karp,
                partial(_karmarkar_karp, equal_counts=False),
            ),
            Policy(
                "kk_equal",
                _core.karmarkar_karp,
                ref_karmarkar_karp,
                partial(_karmarkar_karp, equal_counts=True),
            ),
            Policy(
                "padded_cost", _core.padded_cost, ref_padded_cost, _padded, padded=True, capped=True
            ),
            Policy("greedy_stay", movement_aware_dst, None, _stay, needs_src=True),
        )
    }
)
POLICIES = tuple(REGISTRY)
PADDED_POLICIES = frozenset(p.name for p in REGISTRY.values() if p.padded)


__all__ = [
    "MAX_RANKS",
    "PADDED_POLICIES",
    "POLICIES",
    "REGISTRY",
    "Assignment",
    "InfeasibleCapError",
    "Policy",
    "balance",
    "check_caps",
    "plan_is_deterministic",
]
