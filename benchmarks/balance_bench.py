"""Balancing benchmark: quality and planning time of every policy on realistic length mixes.

Cases: policies x length distributions (``orchmllm.workloads``) x num_ranks x items per rank.
Each rank's mini-batch is a random draw, so ``imbalance_before`` is what data parallelism
without balancing pays. Times are CPU time of the calling thread (``time.thread_time``), so
other processes on a shared machine do not inflate them; targets are ratios from this run:

- greedy on 2560 x 60 items plans in at most 3x the time numpy argsorts the same lengths
  (``plan_ms`` times ``balance()`` as a user calls it: validation, plan, loads, statistics);
- the C++ core is at least 20x faster than the Python reference (where that is timed);
- packed policies (greedy, greedy_cost, kk) end within 1% of the lower bound for 16+ items
  per rank;
- where kk wins or loses against greedy, on quality and on time.

greedy and greedy_cost run as balance() does by default (Alg. 1, then the bounded move/swap
refinement); ``greedy_alg1`` is the paper's Alg. 1 alone (``refine=False``), to show what the
refinement buys and costs. Every policy runs at every size (kk's C++ core takes about a second
at 2560 x 60); the Python reference is timed at 64 x 60 and, for some policies, 2560 x 60.

Peers: on small instances (8-64 ranks, 4-40 items per rank, every distribution) greedy's max
load against the plain-Python LPT, Karmarkar-Karp and MULTIFIT references (target: worse on
0 instances), and greedy_stay's moved tokens against the exact minimum at the makespan it
reaches (a scipy HiGHS MILP; target: max ratio <= 1.2). Scale (skipped under ``--quick``):
greedy alone and greedy + ``placement="auto"`` at 16,384 ranks x 60 items as ratios to numpy's
faster argsort (quicksort or stable) of the same lengths in the same run (targets: greedy <=
2x; placement under 100 ms).
Wrapper: ``balance()`` at 8 ranks x 4 items against its C++ core alone, timed in alternating
rounds (target: at most 10 us more).

A second table replays the audio phase with the H100 audio-10b block cost fitted from
``h100_table1_blocks.json``: Alg. 2 (binary_search) versus padded_cost.

    python benchmarks/balance_bench.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import math
import time
from functools import partial
from pathlib import Path

import numpy as np

from orchmllm import _core
from orchmllm.balance import balance
from orchmllm.cost import CostModel, fit_packed, fit_padded, load_calibration
from orchmllm.placement import REFINE_STEPS_PER_RANK
from orchmllm.policies import PADDED_POLICIES, POLICIES, plan_dst
from orchmllm.provenance import write_records
from orchmllm.reference import ref_karmarkar_karp, ref_lpt, ref_multifit
from orchmllm.workloads import DISTRIBUTIONS, sample_lengths

# H100 block at hidden 1280, fitted on the packaged measurement: the quadratic objective.
QUAD = fit_packed(
    [r for r in load_calibration("h100_block_fwd_bwd.json") if r["hidden"] == 1280]
).model
PACKED_TARGET = ("greedy", "greedy_cost", "kk")
# Policies with a C++ implementation (identity copies src; greedy_stay is orchmllm.placement's).
CORE = tuple(p for p in POLICIES if p not in ("identity", "greedy_stay"))
# Benchmark variants: name -> (policy, extra balance() keywords).
VARIANTS = {p: (p, {}) for p in POLICIES} | {"greedy_alg1": ("greedy", {"refine": False})}
# Over 10^4 items these take 10-1000 ms per plan: fewer repetitions.
SLOW = ("kk", "kk_equal", "greedy_tolerance", "greedy_stay")
# The targets, as bounds on figures of the summary, which carries each one as
# target_max_<figure> / target_min_<figure> (docs/results.md judges by those, not by a copy).
TARGET_MAX = {
    "greedy_over_argsort_max": 3.0,  # greedy against numpy's argsort, largest case
    "packed_gap_to_lb_max": 1.01,  # greedy, greedy_cost, kk at 16+ items per rank
    "wrapper_overhead_us": 10.0,  # balance() over its C++ core at 8 x 4
    "greedy_stay_over_exact_max": 1.2,  # tokens moved over the exact minimum
    "greedy_stay_node_over_exact_max": 1.2,  # the same, node-aware
    "scale_greedy_over_argsort_max": 2.0,  # greedy against argsort at 16,384 x 60
    "scale_placement_ms_max": 100.0,  # placement="auto" at 16,384 x 60
}
TARGET_MIN = {"speedup_min": 20.0}  # the C++ core over the Python reference


def _cpu_ms(fn, reps: int) -> float:
    best = math.inf
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best * 1e3


def _argsort_ms(lengths: np.ndarray, reps: int) -> float:
    """The yardstick: numpy's faster argsort of the lengths, its default quicksort or its
    stable sort. Which wins depends on the lengths and the numpy build (few distinct lengths
    can make quicksort several times slower), so a ratio under it is not a slow sort's credit."""
    return min(
        _cpu_ms(partial(np.argsort, lengths, kind=kind), reps) for kind in ("quicksort", "stable")
    )


def _cost(policy: str) -> CostModel | None:
    return QUAD if policy == "greedy_cost" else None


def run_cases(ranks, per_ranks, variants, ref_cases, seed: int) -> list[dict]:
    records = []
    for dist in DISTRIBUTIONS:
        for d in ranks:
            for per in per_ranks:
                n = d * per
                lengths = sample_lengths(dist, n, rng=seed + d + per)
                src = np.repeat(np.arange(d, dtype=np.int64), per)
                argsort_ms = _argsort_ms(lengths, 7)
                for name in variants:
                    policy, extra = VARIANTS[name]
                    kw = {"src": src, "cost": _cost(policy), **extra}
                    a = balance(lengths, d, policy, **kw)
                    reps = 2 if n > 10_000 and policy in SLOW else 7
                    plan_ms = _cpu_ms(partial(balance, lengths, d, policy, **kw), reps)
                    ref_ms = math.nan
                    core_ms = math.nan
                    if policy in CORE and (
                        (dist, d, per, name) in ref_cases or (d, per) in ref_cases
                    ):
                        # The algorithm alone: C++ core against the Python reference.
                        cost = kw["cost"] or CostModel(
                            "padded" if policy in PADDED_POLICIES else "packed"
                        )
                        plan = partial(
                            plan_dst,
                            policy,
                            lengths,
                            d,
                            cost=cost,
                            cap=n,
                            src=src,
                            refine=extra.get("refine", True),
                        )
                        core_ms = _cpu_ms(plan, reps)
                        ref_ms = _cpu_ms(partial(plan, backend="python"), 1)
                    records.append(
                        {
                            "policy": name,
                            "dist": dist,
                            "ranks": d,
                            "per_rank": per,
                            "cost": "h100_1280" if policy == "greedy_cost" else "default",
                            "imbalance_before": a.stats["imbalance_before"],
                            "imbalance_after": a.stats["imbalance_after"],
                            "gap_to_lb": a.stats["gap_to_lb"],
                            "plan_ms": plan_ms,
                            "argsort_ms": argsort_ms,
                            "python_ms": ref_ms,
                            "core_ms": core_ms,
                            "speedup_vs_python": ref_ms / core_ms if core_ms > 0 else math.nan,
                        }
                    )
    return records


def audio_cases(ranks, per_ranks, seed: int, draws: int) -> list[dict]:
    rows = load_calibration("h100_table1_blocks.json")
    fit = fit_padded([r for r in rows if r["shape"] == "audio-10b"])
    records = []
    for dist in ("librispeech", "spoken_qa"):
        for d in ranks:
            for per in per_ranks:
                for policy in ("binary_search", "padded_cost"):
                    before, after, slowest = [], [], []
                    for k in range(draws):
                        # Encoder positions: mel frames after the stride-2 convolution.
                        lengths = sample_lengths(dist, d * per, rng=seed + 100 * k + d) // 2
                        src = np.repeat(np.arange(d), per)
                        t0 = time.thread_time()
                        a = balance(lengths, d, policy, src=src, cost=fit.model)
                        plan_ms = (time.thread_time() - t0) * 1e3
                        before.append(a.stats["imbalance_before"])
                        after.append(a.stats["imbalance_after"])
                        slowest.append(a.loads.max())
                    records.append(
                        {
                            "policy": policy,
                            "dist": dist,
                            "ranks": d,
                            "per_rank": per,
                            "cost": "h100_audio_10b",
                            "imbalance_before": float(np.mean(before)),
                            "imbalance_after": float(np.mean(after)),
                            "gap_to_lb": math.nan,
                            "slowest_ms": float(np.mean(slowest)),
                            "plan_ms": plan_ms,
                        }
                    )
    return records


def _max_load(lengths: np.ndarray, dst, d: int) -> float:
    return float(np.bincount(np.asarray(dst), weights=lengths, minlength=d).max())


def movement_cost(
    lengths: np.ndarray, src: np.ndarray, dst: np.ndarray, ranks_per_node: int | None
) -> np.ndarray:
    """What greedy_stay minimises, per item: its tokens if it leaves its rank, twice that if
    it also leaves its node (with ``ranks_per_node``; cpp/movement.cpp)."""
    moved = np.where(dst != src, lengths, 0).astype(np.float64)
    if ranks_per_node is not None:
        moved += np.where(dst // ranks_per_node != src // ranks_per_node, lengths, 0)
    return moved


def min_moved_exact(
    lengths: np.ndarray,
    src: np.ndarray,
    d: int,
    makespan: float,
    *,
    ranks_per_node: int | None = None,
) -> tuple[float, bool]:
    """Fewest tokens any plan with max load <= ``makespan`` moves (with ``ranks_per_node``:
    the movement greedy_stay weighs, tokens leaving their node counted twice): a MILP over
    binary x[i, r] (item i on rank r), solved by scipy's HiGHS. Returns (value, exact): past
    the time limit the value is HiGHS's dual bound, below the optimum, so a ratio over it is
    an upper bound on the true ratio."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    n = lengths.size
    cols = np.arange(n * d)
    item, rank = cols // d, cols % d
    cost = movement_cost(lengths[item], src[item], rank, ranks_per_node)
    one = coo_matrix((np.ones(n * d), (item, cols)), shape=(n, n * d))
    load = coo_matrix((lengths[item].astype(np.float64), (rank, cols)), shape=(d, n * d))
    res = milp(
        cost,
        constraints=[LinearConstraint(one, 1, 1), LinearConstraint(load, -np.inf, makespan)],
        integrality=np.ones(n * d),
        bounds=Bounds(0, 1),
        options={"time_limit": 20},
    )
    if res.success:
        return float(res.fun), True
    if res.status == 1 and res.get("mip_dual_bound") is not None:  # time limit
        return max(float(res.mip_dual_bound), 0.0), False
    raise RuntimeError(f"HiGHS found no bound: {res.message}")


def peer_cases(ranks, per_ranks, seed: int) -> list[dict]:
    """Per instance: greedy's max load against the LPT/KK/MULTIFIT references."""
    records = []
    for dist in DISTRIBUTIONS:
        for d in ranks:
            for per in per_ranks:
                n = d * per
                lengths = sample_lengths(dist, n, rng=seed + 7 * d + per)
                w = lengths.astype(np.float64)
                order = sorted(range(n), key=lambda i: (-w[i], i))
                ours = _max_load(lengths, balance(lengths, d).dst, d)
                rec = {"policy": "peers", "dist": dist, "ranks": d, "per_rank": per}
                rec["greedy_max_load"] = ours
                rec["lpt_max_load"] = _max_load(lengths, ref_lpt(w, d, n), d)
                rec["kk_max_load"] = _max_load(lengths, ref_karmarkar_karp(w, d, False), d)
                rec["multifit_max_load"] = _max_load(
                    lengths, ref_multifit(w.tolist(), order, d, n), d
                )
                records.append(rec)
    return records


def movement_cases(ranks, per_ranks, seed: int, *, ranks_per_node: int | None = None) -> list[dict]:
    """Per small instance: greedy_stay's moved tokens over the exact minimum at its makespan
    (with ``ranks_per_node``: node-aware, tokens leaving their node counted twice in both)."""
    records = []
    for dist in DISTRIBUTIONS:
        for d in ranks:
            for per in per_ranks:
                n = d * per
                lengths = sample_lengths(dist, n, rng=seed + 11 * d + per)
                src = np.repeat(np.arange(d, dtype=np.int64), per)
                plan = partial(
                    balance, lengths, d, "greedy_stay", src=src, ranks_per_node=ranks_per_node
                )
                a = plan()
                plan_ms = _cpu_ms(plan, 3)
                makespan = float(a.loads.max())
                exact, solved = min_moved_exact(
                    lengths, src, d, makespan, ranks_per_node=ranks_per_node
                )
                moved = float(movement_cost(lengths, src, a.dst, ranks_per_node).sum())
                records.append(
                    {
                        "policy": "movement" if ranks_per_node is None else "movement_node",
                        "ranks_per_node": ranks_per_node,
                        "dist": dist,
                        "ranks": d,
                        "per_rank": per,
                        "tokens_moved": moved,
                        "tokens_moved_exact_min": exact,
                        "exact": solved,
                        "moved_over_exact": moved / exact if exact > 0 else 1.0,
                        "plan_ms": plan_ms,
                    }
                )
    return records


def wrapper_overhead(seed: int, d: int = 8, per: int = 4, rounds: int = 30) -> dict:
    """balance(lengths, d) against its C++ core alone (``_core.lpt`` on float weights), at
    8 ranks x 4 items: best per-call time of each over alternating rounds of 300 calls, so
    both see the same machine load."""
    lengths = sample_lengths("text", d * per, rng=seed)
    w = lengths.astype(np.float64)
    steps = REFINE_STEPS_PER_RANK * d
    calls = {
        "core": partial(_core.lpt, w, d, w.size, steps),
        "wrapper": partial(balance, lengths, d),
    }
    best = dict.fromkeys(calls, math.inf)
    for _ in range(rounds):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            for _ in range(300):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / 300 * 1e6)
    return {
        "policy": "wrapper",
        "ranks": d,
        "per_rank": per,
        "core_us": best["core"],
        "wrapper_us": best["wrapper"],
        "overhead_us": best["wrapper"] - best["core"],
    }


def scale_cases(seed: int, d: int = 16_384, per: int = 60) -> list[dict]:
    """greedy and greedy + placement="auto" at ``d`` ranks, as ratios to argsort (same run)."""
    records = []
    for dist in ("text", "llava_image"):
        lengths = sample_lengths(dist, d * per, rng=seed + d)
        src = np.repeat(np.arange(d, dtype=np.int64), per)
        argsort_ms = _argsort_ms(lengths, 3)
        greedy_ms = _cpu_ms(partial(balance, lengths, d), 3)
        auto = partial(balance, lengths, d, src=src, ranks_per_node=8, placement="auto")
        auto_ms = _cpu_ms(auto, 2)
        records.append(
            {
                "policy": "scale",
                "dist": dist,
                "ranks": d,
                "per_rank": per,
                "argsort_ms": argsort_ms,
                "greedy_ms": greedy_ms,
                "greedy_auto_ms": auto_ms,
                "greedy_over_argsort": greedy_ms / argsort_ms,
                "placement_ms": auto_ms - greedy_ms,
                "greedy_auto_over_argsort": auto_ms / argsort_ms,
            }
        )
    return records


def _fmt(x: float, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def report_targets(
    peers: list[dict], moves: list[dict], scale: list[dict], wrapper: dict
) -> dict[str, float]:
    """The issue-16 targets: printed met/not met, returned for the JSON summary."""
    summary: dict[str, float] = {"wrapper_overhead_us": wrapper["overhead_us"]}
    bound = TARGET_MAX["wrapper_overhead_us"]
    ok = "met" if wrapper["overhead_us"] <= bound else "NOT met"
    print(f"  target balance() <= {bound:g} us over the core at 8 x 4: {ok}"
          f" ({wrapper['overhead_us']:.1f} us: core {wrapper['core_us']:.1f} us,"
          f" balance() {wrapper['wrapper_us']:.1f} us)")  # fmt: skip
    for ref in ("lpt", "kk", "multifit"):
        summary[f"greedy_worse_than_{ref}"] = float(
            sum(r["greedy_max_load"] > r[f"{ref}_max_load"] for r in peers)
        )
    summary["peer_instances"] = float(len(peers))
    worse = sum(summary[f"greedy_worse_than_{r}"] for r in ("lpt", "kk", "multifit"))
    print(f"  target greedy never worse than LPT/KK/MULTIFIT: {'met' if worse == 0 else 'NOT met'}"
          f" (worse on {worse:.0f} of {3 * len(peers)} comparisons)")  # fmt: skip
    for policy, key, what in (
        ("movement", "greedy_stay", "greedy_stay <= {:g}x exact minimum moved"),
        ("movement_node", "greedy_stay_node", "node-aware greedy_stay <= {:g}x exact minimum"
         " (moved, inter-node counted twice)"),
    ):  # fmt: skip
        cases = [r for r in moves if r["policy"] == policy]
        if not cases:
            continue
        ratios = [r["moved_over_exact"] for r in cases]
        top = max(ratios)
        summary[f"{key}_over_exact_max"] = top
        summary[f"{key}_over_exact_median"] = float(np.median(ratios))
        summary[f"{key}_within_1_2"] = float(sum(x <= 1.2 for x in ratios))
        exact = sum(x <= 1.0 + 1e-9 for x in ratios)
        summary[f"{key}_small_plan_ms_max"] = max(r["plan_ms"] for r in cases)
        bound = TARGET_MAX[f"{key}_over_exact_max"]
        ok = "met" if top <= bound else "NOT met"
        bounded = sum(not r["exact"] for r in cases)
        print(f"  target {what.format(bound)}: {ok}"
              f" (max {top:.3f}, median {np.median(ratios):.3f}, within 1.2x on"
              f" {sum(x <= 1.2 for x in ratios)} of {len(cases)} instances, the minimum on"
              f" {exact}, plan at most {max(r['plan_ms'] for r in cases):.1f} ms,"
              f" {bounded} against HiGHS's bound at its time limit)")  # fmt: skip
    if scale:
        g = max(r["greedy_over_argsort"] for r in scale)
        p = max(r["placement_ms"] for r in scale)
        summary["scale_greedy_over_argsort_max"] = g
        summary["scale_greedy_auto_over_argsort_max"] = max(
            r["greedy_auto_over_argsort"] for r in scale
        )
        summary["scale_placement_ms_max"] = p
        g_max, p_max = (
            TARGET_MAX["scale_greedy_over_argsort_max"],
            TARGET_MAX["scale_placement_ms_max"],
        )
        print(f"  target greedy <= {g_max:g}x argsort at 16,384 x 60:"
              f" {'met' if g <= g_max else 'NOT met'} (max {g:.2f}x)")  # fmt: skip
        print(f"  target placement=auto <= {p_max:g} ms at 16,384 ranks:"
              f" {'met' if p <= p_max else 'NOT met'}"
              f" (max {p:.0f} ms, {summary['scale_greedy_auto_over_argsort_max']:.1f}x argsort"
              " with greedy)")  # fmt: skip
    return summary


def report(records: list[dict], audio: list[dict], *, quick: bool = False) -> dict[str, float]:
    print(
        f"{'policy':17s} {'dist':12s} {'ranks':>5s} {'per':>4s} {'before':>7s} {'after':>7s}"
        f" {'gap_lb':>7s} {'plan_ms':>9s} {'x_argsort':>9s} {'x_python':>8s}"
    )
    for r in records:
        print(
            f"{r['policy']:17s} {r['dist']:12s} {r['ranks']:5d} {r['per_rank']:4d}"
            f" {r['imbalance_before']:7.3f} {r['imbalance_after']:7.3f} {r['gap_to_lb']:7.4f}"
            f" {r['plan_ms']:9.2f} {r['plan_ms'] / r['argsort_ms']:9.2f}"
            f" {_fmt(r['speedup_vs_python'], '8.0f'):>8s}"
        )
    summary: dict[str, float] = {}
    big = max(r["ranks"] * r["per_rank"] for r in records)
    greedy_big = [
        r for r in records if r["policy"] == "greedy" and r["ranks"] * r["per_rank"] == big
    ]
    summary["greedy_largest_items"] = float(big)
    summary["greedy_over_argsort_max"] = max(r["plan_ms"] / r["argsort_ms"] for r in greedy_big)
    summary["greedy_over_argsort_median"] = float(
        np.median([r["plan_ms"] / r["argsort_ms"] for r in greedy_big])
    )
    alg1_big = [
        r for r in records if r["policy"] == "greedy_alg1" and r["ranks"] * r["per_rank"] == big
    ]
    if alg1_big:
        summary["greedy_alg1_over_argsort_max"] = max(
            r["plan_ms"] / r["argsort_ms"] for r in alg1_big
        )
    speedups = [r["speedup_vs_python"] for r in records if not math.isnan(r["speedup_vs_python"])]
    timed = [r for r in records if not math.isnan(r["speedup_vs_python"])]
    summary["speedup_min"] = min(speedups) if speedups else math.nan
    summary["speedup_median"] = float(np.median(speedups)) if speedups else math.nan
    largest = [r for r in timed if r["ranks"] * r["per_rank"] == big]
    summary["speedup_min_largest"] = min(
        (r["speedup_vs_python"] for r in largest), default=math.nan
    )
    packed = [r for r in records if r["policy"] in PACKED_TARGET and r["per_rank"] >= 16]
    summary["packed_gap_to_lb_max"] = max(r["gap_to_lb"] for r in packed)
    for p in ("greedy_alg1", "greedy_tolerance", "kk_equal", "greedy_stay"):
        gaps = [r["gap_to_lb"] for r in records if r["policy"] == p]
        if gaps:
            summary[f"{p}_gap_to_lb_max"] = max(gaps)
    kk = {(r["dist"], r["ranks"], r["per_rank"]): r for r in records if r["policy"] == "kk"}
    pairs = [
        (r, kk[(r["dist"], r["ranks"], r["per_rank"])])
        for r in records
        if r["policy"] == "greedy" and (r["dist"], r["ranks"], r["per_rank"]) in kk
    ]
    if pairs:
        summary["kk_better_cases"] = float(
            sum(k["gap_to_lb"] < g["gap_to_lb"] - 1e-12 for g, k in pairs)
        )
        summary["kk_worse_cases"] = float(
            sum(k["gap_to_lb"] > g["gap_to_lb"] + 1e-12 for g, k in pairs)
        )
        summary["kk_cases"] = float(len(pairs))
        summary["kk_mean_gap_to_lb"] = float(np.mean([k["gap_to_lb"] for _, k in pairs]))
        summary["greedy_mean_gap_to_lb"] = float(np.mean([g["gap_to_lb"] for g, _ in pairs]))
        summary["kk_max_gap_to_lb"] = float(max(k["gap_to_lb"] for _, k in pairs))
        summary["greedy_max_gap_to_lb"] = float(max(g["gap_to_lb"] for g, _ in pairs))
        for d in sorted({g["ranks"] for g, _ in pairs}):
            ratio = [k["plan_ms"] / g["plan_ms"] for g, k in pairs if g["ranks"] == d]
            summary[f"kk_time_over_greedy_ranks{d}"] = float(np.median(ratio))
    if audio:
        print("\naudio phase under the H100 audio-10b fit (mean over draws)")
        print(
            f"{'policy':14s} {'dist':12s} {'ranks':>5s} {'per':>4s} {'before':>7s} {'after':>7s}"
            f" {'slowest_ms':>10s}"
        )
        for r in audio:
            print(
                f"{r['policy']:14s} {r['dist']:12s} {r['ranks']:5d} {r['per_rank']:4d}"
                f" {r['imbalance_before']:7.3f} {r['imbalance_after']:7.3f}"
                f" {r['slowest_ms']:10.2f}"
            )
        bs = [r for r in audio if r["policy"] == "binary_search"]
        pc = [r for r in audio if r["policy"] == "padded_cost"]
        summary["audio_binary_search_excess_mean"] = float(
            np.mean([r["imbalance_after"] - 1 for r in bs])
        )
        summary["audio_padded_cost_excess_mean"] = float(
            np.mean([r["imbalance_after"] - 1 for r in pc])
        )
        summary["audio_slowest_ratio_mean"] = float(
            np.mean([p["slowest_ms"] / b["slowest_ms"] for b, p in zip(bs, pc, strict=True)])
        )
    print("\nsummary")
    for k, v in summary.items():
        print(f"  {k}: {v:.4g}")
    checks = {
        f"greedy <= {TARGET_MAX['greedy_over_argsort_max']:g}x argsort": (
            summary["greedy_over_argsort_max"] <= TARGET_MAX["greedy_over_argsort_max"],
            f"max {summary['greedy_over_argsort_max']:.2f}x, "
            f"median {summary['greedy_over_argsort_median']:.2f}x at {big} items",
        ),
        f"C++ >= {TARGET_MIN['speedup_min']:g}x Python reference": (
            summary["speedup_min"] >= TARGET_MIN["speedup_min"],
            f"min {summary['speedup_min']:.1f}x, median {summary['speedup_median']:.0f}x "
            f"over {len(speedups)} timed cases",
        ),
        "packed within 1% of lower bound": (
            summary["packed_gap_to_lb_max"] <= TARGET_MAX["packed_gap_to_lb_max"],
            f"max gap {summary['packed_gap_to_lb_max']:.4f} ({', '.join(PACKED_TARGET)}; "
            f"Alg. 1 alone {summary.get('greedy_alg1_gap_to_lb_max', math.nan):.4f})",
        ),
    }
    if quick:
        print("  (--quick sizes: the targets are set for the full run)")
    for name, (ok, figures) in checks.items():
        print(f"  target {name}: {'met' if ok else 'NOT met'} ({figures})")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, seconds")
    parser.add_argument("--json", type=Path, help="write one flat record per case")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    variants = tuple(VARIANTS)
    if args.quick:
        ranks, per_ranks = (8, 64), (16,)
        ref_cases = {(8, 16), (64, 16)}
        audio = audio_cases((64,), (16,), args.seed, draws=2)
    else:
        ranks, per_ranks = (8, 64, 512, 2560), (16, 60)
        # Python reference on every policy at 64 x 60; the fast policies also at 2560 x 60.
        ref_cases = {(64, 60)} | {
            ("text", 2560, 60, p)
            for p in ("greedy", "greedy_alg1", "greedy_cost", "binary_search", "kk_equal")
        }
        audio = audio_cases((8, 64, 512), (16, 60), args.seed, draws=5)
    records = run_cases(ranks, per_ranks, variants, ref_cases, args.seed)
    if args.quick:
        peers = peer_cases((8,), (4, 40), args.seed)
        moves = movement_cases((8,), (4,), args.seed)
        moves += movement_cases((8,), (4,), args.seed, ranks_per_node=4)
        scale = []
    else:
        peers = peer_cases((8, 16, 64), (4, 8, 16, 40), args.seed)
        moves = movement_cases((4, 8), (4, 6, 8), args.seed)
        moves += movement_cases((8,), (4, 6, 8), args.seed, ranks_per_node=4)
        scale = scale_cases(args.seed)
    summary = report(records, audio, quick=args.quick)
    wrapper = wrapper_overhead(args.seed)
    summary.update(report_targets(peers, moves, scale, wrapper))
    for kind, targets in (("max", TARGET_MAX), ("min", TARGET_MIN)):
        summary.update({f"target_{kind}_{k}": v for k, v in targets.items() if k in summary})
    if args.json:
        out = records + audio + peers + moves + scale + [wrapper, {"policy": "summary", **summary}]
        write_records(args.json, out)


if __name__ == "__main__":
    main()
