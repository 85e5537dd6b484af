"""The balancing policies written plainly in Python: the same algorithms as ``cpp/`` (same
tie-breaking, same floating-point operation order), so tests can check that the C++ core
gives the same ``dst`` and ``benchmarks/balance_bench.py`` can measure its speed-up.

Each ``ref_*`` function is a built-in policy's ``reference`` in
:data:`orchmllm.planner.policies.REGISTRY` (``balance(..., backend="python")`` runs it); the
algorithms and their edges are described in :mod:`orchmllm.planner.policies`. Inputs are what
:func:`orchmllm.planner.policies.plan_dst` hands them: validated, non-empty, not all zero.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable

import numpy as np

import orchmllm._core as _core

__all__ = [
    "ref_binary_search",
    "ref_conv",
    "ref_greedy_tolerance",
    "ref_karmarkar_karp",
    "ref_lpt",
    "ref_multifit",
    "ref_padded_cost",
]


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


def _pair_step(w, lists, load, count, cap, h, p) -> tuple | None:
    """The best move or swap between ranks h and p that lowers the pair's maximum below h's
    load: (new max of the pair, item leaving h, item leaving p or -1), or None."""
    lh, ll = load[h], load[p]
    half = (lh - ll) * 0.5
    hs, ls = lists[h], lists[p]
    neg_h, neg_l = [-w[i] for i in hs], [-w[j] for j in ls]
    steps = []
    if count[p] < cap:
        moves = [hs[a] for a in _around(neg_h, half)]
        steps += [(max(lh - w[i], ll + w[i]), i, -1) for i in moves if w[i] > 0]
    for i in hs:
        partners = [ls[b] for b in _around(neg_l, w[i] - half)]
        steps += [
            (max((lh - w[i]) + w[j], (ll - w[j]) + w[i]), i, j) for j in partners if w[j] < w[i]
        ]
    steps = [s for s in steps if s[0] < lh]
    return min(steps) if steps else None


def _refine(w, order, dst, load, count, cap, max_steps, floor=-math.inf) -> None:
    d = len(load)
    lists = [[] for _ in range(d)]  # per rank, weight descending then index ascending
    for i in order:
        lists[dst[i]].append(i)
    for _ in range(max_steps):
        h = max(range(d), key=lambda r: (load[r], -r))
        l = min(range(d), key=lambda r: (load[r], r))
        if h == l or count[h] <= 1 or load[h] <= floor:
            break
        step = _pair_step(w, lists, load, count, cap, h, l)
        if step is None and d <= _core.REFINE_WIDE_RANKS:
            others = sorted(
                (r for r in range(d) if r not in (h, l) and load[r] < load[h]),
                key=lambda r: (load[r], r),
            )
            for p in others[: _core.REFINE_WIDE_PARTNERS]:
                step = _pair_step(w, lists, load, count, cap, h, p)
                if step is not None:
                    l = p
                    break
        if step is None:
            break
        _, i, j = step
        lh, ll = load[h], load[l]
        hs, ls = lists[h], lists[l]
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


def _weight_unit(x: list[float]) -> float:
    """The greatest common divisor of the weights when all are integers in [0, 2**53), else
    0.0 (cpp/exact.cpp)."""
    g = 0
    for v in x:
        if not (0.0 <= v < 2.0**53 and v == math.floor(v)):
            return 0.0
        g = math.gcd(g, int(v))
    return float(g)


def _makespan_floor(x: list[float], d: int, unit: float) -> float:
    """No plan is lighter (cpp/exact.cpp): the mean, the heaviest item, and for k = 1..8 the
    k + 1 lightest of the k*d + 1 heaviest items; rounded up to a multiple of ``unit``."""
    if not x:
        return 0.0
    total = 0.0
    for v in x:
        total += v
    floor = max(total / d, x[0])
    k = 1
    while k <= 8 and k * d + 1 <= len(x):
        window = 0.0
        for v in x[k * d - k : k * d + 1]:
            window += v
        floor = max(floor, window)
        k += 1
    return math.ceil(floor / unit) * unit if unit > 0 else floor


def ref_lpt(
    weights: np.ndarray, num_ranks: int, cap: int, max_steps: int = 0, with_proof: bool = False
):
    """LPT; with ``max_steps > 0`` the refined portfolio of ``greedy`` (see ``cpp/balance.hpp``):
    refined LPT; without a binding cap, the steps after it plan only the items of non-zero
    weight; on at most ``_core.EXACT_ITEMS`` of them the exact search (``_core.improve_exact``,
    which has no Python twin: tests check it against brute force); then refined KK (past its
    work limit its equal-counts variant, within its own) and MULTIFIT within their limits,
    the lightest maximum load winning, ties to the earlier candidate; every step stops at the
    floor. ``with_proof``: ``(dst, proven)``."""
    w = [float(x) for x in weights]
    n, d = len(w), num_ranks
    dst = [0] * n
    load, count, order = [0.0] * d, [0] * d, _desc(w)
    _fill_least_loaded(w, order, load, count, cap, dst)

    def done(proven: bool):
        out = np.array(dst, dtype=np.int64)
        return (out, proven) if with_proof else out

    if max_steps <= 0:
        return done(False)
    if n and w[order[0]] == w[order[-1]]:  # all alike: LPT's rounds are optimal
        for k, i in enumerate(order):
            dst[i] = k % d
        return done(True)
    live = n
    if cap >= n:
        while live > 0 and w[order[live - 1]] == 0.0:
            live -= 1
    part = order[:live]
    xs = [w[i] for i in part]
    unit = _weight_unit(xs)
    floor = _makespan_floor(xs, d, unit)
    _refine(w, order, dst, load, count, cap, max_steps, floor)
    best = max(load)
    if not best > floor or d < 2:
        return done(True)
    if live <= _core.EXACT_ITEMS:
        plan = np.array([dst[i] for i in part], dtype=np.int64)
        plan, proven, _ = _core.improve_exact(np.array(xs), d, cap, floor, _core.EXACT_NODES, plan)
        for i, r in zip(part, plan.tolist(), strict=True):
            dst[i] = r
        if proven:
            return done(True)
        load = [0.0] * d
        for i in part:
            load[dst[i]] += w[i]
        best = max(load)

    def consider(plan: list[int]) -> None:
        nonlocal best
        load, count = [0.0] * d, [0] * d
        for i in part:
            load[plan[i]] += w[i]
            count[plan[i]] += 1
        if max(count) > cap:
            return
        _refine(w, part, plan, load, count, cap, max_steps, floor)
        if max(load) < best:
            best = max(load)
            for i in part:
                dst[i] = plan[i]

    full_kk = live * d <= _core.PORTFOLIO_KK_WORK
    if full_kk or live <= _core.PORTFOLIO_KK_EQUAL_ITEMS:
        ids = sorted(part)
        kk = ref_karmarkar_karp(np.array([w[i] for i in ids]), d, not full_kk).tolist()
        plan = list(dst)
        for i, r in zip(ids, kk, strict=True):
            plan[i] = r
        consider(plan)
    top = best - unit if unit > 0 else math.nextafter(best, -math.inf)
    if best > floor and live <= _core.PORTFOLIO_MULTIFIT_ITEMS:
        plan = _multifit_below(w, part, d, cap, floor, top, unit)
        if plan is not None:
            full = list(dst)
            for i in part:
                full[i] = plan[i]
            consider(full)
    return done(not best > floor)


def _multifit_below(w, order, d, cap, floor, top, unit) -> list[int] | None:
    """The portfolio's MULTIFIT (cpp/balance.cpp): bisection on first-fit decreasing's
    capacity from the floor up to ``top`` (a plan lighter than the one in hand), capacities
    multiples of ``unit`` when it is > 0."""
    if not floor <= top:
        return None

    def next_capacity(lo: float, hi: float) -> float | None:
        mid = lo + (hi - lo) / 2
        if unit > 0:
            mid = lo + math.floor((hi - lo) / (2 * unit)) * unit
        return mid if lo < mid < hi else None

    return _bisect_first_fit(w, order, d, cap, floor, top, next_capacity)


def _bisect_first_fit(w, order, d, cap, lo, hi, next_capacity) -> list[int] | None:
    """MULTIFIT's search, shared by the classic one and the portfolio's: first-fit decreasing
    at ``lo``, then at ``hi`` (None if that fails too), then at ``next_capacity(lo, hi)`` while
    it gives one, at most ``MULTIFIT_ROUNDS`` tries after ``lo``; the plan of the smallest
    capacity that fit."""
    found = _first_fit(w, order, d, cap, lo)
    if found is not None:
        return found
    for rounds in range(_core.MULTIFIT_ROUNDS):
        mid = hi if rounds == 0 else next_capacity(lo, hi)
        if mid is None:
            break
        plan = _first_fit(w, order, d, cap, mid)
        if plan is not None:
            hi, found = mid, plan
        elif rounds == 0:
            return None
        else:
            lo = mid
    return found


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
    integral = all(x == math.floor(x) for x in w)  # then capacities < 1 apart plan alike

    def next_capacity(lo: float, hi: float) -> float | None:
        mid = lo + (hi - lo) / 2
        return mid if lo < mid < hi and not (integral and hi - lo < 1.0) else None

    lo = max(total / d, w[order[0]])
    hi = max(2.0 * total / d, w[order[0]])
    return _bisect_first_fit(w, order, d, cap, lo, hi, next_capacity)


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
