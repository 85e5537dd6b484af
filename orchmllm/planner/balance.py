"""Post-balancing: which rank should compute which item, so the slowest rank finishes sooner.

``balance()`` is the public entry point, in named steps: check the arguments (``validate``),
run one policy of the registry (``policies``: the built-ins in the C++ core, GIL released, each
also written plainly in ``reference``), steer the plan under the per-rank caps, place its
batches on nodes (``placement``; all four modules of ``orchmllm.planner``) and return
an :class:`Assignment` with per-rank loads and statistics (``orchmllm.planner.stats``, computed on
first read).

Caps are steered, not only checked: ``max_items_per_rank`` (items per rank) and
``max_load_per_rank`` (a memory budget in the policy's cost) hold for every policy but
``identity`` whenever the fallbacks described next or, on small instances, an exact search
find a plan.
The policy plans first (the greedy and padded ones enforce the item cap as they go); a plan
over a cap is replaced by the capped ``greedy_cost`` portfolio (packed) or the exact
``padded_cost`` (padded), then, for packed policies on at most ``EXACT_MAX_CELLS`` items x
ranks, by the exact minimum makespan under the item cap (``orchmllm.planner.exact``: a branch and
bound in the C++ core with a node limit). ``greedy_stay``'s fallbacks are placed whole on the
ranks holding most of their tokens. When nothing fits, :class:`InfeasibleCapError` (a
``ValueError``) names the smallest value that works: exact for padded policies and small
packed instances, else the lightest plan found and the floor no plan goes below.
``identity`` moves nothing, so its caps are checked. ``stats["caps_steered"]`` says whether a
fallback replaced the policy's plan.

Never worse than the input: with ``src``, a plan of a ``never_worse`` policy (every built-in
but ``identity``) whose busiest rank is heavier under the policy's cost than the source
layout's is replaced by the source layout where that meets the caps (and ``kk_equal``'s
equal counts); ``stats["kept_source"]`` says so. ``imbalance_after`` and
``imbalance_before`` divide by each layout's own mean, which differs for padded costs, so
only the maxima compare.

Edges: lengths must fit int64 and ``num_ranks`` is at most ``MAX_RANKS``; all-zero lengths
carry no load to balance, so the policies that ignore ``src`` deal them out by count (item
``i`` to rank ``i % num_ranks``), while those that plan from ``src`` (``identity``,
``greedy_stay``) leave them where they are; integer arithmetic on lengths is exact (128-bit in
the C++ core), and a cost model that overflows float64 on the lengths is refused.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import numpy as np

import orchmllm._core as _core
from orchmllm.planner.context_parallel import (
    Pieces,
    Split,
    check_context_parallel,
    check_split_request,
    largest_pieces,
    plan_split,
    split_stats,
)
from orchmllm.planner.cost import CostModel
from orchmllm.planner.exact import EXACT_MAX_CELLS, min_makespan
from orchmllm.planner.placement import (
    MAX_RANKS,
    REFINE_STEPS_PER_RANK,
    check_num_ranks,
    movement_lower_bound,
    place_batches,
)
from orchmllm.planner.policies import Planned, Policy, get_policy, plan_dst, plan_policy
from orchmllm.planner.stats import LazyStats, lower_bound, plan_stats
from orchmllm.planner.validate import (
    check_caps,
    check_count,
    check_finite_cost,
    check_lengths,
    check_ranks,
)

__all__ = [
    "BACKENDS",
    "CLOCKED_PLACEMENTS",
    "PLACEMENTS",
    "Assignment",
    "InfeasibleCapError",
    "balance",
    "plan_is_deterministic",
]

PLACEMENTS = ("none", "ilp", "assign", "auto")
# Placements whose result depends on more than the inputs: ``ilp`` is time-limited (CBC's
# CPU-time limit, scaled by the machine's load), so a busy rank can stop the solve at another
# point and reach another placement than its peers.
CLOCKED_PLACEMENTS = frozenset({"ilp"})
BACKENDS = ("cpp", "python")
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
            the refined ``greedy``/``greedy_cost`` ``proven_optimal`` (1.0 when no plan has a
            lighter busiest rank under the policy's cost: the plan reached the floor, or the
            exact search finished within its node budget); for
            ``greedy_stay`` ``tokens_moved_lower_bound``; with placement the placement
            statistics; with ``src`` (a ``never_worse`` policy: every built-in but
            ``identity``) ``kept_source`` (1.0 when
            the source layout, feasible and with a strictly lighter busiest rank, replaced
            the policy's plan: balancing never returns a plan slower than the input); with
            ``context_parallel`` ``items_split``, ``pieces`` and ``gap_to_lb`` against the
            split plans' floor (mean load, or an item's heaviest piece in ``N``).
        pieces: where the pieces of split items go (``context_parallel``;
            :class:`orchmllm.planner.context_parallel.Pieces`, rows ``(item, rank, start,
            end)``); empty when no item is split. A split item's ``dst`` is -1.
    """

    dst: np.ndarray
    loads: np.ndarray
    stats: Mapping[str, float] = field(default_factory=dict)
    pieces: Pieces = field(default_factory=Pieces.empty)


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
    context_parallel: int = 1,
) -> Assignment:
    """Plan where every item goes so that the most loaded rank is as light as possible.

    Args:
        lengths: tokens per item (non-negative integers, 1-D).
        num_ranks: ranks to balance over.
        policy: a name in ``orchmllm.POLICIES``: a built-in (``orchmllm.planner.policies``) or one
            added with ``orchmllm.register_policy``.
        src: current rank of every item (needed by ``identity``, ``greedy_stay`` and a
            placement; adds movement statistics).
        cost: the cost model balanced (``None``: the policy's default,
            ``orchmllm.planner.policies.default_cost``).
        ranks_per_node: ranks per node, for ``greedy_stay`` and ``placement``.
        placement: ``none``, or how batches are permuted over ranks to keep traffic inside
            nodes (``orchmllm.planner.placement``).
        max_items_per_rank: at most this many items on any rank (module docstring: caps).
        max_load_per_rank: at most this cost on any rank, e.g. a memory budget in tokens.
        tolerance: ``greedy_tolerance``'s window (fraction of the mean rank sum, default
            ``orchmllm.planner.policies.DEFAULT_TOLERANCE``), or ``greedy_stay``'s makespan slack
            over ``greedy``.
        refine: the move/swap local search after ``greedy``/``greedy_cost`` (default on);
            ``False`` keeps the paper's Alg. 1 exactly.
        backend: ``python`` runs the plain Python reference instead of the C++ core (same
            result, for tests and benchmarks).
        context_parallel: ``N`` > 1 lets an item be cut into ``k <= N`` pieces on ``k`` ranks
            of one group of ``N`` consecutive ranks (inside one node when ``ranks_per_node``
            is given and ``N`` divides it; else on one node of the group when ``k`` is at
            most ``ranks_per_node``): an item whose cost exceeds ``max_load_per_rank``,
            or whose split lowers the slowest rank, is split, and the other items are
            balanced around the pieces (``orchmllm.planner.context_parallel``). Packed
            ``greedy``/``greedy_cost`` only (both balance ``cost``), no item cap or
            placement. It raises only when no plan it tries meets the budget; its last try
            (every item of ``N`` tokens or more in ``N`` pieces) meets any budget of at least
            the mean load + the heaviest ``N``-piece or shorter whole item + one token's cost
            + ``const``. 1 (default): no splitting, the plan of every other argument alone.

    Returns:
        An :class:`Assignment`: ``dst`` per item, ``loads`` per rank, ``stats``.

    Raises:
        InfeasibleCapError: a cap no plan meets, or none was found for (a ``ValueError``).
        ValueError: any other bad argument, named with its value.
    """
    if (
        policy == "greedy"
        and type(context_parallel) is int
        and context_parallel == 1
        and src is cost is ranks_per_node is max_items_per_rank is max_load_per_rank is None
        and tolerance is None
        and placement == "none"
        and refine is True
        and backend == "cpp"
    ):
        fast = _default_greedy(lengths, num_ranks)
        if fast is not None:
            return fast
    req = _check_request(
        lengths,
        num_ranks,
        policy,
        src=src,
        cost=cost,
        ranks_per_node=ranks_per_node,
        placement=placement,
        max_items_per_rank=max_items_per_rank,
        max_load_per_rank=max_load_per_rank,
        tolerance=tolerance,
        refine=refine,
        backend=backend,
        context_parallel=context_parallel,
    )
    if req.context_parallel > 1:
        return _balance_split(req)
    dst, planned = _plan(req)
    known: dict[str, float] = dict(planned)
    if req.caps.max_items is not None or req.caps.max_load is not None:
        steered = _steer_caps(req, dst)
        known["caps_steered"] = float(steered is not dst)
        if steered is not dst:
            known.pop("proven_optimal", None)  # a fallback's plan: no proof carried over
        dst = steered
    loads = req.cost.loads(req.lengths, dst, req.num_ranks)
    if req.src is not None and req.policy.never_worse:
        dst, loads, kept = _no_worse_than_source(req, dst, loads)
        known["kept_source"] = float(kept)
        if kept:
            known.pop("proven_optimal", None)
    if req.placement != "none":
        dst, loads, placed = _place(req, dst, loads)
        known.update(placed)
    if req.policy.name == "greedy_stay":
        known["tokens_moved_lower_bound"] = _movement_bound(req, dst)
    job = (req.lengths, req.longest, dst, loads, req.src, req.num_ranks, req.cost)
    return Assignment(dst=dst, loads=loads, stats=LazyStats(partial(plan_stats, *job), known))


def plan_is_deterministic(*, placement: str = "none", policies: Iterable[str] = ()) -> bool:
    """Whether a plan with these options is a pure function of the gathered metadata, so
    every rank can compute it itself (otherwise one rank computes it for all)."""
    clocked = placement in CLOCKED_PLACEMENTS
    return not clocked and all(get_policy(p).deterministic for p in policies)


# ---------------------------------------------------------------------------------------------
# the steps of balance()


def _default_greedy(lengths: Any, num_ranks: Any) -> Assignment | None:
    """The default call (``greedy`` on an int64 array, no options) in one call of the core,
    which validates it and answers None where :func:`_check_request` would raise or the
    batch is dealt out by count; statistics are computed when first read."""
    if not (
        type(lengths) is np.ndarray
        and lengths.dtype == np.int64
        and lengths.ndim == 1
        and type(num_ranks) is int
        and 1 <= num_ranks <= MAX_RANKS
    ):
        return None
    fast = _core.greedy_lengths(lengths, num_ranks, REFINE_STEPS_PER_RANK * num_ranks)
    if fast is None:
        return None
    dst, loads, proven = fast
    job = (lengths, None, dst, loads, None, num_ranks, _PACKED)
    known = {"proven_optimal": float(proven)}
    return Assignment(dst=dst, loads=loads, stats=LazyStats(partial(plan_stats, *job), known))


class _Caps(NamedTuple):
    items: int  # the item cap in force (n when none was given)
    max_items: int | None  # as given
    max_load: float | None


class _Request(NamedTuple):
    """The arguments of :func:`balance`, checked."""

    policy: Policy
    lengths: np.ndarray
    longest: int
    num_ranks: int
    src: np.ndarray | None
    cost: CostModel
    ranks_per_node: int | None
    placement: str
    caps: _Caps
    tolerance: float | None
    refine: bool
    backend: str
    context_parallel: int


def _check_request(
    lengths: Any,
    num_ranks: Any,
    policy: Any,
    *,
    src: Any,
    cost: Any,
    ranks_per_node: Any,
    placement: Any,
    max_items_per_rank: Any,
    max_load_per_rank: Any,
    tolerance: Any,
    refine: Any,
    backend: Any,
    context_parallel: Any,
) -> _Request:
    """Every argument of :func:`balance` checked, in the order the errors are reported; an
    item cap too small for ``n`` items raises :class:`InfeasibleCapError`."""
    l = check_lengths(lengths)
    n = l.size
    d = check_num_ranks(num_ranks)
    record = get_policy(policy)
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    s = None if src is None else check_ranks("src", src, n, d)
    if ranks_per_node is not None:
        ranks_per_node = check_count("ranks_per_node", ranks_per_node)
    if placement != "none" and (s is None or ranks_per_node is None):
        raise ValueError(f"placement={placement!r} needs src and ranks_per_node")
    if s is None and record.needs_src:
        raise ValueError(f"src is required for policy={policy!r}, got None")
    cost = _check_cost(cost, record)
    longest = int(l.max(initial=0))
    check_finite_cost(longest, n, d, cost)
    check_caps(max_items_per_rank, max_load_per_rank)
    group = check_context_parallel(context_parallel, d, ranks_per_node)
    if group > 1:
        check_split_request(record.name, record.padded, placement, max_items_per_rank, backend)
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
    caps = _Caps(cap, max_items_per_rank, max_load_per_rank)
    return _Request(
        record, l, longest, d, s, cost, ranks_per_node, placement, caps, tolerance,
        bool(refine), backend, group,
    )  # fmt: skip


def _check_cost(cost: CostModel | None, policy: Policy) -> CostModel:
    """The cost balanced: the policy's default when None, else one of its kind (any kind for
    ``identity``, which balances nothing) with non-negative terms."""
    kind = policy.cost_kind
    if cost is None:
        return CostModel(kind)
    if not isinstance(cost, CostModel):
        raise ValueError(f"cost must be a CostModel or None, got {cost!r}")
    if policy.name != "identity" and cost.kind != kind:
        raise ValueError(f"cost must be kind={kind!r} for policy={policy.name!r}, got {cost!r}")
    if cost.alpha < 0 or cost.beta < 0:
        raise ValueError(f"cost must have alpha >= 0 and beta >= 0, got {cost!r}")
    return cost


def _balance_split(req: _Request) -> Assignment:
    """:func:`balance` with ``context_parallel > 1``: the core's plan (whole items or pieces),
    no worse than the source layout (as for every ``never_worse`` policy), or
    :class:`InfeasibleCapError` when no plan it tries meets the budget."""
    d, cost, lengths = req.num_ranks, req.cost, req.lengths
    budget = math.inf if req.caps.max_load is None else float(req.caps.max_load)
    steps = REFINE_STEPS_PER_RANK * d if req.refine else 0
    plan = plan_split(lengths, d, req.context_parallel, req.ranks_per_node, cost, budget, steps)
    if not plan.feasible:
        _raise_split_budget(req, plan)
    known: dict[str, float] = {}
    if req.caps.max_load is not None:
        known["caps_steered"] = 0.0
    if req.src is not None and req.policy.never_worse:
        before = cost.loads(lengths, req.src, d)
        top = float(before.max(initial=0.0))
        kept = top < float(plan.loads.max(initial=0.0)) and top <= budget
        if kept:
            plan = plan._replace(dst=req.src.copy(), loads=before, pieces=Pieces.empty())
        known["kept_source"] = float(kept)
    job = (lengths, plan, req.src, d, cost)
    stats = LazyStats(partial(split_stats, *job), known)
    return Assignment(dst=plan.dst, loads=plan.loads, stats=stats, pieces=plan.pieces)


def _raise_split_budget(req: _Request, plan: Split) -> None:
    """The budget no context-parallel plan was found under: an item too costly even in
    ``context_parallel`` pieces, or the plans tried, named with the smallest value found."""
    cost, n = req.cost, req.context_parallel
    budget = req.caps.max_load
    fixed = cost.multiplier * cost.const
    need = largest_pieces(req.lengths, n, cost) + fixed
    worst = int(np.argmax(need))
    found = float(plan.loads.max())
    lower = max(plan.lower_bound, float(need[worst]))
    if need[worst] > budget:
        why = (
            f"item {worst} ({int(req.lengths[worst])} tokens) costs {float(need[worst]):.10g} "
            f"on a rank even in context_parallel={n} pieces"
        )
    else:
        why = f"no plan was found under it and none goes below {lower:.10g}"
    raise InfeasibleCapError(
        f"max_load_per_rank={budget} is too small with context_parallel={n}: {why}; the "
        f"smallest value found is {found:.10g}",
        argument="max_load_per_rank", value=budget, smallest=found, proven=False,
        lower_bound=lower,
    )  # fmt: skip


def _plan(req: _Request) -> Planned:
    """The requested policy's plan, under the item cap, and its own statistics."""
    return plan_policy(
        req.policy.name,
        req.lengths,
        req.num_ranks,
        cost=req.cost,
        cap=req.caps.items,
        tolerance=req.tolerance,
        src=req.src,
        ranks_per_node=req.ranks_per_node,
        refine=req.refine,
        backend=req.backend,
    )


def _place(
    req: _Request, dst: np.ndarray, loads: np.ndarray
) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """The batches permuted over the ranks to keep traffic inside nodes: the new ``dst``, the
    loads indexed by the rank each batch was placed on, and the placement's statistics."""
    placed = place_batches(
        req.lengths,
        req.src,
        dst,
        num_ranks=req.num_ranks,
        ranks_per_node=req.ranks_per_node,
        method=req.placement,
    )
    permuted = np.empty_like(loads)
    permuted[np.asarray(placed.perm, dtype=np.int64)] = loads
    stats = {k: float(v) for k, v in placed.stats.items()}
    return np.asarray(placed.dst, dtype=np.int64), permuted, stats


def _no_worse_than_source(
    req: _Request, dst: np.ndarray, loads: np.ndarray
) -> tuple[np.ndarray, np.ndarray, bool]:
    """The plan, or the source layout (every item stays) where that is feasible and its
    busiest rank is strictly lighter under the policy's cost, so balancing never makes the
    slowest rank slower than not balancing. Feasible: within the caps, and with the policy's
    own count rule (``equal_counts``: ``n // d`` or ``n // d + 1`` items per rank). Returns
    ``(dst, loads, kept)``, ``kept`` True when the source layout was returned."""
    lengths, src, d, caps = req.lengths, req.src, req.num_ranks, req.caps
    before = req.cost.loads(lengths, src, d)
    if not before.max(initial=0.0) < loads.max(initial=0.0):
        return dst, loads, False
    counts = np.bincount(src, minlength=d)
    if int(counts.max(initial=0)) > caps.items:
        return dst, loads, False
    if caps.max_load is not None and float(before.max()) > caps.max_load:
        return dst, loads, False
    if req.policy.equal_counts and int(counts.max() - counts.min()) > 1:
        return dst, loads, False
    return src.copy(), before, True


def _movement_bound(req: _Request, dst: np.ndarray) -> float:
    """The fewest tokens any plan with ``dst``'s makespan must move."""
    w = req.cost.item_costs(req.lengths)
    makespan = float(np.bincount(dst, weights=w, minlength=req.num_ranks).max(initial=0.0))
    return movement_lower_bound(w, req.src, req.num_ranks, makespan, sizes=req.lengths)


# ---------------------------------------------------------------------------------------------
# caps


def _steer_caps(req: _Request, dst: np.ndarray) -> np.ndarray:
    """``dst`` if it meets the caps, else the first plan that does among, in order: the
    capped portfolio ``greedy_cost`` (packed policies) or the exact ``padded_cost`` (padded
    ones); for packed policies on at most ``EXACT_MAX_CELLS`` items x ranks, the exact
    minimum makespan under the item cap (:func:`orchmllm.planner.exact.min_makespan`). Plans of a
    policy that plans from ``src`` are first placed whole on the ranks holding most of their
    tokens (``place_batches(method="assign")``), so fallbacks still move little. Raises
    :class:`InfeasibleCapError` when none fits, naming the smallest value that works.
    ``identity`` moves nothing, so its caps are only checked."""
    lengths, d, cost, caps, record = req.lengths, req.num_ranks, req.cost, req.caps, req.policy

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
        kw = {"num_ranks": d, "ranks_per_node": req.ranks_per_node or 1, "method": "assign"}
        return np.asarray(place_batches(lengths, req.src, plan, **kw).dst, dtype=np.int64)

    fallback = "padded_cost" if record.padded else "greedy_cost"
    best = dst
    if record.name != fallback:
        kw = {"cost": cost, "cap": caps.items, "backend": req.backend}
        best = placed(plan_dst(fallback, lengths, d, **kw))
        if fits(best):
            return best
    # The item cap alone always fits by now (every fallback enforces it): the load cap is left.
    best_loads = cost.loads(lengths, best, d)
    best_load = float(best_loads.max())
    proven = record.padded  # padded_cost is exact for its cost (orchmllm.planner.policies)
    if not record.padded and lengths.size * d <= EXACT_MAX_CELLS:
        exact = min_makespan(cost.item_costs(lengths), d, max_items=caps.items)
        exact_loads = cost.loads(lengths, exact.dst, d)
        if exact_loads.max() < best_load:
            best, best_loads, best_load = placed(exact.dst), exact_loads, float(exact_loads.max())
        proven = exact.proven
        if fits(best):
            return best
    lower = best_load if proven else lower_bound(lengths, best_loads, cost)
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
