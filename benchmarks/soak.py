"""Soak: does a long run's memory stay flat? The tiny config trained for 1,000+ steps.

Runs the training entry point as a user does::

    torchrun --standalone --nproc_per_node=NPROC -m orchmllm.train --config configs/tiny.yaml \\
        --steps STEPS --metrics PATH

and reads, per step, every rank's resident memory from the metrics (``--metrics-per-rank``,
:mod:`orchmllm.train.host_memory`): anonymous memory (heaps, tensors: what a leak grows) and
file-backed memory (the memory-mapped dataset's pages, page cache the kernel reclaims; it grows
as the epoch reads new examples, which is not a leak). After the warm-up steps (the optimizer's
state, the allocator's first arenas) each rank's growth per 100 steps is the least-squares
slope of its anonymous memory over the steps, times 100, and the run is judged by the worst
rank's (a rank that grows faster than the one with the most memory is not hidden): the target
is under 2 MB per 100 steps. It prints the largest rank's memory every 100 steps and every
rank's slope.

``--native-cache N`` runs the trainer with torch's per-shape CPU kernel caches at N entries
(:func:`orchmllm.train.host_memory.bound_native_caches`; the trainer's own bound otherwise): 1024,
torch's default, shows the growth the bound removes.

    python benchmarks/soak.py [--quick] [--json PATH] [--steps N] [--warmup N] [--nproc N]
        [--native-cache N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from orchmllm.provenance import write_records
from orchmllm.train.host_memory import CACHE_CAPACITY, NATIVE_CACHES
from orchmllm.train.report import load_metrics

ROOT = Path(__file__).resolve().parents[1]
TARGET_MB_PER_100 = 2.0


def train(
    *, config: str, steps: int, nproc: int, native_cache: int, workdir: Path, timeout_s: float
) -> Path:
    """One ``torchrun`` of ``orchmllm.train`` with the native caches at ``native_cache``
    entries; its metrics file."""
    metrics = workdir / "soak.jsonl"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", "-m", "orchmllm.train", "--config", config,
        "--steps", str(steps), "--quiet", "--metrics", str(metrics), "--metrics-per-rank",
        "--data-dir", str(workdir / "data"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", **dict.fromkeys(NATIVE_CACHES, str(native_cache))}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"the soak run exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return metrics


def per_100(steps: np.ndarray, mb: np.ndarray) -> float:
    """The least-squares slope of ``mb`` over ``steps``, per 100 steps."""
    return float(np.polyfit(steps, mb, 1)[0] * 100) if steps.size > 1 else float("nan")


def summarize(records: list[dict], *, warmup: int) -> dict:
    """The memory figures of one run's step records (flat): every rank's growth, and the
    worst rank's, which the target judges."""
    steps = np.array([r["step"] for r in records])
    after = steps >= warmup
    out: dict = {"steps": int(steps.size), "warmup_steps": warmup}
    for kind in ("anon", "file"):
        largest = np.array([r[f"rss_{kind}_mb_max"] for r in records])
        ranks = np.array([r[f"rss_{kind}_mb_per_rank"] for r in records])  # [steps, ranks]
        growth = [per_100(steps[after], ranks[after, r]) for r in range(ranks.shape[1])]
        worst = int(np.argmax(growth))
        out[f"{kind}_mb_at_warmup"] = float(largest[after][0])
        out[f"{kind}_mb_end"] = float(largest[-1])
        out[f"{kind}_growth_mb_per_100_per_rank"] = growth
        out[f"{kind}_growth_mb_per_100"] = growth[worst]
        out[f"{kind}_growth_worst_rank"] = worst
        out[f"{kind}_mb_every_100"] = [float(largest[i]) for i in range(0, steps.size, 100)]
    out["target_max_anon_growth_mb_per_100"] = TARGET_MB_PER_100
    out["anon_growth_within_target"] = bool(out["anon_growth_mb_per_100"] < TARGET_MB_PER_100)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="40 steps, 10 of warm-up (seconds)")
    ap.add_argument("--json", metavar="PATH", help="write the record as a JSON list")
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=None, help="default 1200 (quick: 40)")
    ap.add_argument("--warmup", type=int, default=None, help="default 200 (quick: 10)")
    ap.add_argument("--nproc", type=int, default=2, help="processes (gloo ranks)")
    ap.add_argument("--timeout", type=float, default=7200.0, help="seconds for the run")
    ap.add_argument(
        "--native-cache", type=int, default=CACHE_CAPACITY,
        help=f"entries of torch's per-shape CPU kernel caches (default {CACHE_CAPACITY}, the "
        "trainer's bound; 1024 is torch's own)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    steps = args.steps or (40 if args.quick else 1200)
    warmup = args.warmup if args.warmup is not None else (10 if args.quick else 200)
    if not 0 <= warmup < steps - 1:
        ap.error(f"--warmup must be in [0, steps - 1), got {warmup} for {steps} steps")
    if args.native_cache < 1:
        ap.error(f"--native-cache must be >= 1, got {args.native_cache}")
    with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
        path = train(
            config=args.config, steps=steps, nproc=args.nproc, native_cache=args.native_cache,
            workdir=Path(tmp), timeout_s=args.timeout,
        )  # fmt: skip
        records = load_metrics(path)
    rec = {
        "config": args.config, "nproc": args.nproc, "native_cache": args.native_cache,
        **summarize(records, warmup=warmup),
    }  # fmt: skip
    print(f"{'step':>6}{'anon MB (largest rank)':>24}{'file MB (largest rank)':>24}")
    every_100 = zip(rec["anon_mb_every_100"], rec["file_mb_every_100"], strict=True)
    for i, (anon, file) in enumerate(every_100):
        print(f"{100 * i:>6}{anon:>24.1f}{file:>24.1f}")
    ranks = "  ".join(
        f"rank {r} {g:+.2f}" for r, g in enumerate(rec["anon_growth_mb_per_100_per_rank"])
    )
    verdict = "within" if rec["anon_growth_within_target"] else "OVER"
    print(
        f"after {warmup} warm-up steps, anonymous MB per 100 steps: {ranks}; worst rank "
        f"{rec['anon_growth_worst_rank']} {rec['anon_growth_mb_per_100']:+.2f}, {verdict} the "
        f"target (< {TARGET_MB_PER_100:g}); file-backed {rec['file_growth_mb_per_100']:+.2f} "
        "MB per 100 steps on the worst rank (the dataset's pages: page cache)"
    )
    if args.json:
        write_records(args.json, [rec])
    return [rec]


if __name__ == "__main__":
    main()
