"""The reproduction's PNG plots, from its records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .paper import PAPER
from .sweep import MODES


def plots(records: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig: Any, name: str) -> None:
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    def pick(figure: str, **match: Any) -> list[dict[str, Any]]:
        return [
            r
            for r in records
            if r.get("figure") == figure and all(r.get(k) == v for k, v in match.items())
        ]

    models = sorted({r["model"] for r in records if "model" in r and "ranks" in r})
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rs = sorted(pick("fig8", model=model), key=lambda r: r["ranks"])
        for key, style in (("mfu_none", "o--"), ("mfu_full", "s-")):
            ok = [r for r in rs if r[key]]  # an out-of-memory point is not plotted
            mean = np.array([100 * r[key]["mean"] for r in ok])
            err = [
                mean - [100 * r[key]["min"] for r in ok],
                [100 * r[key]["max"] for r in ok] - mean,
            ]
            ax.errorbar([r["ranks"] for r in ok], mean, yerr=err, fmt=style, capsize=3,
                        label=f"{key[4:]} at its own mini-batch")  # fmt: skip
        if model == "mllm-84b":
            ax.axhline(
                100 * PAPER["fig8_mfu_full_84b_2560"], color="gray", lw=0.8,
                label="paper full @2560",
            )  # fmt: skip
        ax.set_xscale("log")
        ticks = [r["ranks"] for r in rs]
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_title(model)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("MFU (%), mean and min-max over seeds")
        ax.legend(fontsize=7)
    save(fig, "fig8_mfu.png")

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    x = np.arange(len(models))
    for i, mode in enumerate(MODES):
        rs = [pick("fig10_summary", model=m, mode=mode) for m in models]
        mfu = [100 * r[0]["mfu"]["mean"] if r and r[0]["mfu"] else 0 for r in rs]
        a1.bar(x + 0.2 * i, mfu, 0.2, label=mode)
        for j, r in enumerate(rs):
            if r and r[0]["oom"]:
                a1.text(x[j] + 0.2 * i, 1, "OOM", rotation=90, ha="center", fontsize=7)
        a2.bar(x + 0.2 * i, [r[0]["peak_memory_gb_max"] if r else 0 for r in rs], 0.2, label=mode)
    budget = next((r["memory_budget_gb"] for r in records if "memory_budget_gb" in r), None)
    if budget:
        a2.axhline(budget, color="red", lw=0.8, label="budget")
    for ax, label in ((a1, "MFU (%), OOM not plotted"), (a2, "peak memory (GB)")):
        ax.set_xticks(x + 0.3, models)
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    save(fig, "fig10_ablation.png")

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for i, variant in enumerate(("tailored", "all_rmpad", "all_pad")):
        rs = [[r for r in pick("fig11", model=m) if r.get("variant") == variant] for m in models]
        mfu = [100 * np.mean([x["mfu"] for x in r]) if r and not any(x["oom"] for x in r) else 0
               for r in rs]  # fmt: skip
        ax.bar(x + 0.25 * i, mfu, 0.25, label=variant)
    ax.set_xticks(x + 0.25, models)
    ax.set_ylabel("MFU (%), mean over seeds")
    ax.legend(fontsize=7)
    save(fig, "fig11_algorithms.png")

    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.6), squeeze=False)
    phases = ("vision", "audio", "llm")
    for ax, model in zip(axes[0], models, strict=True):
        for j, placement in enumerate(("none", "node")):
            rs = pick("fig13", model=model, placement=placement, policies="tailored")
            vals = [
                np.mean([r[f"inter_node_bytes_mean_rank_{p}"] for r in rs]) / 1e6 if rs else 0
                for p in phases
            ]
            ax.bar(np.arange(3) + 0.4 * j, vals, 0.4, label=f"placement={placement}")
        ax.set_xticks(np.arange(3) + 0.2, phases)
        ax.set_title(model)
        ax.set_ylabel("inter-node MB per rank, mean over seeds")
        ax.legend(fontsize=7)
    save(fig, "fig13_internode.png")

    sens = pick("sensitivity")
    if sens:
        fig, axes = plt.subplots(2, len(models), figsize=(4.5 * len(models), 6), squeeze=False)
        for j, model in enumerate(models):
            rs = sorted(
                (r for r in sens if r["model"] == model and r["varied"] == "scale"),
                key=lambda r: r["length_scale"],
            )
            x = [r["length_scale"] for r in rs]
            for key, style, at in (
                ("product", "s-", "own b"),
                ("at_paper_product", "o--", "paper's b"),
            ):
                y = [r[key] if r[key] else np.nan for r in rs]
                axes[0][j].plot(x, y, style, label=f"full/none at {at}")
            axes[0][j].set_title(model)
            axes[0][j].set_ylabel("MFU ratio full/none")
            axes[0][j].legend(fontsize=7)
            for key, style in (("b_none", "o--"), ("b_full", "s-")):
                axes[1][j].plot(x, [r[key] for r in rs], style, label=key)
                axes[1][j].axhline(rs[0][f"paper_{key}"], color="gray", lw=0.8, ls=style[1:])
            axes[1][j].set_xlabel("length scale")
            axes[1][j].set_ylabel("largest mini-batch (gray: paper's)")
            axes[1][j].legend(fontsize=7)
        save(fig, "sensitivity.png")

    rs = sorted(pick("table2"), key=lambda r: r["ranks"])
    if rs:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        d = [r["ranks"] for r in rs]
        ax.plot(d, [r["dispatch_fwd_ms"] for r in rs], "s-", label="sim overhead")
        ax.plot(d, [r["paper_overhead_ms"] for r in rs], "o--", label="paper overhead")
        ax.plot(d, [r["plan_ms"] for r in rs], "^:", label="measured plan (hidden)")
        ax.set_xscale("log")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("ms")
        ax.legend(fontsize=7)
        save(fig, "table2_overhead.png")
    return written
