"""Writes docs/results.md from the benchmarks' committed ``--json`` files: no figure is typed.

    python benchmarks/results_doc.py            # rewrite docs/results.md from benchmarks/results/
    python benchmarks/results_doc.py --check    # exit 1 if docs/results.md is not what they give

Each benchmark's ``--json PATH`` output goes unedited into ``benchmarks/results/``, one file per
run, named as its section below says. Every figure in the document is read or computed from
those records. Each section names the command that wrote its file, the date and the machine
(the ``orchmllm.provenance`` fields every record carries), and judges a target met or NOT met
from the figure and the bound the benchmark recorded beside it (``target_max_*`` /
``target_min_*``). A section whose file is absent says so and which command writes it.
``tests/test_results_doc.py`` fails when the committed document is not what the committed
files give. Standard library only, so it runs anywhere in a second.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
Records = list[dict[str, Any]]


# -- formatting ------------------------------------------------------------------------------


def fmt(x: float | None, spec: str = ".3g") -> str:
    return "–" if x is None else format(x, spec)


def spread(s: dict[str, float] | None, spec: str = ".3g") -> str:
    """A mean over seeds with its min-max (``reproduce_paper``'s spread dicts); None is OOM."""
    if s is None:
        return "OOM"
    return f"{s['mean']:{spec}} ({s['min']:{spec}}-{s['max']:{spec}})"


def span(values: Iterable[float], spec: str = ".3g") -> str:
    """``lo-hi`` of the values, or the one value when they are all equal."""
    v = sorted(values)
    lo, hi = format(v[0], spec), format(v[-1], spec)
    return lo if lo == hi else f"{lo}-{hi}"


def verdict(value: float, *, at_most: float | None = None, at_least: float | None = None) -> str:
    """``met`` or ``**NOT met**``: the figure against the benchmark's recorded bound."""
    ok = (at_most is None or value <= at_most) and (at_least is None or value >= at_least)
    return "met" if ok else "**NOT met**"


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return [*lines, ""]


def where(records: Records, **match: Any) -> Records:
    return [r for r in records if all(r.get(k) == v for k, v in match.items())]


def one(records: Records, **match: Any) -> dict[str, Any]:
    found = where(records, **match)
    if len(found) != 1:
        raise ValueError(f"expected one record with {match}, found {len(found)}")
    return found[0]


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def provenance(records: Records) -> str:
    """Where one file's figures come from: its command, date and machine."""
    r = records[0]
    if "transcribed_from" in r:
        return f"Not written by the command: transcribed from {r['transcribed_from']}."
    if "run_command" not in r:
        return "Its records carry no run details (written before the benchmark recorded them)."
    load = " / ".join(f"{x:g}" for x in r["host_load_avg"])
    gpu = f"GPU {r['host_gpu']}" if r.get("host_gpu") else "no GPU"
    simd = f", widest SIMD `{r['host_simd']}`" if r.get("host_simd") else ""
    if r.get("numpy_disabled_features"):
        simd += f" (numpy's `{r['numpy_disabled_features']}` kernels turned off)"
    date = r["run_date"].replace("T", " ").removesuffix("Z")
    text = (
        f"From `{r['run_command']}`, run {date} UTC on "
        f"{r['host_cpu']}{simd}, {r['host_cores']} usable cores, {gpu}; load average "
        f"{load} (1 / 5 / 15 min) at its end; Python {r['python_version']}, numpy "
        f"{r['numpy_version']}, torch {r['torch_version']}."
    )
    return text + (f" The machine: {r['host_note']}." if r.get("host_note") else "")


# -- sections --------------------------------------------------------------------------------


def train_modes(recs: Records) -> list[str]:
    r0 = recs[0]
    phases = r0["phase_names"]
    lines = [
        f"`orchmllm.train` on `{r0['config']}`: {r0['steps']} steps on {r0['world_size']} "
        f"processes, placement `{r0['placement']}`. Imbalance is the slowest rank's load over "
        "the mean under each phase's cost model, averaged over steps; kB (1000 bytes) per step "
        "is the all-to-all volume across nodes; the step time is the mean after the first step.",
        "",
    ]
    rows = [
        [f"`{r['mode']}`"]
        + [
            f"{r[f'{p}_imbalance_before_mean']:.3f} → {r[f'{p}_imbalance_after_mean']:.3f}"
            for p in phases
        ]
        + [" / ".join(f"{r[f'{p}_bytes_inter_total'] / r['steps'] / 1e3:.1f}" for p in phases)]
        + [f"{r['loss_last']:.4f}", f"{r['step_time_mean_s'] * 1e3:.1f}"]
        for r in recs
    ]
    header = ["`--balance`", *(f"{p} before → after" for p in phases)]
    header += [f"kB/step across nodes ({' / '.join(phases)})", "final loss", "step ms"]
    losses = [r["loss_last"] for r in recs]
    return (
        lines
        + table(header, rows)
        + [
            f"The final losses of the {len(recs)} modes differ by at most "
            f"{max(losses) - min(losses):.1e}.",
            "",
        ]
    )


def _gap_max(cases: Records, policy: str) -> float:
    return max(r["gap_to_lb"] for r in cases if r["policy"] == policy and r["per_rank"] >= 16)


def balance_bench(recs: Records) -> list[str]:
    s = one(recs, policy="summary")
    wrapper = one(recs, policy="wrapper")
    cases = [r for r in recs if r.get("cost") in ("default", "h100_1280")]
    audio = where(recs, cost="h100_audio_10b")
    peers = where(recs, policy="peers")
    scale = where(recs, policy="scale")
    big = max(cases, key=lambda r: (r["ranks"] * r["per_rank"], r["ranks"]))
    d, per = big["ranks"], big["per_rank"]
    lines = [
        "Planning time is the CPU time of `orchmllm.balance()` as a user calls it, compared "
        "with numpy's faster argsort (quicksort or stable) of the same lengths and with the "
        "plain-Python reference of the same policy, in the same run. Peers are Python "
        "references of LPT, Karmarkar-Karp and MULTIFIT on the same instances; the exact "
        "movement minimum is a scipy HiGHS MILP.",
        "",
    ]
    rows = [
        [
            f"`greedy` on {d:,} ranks × {per} items ({d * per:,}) ≤ "
            f"{s['target_max_greedy_over_argsort_max']:g}× numpy argsort",
            f"max {s['greedy_over_argsort_max']:.2f}×, median "
            f"{s['greedy_over_argsort_median']:.2f}×",
            verdict(s["greedy_over_argsort_max"], at_most=s["target_max_greedy_over_argsort_max"]),
        ]
    ]
    if scale:
        text = one(scale, dist="text")
        rows.append(
            [
                f"`greedy` on {text['ranks']:,} ranks × {text['per_rank']} items "
                f"({text['ranks'] * text['per_rank']:,}) ≤ "
                f"{s['target_max_scale_greedy_over_argsort_max']:g}× numpy argsort",
                f"max {s['scale_greedy_over_argsort_max']:.2f}× (text: {text['greedy_ms']:.1f} "
                f"ms against {text['argsort_ms']:.1f} ms)",
                verdict(
                    s["scale_greedy_over_argsort_max"],
                    at_most=s["target_max_scale_greedy_over_argsort_max"],
                ),
            ]
        )
    timed = [r for r in cases if r.get("speedup_vs_python") is not None]
    rows.append(
        [
            f"C++ core ≥ {s['target_min_speedup_min']:g}× the Python reference",
            f"min {s['speedup_min']:.1f}×, median {s['speedup_median']:.0f}× over {len(timed)} "
            "cases",
            verdict(s["speedup_min"], at_least=s["target_min_speedup_min"]),
        ]
    )
    packed = sorted({r["policy"] for r in cases if r["policy"] in ("greedy", "greedy_cost", "kk")})
    rows.append(
        [
            f"packed policies within {s['target_max_packed_gap_to_lb_max'] - 1:.0%} of the lower "
            "bound, ≥ 16 items/rank",
            f"max gap {s['packed_gap_to_lb_max']:.4f} ("
            + ", ".join(f"`{p}` {_gap_max(cases, p):.4f}" for p in packed)
            + f"); Alg. 1 alone (`refine=False`) {s['greedy_alg1_gap_to_lb_max']:.4f}",
            verdict(s["packed_gap_to_lb_max"], at_most=s["target_max_packed_gap_to_lb_max"]),
        ]
    )
    worse = sum(s[f"greedy_worse_than_{p}"] for p in ("lpt", "kk", "multifit"))
    rows.append(
        [
            f"`greedy` never worse than LPT, KK or MULTIFIT ({len(peers)} instances, "
            f"{span((r['per_rank'] for r in peers), 'd')} items/rank)",
            f"worse on {worse:.0f} of {3 * len(peers)} comparisons",
            verdict(worse, at_most=0),
        ]
    )
    rows.append(
        [
            f"`balance()` at most {s['target_max_wrapper_overhead_us']:g} us over the C++ core "
            f"at {wrapper['ranks']} × {wrapper['per_rank']}",
            f"{wrapper['overhead_us']:.1f} us (core {wrapper['core_us']:.1f} us, `balance()` "
            f"{wrapper['wrapper_us']:.1f} us)",
            verdict(wrapper["overhead_us"], at_most=s["target_max_wrapper_overhead_us"]),
        ]
    )
    for policy, key, what in (
        ("movement", "greedy_stay", "`greedy_stay` moves"),
        ("movement_node", "greedy_stay_node", "node-aware `greedy_stay` moves (tokens leaving "
         "their node count twice)"),
    ):  # fmt: skip
        moves = where(recs, policy=policy)
        if not moves:
            continue
        bound = s[f"target_max_{key}_over_exact_max"]
        ratios = [r["moved_over_exact"] for r in moves]
        rpn = moves[0]["ranks_per_node"]
        nodes = f", {rpn} per node" if rpn else ""
        inexact = sum(not r["exact"] for r in moves)
        rows.append(
            [
                f"{what} ≤ {bound:g}× the exact minimum "
                f"({span((r['ranks'] for r in moves), 'd')} ranks{nodes} × "
                f"{span((r['per_rank'] for r in moves), 'd')} items)",
                f"max {max(ratios):.3f}, median {median(ratios):.3f}; within {bound:g}× on "
                f"{sum(x <= bound for x in ratios)} of {len(moves)}, the minimum on "
                f"{sum(x <= 1 + 1e-9 for x in ratios)}; plan ≤ "
                f"{max(r['plan_ms'] for r in moves):.1f} ms"
                + (f"; {inexact} against HiGHS's bound at its time limit" if inexact else ""),
                verdict(max(ratios), at_most=bound),
            ]
        )
    if scale:
        rows.append(
            [
                f'`placement="auto"` with `greedy` at {scale[0]["ranks"]:,} ranks ≤ '
                f"{s['target_max_scale_placement_ms_max']:g} ms",
                f"max {s['scale_placement_ms_max']:.0f} ms",
                verdict(
                    s["scale_placement_ms_max"], at_most=s["target_max_scale_placement_ms_max"]
                ),
            ]
        )
    steps = where(recs, policy="step_plan")
    if steps:
        first = steps[0]
        rows.append(
            [
                f"`plan_step` at {first['ranks']:,} ranks × {first['per_rank']} examples "
                f"({first['model']}, every phase) ≤ {s['target_max_scale_plan_step_ms_max']:g} ms",
                "; ".join(
                    f"placement `{r['placement']}`: max {r['plan_ms_max']:.0f} ms, median "
                    f"{r['plan_ms_median']:.0f} ms"
                    for r in steps
                ),
                verdict(
                    s["scale_plan_step_ms_max"], at_most=s["target_max_scale_plan_step_ms_max"]
                ),
            ]
        )
    lines += table(["target", "measured", ""], rows)
    if scale:
        lines += [
            f"The yardstick depends on the CPU: numpy's argsort of {text['ranks'] * per:,} "
            f"`text` lengths took {text['argsort_ms']:.1f} ms in this run.",
            "",
        ]
    # Every policy at the largest size (the portfolio and its peers).
    dists = list(dict.fromkeys(r["dist"] for r in cases))
    shown = ("greedy", "greedy_cost", "kk", "greedy_stay")
    lines += [
        f"At {d:,} ranks × {per} items (imbalance max/mean before → after, plan ms). "
        "`greedy_cost` balances the `alpha*l + beta*l^2` cost of an H100 block, so its "
        '"before" is under that cost:',
        "",
    ]
    lines += table(
        ["lengths", *(f"`{p}`" for p in shown)],
        (
            [dist]
            + [
                f"{r['imbalance_before']:.3f} → {r['imbalance_after']:.3f}, {r['plan_ms']:.1f} ms"
                for r in (one(cases, dist=dist, ranks=d, per_rank=per, policy=p) for p in shown)
            ]
            for dist in dists
        ),
    )
    policies = list(dict.fromkeys(r["policy"] for r in cases))
    largest = where(cases, ranks=d, per_rank=per)
    lines += [
        "Every policy over every case with 16 or more items per rank: the largest gap to the "
        f"lower bound, and the median plan time at {d:,} × {per}:",
        "",
    ]
    lines += table(
        ["policy", "max gap to lower bound", f"median plan ms at {d:,} × {per}"],
        (
            [
                f"`{p}`",
                f"{_gap_max(cases, p):.4f}",
                f"{median(r['plan_ms'] for r in where(largest, policy=p)):.1f}",
            ]
            for p in policies
        ),
    )
    if "kk_cases" in s:
        sizes = sorted(int(k.rsplit("ranks", 1)[1]) for k in s if k.startswith("kk_time_over"))
        times = ", ".join(f"{s[f'kk_time_over_greedy_ranks{n}']:.2g}× at {n:,}" for n in sizes)
        lines += [
            f"`kk` alone (Karmarkar-Karp, the algorithm verl uses) ends closer to the lower bound "
            f"than `greedy` in {s['kk_better_cases']:.0f} of {s['kk_cases']:.0f} cases and "
            f"further in {s['kk_worse_cases']:.0f}; its plan time over `greedy`'s (median over "
            f"cases) is {times} ranks.",
            "",
        ]
    if audio:
        lines += [
            "The audio phase under the H100 audio-10b block cost (padded batches, mean over "
            "draws): the paper's `binary_search` (Alg. 2) against `padded_cost`.",
            "",
        ]
        keys = list(dict.fromkeys((r["dist"], r["ranks"], r["per_rank"]) for r in audio))
        rows = []
        for dist, ranks, per_rank in keys:
            bs = one(audio, dist=dist, ranks=ranks, per_rank=per_rank, policy="binary_search")
            pc = one(audio, dist=dist, ranks=ranks, per_rank=per_rank, policy="padded_cost")
            rows.append(
                [dist, ranks, per_rank, f"{bs['imbalance_before']:.3f}",
                 f"{bs['imbalance_after']:.3f}", f"{pc['imbalance_after']:.3f}",
                 f"{pc['slowest_ms'] / bs['slowest_ms']:.3f}"]
            )  # fmt: skip
        lines += table(
            ["lengths", "ranks", "items/rank", "before", "`binary_search` after",
             "`padded_cost` after", "slowest batch, `padded_cost` / `binary_search`"],
            rows,
        )  # fmt: skip
        lines += [
            f"Mean over these cases: the slowest batch ends "
            f"{s['audio_padded_cost_excess_mean']:.1%} above the mean under `padded_cost` and "
            f"{s['audio_binary_search_excess_mean']:.1%} under `binary_search`; `padded_cost`'s "
            f"slowest batch takes {s['audio_slowest_ratio_mean']:.3f}× `binary_search`'s.",
            "",
        ]
    return lines


def _stay(r: dict[str, Any]) -> bool:
    return r["policy"].startswith("greedy_stay")


def placement_bench(recs: Records) -> list[str]:
    cases = [r for r in recs if "method" in r and r["policy"] != "step_plan"]
    steps = where(recs, policy="step_plan")
    r0 = cases[0]
    ranks = sorted({r["num_ranks"] for r in cases})
    per = sorted({r["examples_per_rank"] for r in cases})
    phase_policy = {r["phase"]: r["policy"] for r in cases if not _stay(r)}
    lo, hi = r0["paper_reduction_range"]
    lines = [
        f"{ranks[0]:,} to {ranks[-1]:,} ranks, {r0['ranks_per_node']} per node, "
        f"{' and '.join(map(str, per))} examples per rank, "
        f"{len({r['seed'] for r in cases})} seeds; each phase balanced by the paper's policy "
        "for it ("
        + ", ".join(f"{ph} `{pol}`" for ph, pol in phase_policy.items())
        + "), then placed. Reduction: the drop in the busiest rank's inter-node volume against "
        "leaving the balanced batches where they stand (the paper's objective, Alg. 3), a mean "
        "over seeds per size and phase; the range is over sizes and phases.",
        "",
    ]

    def reductions(rows: Records) -> list[float]:
        groups: dict[tuple, list[float]] = {}
        for r in rows:
            key = (r["examples_per_rank"], r["num_ranks"], r["phase"])
            groups.setdefault(key, []).append(r["reduction_max_rank"])
        return [statistics.fmean(v) for v in groups.values()]

    def ms_at(rows: Records, d: int) -> str:
        times = [r["solve_ms"] for r in rows if r["num_ranks"] == d]
        return f"{max(times):.1f}" if times else "–"

    variants = [
        ("paper's policy + `assign`", [r for r in cases if not _stay(r)], "assign"),
        ("paper's policy + `auto`", [r for r in cases if not _stay(r)], "auto"),
        ("paper's policy + `ilp` (Alg. 3, CBC)", [r for r in cases if not _stay(r)], "ilp"),
        ("`greedy_stay` + `auto`", where(cases, policy="greedy_stay"), "auto"),
        ("`greedy_stay` with `ranks_per_node` + `auto`", where(cases, policy="greedy_stay_node"),
         "auto"),
    ]  # fmt: skip
    big = ranks[-2:]
    rows = []
    for name, pool, method in variants:
        chosen = where(pool, method=method)
        if not chosen:
            continue
        if method == "ilp":
            name += f", ≤ {max(r['num_ranks'] for r in chosen):,} ranks, {chosen[0]['time_limit_s']:g} s limit"  # noqa: E501
        rows.append([name, span(reductions(chosen), ".2f")] + [ms_at(chosen, d) for d in big])
    rows.append(["paper's reported range", f"{lo}-{hi}"] + [""] * len(big))
    lines += table(
        ["batches + placement", "reduction", *(f"max ms at {d:,} ranks" for d in big)], rows
    )

    paper = [r for r in cases if not _stay(r)]
    auto_ms = max(r["solve_ms"] for r in where(paper, method="auto", num_ranks=ranks[-1]))
    rows = [
        [
            f"`auto` at {ranks[-1]:,} ranks ≤ {r0['target_max_auto_ms']:g} ms",
            f"max {auto_ms:.1f} ms",
            verdict(auto_ms, at_most=r0["target_max_auto_ms"]),
        ]
    ]
    for st in steps:
        rows.append(
            [
                f"whole step plan (every phase, `auto`) at {st['num_ranks']:,} ranks × "
                f"{st['examples_per_rank']} examples ≤ {r0['target_max_step_plan_ms']:g} ms",
                f"{st['plan_ms']:.0f} ms",
                verdict(st["plan_ms"], at_most=r0["target_max_step_plan_ms"]),
            ]
        )
    for policy in ("greedy_stay", "greedy_stay_node"):
        stay = where(cases, policy=policy)
        if not stay:
            continue
        limit = r0["target_max_makespan_over_greedy"]
        span_ = [r["makespan_over_greedy"] for r in stay]
        moved = max(r["tokens_moved"] / r["greedy_tokens_moved"] for r in stay)
        within = sum(x <= limit + 1e-9 for x in span_)
        rows.append(
            [
                f"`{policy}`: busiest rank ≤ {limit:g}× `greedy`'s",
                f"in {within} of {len(stay)} cases (max {max(span_):.4f}); tokens moved at most "
                f"{moved:.3f}× `greedy`'s",
                verdict(within, at_least=len(stay)),
            ]
        )
        bound = r0["target_max_moved_over_bound"]
        for b in per:
            ratio = [r["moved_over_bound"] for r in stay if r["examples_per_rank"] == b]
            ok = sum(x <= bound for x in ratio)
            rows.append(
                [
                    f"`{policy}`, {b} examples/rank: tokens moved ≤ {bound:g}× the lower bound",
                    f"in {ok} of {len(ratio)} (max {max(ratio):.3f}, median {median(ratio):.3f})",
                    verdict(ok, at_least=len(ratio)),
                ]
            )
    for phase in phase_policy:
        auto = [r["reduction_max_rank"] for r in where(paper, phase=phase, method="auto")]
        rows.append(
            [
                f"{phase}: paper's policy + `auto` reaches the paper's range (mean ≥ {lo})",
                f"mean {statistics.fmean(auto):.3f}, min {min(auto):.3f}",
                verdict(statistics.fmean(auto), at_least=lo),
            ]
        )
    lines += table(["target", "measured", ""], rows)

    rows = []
    for d in ranks:
        shares = [
            r["on_node_over_bound"]
            for r in where(paper, method="auto", num_ranks=d)
            if r["assignment_kept"]
        ]
        if shares:
            rows.append([f"{d:,}", f"{min(shares):.4f}", len(shares)])
    lines += [
        "What `auto`'s node assignment keeps on its node, over an LP-duality bound on what any "
        "permutation keeps (`on_node_tokens_bound`), where its assignment was kept:",
        "",
        *table(["ranks", "least share of the bound", "plans"], rows),
    ]
    return lines


def dispatch_bench(recs: Records) -> list[str]:
    measured = where(recs, kind="measured")
    simulated = where(recs, kind="simulated")
    m0 = measured[0]
    mb = 2**20
    lines = [
        f"{max(r['world_size'] for r in measured)} {m0['backend']} processes, hidden "
        f"{m0['hidden']} fp32, {m0['batch']} sequences per rank (median length "
        f"{m0['mean_len']}), `greedy` plans; extra memory: {m0['memory_source']}. MiB = 2^20 "
        "bytes, per rank.",
        "",
    ]
    lines += table(
        ["d", "MiB received, all-to-all", "MiB received, all-gather",
         "extra memory, all-to-all / all-gather (MiB)", "time ratio all-gather / all-to-all"],
        (
            [r["world_size"], f"{r['a2a_recv_max_rank'] / mb:.2f}",
             f"{r['allgather_recv_rank'] / mb:.2f}",
             f"{r['a2a_extra_bytes_max_rank'] / mb:.1f} / "
             f"{r['allgather_extra_bytes_max_rank'] / mb:.1f}",
             f"{r['time_ratio']:.2f}"]
            for r in measured
        ),
    )  # fmt: skip
    first, last = simulated[0], simulated[-1]
    a2a = [r["a2a_over_max_batch"] for r in simulated]
    lines += [
        f"From the byte counts of the same planner's plans (no processes) from d = "
        f"{first['world_size']} to {last['world_size']:,}, the busiest rank's all-to-all traffic "
        f"stays between {min(a2a):.2f}× and {max(a2a):.2f}× the largest mini-batch, while "
        f"all-gather traffic is (d−1)× the largest batch: {last['allgather_recv_rank'] / 1e9:.1f}"
        f" GB against {max(last['a2a_sent_max_rank'], last['a2a_recv_max_rank']) / 1e6:.0f} MB "
        f"per rank at d = {last['world_size']:,} (the paper's claim, eqs. 3-4).",
        "",
    ]
    lines += table(
        ["d", "all-to-all / largest batch", "all-gather / largest batch", "all-gather / a2a"],
        (
            [f"{r['world_size']:,}", f"{r['a2a_over_max_batch']:.2f}",
             f"{r['allgather_over_max_batch']:.0f}", f"{r['bytes_ratio']:.1f}"]
            for r in simulated
        ),
    )  # fmt: skip
    return lines


def loader_bench(recs: Records) -> list[str]:
    r0 = recs[0]
    prefetch = max(r["prefetch"] for r in recs)
    lines = [
        f"{r0['world_size']} ranks, {r0['items_per_rank']} items per rank, policy "
        f"`{r0['policy']}`, a simulated training step (`{r0['work']}`) of the given length; "
        '"hidden" is the share of the loader\'s planning and preparation that the training '
        'loop did not wait for, "wait" what it still waited per step.',
        "",
    ]
    rows = []
    for r in where(recs, prefetch=prefetch):
        sync = one(recs, mode=r["mode"], step_s=r["step_s"], prefetch=0)
        rows.append(
            [r["mode"], f"{r['step_s'] * 1e3:.0f} ms", f"{r['plan_s'] * 1e3:.1f} ms",
             f"{r['hidden_fraction']:.2f}", f"{r['wait_s'] * 1e3:.1f} ms",
             f"{sync['hidden_fraction']:.2f}", f"{r['bytes_sent']:,.0f}"]
        )  # fmt: skip
    lines += table(
        ["mode", "step", "plan", f"hidden (prefetch {prefetch})", f"wait (prefetch {prefetch})",
         "hidden (prefetch 0)", "bytes per rank per step"],
        rows,
    )  # fmt: skip
    saved = one(recs, mode="index", step_s=r0["step_s"], prefetch=r0["prefetch"])
    lines += [
        f"Index mode sends {saved['bytes_saved_vs_move']:.1%} fewer bytes than moving the "
        "examples.",
        "",
    ]
    return lines


def reproduce_paper(recs: Records) -> list[str]:
    fig8 = where(recs, figure="fig8")
    seeds = fig8[0]["seeds"] if fig8 else None
    lines = [
        "The simulator (`orchmllm/sim/`) plans every step with training's own step planner and "
        "turns the plan into a step time, an MFU and a peak memory; its inputs are the H100 "
        "block timings, the model shapes, published hardware figures and the paper's cluster "
        "settings (`orchmllm/sim/` and the notes `reproduce_paper.py` prints say which and "
        f"what it leaves out). Speed-ups are means with their min-max over {seeds} seeds.",
        "",
        "Per-shape fits of the H100 block timings the compute model uses:",
        "",
    ]
    lines += table(
        ["shape", "linear TF/s", "attention TF/s", "worst point off by"],
        (
            [r["shape"], f"{r['linear_tflops']:.1f}", f"{r['attention_tflops']:.1f}",
             f"{r['max_rel_err']:.3f}"]
            for r in where(recs, figure="calibration")
        ),
    )  # fmt: skip
    lines += [
        "**Figure 8, decomposed.** Both mini-batches (per rank) are the largest the memory "
        "model lets run under each config's training recipe (the ones `python -m "
        "orchmllm.sim.plan_memory` prints), without balancing (`b none`) and with OrchMLLM "
        "(`b full`). `balance ×` "
        "is the speed-up of balancing at `b none`, `mini-batch ×` the speed-up of going from "
        "`b none` to `b full`, `product ×` the MFU ratio full/none.",
        "",
    ]
    lines += table(
        ["model", "GPUs", "b none", "b full", "paper b", "balance ×", "mini-batch ×",
         "product ×", "paper ×", "MFU none", "MFU full"],
        (
            [r["model"], f"{r['ranks']:,}", spread(r["b_none"]), spread(r["b_full"]),
             f"{r['paper_b_none']}→{r['paper_b_full']}", spread(r["balance"]),
             spread(r["minibatch"]), spread(r["product"]), fmt(r["paper_mfu_ratio"]),
             spread(r["mfu_none"]), spread(r["mfu_full"])]
            for r in fig8
        ),
    )  # fmt: skip
    for r in fig8:
        if r.get("paper_mfu_full") and r["mfu_full"]:
            lines += [
                f"{r['model']} at {r['ranks']:,} GPUs, full at its own mini-batch: MFU "
                f"{spread(r['mfu_full'])} against the paper's {r['paper_mfu_full']} (sim/paper "
                f"{r['mfu_full']['mean'] / r['paper_mfu_full']:.2f}).",
                "",
            ]
    ok = [r for r in fig8 if r["balance"] and r["minibatch"]]
    if ok:
        above = sum(r["b_none"]["mean"] > r["paper_b_none"] for r in fig8)
        models = list(dict.fromkeys(r["model"] for r in ok))
        growing = [
            m for m in models
            if all(a["balance"]["mean"] < b["balance"]["mean"]
                   for a, b in itertools.pairwise(where(ok, model=m)))
        ]  # fmt: skip
        lines += [
            f"`mini-batch ×` is {span((r['minibatch']['mean'] for r in ok), '.3f')} and "
            f"`balance ×` {span((r['balance']['mean'] for r in ok), '.3f')} (means). `b none` "
            f"is above the paper's in {above} of {len(fig8)} rows. `balance ×` grows with the "
            f"number of GPUs for {len(growing)} of {len(models)} models"
            + (f" ({', '.join(growing)})" if growing else "")
            + ".",
            "",
        ]
    lines += _fig8_at_paper(fig8) + _fig9(where(recs, figure="fig9"))
    lines += _sensitivity(where(recs, figure="sensitivity"), where(recs, figure="table2_scale"))
    fixed = where(recs, figure="speedup_summary")
    if fixed:
        f0 = fixed[0]
        lines += [
            f"**Speed-up over `none` at a fixed mini-batch**, {f0['model']}, {f0['ranks']} GPUs "
            "(`llm`: the paper's pre-balancing ablation; `disttrain`: DistTrain-style):",
            "",
        ]
        lines += table(
            ["examples per rank", "`llm`", "`disttrain`", "`full`"],
            (
                [r["examples_per_rank"]]
                + [spread(r[f"speedup_{m}"]) for m in ("llm", "disttrain", "full")]
                for r in fixed
            ),
        )
    fig10 = where(recs, figure="fig10_summary")
    if fig10:
        modes = list(dict.fromkeys(r["mode"] for r in fig10))
        models = list(dict.fromkeys(r["model"] for r in fig10))
        lines += [
            f"**Figure 10** ({fig10[0]['ranks']} GPUs, the paper's ablation mini-batch): MFU and "
            "the worst peak memory (GB) per mode; OOM if any seed runs out.",
            "",
        ]
        rows = []
        for m in models:
            row: list[Any] = [m, one(fig10, model=m, mode=modes[0])["examples_per_rank"]]
            for mode in modes:
                r = one(fig10, model=m, mode=mode)
                row += [spread(r["mfu"]), f"{r['peak_memory_gb_max']:.1f}"]
            rows.append(row)
        lines += table(
            ["model", "b", *(c for mode in modes for c in (f"`{mode}` MFU", "GB"))], rows
        )
        llm_max = where(recs, figure="fig10_llm_max")
        if llm_max:
            r0 = llm_max[0]
            at = one(fig10, model=r0["model"], mode="llm")
            b = [r["examples_per_rank"] for r in llm_max]
            mfu = [r["mfu"] for r in llm_max]
            lines += [
                f"{r0['model']}, `llm` only, {r0['ranks']} GPUs: the paper ran out of memory at "
                f"{r0['paper_oom_at']} and ran at {r0['paper_max_minibatch']} with MFU "
                f"{r0['paper_mfu']} and {r0['paper_memory_gb']} GB. The simulator "
                + ("runs out" if at["oom"] else "fits")
                + f" at {at['examples_per_rank']}; its largest fitting mini-batch is "
                f"{statistics.fmean(b):.3g} ({min(b)}-{max(b)}), with MFU "
                f"{statistics.fmean(mfu):.3g} ({min(mfu):.3g}-{max(mfu):.3g}), sim/paper "
                f"{statistics.fmean(mfu) / r0['paper_mfu']:.2f}.",
                "",
            ]
    fig11 = where(recs, figure="fig11_summary")
    if fig11:
        lines += [
            f"**Figure 11** ({fig11[0]['ranks']} GPUs): step-time speed-up of the tailored "
            "algorithms over one algorithm for both encoders (`all_rmpad`: audio gets the "
            "packed algorithm; `all_pad`: vision gets the padded one).",
            "",
        ]
        lines += table(
            ["model", "over `all_rmpad`", "over `all_pad`"],
            (
                [r["model"], spread(r["speedup_tailored_over_all_rmpad"]),
                 spread(r["speedup_tailored_over_all_pad"])]
                for r in fig11
            ),
        )  # fmt: skip
    lines += _fig12(where(recs, figure="fig12_summary"), where(recs, figure="fig12_max"))
    fig13 = where(recs, figure="fig13_summary")
    if fig13:
        lo, hi = fig13[0]["paper_reduction_range"]
        lines += [
            "**Figure 13**: reduction of the mean inter-node bytes per rank per dispatcher and "
            "of the busiest rank's (1 − on/off; off: the paper's greedy batches without "
            "placement; on: the row's batches with node-wise placement), and the MFU on/off. "
            f"The paper reports {lo}-{hi}.",
            "",
        ]
        lines += table(
            ["model", "GPUs", "batches", "vision", "audio", "LLM", "busiest rank", "MFU on/off"],
            (
                [r["model"], f"{r['ranks']:,}", f"`{r['batches']}`",
                 spread(r["reduction_vision"]), spread(r["reduction_audio"]),
                 spread(r["reduction_llm"]), spread(r["reduction_max_rank"]),
                 spread(r["speedup_placement"], ".4f")]
                for r in fig13
            ),
        )  # fmt: skip
    defaults = where(recs, figure="defaults")
    if defaults:
        lines += [
            "**Defaults**: per model and scale, the batches with the higher predicted MFU over "
            "the paper's greedy batches without placement (both with node-wise placement; "
            f"closer than {defaults[0]['tie']:g} relative is a tie, which keeps the paper's):",
            "",
        ]
        rows = []
        for r in defaults:
            mfu = {
                s["batches"]: s["speedup_placement"]["mean"]
                for s in where(fig13, model=r["model"], ranks=r["ranks"])
            }
            rows.append(
                [r["model"], f"{r['ranks']:,}", f"{mfu['greedy']:.4f}",
                 f"{mfu['greedy_stay']:.4f}", f"`{r['ship']}`"]
            )  # fmt: skip
        lines += table(
            ["model", "GPUs", "`greedy` + placement", "`greedy_stay` + placement", "chosen"], rows
        )
    table2 = where(recs, figure="table2")
    if table2:
        t0 = table2[0]
        lines += [
            f"**Table 2** ({t0['model']}, the paper's mini-batch {t0['examples_per_rank']}, full "
            f"+ node-wise placement, seed {t0['seed']}): forward dispatch overhead, forward time, "
            "and the planning time of the real planner on this machine's CPU.",
            "",
        ]
        lines += table(
            ["GPUs", "overhead ms", "paper", "sim/paper", "forward s", "paper", "sim/paper",
             "plan ms", "plan hidden"],
            (
                [f"{r['ranks']:,}", f"{r['dispatch_fwd_ms']:.3g}", fmt(r["paper_overhead_ms"]),
                 fmt(r["overhead_ratio_to_paper"], ".2f"), f"{r['forward_s']:.3g}",
                 fmt(r["paper_forward_s"]), fmt(r["forward_ratio_to_paper"], ".2f"),
                 f"{r['plan_ms']:.3g}", "yes" if r["plan_hidden"] else "**no**"]
                for r in table2
            ),
        )  # fmt: skip
    lines += shortfalls(recs)
    validation = where(recs, figure="gpu_validation")
    measured = [r for r in validation if "measured_step_s" in r]
    checked = [r for r in measured if is_sound_method(r)]
    if len(checked) < len(measured):
        lines += [
            f"{len(measured) - len(checked)} comparisons with measured steps are left out: "
            "they compare with gpu_step's replaced method, which timed start-up rather than "
            "work (the GPU section keeps those records as history).",
            "",
        ]
    if checked:
        lines += [
            "**Simulated against measured** (`gpu_step_*.json`: the same model shape and "
            "layers, ranks, examples and modes):",
            "",
        ]
        lines += table(
            ["record", "device", "ranks", "b", "mode", "sim step s", "measured s", "sim/meas",
             "sim ×", "measured ×"],
            (
                [r["source"], r["device"], r["ranks"], r["examples_per_rank"], r["mode"],
                 f"{r['sim_step_s']:.3g}", f"{r['measured_step_s']:.3g}",
                 f"{r['step_ratio']:.2f}", fmt(r["sim_speedup"]), fmt(r["measured_speedup"])]
                for r in checked
            ),
        )  # fmt: skip
        phases = [r for r in where(recs, figure="gpu_phase_validation") if is_sound_method(r)]
        lines += [
            "Per phase on identical work (`reproduce_paper.py --gpu-results`: the same examples "
            "in the same layout), measured / simulated mean rank time:",
            "",
            *table(
                ["record", "ranks", "b", "mode", "phase", "measured s", "sim s", "meas/sim"],
                ([r["source"], r["ranks"], r["examples_per_rank"], r["mode"], r["phase"],
                  f"{r['measured_mean_s']:.4f}", f"{r['sim_mean_s']:.4f}",
                  fmt(r["mean_ratio"], ".2f")] for r in phases),
            ),
        ]  # fmt: skip
    elif validation and not measured:
        lines += [
            "**Not checked against a measured step**: this run found no "
            "`benchmarks/results/gpu_step_*.json`, so every figure above is a prediction.",
            "",
        ]
    return lines


def _fig8_at_paper(fig8: Records) -> list[str]:
    """Figure 8 decomposed at the paper's own mini-batches (records from before issue 27
    have none)."""
    rows = [r for r in fig8 if "at_paper_product" in r]
    if not rows:
        return []
    lines = [
        f"**Figure 8 at the paper's mini-batches** (65/40/15 without balancing, 80/60/30 with), "
        f"on the same sampled steps ({rows[0]['steps']} per seed): the same decomposition. "
        "OOM: the simulator's memory model does not fit that mini-batch.",
        "",
    ]
    lines += table(
        ["model", "GPUs", "paper b", "balance ×", "mini-batch ×", "product ×", "paper ×",
         "MFU none", "MFU full"],
        (
            [r["model"], f"{r['ranks']:,}", f"{r['paper_b_none']}→{r['paper_b_full']}",
             spread(r["at_paper_balance"]), spread(r["at_paper_minibatch"]),
             spread(r["at_paper_product"]), fmt(r["paper_mfu_ratio"]),
             spread(r["at_paper_mfu_none"]), spread(r["at_paper_mfu_full"])]
            for r in rows
        ),
    )  # fmt: skip
    return lines


def _fig9(fig9: Records) -> list[str]:
    if not fig9:
        return []
    lo, hi = fig9[0]["paper_tpt_ratio_range"]
    lines = [
        "**Figure 9**: throughput, LLM tokens per second per GPU, without balancing and with "
        f"OrchMLLM at each side's largest fitting mini-batch and at the paper's; the paper "
        f"reports full/none {lo}-{hi}×. The paper's Megatron-LM baseline is not simulated "
        "(the simulator models FSDP data parallelism only; it has no measured "
        "tensor-parallel or pipeline timings to model Megatron-LM with).",
        "",
    ]
    lines += table(
        ["model", "GPUs", "none", "full", "full/none", "none, paper b", "full, paper b",
         "full/none, paper b"],
        (
            [r["model"], f"{r['ranks']:,}", spread(r["tpt_none"], ".0f"),
             spread(r["tpt_full"], ".0f"), spread(r["tpt_ratio"]),
             spread(r["at_paper_tpt_none"], ".0f"), spread(r["at_paper_tpt_full"], ".0f"),
             spread(r["at_paper_tpt_ratio"])]
            for r in fig9
        ),
    )  # fmt: skip
    return lines


def _sensitivity_table(rows: Records) -> list[str]:
    r0 = rows[0]
    lines = [
        f"**Sensitivity to the workload** ({r0['ranks']:,} GPUs, seed {r0['seed']}): every "
        "length (patches, frames, text) times a scale, text capped at the config's "
        "`max_text_tokens`, and the audio tasks' share of the tasks with an image or a clip "
        "(at scale 1). The shipped workload is scale 1 with the config's mix "
        "(`orchmllm/workload_facts.py` gives each number's source); no row is used elsewhere.",
        "",
    ]
    lines += table(
        ["model", "scale", "audio share", "b none", "b full", "paper b", "product ×",
         "product × at paper b", "paper ×"],
        (
            [r["model"], f"{r['length_scale']:g}", f"{r['audio_share']:.2f}", r["b_none"],
             r["b_full"], f"{r['paper_b_none']}→{r['paper_b_full']}", fmt(r["product"]),
             "OOM" if r["at_paper_oom"] else fmt(r["at_paper_product"]),
             fmt(r["paper_mfu_ratio"])]
            for r in rows
        ),
    )  # fmt: skip
    return lines


def _sensitivity(rows: Records, match: Records) -> list[str]:
    lines = _sensitivity_table(rows) if rows else []
    for r in match:
        if r["scale"] is None:
            lines += [
                f"Table 2's forward time at {r['ranks']:,} GPUs ({r['paper_forward_s']} s) lies "
                f"outside the simulated ones over scales {r['searched'][0]}-{r['searched'][1]}.",
                "",
            ]
            continue
        lines += [
            f"**Derived**: at {r['ranks']:,} GPUs Table 2's forward time ({r['paper_forward_s']} "
            f"s, {r['model']}, mini-batch {r['examples_per_rank']}) is the simulator's at length "
            f"scale **{r['scale']:.2f}** (at scale 1: {r['forward_s_at_1']:.3g} s); there the "
            f"memory model needs {r['peak_memory_gb']:.1f} GB per rank"
            + (", more than the budget: the paper ran that mini-batch, so lengths alone do not "
               "explain both figures" if r["oom"] else "")
            + ". Not used as the workload.",
            "",
        ]  # fmt: skip
    return lines


def _fig12(rows: Records, largest: Records) -> list[str]:
    if not rows:
        return []
    lines = [
        f"**Figure 12** ({rows[0]['ranks']} GPUs, the paper's ablation mini-batch, full + "
        "node-wise placement): the all-to-all dispatcher against an all-gather communicator "
        "(every rank receives each move's whole global batch, padded to the largest rank's): "
        "forward+backward dispatch time, MFU and worst peak memory, and the largest mini-batch "
        "the all-gather fits. The paper: MLLM-84B with all-gather runs out of memory at 25 and "
        "runs at 20 with MFU 0.2551 and 61.8 GB.",
        "",
    ]
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        a2a = one(rows, model=model, communicator="all_to_all")
        gather = one(rows, model=model, communicator="all_gather")
        bs = [r["examples_per_rank"] for r in where(largest, model=model)]
        out.append(
            [model, a2a["examples_per_rank"]]
            + [x for r in (a2a, gather) for x in (spread(r["dispatch_ms"]), spread(r["mfu"]),
               f"{r['peak_memory_gb_max']:.1f}" + (" OOM" if r["oom"] else ""))]
            + [span(bs) if bs else "OOM"]
        )  # fmt: skip
    lines += table(
        ["model", "b", "all-to-all ms", "MFU", "GB", "all-gather ms", "MFU", "GB",
         "all-gather largest b"],
        out,
    )  # fmt: skip
    return lines


def shortfalls(recs: Records) -> list[str]:
    """Every figure of the paper's text the simulation falls short of, or misses, with the
    likely cause; read from the records, so a rerun rewrites it."""
    items = []
    fig8 = [r for r in where(recs, figure="fig8") if "at_paper_product" in r]
    top = max((r["ranks"] for r in fig8 if r["ranks"] <= 2560), default=None)
    at = [r for r in fig8 if r["ranks"] == top]
    if at:
        prods = "; ".join(
            f"{r['model']} {spread(r['at_paper_product'])} at the paper's mini-batches, "
            f"{spread(r['product'])} at its own"
            for r in at
        )
        lo, hi = at[0].get("paper_mfu_ratio_range", (1.5, 2.0))
        below = [r["model"] for r in at if r["at_paper_product"]["mean"] < lo]
        own_below = [r["model"] for r in at if r["product"] and r["product"]["mean"] < lo]
        items.append(
            f"Figure 8 at {top:,} GPUs, MFU ratio full/none (the paper: {lo}-{hi}×, growing "
            f"with the model): {prods}. Below the paper's range at its mini-batches: "
            f"{', '.join(below) or 'none'}; at the simulator's own: "
            f"{', '.join(own_below) or 'none'}. Likely causes: the simulator's balancing "
            "factor comes from block compute only (no kernel gaps, stragglers or exposed "
            "latency, which imbalance also lengthens), and at its own, larger mini-batches "
            "ZeRO-3 traffic hides behind compute, so the larger mini-batch balancing allows "
            "pays little."
        )
        ratios = [
            f"{r['model']} {r['b_none']['mean'] / r['paper_b_none']:.2f}×/"
            f"{r['b_full']['mean'] / r['paper_b_full']:.2f}×"
            for r in at
        ]
        items.append(
            f"Largest fitting mini-batches at {top:,} GPUs, sim/paper without/with balancing: "
            f"{', '.join(ratios)}. Likely cause: the workload (the sensitivity table shows "
            "them fall with every length); the paper does not state its data's lengths."
        )
    for r in at:
        if r.get("paper_mfu_full") and r["mfu_full"]:
            items.append(
                f"{r['model']} MFU with OrchMLLM at {top:,} GPUs: {spread(r['mfu_full'])} "
                f"against the paper's {r['paper_mfu_full']}. The simulator's MFU is an upper "
                "bound: no optimizer step, embeddings, data loading, kernel gaps or exposed "
                "collective latency."
            )
    fig9 = [r for r in where(recs, figure="fig9", ranks=top) if r["at_paper_tpt_ratio"]]
    if fig9:
        lo, hi = fig9[0]["paper_tpt_ratio_range"]

        def side(r: dict[str, Any]) -> str:
            m = r["at_paper_tpt_ratio"]["mean"]
            return "below" if m < lo else "above" if m > hi else "within"

        items.append(
            f"Figure 9, throughput full/none at the paper's mini-batches (the paper: {lo}-{hi}×): "
            + ", ".join(f"{r['model']} {spread(r['at_paper_tpt_ratio'])} ({side(r)})" for r in fig9)
            + "; the causes are Figure 8's. Megatron-LM (3.1-4.2× below OrchMLLM in the "
            "paper): not simulated."
        )
    for r in where(recs, figure="table2_scale"):
        if r["scale"] is not None:
            items.append(
                f"Table 2 forward time at {r['ranks']:,} GPUs: {r['forward_s_at_1']:.3g} s "
                f"against the paper's {r['paper_forward_s']} s; the length scale that closes it "
                f"is {r['scale']:.2f}. Likely causes: lighter examples than the paper's and no "
                "per-step overheads in the simulator."
            )
    t2 = where(recs, figure="table2")
    if t2:
        ratios = [r["overhead_ratio_to_paper"] for r in t2 if r["overhead_ratio_to_paper"]]
        items.append(
            f"Table 2 dispatch overhead, sim/paper {span(ratios, '.2f')}: the simulator times "
            "the all-to-all's transfer at link peak plus per-peer latency; the paper's "
            "overhead also holds copies, assembly and synchronisation."
        )
    llm = where(recs, figure="fig10_llm_max")
    if llm:
        mfu = statistics.fmean(r["mfu"] for r in llm)
        items.append(
            f"Figure 10, MLLM-84B balancing the LLM only: MFU {mfu:.3g} at the simulator's "
            f"largest mini-batch against the paper's {llm[0]['paper_mfu']} at 18: the "
            "simulator charges the unbalanced encoders only their compute imbalance; the "
            "paper's much lower figure points at costs it does not model."
        )
    fig11 = where(recs, figure="fig11_summary")
    if fig11:
        gains = [r[f"speedup_tailored_over_{k}"]["mean"] for r in fig11
                 for k in ("all_rmpad", "all_pad")]  # fmt: skip
        items.append(
            f"Figure 11, tailored over one algorithm for both encoders: {span(gains, '.3f')}× "
            "in the simulator, where the paper shows 'significantly lower' MFU without a "
            "number: in the simulator the "
            "wrong algorithm only leaves more imbalance in one encoder, a small share of the "
            "simulated step."
        )
    fig13 = where(recs, figure="fig13_summary", batches="greedy")
    if fig13:
        lo, hi = fig13[0]["paper_reduction_range"]
        red = [r[f"reduction_{p}"]["mean"] for r in fig13 for p in ("vision", "audio", "llm")]
        items.append(
            f"Figure 13, inter-node volume reduction with the paper's greedy batches: "
            f"{span(red, '.2f')} against the paper's {lo}-{hi}: greedy rebuilds every batch "
            "from scratch, so no permutation keeps much traffic inside a node; the paper's "
            "implementation details that let it keep more are not given."
        )
    fig12 = [r for r in where(recs, figure="fig12_max") if r["model"] == "mllm-84b"]
    if fig12:
        b = [r["examples_per_rank"] for r in fig12]
        mfu = statistics.fmean(r["mfu"] for r in fig12)
        items.append(
            f"Figure 12, MLLM-84B with the all-gather communicator: largest mini-batch "
            f"{span(b)} with MFU {mfu:.3g} and up to "
            f"{max(r['peak_memory_gb'] for r in fig12):.1f} GB, against the paper's 20, 0.2551 "
            "and 61.8 GB. Likely causes: the simulator counts only the gathered receive "
            "buffers while a move runs (the paper does not say what its all-gather "
            "communicator keeps alive), and its MFU has none of the paper's overheads."
        )
    if not items:
        return []
    return [
        "**Where the simulation falls short of the paper** (read from the records above; "
        "each with its likely cause):",
        "",
        *(f"- {i}" for i in items),
        "",
    ]


# gpu_step's timing method since issue 38 (its records say ``method``): warm shapes, median of
# repeats, modes interleaved, the identical-work self-check. Records without it are history.
SOUND_METHOD = "warm-median"


def is_sound_method(r: dict[str, Any]) -> bool:
    return r.get("method") == SOUND_METHOD


def gpu_step(recs: Records) -> list[str]:
    """The sound step's records (one run), then the replaced method's, marked as history."""
    current = [r for r in recs if is_sound_method(r)]
    old = [r for r in recs if not is_sound_method(r)]
    lines = []
    if current:
        lines += _gpu_step_current(current)
    else:
        lines += [
            "No record of the sound step yet (`benchmarks/gpu_step.py` since issue 38: every "
            "rank's exact inputs once untimed, then timed repeats, median kept, modes "
            "interleaved, the identical-work self-check): `python -m benchmarks.gpu_check` on a "
            "GPU writes one.",
            "",
        ]
    if old:
        lines += _gpu_step_history(old)
    return lines


def _gpu_step_table(recs: Records) -> tuple[list[str], list[list[str]]]:
    """The step table and the full mode's target verdicts."""
    rows, targets = [], []
    for r in recs:
        encoders = [k for k in r if k.endswith("_layers") and k != "llm_layers"]
        layers = "/".join(str(r[k]) for k in [*encoders, "llm_layers"])
        rows.append(
            [r["device"], layers, r["ranks"], r["examples_per_rank"], f"`{r['mode']}`",
             f"{r['step_time_s']:.4f}", f"{r['sim_step_time_s']:.4f}",
             f"{r['speedup_vs_none']:.3f}", f"{r['sim_speedup_vs_none']:.3f}",
             f"{r['speedup_vs_llm']:.3f}", f"{r['step_over_ideal']:.3f}",
             f"{r['peak_mem_bytes'] / 2**30:.2f}", f"{r['sim_peak_mem_bytes'] / 2**30:.2f}",
             f"{r['tokens_per_s']:,.0f}"]
        )  # fmt: skip
        if r["mode"] != "full" or not r.get("sound", True):  # no verdict on unsound timing
            continue
        where_ = f"{r['ranks']} ranks x {r['examples_per_rank']}/rank, `full`"
        for key, name in (("speedup_vs_none", "`none`"), ("speedup_vs_llm", "`llm`")):
            want = r[f"sim_{key}"]
            targets.append(
                [f"{where_}: × {name} ≥ the prediction {want:.3f}", f"{r[key]:.3f}",
                 verdict(r[key], at_least=want)]
            )  # fmt: skip
    table_lines = table(
        ["device", "layers", "ranks", "b", "mode", "step s", "sim s", "× none", "sim",
         "× llm", "/ ideal", "peak GiB", "sim GiB", "LLM tokens/s per GPU"],
        rows,
    )  # fmt: skip
    return table_lines, targets


def _phases(r: dict[str, Any]) -> list[str]:
    return [k.removesuffix("_mean_over_sim") for k in r if k.endswith("_mean_over_sim")]


def _gpu_step_current(recs: Records) -> list[str]:
    runs = sorted({str(r.get("run_id")) for r in recs})
    lines = [
        "Data-parallel ranks emulated on one device (`benchmarks/gpu_step.py` says how): per "
        "rank, every mode's exact inputs run once untimed, then "
        f"{span(r['repeats'] for r in recs)} timed repeats with the modes interleaved; a "
        "phase's time is the median of its repeats (CUDA events on a GPU). The step is the "
        "slowest rank per phase plus the dispatch cost; the ideal step gives every phase its "
        "mean rank time (each record defines its figures in `definitions`). `sim` columns are "
        "the simulator's prediction for the same set-up and the very batches measured "
        "(`orchmllm.sim.emulated`); a measured speed-up below it is a finding, not hidden. "
        f"Layers: each encoder's, then the LLM's. Run `{'`, `'.join(runs)}`.",
        "",
    ]
    table_lines, targets = _gpu_step_table(recs)
    lines += table_lines
    checks = []
    for (ranks, b), group in _by_setup(recs).items():
        r = group.get("none") or next(iter(group.values()))
        ratios = [k for k in r if k.startswith("check_") and k.endswith("_ratio")]
        checks.append(
            [f"{ranks} x {b}", f"{r['check_tolerance']:.0%}",
             ", ".join(f"{k.removeprefix('check_').removesuffix('_ratio')} {r[k]:.3f}"
                       for k in ratios),
             "sound" if r["sound"] else "**unsound**: " + ", ".join(r["unsound_phases"])]
        )  # fmt: skip
    lines += [
        "**Self-check**: `llm` runs `none`'s very encoder inputs on every rank, so each "
        "encoder phase under `llm` over `none` (slowest and mean rank) must be within the "
        "tolerance of 1; an unsound set-up's figures say more about the timing than about "
        "balancing.",
        "",
        *table(["set-up", "tolerance", "llm / none", "verdict"], checks),
    ]
    if targets:
        lines += table(["target", "measured", ""], targets)
    phase_rows = [
        [f"{r['ranks']} x {r['examples_per_rank']}", f"`{r['mode']}`", p,
         f"{r[f'{p}_mean_s']:.4f}", f"{r[f'sim_{p}_mean_s']:.4f}",
         fmt(r[f"{p}_mean_over_sim"], ".2f"), f"{r[f'{p}_max_s']:.4f}",
         f"{r[f'sim_{p}_max_s']:.4f}", fmt(r[f"{p}_max_over_sim"], ".2f"),
         f"{r[f'{p}_spread_max']:.1%}"]
        for r in recs
        for p in _phases(r)
    ]  # fmt: skip
    lines += [
        "**Per phase, measured against simulated** on the same work (the same examples in the "
        "same layout on every rank; from the same records): mean rank and slowest rank time, "
        "and the largest spread of a rank's repeats ((slowest - fastest) / median).",
        "",
        *table(["set-up", "mode", "phase", "mean s", "sim", "meas/sim", "max s", "sim",
                "meas/sim", "spread"], phase_rows),
    ]  # fmt: skip
    return lines


def _gpu_step_history(recs: Records) -> list[str]:
    """The replaced method's records: kept, their flaw measured from themselves."""
    lines = [
        "**History: the replaced method, unsound.** These records timed each rank once, for "
        "one step, after a warm-up on other batches, so a rank meeting padded shapes it had "
        "not run paid their first-call cost inside its timing (issue 38). Their own figures "
        "show it: `llm` runs `none`'s very audio inputs, yet its audio phase timed "
        + "; ".join(
            f"{g['none']['audio_mean_s'] / g['llm']['audio_mean_s']:.1f}x faster at "
            f"{ranks} x {b} (mean rank)"
            for (ranks, b), g in _by_setup(recs).items()
            if {"none", "llm"} <= set(g) and g["llm"].get("audio_mean_s")
        )
        + ". No conclusion is drawn from them.",
        "",
    ]
    table_lines, _ = _gpu_step_table(recs)
    return lines + table_lines


def _by_setup(recs: Records) -> dict[tuple[int, int], dict[str, dict]]:
    """gpu_step records by (ranks, examples per rank), then by mode."""
    out: dict[tuple[int, int], dict[str, dict]] = {}
    for r in recs:
        out.setdefault((r["ranks"], r["examples_per_rank"]), {})[r["mode"]] = r
    return out


def new_shape(recs: Records) -> list[str]:
    """What an encoder's first call on a new input shape costs over the same call warm."""
    rows = [
        [r["device"], r["encoder"], r["items"], r["shapes"], f"{r['first_s'] * 1e3:.2f}",
         f"{r['warm_s'] * 1e3:.2f}", f"{r['cost_s'] * 1e3:.2f}", f"{r['cost_over_warm']:.2f}"]
        for r in recs
    ]  # fmt: skip
    return [
        "Per encoder (forward and backward), the first call on an input shape the process has "
        "not run against the same call warm (median of its repeats), over shapes that differ "
        "only in every item's length growing by one length unit "
        "(`gpu_step.py --new-shape-cost`): the cost a training step pays for each new padded "
        "audio width or packed vision total it meets. On CPU, times are the thread's CPU time.",
        "",
        *table(["device", "encoder", "items", "shapes", "first ms", "warm ms", "cost ms",
                "cost / warm"], rows),
    ]  # fmt: skip


def gpu_memory(recs: Records) -> list[str]:
    """The trainer's measured peak memory per phase beside the memory model's prediction."""
    rows = [
        [r["step"], r["phase"], r["llm_tokens"], f"{r['measured_peak_bytes'] / 2**30:.2f}",
         "–" if r["predicted_bytes"] is None else f"{r['predicted_bytes'] / 2**30:.2f}",
         r["predicted_figure"] or "–",
         "–" if r["measured_over_predicted"] is None else f"{r['measured_over_predicted']:.3f}"]
        for r in recs
    ]  # fmt: skip
    first = recs[0]
    later = [
        r["measured_over_predicted"]
        for r in recs
        if r["step"] > first["step"] and r["measured_over_predicted"] is not None
    ]
    after_first = (
        f" From the second step on, measured / model is {min(later):.3f}-{max(later):.3f}. "
        "The first step's forward and backward run before AdamW's first update allocates its "
        "two moments per parameter, which the model counts as static from the start: they "
        "sit below it by those bytes."
        if later
        else ""
    )
    run = (
        f" Run `{first['run_id']}`."
        if first.get("run_id")
        else " Measured before records carried a run id (with the GPU section's history "
        "records); memory is not what the replaced timing method got wrong."
    )
    return [
        f"`orchmllm.train` on `{first['config']}` ({first['precision']}, checkpointing "
        f"{first['checkpointing']}, loss chunk {first['loss_chunk']}), one process, peak "
        f"memory per phase of each step ({first['source']}) beside the memory model's "
        f"prediction for the same step's batch (`benchmarks/train_memory.py`): its peak for "
        f"every phase (static bytes included). The memory model counts "
        f"{first['sim_parameters'] / 1e6:,.0f} M parameters, the model has "
        f"{first['model_parameters'] / 1e6:,.0f} M.{after_first}{run}",
        "",
        *table(
            ["step", "phase", "LLM tokens", "peak GiB", "model GiB", "model figure",
             "measured / model"],
            rows,
        ),
    ]  # fmt: skip


def oldest_torch(recs: Records) -> list[str]:
    return table(
        ["torch", "passed", "failed", "errors", "skipped", "pytest s", "did not pass"],
        (
            [r["torch"], r["passed"], r["failed"], r["errors"], r["skipped"],
             f"{r['pytest_seconds']:.0f}", ", ".join(f"`{t}`" for t in r["not_passed"]) or "–"]
            for r in recs
        ),
    )  # fmt: skip


def planner_at_scale(recs: Records) -> list[str]:
    """``balance_bench.py --scale-only`` runs on other machines (a GPU host's CPU, numpy's
    AVX-512 kernels on and off), side by side per distribution."""
    runs: dict[tuple, Records] = {}
    for r in recs:
        runs.setdefault((r["run_date"], r.get("numpy_disabled_features")), []).append(r)
    labels = [
        f"{run[0]['host_cpu']}" + (f", numpy's `{flag}` off" if flag else "")
        for (_, flag), run in runs.items()
    ]
    dists = list(dict.fromkeys(r["dist"] for r in where(recs, policy="scale")))
    lines = [
        "`balance()` at 16,384 ranks × 60 items on machines beside the one above: `greedy`'s "
        "CPU time against numpy's faster argsort of the same lengths in the same run, and the "
        'max over repeats of the whole `balance(placement="auto")` call (ms).',
        "",
    ]
    lines += table(
        ["lengths", *(f"{label}: `greedy` / argsort, `auto` max" for label in labels)],
        (
            [dist]
            + [
                f"{r['greedy_ms']:.1f} / {r['argsort_ms']:.1f} = {r['greedy_over_argsort']:.2f}×,"
                f" {r['greedy_auto_ms_max']:.0f}"
                for run in runs.values()
                for r in where(run, policy="scale", dist=dist)
            ]
            for dist in dists
        ),
    )
    rows = []
    for label, run in zip(labels, runs.values(), strict=True):
        s = one(run, policy="summary")
        worst = max(where(run, policy="scale"), key=lambda r: r["greedy_over_argsort"])
        for what, key, figure in (
            ("`greedy` ≤ {:g}× argsort", "scale_greedy_over_argsort_max",
             f"max {worst['greedy_over_argsort']:.2f}× ({worst['dist']})"),
            ('`placement="auto"` call ≤ {:g} ms', "scale_auto_ms_max",
             f"max {s['scale_auto_ms_max']:.0f} ms"),
            ("`plan_step` ≤ {:g} ms", "scale_plan_step_ms_max",
             f"max {s['scale_plan_step_ms_max']:.0f} ms"),
        ):  # fmt: skip
            bound = s[f"target_max_{key}"]
            rows.append([label, what.format(bound), figure, verdict(s[key], at_most=bound)])
    return lines + table(["machine", "target", "measured", ""], rows)


@dataclass(frozen=True)
class Section:
    """One benchmark's part of the document: its files under the results folder (a name or a
    glob, one file per run), the command that writes one, and how its records read."""

    title: str
    pattern: str
    command: str
    render: Callable[[Records], list[str]]
    missing: str = "No record yet."


SECTIONS = (
    Section(
        "The main job: tiny multimodal training on 4 CPU processes",
        "train_modes.json",
        "python benchmarks/train_modes.py --json benchmarks/results/train_modes.json",
        train_modes,
    ),
    Section(
        "Balancing policies",
        "balance_bench.json",
        "python benchmarks/balance_bench.py --json benchmarks/results/balance_bench.json",
        balance_bench,
    ),
    Section(
        "The planner at 16,384 ranks on other CPUs",
        "balance_scale_*.json",
        "python benchmarks/balance_bench.py --scale-only --json "
        "benchmarks/results/balance_scale_<host>.json",
        planner_at_scale,
    ),
    Section(
        "Node-wise placement and movement-aware balancing",
        "placement_bench.json",
        "python benchmarks/placement_bench.py --json benchmarks/results/placement_bench.json",
        placement_bench,
    ),
    Section(
        "All-to-all vs the all-gather strawman",
        "dispatch_bench.json",
        "python benchmarks/dispatch_bench.py --json benchmarks/results/dispatch_bench.json",
        dispatch_bench,
    ),
    Section(
        "Prefetched planning and index mode",
        "loader_bench.json",
        "python benchmarks/loader_bench.py --json benchmarks/results/loader_bench.json",
        loader_bench,
    ),
    Section(
        "At cluster scale: the paper's section 8 on the simulator",
        "reproduce_paper.json",
        "python benchmarks/reproduce_paper.py --json benchmarks/results/reproduce_paper.json",
        reproduce_paper,
    ),
    Section(
        "A training step on a GPU",
        "gpu_step_*.json",
        "python benchmarks/gpu_step.py --json benchmarks/results/gpu_step_<gpu>.json",
        gpu_step,
        missing="No GPU record: nothing here has been measured on a GPU.",
    ),
    Section(
        "The cost of a new encoder shape",
        "new_shape_*.json",
        "python -m benchmarks.gpu_step --new-shape-cost --json "
        "benchmarks/results/new_shape_<gpu>.json",
        new_shape,
    ),
    Section(
        "The trainer's memory on a GPU",
        "gpu_memory_*.json",
        "python -m benchmarks.train_memory --json benchmarks/results/gpu_memory_<gpu>.json",
        gpu_memory,
        missing="No GPU record.",
    ),
    Section(
        "The test suite on older torch releases",
        "oldest_torch_*.json",
        "bash .ci/oldest-torch VERSION --json benchmarks/results/oldest_torch_VERSION.json",
        oldest_torch,
    ),
)


def gpu_runs(results: Path = RESULTS) -> dict[str, list[str]]:
    """Run id -> the files whose GPU records the documents quote as current: the sound
    step's gpu_step records, the new-shape cost and the trainer's memory measured on a GPU, and
    reproduce_paper's comparisons with those gpu_step records (their ``gpu_run_id``)."""
    runs: dict[str, set[str]] = {}

    def add(run_id: Any, name: str) -> None:
        runs.setdefault(str(run_id), set()).add(name)

    for path in sorted(results.glob("*.json")):
        recs = json.loads(path.read_text())
        if not isinstance(recs, list):
            continue
        for r in recs:
            on_gpu = r.get("device", "cpu") != "cpu"
            measured = path.name.startswith("new_shape_") or (
                path.name.startswith("gpu_step_") and is_sound_method(r)
            )
            if measured and on_gpu:
                add(r.get("run_id"), path.name)
            elif path.name.startswith("gpu_memory_") and r.get("run_id"):
                add(r["run_id"], path.name)
            elif str(r.get("figure")).startswith("gpu_") and on_gpu and is_sound_method(r):
                add(r.get("gpu_run_id"), path.name)
    return {k: sorted(v) for k, v in runs.items()}


def check_one_gpu_run(results: Path) -> None:
    """Every GPU figure the documents quote as current comes from one run, else an error."""
    runs = gpu_runs(results)
    if len(runs) > 1:
        listed = "; ".join(f"{k}: {', '.join(v)}" for k, v in runs.items())
        raise ValueError(
            f"GPU records from {len(runs)} runs ({listed}): the documents quote one run; rerun "
            "`python -m benchmarks.gpu_check` (one run id for every part), then "
            "`benchmarks/reproduce_paper.py`"
        )


def render(results: Path = RESULTS) -> str:
    """The whole document from the ``--json`` files in ``results``."""
    check_one_gpu_run(results)
    lines = [
        "# Measured results",
        "",
        "<!-- Generated by `python benchmarks/results_doc.py` from benchmarks/results/*.json. "
        "Do not edit: rerun a benchmark with --json into benchmarks/results/, then the "
        "generator. -->",
        "",
        "Every figure here is read from a benchmark's unedited `--json` output in "
        "`benchmarks/results/`, by `python benchmarks/results_doc.py`; each section says which "
        "command wrote it, when, and on what machine. Timings depend on that machine and on "
        "its load at the time (given as its load average); ratios within one run are the "
        "figures to compare.",
        "",
    ]
    lines += [f"- [{s.title}](#{_anchor(s.title)})" for s in SECTIONS] + [""]
    for section in SECTIONS:
        files = sorted(results.glob(section.pattern))
        lines += [f"## {section.title}", ""]
        if not files:
            lines += [
                f"{section.missing} `{section.command}` writes one (`benchmarks/results/"
                f"{section.pattern}`).",
                "",
            ]
            continue
        records: Records = []
        for path in files:
            recs = json.loads(path.read_text())
            lines += [provenance(recs), ""]
            records += recs
        lines += section.render(records)
    return "\n".join(lines).rstrip("\n") + "\n"


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


# -- the README's marked blocks ---------------------------------------------------------------


def gpu_proof(recs: Records) -> list[str]:
    """What the README says of the GPU: each set-up's measured speed-up beside its prediction,
    from the sound step's records only (one run)."""
    current = [r for r in recs if is_sound_method(r)]
    if not current:
        old = sorted({r["run_date"][:10] for r in recs})
        return [
            "- No GPU measurement by the sound method yet (`python -m benchmarks.gpu_check` on "
            "a GPU writes one). The records of " + ", ".join(old) + " came from gpu_step's "
            "replaced method, which timed start-up rather than work; docs/results.md keeps them "
            "as history."
        ]
    lines = []
    for (ranks, b), group in _by_setup(current).items():
        full = group["full"]
        lines.append(
            f"- {ranks} ranks x {b} examples: `full` over `none` {full['speedup_vs_none']:.3f}, "
            f"the simulator predicted {full['sim_speedup_vs_none']:.3f} for the same batches "
            f"(measured / predicted {full['speedup_vs_none'] / full['sim_speedup_vs_none']:.2f}); "
            f"`full` over `llm` {full['speedup_vs_llm']:.3f} (predicted "
            f"{full['sim_speedup_vs_llm']:.3f})"
            + ("" if full["sound"] else "; **unsound**: " + ", ".join(full["unsound_phases"])
               + " timed apart on identical work")
            + "."
        )  # fmt: skip
    r = current[0]
    return [
        *lines,
        "",
        f"({r['device']}, torch {r['torch_version']}, {r['run_date'][:10]}, run `{r['run_id']}`; "
        "docs/results.md has every figure, the memory measurements and what they mean.)",
    ]


def sim_summary(recs: Records) -> list[str]:
    """What the README says of the simulator: what it predicts for the paper's figures
    beside the paper's, and where it disagrees (docs/results.md has every figure)."""
    fig8 = [r for r in where(recs, figure="fig8") if "at_paper_product" in r]
    top = max((r["ranks"] for r in fig8 if r["ranks"] <= 2560), default=None)
    lines = []
    at = [r for r in fig8 if r["ranks"] == top]
    if at:
        lines.append(
            f"- Predicted, Figure 8 at {top:,} GPUs, MFU with OrchMLLM over without, at the "
            "paper's mini-batches (mean and min-max over seeds): "
            + ", ".join(f"{r['model']} {spread(r['at_paper_product'])}" for r in at)
            + "; at the largest each fits: "
            + ", ".join(f"{r['model']} {spread(r['product'])}" for r in at)
            + ". The paper: 1.5-2.0×."
        )
    fig9 = [r for r in where(recs, figure="fig9", ranks=top) if r.get("at_paper_tpt_ratio")]
    if fig9:
        lines.append(
            "- Predicted, Figure 9, throughput full/none at the paper's mini-batches: "
            + ", ".join(f"{r['model']} {spread(r['at_paper_tpt_ratio'])}" for r in fig9)
            + " (the paper: 1.4-1.9×; its Megatron-LM baseline is not simulated)."
        )
    fig12 = where(recs, figure="fig12_summary")
    if fig12:
        slow = [
            one(fig12, model=m, communicator="all_gather")["dispatch_ms"]["mean"]
            / one(fig12, model=m, communicator="all_to_all")["dispatch_ms"]["mean"]
            for m in dict.fromkeys(r["model"] for r in fig12)
        ]
        lines.append(
            f"- Predicted, Figure 12 ({fig12[0]['ranks']} GPUs): an all-gather communicator's "
            f"dispatch takes {span(slow, '.0f')}× the all-to-all's."
        )
    matches = [r for r in where(recs, figure="table2_scale") if r["scale"] is not None]
    if matches:
        lines.append(
            "- Disagrees: Table 2's forward time is "
            + ", ".join(
                f"{r['forward_s_at_1']:.3g} s against the paper's {r['paper_forward_s']} s at "
                f"{r['ranks']:,} GPUs (matched only with every length × {r['scale']:.2f}, not "
                "used)"
                for r in matches
            )
            + "; likely causes: the paper's examples are heavier than this workload's "
            "public-dataset lengths, and the simulator has no per-step overheads."
        )
    if at:
        above = sum(r["b_none"]["mean"] > r["paper_b_none"] for r in at)
        lines.append(
            f"- Disagrees: the largest mini-batch without balancing is above the paper's for "
            f"{above} of {len(at)} models at {top:,} GPUs (the same likely cause)."
        )
    checked = [
        r
        for r in where(recs, figure="gpu_validation")
        if "measured_step_s" in r and r["device"] != "cpu" and is_sound_method(r)
    ]
    if checked:
        lines.append(
            f"- Measured on {checked[0]['device']}: gpu_step's emulated steps (benchmarks/"
            "gpu_step.py), simulated/measured step time "
            f"{span((r['step_ratio'] for r in checked), '.2f')}; the simulator's compute "
            "inputs are H100 block timings."
        )
    if not lines:
        return ["(no Figure 8 record at the paper's mini-batches yet)"]
    return [
        *lines,
        "",
        "(docs/results.md lists every shortfall against the paper with its likely cause.)",
    ]


@dataclass(frozen=True)
class Block:
    """A marked block of the README (``<!-- results:NAME -->`` ... ``<!-- /results:NAME -->``)
    and the records it is made of."""

    name: str
    pattern: str
    render: Callable[[Records], list[str]]


BLOCKS = (
    Block("main-job", "train_modes.json", lambda recs: table_only(train_modes(recs))),
    Block("gpu", "gpu_step_*.json", gpu_proof),
    Block("sim", "reproduce_paper.json", sim_summary),
)


def table_only(lines: list[str]) -> list[str]:
    """The table of a section's lines (the README keeps only the figures)."""
    return [line for line in lines if line.startswith("|")]


def render_readme(text: str, results: Path = RESULTS) -> str:
    """``text`` with every marked block rewritten from the records (a block without records
    says so)."""
    check_one_gpu_run(results)
    for block in BLOCKS:
        start, end = f"<!-- results:{block.name} -->", f"<!-- /results:{block.name} -->"
        head, found, rest = text.partition(start)
        if not found:
            raise ValueError(f"README has no {start} block")
        _, found, tail = rest.partition(end)
        if not found:
            raise ValueError(f"README's {start} block has no {end}")
        records: Records = []
        for path in sorted(results.glob(block.pattern)):
            records += json.loads(path.read_text())
        body = block.render(records) if records else [f"(no `{block.pattern}` record yet)"]
        text = "\n".join([head + start, *body, end]) + tail
    return text


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="the --json files")
    ap.add_argument("--doc", type=Path, default=DOC, help="the document to write or check")
    ap.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if the document is stale"
    )
    ap.add_argument("--readme", type=Path, default=README, help="the README whose blocks to fill")
    args = ap.parse_args(argv)
    outputs = {args.doc: render(args.results)}
    if args.readme.exists():
        outputs[args.readme] = render_readme(args.readme.read_text(), args.results)
    if args.check:
        stale = [
            path for path, text in outputs.items() if not path.exists() or path.read_text() != text
        ]
        for path in stale:
            print(f"{path} is not what {args.results} gives: run benchmarks/results_doc.py")
        if not stale:
            print(f"{', '.join(map(str, outputs))} up to date")
        return 1 if stale else 0
    for path, text in outputs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
