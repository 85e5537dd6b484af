"""Balancing policies: one :class:`Policy` record each in :data:`REGISTRY`, the one place a
policy is declared, and :func:`register_policy` for a policy written in Python alone.

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
- With ``refine=True`` both are a portfolio (C++ ``lpt``, reference
  ``orchmllm.planner.reference.ref_lpt``): refined LPT always; refined Karmarkar-Karp when items x
  ranks <= ``_core.PORTFOLIO_KK_WORK`` (2^20), above that its equal-counts variant (verl's)
  when items <= ``_core.PORTFOLIO_KK_EQUAL_ITEMS`` (8,192); refined MULTIFIT (bisection on
  first-fit decreasing, at most ``_core.MULTIFIT_ROUNDS`` rounds) when items <=
  ``_core.PORTFOLIO_MULTIFIT_ITEMS`` (8,192). The lightest maximum load wins, ties in that
  order; the others are skipped once the best reaches the lower bound (mean, heaviest item,
  d-th + (d+1)-th heaviest). So on every instance up to those sizes the default is never worse
  than LPT, KK or MULTIFIT; above them it is refined LPT, which keeps 983,040 items within
  about 2x numpy's argsort.
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
- ``greedy_stay``: movement-aware greedy (``orchmllm.planner.placement.movement_aware_dst``): within
  ``tolerance`` (default 0.5%) of the default ``greedy``'s makespan while keeping most items
  on their source rank; with ``ranks_per_node`` the moved items stay on their node where they
  fit. Its statistics add ``tokens_moved_lower_bound``, the fewest tokens any plan with the
  same makespan must move (``orchmllm.planner.placement.movement_lower_bound``).


Every fact about a policy (its cost kind, whether it enforces the item cap, is refined, is a
pure function of its inputs, needs ``src``; the function that plans it and its plain Python
version in ``orchmllm.planner.reference``) is its record. :data:`POLICIES` and
:data:`PADDED_POLICIES` are live views of the registry, so a policy registered later is
accepted wherever a policy name is: ``orchmllm.balance``, ``EncoderPhase``, ``StepOptions``,
``BatchDispatcher``, the loader and the run configs.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

import orchmllm._core as _core
from orchmllm.planner.cost import CostModel
from orchmllm.planner.placement import REFINE_STEPS_PER_RANK, movement_aware_dst
from orchmllm.planner.reference import (
    ref_binary_search,
    ref_conv,
    ref_greedy_tolerance,
    ref_karmarkar_karp,
    ref_lpt,
    ref_padded_cost,
)
from orchmllm.planner.stats import exact_total
from orchmllm.planner.validate import check_ranks

__all__ = [
    "DEFAULT_TOLERANCE",
    "PADDED_POLICIES",
    "POLICIES",
    "REGISTRY",
    "Policy",
    "PolicyInput",
    "Planned",
    "default_cost",
    "get_policy",
    "plan_dst",
    "plan_policy",
    "register_policy",
    "unregister_policy",
]

# greedy_tolerance: sums within this fraction of the mean rank sum count as tied.
DEFAULT_TOLERANCE = 0.01
# "none" means no balancing to the command lines and examples (--balance none): never a policy.
_RESERVED = frozenset({"none"})


class PolicyInput(NamedTuple):
    """What a policy's function is given: the inputs of one :func:`orchmllm.balance` call,
    validated.

    Attributes:
        lengths: int64 ``(n,)`` tokens per item, >= 0, ``n >= 1``; at least one > 0 unless
            the policy ``needs_src`` (see :func:`plan_dst`).
        num_ranks: the ranks to plan over, >= 1.
        cost: the cost model balanced, of the policy's kind (``padded`` or ``packed``); a
            packed policy's item weights are ``cost.item_costs(lengths)``.
        max_items: at most this many items on any rank (``n`` without an item cap, and
            ``max_items * num_ranks >= n``); a policy registered ``capped`` meets it itself.
        steps: how many local-search steps a refined built-in may take (0 for the others).
        tolerance: ``balance(tolerance=)``, or None.
        src: int64 ``(n,)`` current rank of every item, or None (always given to a policy
            that ``needs_src``).
        ranks_per_node: ``balance(ranks_per_node=)``, or None.
    """

    lengths: np.ndarray
    num_ranks: int
    cost: CostModel
    max_items: int
    steps: int
    tolerance: float | None
    src: np.ndarray | None
    ranks_per_node: int | None


@dataclass(frozen=True)
class Policy:
    """One balancing policy and every fact other code asks about it.

    Attributes:
        name: the name ``policy=`` accepts.
        fn: plans it: ``fn(PolicyInput)`` returns the destination rank of every item (the
            built-ins run the C++ core, GIL released).
        reference: the same plan in plain Python (``orchmllm.planner.reference``), or None: then
            ``backend="python"`` runs ``fn`` too.
        padded: its cost model is kind ``padded`` (count x longest), else ``packed``
            (additive over items).
        capped: it meets the item cap (``PolicyInput.max_items``) while planning; a plan of
            any policy over a cap is steered after it (``orchmllm.balance``).
        refined: ``refine=True`` gives it local-search steps (``PolicyInput.steps``).
        deterministic: the plan is a pure function of the inputs, so every rank can compute
            it itself (all built-ins; a clocked or random one is computed by one rank and
            broadcast).
        needs_src: it plans from where the items are: ``src`` is required, and it plans
            all-zero lengths too (the built-ins leave them where they are).
        equal_counts: every rank gets ``n // d`` or ``n // d + 1`` items (``kk_equal``); the
            source layout replaces a heavier plan (``orchmllm.balance``) only when it has
            such counts too.
        never_worse: with ``src``, a plan whose busiest rank is heavier than the source
            layout's is replaced by the source layout where that is feasible (every built-in
            but ``identity``; a registered policy only when it asks).
    """

    name: str
    fn: Callable[[PolicyInput], Any]
    reference: Callable[[PolicyInput], Any] | None = None
    padded: bool = False
    capped: bool = False
    refined: bool = False
    deterministic: bool = True
    needs_src: bool = False
    equal_counts: bool = False
    never_worse: bool = False

    @property
    def cost_kind(self) -> str:
        """The kind of the cost model it balances: ``padded`` or ``packed``."""
        return "padded" if self.padded else "packed"


# ---------------------------------------------------------------------------------------------
# how each built-in's C++ function (or its reference) is called on a PolicyInput


def _keep(job: PolicyInput) -> np.ndarray:
    return job.src.copy()


def _portfolio(fn: Callable, weights: np.ndarray, job: PolicyInput) -> Any:
    """LPT alone, or with steps the portfolio, which also says whether its plan is proven
    optimal (``proven_optimal`` in the statistics)."""
    if job.steps <= 0:
        return fn(weights, job.num_ranks, job.max_items, 0)
    dst, proven = fn(weights, job.num_ranks, job.max_items, job.steps, True)
    return dst, {"proven_optimal": float(proven)}


def _lpt_lengths(fn: Callable, job: PolicyInput) -> Any:
    return _portfolio(fn, job.lengths.astype(np.float64), job)


def _lpt_costs(fn: Callable, job: PolicyInput) -> Any:
    return _portfolio(fn, job.cost.item_costs(job.lengths), job)


def _tolerance_window(fn: Callable, job: PolicyInput) -> np.ndarray:
    fraction = DEFAULT_TOLERANCE if job.tolerance is None else float(job.tolerance)
    total = exact_total(job.lengths, int(job.lengths.max()))
    window = fraction * float(total) / job.num_ranks
    return fn(job.lengths, job.num_ranks, window, job.max_items)


def _lengths_capped(fn: Callable, job: PolicyInput) -> np.ndarray:
    return fn(job.lengths, job.num_ranks, job.max_items)


def _padded(fn: Callable, job: PolicyInput) -> np.ndarray:
    c = job.cost
    return fn(job.lengths, job.num_ranks, c.alpha, c.beta, c.const, c.multiplier, job.max_items)


def _karmarkar_karp(fn: Callable, job: PolicyInput, *, equal_counts: bool) -> np.ndarray:
    return fn(job.cost.item_costs(job.lengths), job.num_ranks, equal_counts)


def _stay(job: PolicyInput) -> np.ndarray:
    # orchmllm.planner.placement's movement-aware greedy validates its own options and runs
    # _core.movement_aware.
    extra = {} if job.tolerance is None else {"tolerance": float(job.tolerance)}
    w = job.cost.item_costs(job.lengths)
    return movement_aware_dst(
        w, job.src, job.num_ranks, sizes=job.lengths, ranks_per_node=job.ranks_per_node, **extra
    )


def _builtin(name: str, call: Callable, cpp: Callable, ref: Callable, **facts: bool) -> Policy:
    return Policy(name, partial(call, cpp), partial(call, ref), never_worse=True, **facts)


_REGISTRY: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("identity", _keep, needs_src=True),
        _builtin("greedy", _lpt_lengths, _core.lpt, ref_lpt, capped=True, refined=True),
        _builtin(
            "binary_search",
            _lengths_capped,
            _core.binary_search,
            ref_binary_search,
            padded=True,
            capped=True,
        ),
        _builtin(
            "greedy_tolerance",
            _tolerance_window,
            _core.greedy_tolerance,
            ref_greedy_tolerance,
            capped=True,
        ),
        _builtin("conv", _lengths_capped, _core.conv, ref_conv, padded=True, capped=True),
        _builtin("greedy_cost", _lpt_costs, _core.lpt, ref_lpt, capped=True, refined=True),
        _builtin(
            "kk",
            partial(_karmarkar_karp, equal_counts=False),
            _core.karmarkar_karp,
            ref_karmarkar_karp,
        ),
        _builtin(
            "kk_equal",
            partial(_karmarkar_karp, equal_counts=True),
            _core.karmarkar_karp,
            ref_karmarkar_karp,
            equal_counts=True,
        ),
        _builtin(
            "padded_cost", _padded, _core.padded_cost, ref_padded_cost, padded=True, capped=True
        ),
        Policy("greedy_stay", _stay, needs_src=True, never_worse=True),
    )
}
_BUILTINS = frozenset(_REGISTRY)
_LOCK = threading.Lock()  # registration: check the name and add it as one step
# Read-only and live: every policy, built-in and registered, by name in registration order.
REGISTRY: Mapping[str, Policy] = MappingProxyType(_REGISTRY)


class _Names(Sequence):
    """A live, read-only view of the names of the registered policies that have ``fact``
    (all of them when None), in registration order: membership, iteration and ``repr`` (that
    of a tuple) always see the registry as it is now."""

    def __init__(self, fact: str | None = None) -> None:
        self._fact = fact

    def _has(self, policy: Policy) -> bool:
        return self._fact is None or getattr(policy, self._fact)

    def _names(self) -> tuple[str, ...]:
        return tuple(name for name, p in _REGISTRY.items() if self._has(p))

    def __contains__(self, name: object) -> bool:
        policy = _REGISTRY.get(name) if isinstance(name, str) else None
        return policy is not None and self._has(policy)

    def __getitem__(self, index):
        return self._names()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


# The names accepted by policy=, and those of the padded policies: live views of REGISTRY.
POLICIES: Sequence[str] = _Names()
PADDED_POLICIES: Sequence[str] = _Names("padded")


def get_policy(name: Any) -> Policy:
    """The record of a registered policy.

    Args:
        name: a name in :data:`POLICIES`.

    Returns:
        Its :class:`Policy`.

    Raises:
        ValueError: ``name`` is no registered policy.
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):  # TypeError: an unhashable name
        raise ValueError(f"policy must be one of {POLICIES}, got {name!r}") from None


def default_cost(policy: str) -> CostModel:
    """The cost a policy balances when given none.

    Args:
        policy: a name in :data:`POLICIES`.

    Returns:
        Padded batches for padded policies, else packed tokens (``CostModel(kind)``).
    """
    return CostModel(get_policy(policy).cost_kind)


# ---------------------------------------------------------------------------------------------
# registering a policy written in Python


def register_policy(
    name: str,
    fn: Callable[[PolicyInput], Any],
    *,
    padded: bool = False,
    capped: bool = False,
    deterministic: bool = True,
    needs_src: bool = False,
    never_worse: bool = False,
) -> Policy:
    """Add a policy written in Python alone: from then on ``name`` is accepted wherever a
    policy is (``orchmllm.balance``, ``EncoderPhase``, ``StepOptions``, ``BatchDispatcher``,
    the loader, the run configs).

    ``fn`` gets a :class:`PolicyInput` and returns the destination rank of every item (``n``
    integers in ``[0, num_ranks)``, checked after every call). ``orchmllm.balance`` does the
    rest as for a built-in: validation, empty batches, all-zero ones (dealt out by count
    unless the policy ``needs_src``), caps (a plan over a cap is replaced by a capped
    fallback), loads, placement and statistics. Register it in every process that plans
    (every rank under ``torchrun``): a name registered on one rank only is unknown on the
    others.

    Args:
        name: the policy's name: a Python identifier, not taken, not ``none``.
        fn: the function that plans: ``fn(job: PolicyInput) -> dst``.
        padded: it balances padded batches (cost kind ``padded``: count x longest), else
            packed ones (cost additive over items).
        capped: it meets ``job.max_items`` itself (a plan over an item cap is steered either
            way; this says the steering is not needed).
        deterministic: the plan is a pure function of ``job``, so every rank computes it
            itself; False: one rank computes it and broadcasts it.
        needs_src: it plans from where the items are: ``job.src`` is always given
            (``orchmllm.balance`` requires ``src=``), and all-zero lengths are its to plan.
        never_worse: with ``src``, ``orchmllm.balance`` returns the source layout instead
            of a plan whose busiest rank is heavier, where the source layout meets the caps.

    Returns:
        The :class:`Policy` record, now in :data:`REGISTRY`.

    Raises:
        ValueError: ``name`` is taken, reserved or no identifier; ``fn`` cannot be called
            with one argument; a fact that is not a bool. The message names it.
    """
    if not isinstance(name, str) or not name.isidentifier() or name in _RESERVED:
        raise ValueError(f"name must be a Python identifier other than 'none', got {name!r}")
    _check_fn(name, fn)
    facts = {
        "padded": padded,
        "capped": capped,
        "deterministic": deterministic,
        "needs_src": needs_src,
        "never_worse": never_worse,
    }
    for fact, value in facts.items():
        if not isinstance(value, bool):
            raise ValueError(f"{fact} of policy {name!r} must be True or False, got {value!r}")
    policy = Policy(name, partial(_checked_plan, name, fn), **facts)
    with _LOCK:
        if name in _REGISTRY:
            kind = "a built-in policy" if name in _BUILTINS else "already registered"
            raise ValueError(f"policy name {name!r} is taken: {kind}")
        _REGISTRY[name] = policy
    return policy


def unregister_policy(name: str) -> None:
    """Remove a policy that :func:`register_policy` added (tests, notebooks).

    Args:
        name: the registered policy's name.

    Raises:
        ValueError: ``name`` is a built-in policy or not registered.
    """
    with _LOCK:
        if name in _BUILTINS:
            raise ValueError(f"policy {name!r} is built in and cannot be unregistered")
        if _REGISTRY.pop(name, None) is None:
            raise ValueError(f"policy {name!r} is not registered")


def _check_fn(name: str, fn: Any) -> None:
    if not callable(fn):
        raise ValueError(f"fn of policy {name!r} must be callable, got {fn!r}")
    try:
        inspect.signature(fn).bind(None)
    except TypeError as e:
        raise ValueError(
            f"fn of policy {name!r} must take one argument (a PolicyInput), got {fn!r}: {e}"
        ) from None
    except ValueError:
        pass  # no signature to read (a C function): the call will tell


def _checked_plan(name: str, fn: Callable, job: PolicyInput) -> np.ndarray:
    """A registered policy's plan, checked: one rank in ``[0, num_ranks)`` per item."""
    return check_ranks(f"dst of policy {name!r}", fn(job), job.lengths.size, job.num_ranks)


# ---------------------------------------------------------------------------------------------
# running a policy


class Planned(NamedTuple):
    """A policy's plan: ``dst`` (int64 ``(n,)``) and the statistics the policy itself knows
    (``proven_optimal`` for the refined ``greedy``/``greedy_cost`` portfolio)."""

    dst: np.ndarray
    stats: Mapping[str, float]


def plan_dst(policy: str, lengths: np.ndarray, d: int, **options: Any) -> np.ndarray:
    """:func:`plan_policy`'s ``dst`` alone (same arguments)."""
    return plan_policy(policy, lengths, d, **options).dst


def plan_policy(
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
) -> Planned:
    """The policy's plan alone, on inputs :func:`orchmllm.balance` has validated (int64
    lengths, a cost of the policy's kind, ``cap * d >= n``). The benchmark times the C++ core
    against the Python reference here, without the validation and statistics both share.

    Args:
        policy: a name in :data:`POLICIES`.
        lengths: int64 ``(n,)`` tokens per item, >= 0.
        d: the number of ranks.
        cost: the cost model balanced, of the policy's kind.
        cap: at most this many items per rank (``n``: no cap).
        tolerance: ``balance(tolerance=)``.
        src: current rank of every item (required by a policy that needs it).
        ranks_per_node: ``balance(ranks_per_node=)``.
        refine: give a refined policy its local-search steps.
        backend: ``python`` runs the policy's reference where it has one.

    Returns:
        :class:`Planned`: the destination rank of every item and the policy's own
        statistics. An empty batch plans nothing; all-zero lengths carry no load, so a policy
        that does not need ``src`` does not run: item ``i`` goes to rank ``i % d``.
    """
    record = get_policy(policy)
    n = lengths.size
    if n == 0:
        return Planned(np.zeros(0, dtype=np.int64), {})
    if not record.needs_src and np.count_nonzero(lengths) == 0:
        # nothing to balance: deal out by count
        return Planned(np.arange(n, dtype=np.int64) % d, {})
    steps = REFINE_STEPS_PER_RANK * d if refine and record.refined else 0
    fn = record.reference if backend == "python" and record.reference else record.fn
    job = PolicyInput(lengths, d, cost, cap, steps, tolerance, src, ranks_per_node)
    out = fn(job)
    dst, stats = out if isinstance(out, tuple) else (out, {})
    return Planned(np.asarray(dst, dtype=np.int64), stats)
