"""The main job: the tiny multimodal model trained with every ``--balance`` mode, 4 processes.

For each mode this runs the training entry point as a user does::

    torchrun --standalone --nproc_per_node=4 -m orchmllm.train --config configs/tiny.yaml \\
        --balance MODE --metrics PATH

(4 gloo processes; the tiny config treats them as 2 nodes of 2 and places with ``auto``), one
mode after another on the same synthetic dataset, and summarises each run's metrics with
``orchmllm.train.report.summarize``: per phase the imbalance (the slowest rank's load over the mean,
under that phase's cost model) before and after balancing, averaged over steps, and the
all-to-all bytes inside and across nodes; the first and final loss; the mean step time after
the first step. Balancing rearranges examples and never changes training, so every mode
reaches the same loss (``tests/test_train.py`` checks the parameters too).

    python benchmarks/train_modes.py [--quick] [--json PATH] [--steps N] [--modes ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from orchmllm.planner.step_options import MODES
from orchmllm.provenance import write_records
from orchmllm.train.report import load_metrics, summarize

ROOT = Path(__file__).resolve().parents[1]
NPROC = 4


def train(mode: str, *, config: str, steps: int, workdir: Path, timeout_s: float) -> Path:
    """One ``torchrun`` of ``orchmllm.train`` with ``--balance mode``; its metrics file."""
    metrics = workdir / f"{mode}.jsonl"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={NPROC}", "-m", "orchmllm.train", "--config", config,
        "--balance", mode, "--steps", str(steps), "--seed", "0", "--quiet",
        "--metrics", str(metrics), "--data-dir", str(workdir / "data"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"--balance {mode} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return metrics


def record(mode: str, config: str, metrics: Path) -> dict:
    """The run's summary (``orchmllm.train.report.summarize``), flat, with what it ran."""
    summary = summarize(load_metrics(metrics))
    phases = summary.pop("phases")
    return {"mode": mode, "config": config, "nproc": NPROC, "phase_names": phases, **summary}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 steps, modes none and full")
    ap.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=None, help="default: the config's (quick: 2)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=None)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mode")
    args = ap.parse_args(argv)
    modes = args.modes or (("none", "full") if args.quick else MODES)
    steps = args.steps or (2 if args.quick else 10)
    records = []
    with tempfile.TemporaryDirectory(prefix="train_modes_") as tmp:
        for mode in modes:
            path = train(
                mode, config=args.config, steps=steps, workdir=Path(tmp), timeout_s=args.timeout
            )
            rec = record(mode, args.config, path)
            records.append(rec)
            phases = "  ".join(
                f"{p} {rec[f'{p}_imbalance_before_mean']:.3f}"
                f"->{rec[f'{p}_imbalance_after_mean']:.3f}"
                f" ({rec[f'{p}_bytes_inter_total'] / rec['steps'] / 1e3:.1f} KB/step across nodes)"
                for p in rec["phase_names"]
            )
            print(
                f"--balance {mode:4s} loss {rec['loss_first']:.4f} -> {rec['loss_last']:.4f}  "
                f"step {rec['step_time_mean_s'] * 1e3:.1f} ms  {phases}",
                flush=True,
            )
    losses = [r["loss_last"] for r in records]
    print(f"final losses differ between modes by at most {max(losses) - min(losses):.2e}")
    if args.json:
        write_records(args.json, records)
    return records


if __name__ == "__main__":
    main()
