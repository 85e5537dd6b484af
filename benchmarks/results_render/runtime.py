"""Sections on the runtime on CPU processes: the training job per ``--balance`` mode, the
all-to-all dispatcher against all-gather, the prefetching loader, and the test suite on older
torch releases."""

from __future__ import annotations

from .tables import Records, one, table, where


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


def oldest_torch(recs: Records) -> list[str]:
    return table(
        ["torch", "passed", "failed", "errors", "skipped", "pytest s", "did not pass"],
        (
            [r["torch"], r["passed"], r["failed"], r["errors"], r["skipped"],
             f"{r['pytest_seconds']:.0f}", ", ".join(f"`{t}`" for t in r["not_passed"]) or "–"]
            for r in recs
        ),
    )  # fmt: skip
