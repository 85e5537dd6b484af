"""Node-wise placement of balanced batches, and movement-aware balancing.

A balancing policy decides which items form each new batch, not which rank runs it: any
permutation of the batches keeps the balance. The permutation decides how much of the
all-to-all crosses nodes, where bandwidth is about 10x below NVLink, and the all-to-all ends
when the rank with the most inter-node traffic is done (paper section 5.2.2). Rank ``r`` lives on
node ``r // ranks_per_node``.

Methods of :func:`place_batches`:

- ``identity``: batch ``b`` runs on rank ``b`` (statistics only).
- ``assign``: exact maximum of the tokens that stay inside their node, as an assignment of
  batches to node slots (each node's column repeated ``ranks_per_node`` times), then inside each
  node every batch goes to the rank holding most of its tokens (assignment again), so those
  tokens do not move at all. Both assignments run in the C++ core on the sparse volume matrix
  (``cpp/traffic.cpp`` builds it, ``cpp/assignment.cpp`` solves it). The statistics carry
  ``on_node_tokens_bound``, an LP-duality upper bound on the tokens any permutation keeps on
  their node; for ``assign`` it equals what it keeps, a certificate of exactness.
- ``ilp``: the paper's Algorithm 3 in cvxpy + CBC: binary ``x[batch, node]``, each node takes
  ``ranks_per_node`` batches, minimise the largest inter-node volume any one rank sends. It is
  time-limited, starts from the ``assign`` solution (as an upper bound on the objective, and it
  never returns anything worse), and falls back to ``assign`` when the solver is missing or
  fails, with a warning the first time each failure occurs in the process.
- ``auto``: ``assign``, exact up to ``AUTO_EXACT_NODES`` nodes; on larger clusters each
  batch's search is bounded to ``AUTO_SEARCH_COLUMNS`` node columns (a batch whose search would
  go further takes a free slot, and ``on_node_tokens_bound`` says how much that can cost; the
  share of the bound reached at each size is printed by ``benchmarks/placement_bench.py``),
  then the ILP refinement only where it is certain to finish within the
  budget: models of at most ``AUTO_ILP_MAX_BINARIES`` binaries (16 ranks of 8) when
  ``time_limit_s >= AUTO_ILP_MIN_BUDGET_S``, solved to proven optimality (so with the default
  50 ms budget ``auto`` is ``assign``). If the result leaves the busiest rank sending more
  across nodes than the unpermuted batches would, ``auto`` keeps the unpermuted batches, so it
  is never worse than ``identity`` on the paper's objective. The choice depends on the problem
  size and the budget alone, never on a clock, so every rank planning independently gets the
  same placement.
  ``ilp`` with a binding time limit returns whatever the solver reached in time, which can
  differ between machines: plan it on one rank and broadcast it, or bound it by a count of
  branch-and-bound nodes instead (``node_limit=``), which every machine reaches alike.

:func:`movement_aware_dst` is the ``greedy_stay`` policy: the paper's greedy rebuilds every
batch from scratch, so nearly every token moves; this keeps items on their source rank unless
the rank is over the makespan limit, reaching a makespan within ``tolerance`` of the default
(refined) greedy.
:func:`movement_lower_bound` is what any assignment with that makespan must move.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import orchmllm._core as _core

METHODS = ("identity", "assign", "ilp", "auto")
# The most ranks a plan may have: far beyond any data-parallel group, and small enough that
# every policy's per-rank arrays stay small (num_ranks=10**9 planned for minutes).
MAX_RANKS = 1 << 20
# greedy's local search (orchmllm.planner.policies): at most this many steps per rank. It lives
# here, below policies.py, because the movement-aware policy must reach greedy's makespan as
# balance() runs it.
REFINE_STEPS_PER_RANK = 2
# Volumes are float64 bincounts of tokens, exact up to this total.
_EXACT_TOKENS = 1 << 53

# cvxpy solver name -> its time-limit option (seconds). A solver outside this table is refused:
# every ILP solve must be time-limited.
TIME_LIMIT_OPTIONS = {"CBC": "maximumSeconds", "HIGHS": "time_limit", "GUROBI": "TimeLimit"}
# ... and its limit on branch-and-bound nodes (``node_limit=``: a count, the same on every machine).
NODE_LIMIT_OPTIONS = {"CBC": "maximumNodes", "HIGHS": "mip_max_nodes", "GUROBI": "NodeLimit"}

# Measured on CBC through cvxpy 1.9 (2-core x86), in CPU seconds: building the model costs about
# _COMPILE_S + _COMPILE_S_PER_VAR * binaries, and CBC's root processing, which ignores its
# time limit, about _ROOT_S_PER_VAR * binaries. The ILP is only attempted when that fits the
# remaining budget, so the wall time stays near the limit at every cluster size.
_COMPILE_S = 0.008
_COMPILE_S_PER_VAR = 5e-6
_ROOT_S_PER_VAR = 2.5e-5
# CBC overshoots its own limit by a few milliseconds per solve; it gets this share of what is left.
_SOLVER_SHARE = 0.8
# ``auto`` must give every rank the same plan, so it cannot let a clock decide anything: it
# runs the ILP only on models this small (16 ranks of 8: two nodes), and only when the budget
# covers what solving one to proven optimality costs (cvxpy + CBC, CPU seconds measured on a
# busy 2-core x86), and keeps the result only when proven optimal. Its solve stops after
# AUTO_ILP_NODE_LIMIT branch-and-bound nodes, a count, so that no clock decides whether a rank
# proves it (such models close in a few dozen; a runaway guard, never reached in practice).
AUTO_ILP_MAX_BINARIES = 32
AUTO_ILP_MIN_BUDGET_S = 0.15
AUTO_ILP_NODE_LIMIT = 10_000
# ``auto``'s node assignment is exact up to AUTO_EXACT_NODES nodes; on larger clusters each
# batch's search settles at most AUTO_SEARCH_COLUMNS node columns, and a batch whose search
# would go further takes a free slot. At 16,384 ranks (2048 nodes) of greedy batches the exact
# search spends most of its time on the few batches whose search crosses hundreds of nodes.
# benchmarks/placement_bench.py prints auto's time against assign's (exact) and the share of
# the bound auto keeps at each size: at 1024-16,384 ranks at least 0.82 with 16 columns, 0.85
# with 64, where the whole 16,384-rank step plan took 161-167 ms instead of 144-151 ms.
AUTO_EXACT_NODES = 64
AUTO_SEARCH_COLUMNS = 16
# solver -> seconds its one-time setup took in this process (see prepare_ilp)
_PREPARED: dict[str, float] = {}
# ILP failure messages already warned about in this process (see _warn_once)
_WARNED: set[str] = set()


class _Clock:
    """Wall-clock budget of one call, and the share of a CPU this process gets meanwhile.

    CBC's time limit counts CPU seconds; on a busy machine (other processes, the training step
    itself) those pass slower than wall seconds, so every CPU-time figure is divided by this
    share before it is compared with the wall budget. The share is measured since the call
    began once that is long enough to mean something, and never assumed above what the
    1-minute load average leaves per core.
    """

    def __init__(self, limit_s: float) -> None:
        self.wall0 = time.perf_counter()
        self.cpu0 = time.process_time()
        self.deadline = self.wall0 + limit_s
        self.share = 1.0
        if hasattr(os, "getloadavg") and hasattr(os, "sched_getaffinity"):
            cores = len(os.sched_getaffinity(0))
            self.share = min(1.0, cores / max(os.getloadavg()[0], 1e-9))

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    def cpu_share(self) -> float:
        wall = time.perf_counter() - self.wall0
        if wall < 0.005:
            return max(self.share, 0.05)
        measured = (time.process_time() - self.cpu0) / wall
        return min(max(min(measured, self.share), 0.05), 1.0)


@dataclass(frozen=True)
class Traffic:
    """Token volume of one assignment ``src -> dst``, per rank and in total.

    ``inter_sent[r]``/``inter_recv[r]``: tokens rank ``r`` sends to / receives from other nodes;
    ``intra``: tokens moving between two ranks of the same node; ``kept``: tokens not moving.
    """

    inter_sent: np.ndarray
    inter_recv: np.ndarray
    intra: int
    kept: int

    @property
    def inter_total(self) -> int:
        return int(self.inter_sent.sum())


@dataclass(frozen=True)
class Placement:
    """Batch ``b`` (the items with policy ``dst == b``) runs on rank ``perm[b]``."""

    dst: np.ndarray
    perm: np.ndarray
    stats: dict[str, float] = field(default_factory=dict)
    before: Traffic | None = None
    after: Traffic | None = None


def traffic(lengths: Any, src: Any, dst: Any, *, num_ranks: int, ranks_per_node: int) -> Traffic:
    """Where the tokens of the move ``src -> dst`` travel (see :class:`Traffic`)."""
    d, c = _topology(num_ranks, ranks_per_node)
    l = _lengths(lengths)
    return _traffic(l, _ranks("src", src, l.size, d), _ranks("dst", dst, l.size, d), d, c)


def place_batches(
    lengths: Any,
    src: Any,
    dst: Any,
    *,
    num_ranks: int,
    ranks_per_node: int,
    method: str = "auto",
    time_limit_s: float = 0.05,
    solver: str = "CBC",
    node_limit: int | None = None,
) -> Placement:
    """Permute the balanced batches ``dst`` over the ranks to cut inter-node traffic.

    ``lengths`` are tokens per item (the volume an item moves), ``src``/``dst`` its current and
    planned rank. ``time_limit_s`` bounds the whole ``ilp`` call (CBC's CPU-time limit scaled
    by the CPU share this process gets); ``auto`` is deterministic instead (module docstring).
    ``solver`` is the cvxpy solver of the ILP (one of ``TIME_LIMIT_OPTIONS``). ``node_limit``
    bounds the ``ilp`` solve by that many branch-and-bound nodes instead of ``time_limit_s``,
    so that every machine, loaded or not, reaches the same placement (the ILP's size, not a
    clock, then bounds its time). Never raises on solver trouble: it warns and returns the
    ``assign`` placement.

    The ILP's one-time setup (:func:`prepare_ilp`: cvxpy's import and the solver's first load,
    1-3 s) is paid before the clock starts and reported apart as ``placement_setup_ms`` (0
    once paid); ``placement_solve_ms`` is the rest of the call, the part the limit bounds.
    """
    d, c = _topology(num_ranks, ranks_per_node)
    l = _lengths(lengths)
    s = _ranks("src", src, l.size, d)
    t = _ranks("dst", dst, l.size, d)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not (isinstance(time_limit_s, numbers.Real) and 0 < time_limit_s < math.inf):
        raise ValueError(f"time_limit_s must be a finite number > 0, got {time_limit_s!r}")
    if solver not in TIME_LIMIT_OPTIONS:
        raise ValueError(f"solver must be one of {tuple(TIME_LIMIT_OPTIONS)}, got {solver!r}")
    if node_limit is not None and not (
        isinstance(node_limit, numbers.Integral) and not isinstance(node_limit, bool)
        and node_limit >= 0
    ):  # fmt: skip
        raise ValueError(f"node_limit must be an int >= 0 or None, got {node_limit!r}")

    tiny = d * (d // c) <= AUTO_ILP_MAX_BINARIES and time_limit_s >= AUTO_ILP_MIN_BUDGET_S
    use_ilp = method == "ilp" or (method == "auto" and tiny)
    setup_ms = prepare_ilp(solver) * 1e3 if use_ilp else 0.0
    clock = _Clock(float(time_limit_s))
    optimal = ilp_improved = kept_unpermuted = False
    on_node_bound = int(l.sum())
    if method == "identity":
        perm = np.arange(d, dtype=np.int64)
    else:
        volumes = _Volumes(l, s, t, d, c)
        bounded = method == "auto" and d // c > AUTO_EXACT_NODES
        node_of, on_node_bound = _assign_nodes(volumes, AUTO_SEARCH_COLUMNS if bounded else 0)
        if use_ilp:
            timed = method == "ilp" and node_limit is None
            node_of, optimal, ilp_improved = _refine_ilp(
                volumes,
                node_of,
                solver,
                clock=clock if timed else None,
                node_limit=AUTO_ILP_NODE_LIMIT if method == "auto" else node_limit,
                proven_only=method == "auto",
            )
        perm = _assign_ranks(volumes, node_of)
    before = _traffic(l, s, t, d, c)
    after = _traffic(l, s, perm[t], d, c)
    if method == "auto" and before.inter_sent.max(initial=0) < after.inter_sent.max(initial=0):
        # The assignment maximises the tokens kept inside their node, which can leave one rank
        # sending more across nodes than the batches where they stand: then keep those.
        perm, after = np.arange(d, dtype=np.int64), before
        kept_unpermuted = True
    new_dst = perm[t]
    elapsed_ms = (time.perf_counter() - clock.wall0) * 1e3

    stats = {
        **_traffic_stats(before, "before"),
        **_traffic_stats(after, "after"),
        "placement_solve_ms": elapsed_ms,
        "placement_setup_ms": setup_ms,
        "placement_optimal": float(optimal),
        "on_node_tokens_bound": float(on_node_bound),
        "placement_kept_unpermuted": float(kept_unpermuted),
        "placement_ilp_improved": float(ilp_improved),
    }
    return Placement(dst=new_dst, perm=perm, stats=stats, before=before, after=after)


def movement_aware_dst(
    weights: Any,
    src: Any,
    num_ranks: int,
    *,
    sizes: Any = None,
    tolerance: float = 0.005,
    ranks_per_node: int | None = None,
) -> np.ndarray:
    """Balance like greedy (makespan within ``tolerance`` of it) while moving few items.

    ``weights``: additive per-item cost; ``src``: current rank of each item. The reference is
    the default ``greedy`` of :func:`orchmllm.balance` (LPT plus its bounded refinement), since
    that is what users compare with. Three phases (cpp/movement.cpp): ranks above the limit
    shed items (the lightest set covering their excess, or what does not fit after keeping
    their heaviest items; both are tried) and the shed items go largest first, best fit, to the
    fullest rank they fit on (their own node first with ``ranks_per_node``); a repair phase of
    greedy-style moves and swaps brings any rank still above the limit under it; a final phase
    sends moved items back to their source rank, alone or in exchange for an item that is
    already away (or a lighter one), while every rank stays within the limit. With at most 8
    items per rank, or when shedding fails, a third candidate keeps greedy's own batches and
    places each whole on the rank already holding most of its weight (an assignment, as in
    placement), then runs the final phase; it always reaches the limit. Up to 16 ranks with at
    most 8 items each, a fourth is exact: which items each rank keeps, tried in increasing
    moved weight, the first whose other items pack into the room left under the limit
    (cpp/keep_search.cpp, within a fixed work budget); where that budget runs out (a tight
    limit that ranks meet only by trading a short item for a long one), or with
    ``ranks_per_node`` (the keep-set search does not weigh nodes), a fifth searches item by
    item, stay or move, bounded below by what each rank must still shed (same file, a fixed
    node budget per order: staying first, then by the bound each choice leaves;
    ``balance_bench.py`` prints the planning time). The plan moving the least weight wins, so
    the tolerance always holds; up to 16 ranks, every pair of ranks re-splits the items the
    two hold (all ways, up to ``_core.RESPLIT_MAX_ITEMS`` items) where that moves less, on
    the heuristics' best before the searches and on the winner after them. Items are chosen
    by weight alone, so ``sizes`` (tokens per item) only has to be valid; it is accepted for
    the ``balance()`` contract and used by :func:`movement_lower_bound`. Deterministic: ties
    break by item index, then rank index.
    """
    w = _weights(weights)
    d = check_num_ranks(num_ranks)
    s = _ranks("src", src, w.size, d)
    if sizes is not None:
        _sizes(sizes, w.size)
    if not (isinstance(tolerance, numbers.Real) and 0 <= tolerance < math.inf):
        raise ValueError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
    c = 0 if ranks_per_node is None else _topology(d, ranks_per_node)[1]
    steps = REFINE_STEPS_PER_RANK * d
    return np.asarray(_core.movement_aware(w, s, d, float(tolerance), c, steps), dtype=np.int64)


def movement_lower_bound(
    weights: Any, src: Any, num_ranks: int, makespan: float, *, sizes: Any = None
) -> float:
    """Fewest tokens any assignment with max load ``makespan`` must move off its source rank.

    Each rank above ``makespan`` must shed ``load - makespan`` of weight; the cheapest way in
    tokens, relaxed to fractions of items, sheds the items with the most weight per token
    first. With ``sizes=None`` (tokens = weights) this is ``sum(max(0, load - makespan))``.
    """
    w = _weights(weights)
    d = check_num_ranks(num_ranks)
    s = _ranks("src", src, w.size, d)
    z = w if sizes is None else _sizes(sizes, w.size)
    excess = np.maximum(np.bincount(s, weights=w, minlength=d) - float(makespan), 0.0)
    if sizes is None:
        return float(excess.sum())
    density = np.divide(w, z, out=np.full_like(w, np.inf), where=z > 0)
    order = np.lexsort((-density, s))  # by rank, densest first
    ws, zs, ss = w[order], z[order], s[order]
    cum = np.cumsum(ws)
    before = cum - ws
    shed_before = before - before[np.searchsorted(ss, ss)]  # by earlier items of the same rank
    need = excess[ss] - shed_before
    frac = np.clip(np.divide(need, ws, out=np.zeros_like(ws), where=ws > 0), 0.0, 1.0)
    return float((frac * zs).sum())


# ---------------------------------------------------------------------------------------------
# the volume matrix and the two exact assignments


class _Volumes:
    """The move's items, with the aggregates the placement needs (all bincounts over items)."""

    def __init__(self, l: np.ndarray, s: np.ndarray, t: np.ndarray, d: int, c: int) -> None:
        self.l, self.src, self.batch = l, s, t
        self.d, self.c, self.m = d, c, d // c
        self.src_node = s // c

    @functools.cached_property
    def held(self) -> np.ndarray:
        """Tokens each rank holds before the move (only the ILP's bound asks)."""
        return np.bincount(self.src, weights=self.l, minlength=self.d).astype(np.int64)

    def node_matrix(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """CSR over batches of ``W[b, k]`` = tokens already on node ``k`` for batch ``b``."""
        return _core.grouped_sums(self.batch, self.src_node, self.l, self.d, self.m)

    def max_inter(self, node_of: np.ndarray) -> int:
        """Most tokens one rank sends off-node when batch ``b`` runs on node ``node_of[b]``."""
        away = node_of[self.batch] != self.src_node
        sent = np.bincount(self.src[away], weights=self.l[away], minlength=self.d)
        return int(sent.max(initial=0))

    def lower_bound(self) -> int:
        """A rank's node takes ``c`` batches, so at best its ``c`` largest volumes stay."""
        d = self.d
        key = np.sort(self.src * d + self.batch)
        first = np.flatnonzero(np.diff(key, prepend=-1))
        volume = np.add.reduceat(self.l[np.argsort(self.src * d + self.batch)], first)
        top = int(volume.max(initial=0)) + 1
        rank_first = np.sort(key[first] // d * top + (top - 1 - volume))  # by rank, largest first
        rank = rank_first // top
        pos = np.arange(rank.size) - np.searchsorted(rank, rank)
        best = pos < self.c
        kept = np.bincount(rank[best], weights=(top - 1 - rank_first % top)[best], minlength=d)
        return int((self.held - kept).max(initial=0))


def _assign_nodes(v: _Volumes, max_settled: int) -> tuple[np.ndarray, int]:
    """Node per batch maximising the tokens that stay on their node, and an upper bound on
    those tokens (equal to what is reached when ``max_settled`` is 0: exact)."""
    indptr, cols, profit = v.node_matrix()
    node_of, bound = _core.capacitated_assignment(indptr, cols, profit, v.m, v.c, max_settled)
    node_of = np.asarray(node_of, np.int64)
    free = np.repeat(np.arange(v.m), v.c - np.bincount(node_of[node_of >= 0], minlength=v.m))
    node_of[node_of < 0] = free  # unmatched batches, in index order, take the free slots
    return node_of, int(bound)


def _assign_ranks(v: _Volumes, node_of: np.ndarray) -> np.ndarray:
    """Rank per batch inside its node, maximising the tokens that do not move at all (exact)."""
    d = v.d
    # edges (batch, rank on the batch's node); gathered by index, which costs a fraction of
    # three boolean-mask gathers
    local = np.flatnonzero(node_of[v.batch] == v.src_node)
    csr = _core.grouped_sums(v.batch[local], v.src[local], v.l[local], d, d)
    perm, _ = _core.capacitated_assignment(*csr, d, 1)
    perm = np.asarray(perm, dtype=np.int64)
    taken = np.zeros(d, dtype=bool)
    taken[perm[perm >= 0]] = True
    free = np.flatnonzero(~taken)  # sorted by rank, hence by node
    open_batches = np.flatnonzero(perm < 0)
    perm[open_batches[np.argsort(node_of[open_batches], kind="stable")]] = free
    return perm


# ---------------------------------------------------------------------------------------------
# the paper's ILP (Algorithm 3)


def _ilp_estimate_s(v: _Volumes) -> float:
    binaries = v.d * v.m
    return _COMPILE_S + (_COMPILE_S_PER_VAR + _ROOT_S_PER_VAR) * binaries


def _refine_ilp(
    v: _Volumes,
    warm: np.ndarray,
    solver: str,
    *,
    clock: _Clock | None,
    node_limit: int | None,
    proven_only: bool,
) -> tuple[np.ndarray, bool, bool]:
    """Algorithm 3 from the warm start ``warm``.

    Returns ``(node_of, proven_optimal, improved)``; ``node_of`` is never worse than ``warm``.
    With a ``clock`` (method ``ilp``) the solve is bounded by its budget and returns the best
    found, warning when the model cannot be solved in the budget at all (:func:`prepare_ilp`
    has paid the one-time setup already). Without, ``node_limit`` bounds it, so the result does
    not depend on the machine's speed; ``proven_only`` (``auto``) uses it only if proven
    optimal.
    """
    keep = (warm, False, False)
    if clock is not None and _ilp_estimate_s(v) / clock.cpu_share() > clock.remaining():
        warnings.warn(
            f"placement ILP with {v.d * v.m} binaries does not fit the time left "
            f"({clock.remaining():.3f} s at {clock.cpu_share():.2f} of a CPU); "
            "returning the assign placement",
            RuntimeWarning,
            stacklevel=3,
        )
        return keep
    warm_value = v.max_inter(warm)
    if warm_value <= v.lower_bound():
        return warm, True, False
    try:
        import cvxpy as cp

        problem, x = _ilp_problem(v, warm_value)
        if clock is not None:
            cpu_left = clock.remaining() * clock.cpu_share() * _SOLVER_SHARE
            if cpu_left <= 0:
                return keep
            _solve(problem, solver, {TIME_LIMIT_OPTIONS[solver]: max(cpu_left, 1e-3)})
        else:
            _solve(problem, solver, {NODE_LIMIT_OPTIONS[solver]: node_limit})
    except Exception as exc:  # noqa: BLE001 - a solver problem must never stop training
        _warn_once(
            f"placement ILP failed ({type(exc).__name__}: {exc}); returning the assign placement"
        )
        return keep

    proven = problem.status == cp.OPTIMAL
    if proven_only and not proven:
        return keep
    node_of = _rounded_assignment(x.value, v.c)
    if node_of is not None and v.max_inter(node_of) < warm_value:
        return node_of, proven, True
    # Proven optimal at the warm start's value: the warm start itself is optimal.
    if proven and problem.value is not None and problem.value >= warm_value - 0.5:
        return warm, True, False
    return keep


def _warn_once(message: str) -> None:
    """Warn the first time this process meets ``message``: a missing solver fails the same way
    on every step, and one warning says it (Python's own once-per-location registry is reset
    by every ``catch_warnings`` around a solve)."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _ilp_problem(v: _Volumes, warm_value: int) -> tuple[Any, Any]:
    """Algorithm 3 as a cvxpy problem, and its ``x[batch, node]`` variable."""
    import cvxpy as cp
    import scipy.sparse as sp

    d, m = v.d, v.m
    # x is vectorised column-major: x[b, k] is entry b + k * d; duplicates are summed.
    cols = v.batch + v.src_node * d
    a = sp.csr_matrix((v.l.astype(np.float64), (v.src, cols)), shape=(d, d * m))
    x = cp.Variable((d, m), boolean=True)
    worst = cp.Variable()
    constraints = [
        cp.sum(x, axis=1) == 1,
        cp.sum(x, axis=0) == v.c,
        v.held.astype(np.float64) - a @ cp.vec(x, order="F") <= worst,
        worst <= warm_value,  # the warm start bounds the search
    ]
    return cp.Problem(cp.Minimize(worst), constraints), x


def _solve(problem: Any, solver: str, limit: dict[str, float]) -> None:
    """Solve within ``limit`` (the solver's time- or node-limit option and its value)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cvxpy's "solution may be inaccurate" on time-outs
        problem.solve(solver=solver, **limit)


def prepare_ilp(solver: str = "CBC") -> float:
    """Pay the ILP's one-time costs now; returns the seconds spent (0.0 once paid for ``solver``).

    The first ILP in a process imports cvxpy and loads the solver's interface (1-3 s measured
    on the 2-core machine), 20-60x the default 50 ms budget. This builds and solves a two-batch
    instance of the same model, so all of that is paid here. :func:`place_batches` calls it
    before starting its clock; callers that know they will use ``ilp`` (the orchestrator with
    ``placement="ilp"``) call it at construction to keep it off the first step. Never raises on
    a missing cvxpy or solver: the real solve reports that, with a warning and the fallback.
    """
    if solver not in TIME_LIMIT_OPTIONS:
        raise ValueError(f"solver must be one of {tuple(TIME_LIMIT_OPTIONS)}, got {solver!r}")
    if solver in _PREPARED:
        return 0.0
    start = time.perf_counter()
    one = np.ones(2, dtype=np.int64)
    try:
        problem, _ = _ilp_problem(_Volumes(one, np.arange(2), np.arange(2)[::-1], 2, 1), 2)
        _solve(problem, solver, {TIME_LIMIT_OPTIONS[solver]: 1.0})
    except Exception:  # noqa: BLE001 - the solve that needs the solver warns about it
        pass
    _PREPARED[solver] = time.perf_counter() - start
    return _PREPARED[solver]


def _rounded_assignment(values: np.ndarray | None, c: int) -> np.ndarray | None:
    """The node per batch of a solver's 0/1 matrix, or ``None`` if it is not a valid placement."""
    if values is None or not np.all(np.isfinite(values)):
        return None
    node_of = np.argmax(values, axis=1).astype(np.int64)
    one_hot = np.arange(values.shape[1]) == node_of[:, None]
    ok_rows = np.all(np.abs(values - one_hot) < 0.5, axis=1)
    counts = np.bincount(node_of, minlength=values.shape[1])
    if not ok_rows.all() or np.any(counts != c):
        return None
    return node_of


# ---------------------------------------------------------------------------------------------
# statistics and validation


def _traffic(l: np.ndarray, s: np.ndarray, t: np.ndarray, d: int, c: int) -> Traffic:
    sent, recv, intra, kept = _core.traffic(l, s, t, d, c)
    return Traffic(inter_sent=sent, inter_recv=recv, intra=int(intra), kept=int(kept))


def _traffic_stats(tr: Traffic, when: str) -> dict[str, float]:
    return {
        f"inter_node_tokens_max_rank_{when}": float(tr.inter_sent.max(initial=0)),
        f"inter_node_tokens_max_rank_recv_{when}": float(tr.inter_recv.max(initial=0)),
        f"inter_node_tokens_total_{when}": float(tr.inter_total),
        f"intra_node_tokens_total_{when}": float(tr.intra),
        f"tokens_kept_{when}": float(tr.kept),
    }


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def check_num_ranks(num_ranks: Any) -> int:
    """``num_ranks`` as an int in ``[1, MAX_RANKS]``, else a ValueError naming it."""
    d = _count("num_ranks", num_ranks)
    if d > MAX_RANKS:
        raise ValueError(f"num_ranks must be at most MAX_RANKS={MAX_RANKS}, got {d}")
    return d


def _topology(num_ranks: Any, ranks_per_node: Any) -> tuple[int, int]:
    d = check_num_ranks(num_ranks)
    c = _count("ranks_per_node", ranks_per_node)
    if d % c:
        raise ValueError(f"ranks_per_node={c} must divide num_ranks={d}")
    return d, c


def _vector(name: str, value: Any) -> np.ndarray:
    a = np.asarray(value)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    return a


def _lengths(lengths: Any) -> np.ndarray:
    a = _vector("lengths", lengths)
    integer = a.dtype.kind in "iu" and a.dtype != np.uint64  # values below 2**63 by type
    if a.size and (
        a.dtype.kind not in "iuf"
        or np.any(a < 0)
        or (not integer and (np.any(a != np.floor(a)) or np.any(a >= 2**63)))
    ):
        raise ValueError(f"lengths must be non-negative int64 integers, got {a[:8]!r}")
    total = float(a.sum(dtype=np.float64))
    if total > _EXACT_TOKENS:
        raise ValueError(
            f"lengths must sum to at most 2**53 tokens (volumes are exact float64 sums), "
            f"got {total:.6g}"
        )
    return a.astype(np.int64, copy=False)


def _ranks(name: str, value: Any, n: int, d: int) -> np.ndarray:
    a = _vector(name, value)
    if a.size != n:
        raise ValueError(f"{name} must have one entry per item ({n}), got {a.size}")
    if a.size and (a.dtype.kind not in "iu" or a.min() < 0 or a.max() >= d):
        raise ValueError(f"{name} must hold integer ranks in [0, {d}), got {a[:8]!r}")
    return a.astype(np.int64, copy=False)


def _weights(weights: Any) -> np.ndarray:
    a = _vector("weights", weights)
    if a.size and (a.dtype.kind not in "iuf" or not np.all(np.isfinite(a)) or np.any(a < 0)):
        raise ValueError(f"weights must be finite and >= 0, got {a[:8]!r}")
    return a.astype(np.float64)


def _sizes(sizes: Any, n: int) -> np.ndarray:
    a = _vector("sizes", sizes)
    if a.size != n:
        raise ValueError(f"sizes must have one entry per item ({n}), got {a.size}")
    if a.size and (a.dtype.kind not in "iuf" or not np.all(np.isfinite(a)) or np.any(a < 0)):
        raise ValueError(f"sizes must be finite and >= 0, got {a[:8]!r}")
    return a.astype(np.float64)
