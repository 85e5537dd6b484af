"""Plots and a text summary from the training metrics (``orchmllm.train --metrics``).

Usage::

    python -m orchmllm.train.report METRICS.jsonl --out DIR [--step N]

Writes into DIR:

- ``loads.png``: per-rank load of every phase before and after balancing, for one step
  (the last by default), so the reader sees what the rearrangement did to the slowest rank;
- ``step_time.png``: step time over steps;
- ``imbalance.png``: per-phase imbalance (max/mean load) before and after, over steps;
- ``memory.png``: the largest rank's anonymous and file-backed resident memory over steps, so
  a leak (anonymous memory that keeps growing) is told apart from the memory-mapped dataset's
  page cache (file-backed, growing as the epoch reads it); when the records have them;
- ``summary.txt``: the numbers of :func:`summarize`, also printed.

The input is one JSON object per line, the schema written by ``orchmllm.train``:
``{"step", "loss", "step_time_s", "tokens_per_s", "balance", "world_size",
"phases": {name: {"imbalance_before", "imbalance_after", "load_max_before",
"load_max_after", "bytes_intra", "bytes_inter", "plan_ms"}}}``; the per-rank
``"loads_before"``/``"loads_after"`` of each phase are there when training ran with
``--metrics-per-rank``, and ``loads.png`` needs them (it is skipped otherwise).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from orchmllm.schema import LLM, MODALITIES  # noqa: E402

STEP_FIELDS = ("step", "step_time_s", "tokens_per_s", "world_size", "phases")
PHASE_FIELDS = ("imbalance_before", "imbalance_after", "bytes_intra", "bytes_inter", "plan_ms")
PER_RANK = ("loads_before", "loads_after")  # optional (train --metrics-per-rank)
#: The resident memory kinds the trainer records (``rss_<kind>_mb_max``), with their labels.
MEMORY_KINDS = {"anon": "anonymous (heaps, tensors)", "file": "file-backed (dataset, libraries)"}


def _bad(path: str | os.PathLike, where: str, why: str) -> ValueError:
    return ValueError(f"metrics={str(path)!r}: {where}: {why}")


def _check_number(path, where: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(path, where, f"expected a finite number, got {value!r}")


def _check_object(path, where: str, value: Any, fields: tuple[str, ...]) -> None:
    if not isinstance(value, dict):
        raise _bad(path, where, f"expected a JSON object, got {type(value).__name__}")
    missing = [k for k in fields if k not in value]
    if missing:
        raise _bad(path, where, f"missing field(s) {missing}")


def _check_record(path, lineno: int, rec: Any) -> None:
    where = f"line {lineno}"
    _check_object(path, where, rec, STEP_FIELDS)
    for k in ("step", "step_time_s", "tokens_per_s", "world_size"):
        _check_number(path, f"{where} field {k!r}", rec[k])
    world = rec["world_size"]
    if world != int(world) or world < 1:
        raise _bad(path, f"{where} field 'world_size'", f"expected an integer >= 1, got {world!r}")
    phases = rec["phases"]
    if not isinstance(phases, dict) or not phases:
        raise _bad(path, f"{where} field 'phases'", f"expected a non-empty object, got {phases!r}")
    for name, ph in phases.items():
        pw = f"{where} phase {name!r}"
        _check_object(path, pw, ph, PHASE_FIELDS)
        for k in PHASE_FIELDS:
            _check_number(path, f"{pw} field {k!r}", ph[k])
        if not all(k in ph for k in PER_RANK):  # then the slowest rank's loads must be there
            _check_object(path, pw, ph, ("load_max_before", "load_max_after"))
        for k in ("load_max_before", "load_max_after"):
            if k in ph:
                _check_number(path, f"{pw} field {k!r}", ph[k])
        for k in (k for k in PER_RANK if k in ph):
            loads = ph[k]
            if not isinstance(loads, list) or len(loads) != world:
                raise _bad(path, f"{pw} field {k!r}", f"expected {int(world)} per-rank loads")
            for v in loads:
                _check_number(path, f"{pw} field {k!r}", v)


def load_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read and validate a metrics file; one dict per step, in file order.

    Raises ``ValueError`` naming the file and the offending line for a missing, empty or
    malformed file, so a broken training run is reported, not plotted as nonsense.
    """
    p = Path(path)
    if not p.is_file():
        raise _bad(path, "file", "does not exist or is not a regular file")
    records = []
    with p.open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise _bad(path, f"line {lineno}", f"not valid JSON ({e.msg})") from None
            _check_record(path, lineno, rec)
            records.append(rec)
    if not records:
        raise _bad(path, "file", "contains no metrics records")
    worlds = {int(r["world_size"]) for r in records}
    if len(worlds) != 1:
        raise _bad(path, "field 'world_size'", f"differs between steps: {sorted(worlds)}")
    return records


def phase_names(records: Sequence[dict[str, Any]]) -> list[str]:
    """Every phase seen in any step, in execution order (encoders, then llm)."""
    names = {n for r in records for n in r["phases"]}
    order = [*MODALITIES, LLM]  # the table's order now (a plugin's row included), then llm
    return sorted(names, key=lambda n: (n == LLM, order.index(n) if n in order else len(order), n))


def _timed(records: Sequence[dict[str, Any]]) -> Sequence[dict[str, Any]]:
    # The first step pays for warm-up (allocator, lazy init); leave it out when there are more.
    return records[1:] if len(records) > 1 else records


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Summary numbers of a run; flat keys, ``<phase>_<stat>`` for per-phase numbers.

    Step time, throughput and planning time are means over the steps after the first (warm-up:
    allocator, lazy imports, solver start-up), or over the only step; imbalance and bytes over
    all steps. ``<phase>_max_load_ratio`` is the mean over steps of
    max(loads_before)/max(loads_after): how much faster the slowest rank of that phase got.
    """
    if not records:
        raise ValueError("records=[]: need at least one metrics record")
    timed = _timed(records)
    out: dict[str, Any] = {
        "steps": len(records),
        "world_size": int(records[0]["world_size"]),
        "balance": str(records[0].get("balance", "unknown")),
        "placement": str(records[0].get("placement", "unknown")),
        "phases": phase_names(records),
        "timed_steps": len(timed),
        "step_time_mean_s": float(np.mean([r["step_time_s"] for r in timed])),
        "tokens_per_s_mean": float(np.mean([r["tokens_per_s"] for r in timed])),
    }
    losses = [r["loss"] for r in records if isinstance(r.get("loss"), (int, float))]
    if losses:
        out["loss_first"] = float(losses[0])
        out["loss_last"] = float(losses[-1])
    for name in phase_names(records):
        phs = [r["phases"][name] for r in records if name in r["phases"]]
        ratios = [before / after for before, after in map(_max_loads, phs) if after > 0]
        out[f"{name}_imbalance_before_mean"] = float(np.mean([p["imbalance_before"] for p in phs]))
        out[f"{name}_imbalance_after_mean"] = float(np.mean([p["imbalance_after"] for p in phs]))
        out[f"{name}_max_load_ratio_mean"] = float(np.mean(ratios)) if ratios else float("nan")
        timed_phs = [r["phases"][name] for r in timed if name in r["phases"]] or phs
        out[f"{name}_plan_ms_mean"] = float(np.mean([p["plan_ms"] for p in timed_phs]))
        out[f"{name}_bytes_intra_total"] = float(np.sum([p["bytes_intra"] for p in phs]))
        out[f"{name}_bytes_inter_total"] = float(np.sum([p["bytes_inter"] for p in phs]))
    return out


def _max_loads(ph: dict[str, Any]) -> tuple[float, float]:
    """The slowest rank's load before and after balancing (older files: per-rank only)."""
    if "load_max_before" in ph:
        return ph["load_max_before"], ph["load_max_after"]
    return max(ph["loads_before"]), max(ph["loads_after"])


def has_per_rank_loads(record: dict[str, Any]) -> bool:
    return all(k in ph for ph in record["phases"].values() for k in PER_RANK)


def format_summary(summary: dict[str, Any]) -> str:
    """Human-readable text of :func:`summarize`'s dict (a header and one row per phase)."""
    s = summary
    lines = [
        f"balance={s['balance']}  placement={s['placement']}  world_size={s['world_size']}"
        f"  steps={s['steps']}",
        f"step time (mean of {s['timed_steps']} step(s)): {s['step_time_mean_s']:.4f} s",
        f"tokens/s (mean of {s['timed_steps']} step(s)): {s['tokens_per_s_mean']:.1f}",
    ]
    if "loss_first" in s:
        lines.append(f"loss: {s['loss_first']:.4f} (first) -> {s['loss_last']:.4f} (last)")
    lines.append(
        f"{'phase':<8}{'imb before':>11}{'imb after':>11}{'max-load x':>11}"
        f"{'plan ms':>9}{'MB intra':>10}{'MB inter':>10}"
    )
    for n in s["phases"]:
        lines.append(
            f"{n:<8}{s[f'{n}_imbalance_before_mean']:>11.3f}{s[f'{n}_imbalance_after_mean']:>11.3f}"
            f"{s[f'{n}_max_load_ratio_mean']:>11.3f}{s[f'{n}_plan_ms_mean']:>9.2f}"
            f"{s[f'{n}_bytes_intra_total'] / 1e6:>10.2f}{s[f'{n}_bytes_inter_total'] / 1e6:>10.2f}"
        )
    return "\n".join(lines) + "\n"


def _pick_step(records: Sequence[dict[str, Any]], step: int | None) -> dict[str, Any]:
    if step is None:
        return records[-1]
    for r in records:
        if int(r["step"]) == step:
            return r
    have = [int(r["step"]) for r in records]
    raise ValueError(f"step={step!r}: not in the metrics (steps {have[0]}..{have[-1]})")


def plot_loads(record: dict[str, Any], path: str | os.PathLike) -> None:
    """Grouped bars: each rank's load before and after balancing, one panel per phase."""
    names = phase_names([record])
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        ph = record["phases"][name]
        before, after = np.asarray(ph["loads_before"]), np.asarray(ph["loads_after"])
        x = np.arange(len(before))
        ax.bar(x - 0.2, before, 0.4, label="before", color="#c44e52")
        ax.bar(x + 0.2, after, 0.4, label="after", color="#4c72b0")
        ax.axhline(before.mean(), color="grey", lw=0.8, ls="--", label="mean before")
        ax.set_title(
            f"{name}: max/mean {ph['imbalance_before']:.2f} -> {ph['imbalance_after']:.2f}",
            fontsize=9,
        )
        ax.set_xlabel("rank")
        ax.set_xticks(x)
        ax.set_ylabel("load (cost model units)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(
        f"Per-rank load, step {record['step']} (balance={record.get('balance', '?')})",
        x=0.02,
        ha="left",
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_step_time(records: Sequence[dict[str, Any]], path: str | os.PathLike) -> None:
    """Step time per step; the first (warm-up) step is drawn but marked."""
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(steps, [r["step_time_s"] for r in records], marker="o", ms=3)
    if len(records) > 1:
        ax.axhline(
            summarize(records)["step_time_mean_s"],
            color="grey",
            ls="--",
            lw=0.8,
            label="mean (after the first step)",
        )
        ax.legend(fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (s)")
    ax.set_title(f"Step time (balance={records[0].get('balance', '?')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_imbalance(records: Sequence[dict[str, Any]], path: str | os.PathLike) -> None:
    """Per-phase max/mean load over steps: dashed before, solid after balancing."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for i, name in enumerate(phase_names(records)):
        color = f"C{i}"
        steps = [r["step"] for r in records if name in r["phases"]]
        phs = [r["phases"][name] for r in records if name in r["phases"]]
        ax.plot(
            steps,
            [p["imbalance_before"] for p in phs],
            ls="--",
            color=color,
            label=f"{name} before",
        )
        ax.plot(
            steps,
            [p["imbalance_after"] for p in phs],
            ls="-",
            marker="o",
            ms=3,
            color=color,
            label=f"{name} after",
        )
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set_xlabel("step")
    ax.set_ylabel("imbalance (max/mean load)")
    ax.set_title(f"Imbalance per phase (balance={records[0].get('balance', '?')})", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def has_memory(records: Sequence[dict[str, Any]]) -> bool:
    """Whether every record has the resident memory ``orchmllm.train`` writes."""
    return all(f"rss_{kind}_mb_max" in r for r in records for kind in MEMORY_KINDS)


def plot_memory(records: Sequence[dict[str, Any]], path: str | os.PathLike) -> None:
    """The largest rank's resident memory per step, one line per kind."""
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for kind, label in MEMORY_KINDS.items():
        ax.plot(steps, [r[f"rss_{kind}_mb_max"] for r in records], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("resident memory (MB)")
    ax.set_title("Host memory of the largest rank", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_report(
    metrics: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None
) -> dict[str, Any]:
    """Validate ``metrics``, write the PNGs and ``summary.txt`` into ``out``.

    ``loads.png`` only when the chosen step has per-rank loads (train --metrics-per-rank).
    Returns the summary dict plus ``files``: the paths written.
    """
    records = load_metrics(metrics)
    chosen = _pick_step(records, step)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {
        "step_time": out_dir / "step_time.png",
        "imbalance": out_dir / "imbalance.png",
        "summary": out_dir / "summary.txt",
    }
    if has_per_rank_loads(chosen):
        files["loads"] = out_dir / "loads.png"
        plot_loads(chosen, files["loads"])
    plot_step_time(records, files["step_time"])
    plot_imbalance(records, files["imbalance"])
    if has_memory(records):
        files["memory"] = out_dir / "memory.png"
        plot_memory(records, files["memory"])
    summary = summarize(records)
    files["summary"].write_text(format_summary(summary))
    return {**summary, "files": {k: str(v) for k, v in files.items()}}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m orchmllm.train.report", description=__doc__.split("\n")[0]
    )
    ap.add_argument("metrics", help="JSON-lines metrics file written by orchmllm.train --metrics")
    ap.add_argument("--out", required=True, help="directory for the PNGs and summary.txt")
    ap.add_argument(
        "--step", type=int, default=None, help="step for the per-rank load plot (default: the last)"
    )
    args = ap.parse_args(argv)
    try:
        result = write_report(args.metrics, args.out, step=args.step)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(Path(result["files"]["summary"]).read_text(), end="")
    for name, path in result["files"].items():
        if name != "summary":
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
