"""The step records: what ``--metrics`` writes per step (one JSON line, rank 0), the line
the progress report shows, and the running means of the closing table."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np


def step_phase_stats(micro: list[dict[str, dict]]) -> dict[str, dict]:
    """One optimizer step's per-phase statistics from its micro-steps' (one micro-step: its
    own, unchanged). Each micro-step waits for its slowest rank, so a phase's
    ``load_max_before``/``after`` is the sum of the micro-steps' slowest loads and its
    imbalance that sum over the sum of their mean loads; per-rank loads, bytes, items and
    planning times add up."""
    if len(micro) == 1:
        return micro[0]
    out = {}
    for name in micro[0]:
        parts = [m[name] for m in micro]
        merged = {
            key: sum(p[key] for p in parts) for key in parts[0] if not key.startswith("loads_")
        }
        for when in ("before", "after"):
            loads = np.asarray([p[f"loads_{when}"] for p in parts], dtype=np.float64)
            slowest, mean = float(loads.max(axis=1).sum()), float(loads.mean(axis=1).sum())
            merged[f"loads_{when}"] = loads.sum(axis=0).tolist()
            merged[f"load_max_{when}"] = slowest
            merged[f"imbalance_{when}"] = slowest / mean if mean > 0 else 1.0
        out[name] = merged
    return out


def phase_record(stats: dict[str, Any], *, per_rank: bool) -> dict[str, Any]:
    """A phase's metrics for the step record: scalars (imbalance, the slowest rank's load
    before and after, bytes, planning time), plus every rank's load when ``per_rank``
    (summed over micro-steps: :func:`step_phase_stats`)."""
    out = {k: v for k, v in stats.items() if k not in ("loads_before", "loads_after")}
    out.setdefault("load_max_before", max(stats["loads_before"]))
    out.setdefault("load_max_after", max(stats["loads_after"]))
    if per_rank:
        out["loads_before"], out["loads_after"] = stats["loads_before"], stats["loads_after"]
    return out


def start_metrics(path: str, *, start: int) -> None:
    """Begin ``--metrics`` for a run starting at step ``start``: empty, or, when resuming,
    only the lines of the steps before ``start`` (later ones are not in the checkpoint)."""
    kept = []
    if start > 0 and os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] < start]
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def append_metrics(path: str, record: dict[str, Any]) -> None:
    """One JSON line, on disk when this returns (opened per step: a crash keeps the record,
    and nothing stays open across steps)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class RunningSummary:
    """Running means of the step records, for the closing table: its memory does not grow
    with the number of steps (the records themselves go to ``--metrics``)."""

    _KEYS = (
        "imbalance_before", "imbalance_after", "load_max_before", "load_max_after",
        "bytes_intra", "bytes_inter", "plan_ms",
    )  # fmt: skip

    def __init__(self) -> None:
        self.steps = 0
        self.sums: dict[str, dict[str, float]] = {}  # phase -> key -> sum, from the first step
        self.timed_s = 0.0  # step times after the first step of this process (warm-up)
        self.first: dict[str, Any] | None = None
        self.last_loss = float("nan")
        self.split: dict[str, list[int]] = {}  # phase -> [items split, pieces], summed

    def add(self, record: dict[str, Any]) -> None:
        if self.first is None:
            self.first = {k: v for k, v in record.items() if k != "phases"}
        else:
            self.timed_s += record["step_time_s"]
        self.steps += 1
        self.last_loss = record["loss"]
        for name, phase in record["phases"].items():
            sums = self.sums.setdefault(name, dict.fromkeys(self._KEYS, 0.0))
            for key in self._KEYS:
                sums[key] += phase[key]
            if "items_split" in phase:  # context parallelism
                split = self.split.setdefault(name, [0, 0])
                split[0] += phase["items_split"]
                split[1] += phase["pieces"]

    def table(self) -> str:
        """Per-phase means over the steps: imbalance before/after (max/mean load), the
        slowest rank's load before -> after (the phase's cost units: what a step waits for;
        under a padded cost the ratio's mean shrinks with the padding a plan removes), bytes
        moved intra- and inter-node per step, planning time; with context parallelism the
        items split and their pieces; then the mean step time."""
        if self.first is None:
            return "no steps run"
        lines = [
            f"{'phase':<8}{'imbalance before':>18}{'imbalance after':>17}{'slowest rank':>17}"
            f"{'KB intra/step':>15}{'KB inter/step':>15}{'plan ms':>9}"
        ]
        for name, sums in self.sums.items():
            m = {k: v / self.steps for k, v in sums.items()}
            slowest = f"{m['load_max_before']:.0f} -> {m['load_max_after']:.0f}"
            lines.append(
                f"{name:<8}{m['imbalance_before']:>18.3f}{m['imbalance_after']:>17.3f}"
                f"{slowest:>17}{m['bytes_intra'] / 1e3:>15.1f}{m['bytes_inter'] / 1e3:>15.1f}"
                f"{m['plan_ms']:>9.2f}"
            )
        for name, (items, pieces) in self.split.items():
            lines.append(
                f"{name}: {items} items split into {pieces} pieces over {self.steps} steps "
                "(context parallelism)"
            )
        f = self.first
        step_s = self.timed_s / (self.steps - 1) if self.steps > 1 else f["step_time_s"]
        lines.append(
            f"balance={f['balance']} placement={f['placement']} world={f['world_size']} "
            f"ranks/node={f['ranks_per_node']} steps={self.steps} "
            f"mean step {step_s * 1e3:.1f} ms (after the first)  final loss {self.last_loss:.4f}"
        )
        return "\n".join(lines)


def progress_line(r: dict[str, Any]) -> str:
    """The step's line in the progress report (rank 0)."""
    imb = "  ".join(
        f"{name} {p['imbalance_before']:.2f}->{p['imbalance_after']:.2f}"
        for name, p in r["phases"].items()
    )
    return (
        f"step {r['step']:4d}  loss {r['loss']:.4f}  {r['step_time_s'] * 1e3:7.1f} ms  "
        f"{r['tokens_per_s']:8.0f} tok/s  imbalance {imb}"
    )
