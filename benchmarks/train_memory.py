"""The trainer's peak memory per phase of a step, measured, beside the memory model's prediction.

Runs the real entry point on one process, ``torchrun --standalone --nproc_per_node=1 -m
orchmllm.train`` (NCCL and one GPU on CUDA, gloo on CPU), for a few steps with
``--memory-trace`` (:mod:`orchmllm.train.phase_memory`: ``torch.cuda.max_memory_allocated`` reset
and read around the forward, the backward and the optimizer step, and the step's batch) under
the config's training recipe (``recipe:``: precision, activation checkpointing, loss chunk).
For every step it then predicts the same step's batch with the simulator's memory model
(:class:`orchmllm.sim.memory.MemoryModel`) for that recipe: one rank holds everything (shard
group 1), the model replays the trainer's step (:mod:`orchmllm.sim.allocations`), and each
phase's prediction is the static bytes (fp32 master weights, AdamW's moments) plus that
phase's peak, the previous step's batch alive until the backward ends as in the trainer's
loop. Step 0 has no optimizer state yet (AdamW creates it in its first step), so its backward
lies below the model's; compare from step 1. Left out by the model: the CUDA context and
allocator fragmentation (what ``--reserve`` covers in ``orchmllm.sim.plan_memory``).

On CUDA the default is ``configs/mllm-10b-1gpu.yaml`` for 5 steps; with ``--quick`` or without
a GPU, ``configs/tiny.yaml`` for 2 steps. On CPU there is no allocator counter: the measured
figures are null and only the path is exercised (``tests/test_memory_measured.py`` checks the
model against the CPU allocator).

    python -m benchmarks.train_memory [--quick] [--config PATH] [--steps N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from orchmllm.config import TrainRecipe, load_config
from orchmllm.models import MLLM
from orchmllm.provenance import write_records
from orchmllm.sim.batch import Batch
from orchmllm.sim.layout import Layout
from orchmllm.sim.memory import MemoryModel
from orchmllm.train.phase_memory import PHASES as STEP_PHASES

ROOT = Path(__file__).resolve().parents[1]


def predict(config: Path, batch: Batch, *, device: str) -> dict[str, float]:
    """The memory model's bytes per phase (static included) for one rank holding ``batch``
    under the config's recipe."""
    run = load_config(str(config))
    cfg, recipe = run.model, run.recipe
    n = batch.text.size
    home = Layout(np.zeros(n, np.int64), {k: np.zeros(batch.of(k).raw.size, np.int64)
                                          for k in cfg.encoders})  # fmt: skip
    memory = MemoryModel(shard_group=1, device=device, threads=torch.get_num_threads())
    features = memory.rank_features(cfg, recipe, batch, home)
    static = memory.static_bytes(cfg, recipe, 1)
    peaks = memory.phase_peaks(cfg, recipe, features, num_ranks=1)
    return {
        **{p: static + float(v[0]) for p, v in peaks.items()},
        "static": static,
        "sim_parameters": float(memory.parameters(cfg)[0]),
        "llm_tokens": int(features["llm.tokens"][0]),
    }


def model_parameters(config: Path) -> int:
    """The reference model's own parameter count (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = MLLM(load_config(str(config)).model)
    return sum(p.numel() for p in model.parameters())


def run_trainer(config: Path, *, steps: int, workdir: Path, timeout: float) -> list[dict]:
    """Train ``steps`` steps on one process with ``--memory-trace``; its lines."""
    report = workdir / "memory.jsonl"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
        "-m", "orchmllm.train", "--config", str(config), "--steps", str(steps),
        "--balance", "full", "--progress", "lines",
        "--memory-trace", str(report), "--data-dir", str(workdir / "data"),
    ]  # fmt: skip
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout, check=True)
    return [json.loads(line) for line in report.read_text().splitlines() if line.strip()]


def _shown(path: Path) -> str:
    """``path`` relative to the checkout when inside it (records stay machine-independent)."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _recipe(recipe: TrainRecipe) -> dict:
    return {"precision": recipe.precision, "checkpointing": recipe.checkpointing,
            "loss_chunk": recipe.loss_chunk}  # fmt: skip


def records_of(report: list[dict], *, config: Path, device: str) -> list[dict]:
    """One flat record per (step, phase): measured and predicted bytes."""
    params = model_parameters(config)
    recipe = _recipe(load_config(str(config)).recipe)
    kernels = "cpu" if device == "cpu" else "cuda"
    records = []
    for line in report:
        batch = Batch.from_record(line["batch"])
        pred = predict(config, batch, device=kernels)
        for phase in STEP_PHASES:
            measured = line["phases"][phase]
            predicted = pred[phase]
            peak = measured["peak_bytes"]
            records.append(
                {
                    "step": line["step"],
                    "phase": phase,
                    "device": device,
                    "config": _shown(config),
                    **recipe,
                    "source": line["source"],
                    "measured_peak_bytes": peak,
                    "measured_allocated_bytes": measured["allocated_bytes"],
                    "predicted_figure": phase,
                    "predicted_bytes": predicted,
                    "predicted_static_bytes": pred["static"],
                    "measured_over_predicted": peak / predicted if peak and predicted else None,
                    "llm_tokens": pred["llm_tokens"],
                    **{f"{n}_items": it.raw.size for n, it in batch.items.items()},
                    "sim_parameters": pred["sim_parameters"],
                    "model_parameters": params,
                }
            )
    return records


def print_table(records: Sequence[dict]) -> None:
    def gib(v: float | None) -> str:
        return "-" if v is None else f"{v / 2**30:.2f}"

    print(
        f"{'step':>4} {'phase':>9} {'LLM tok':>8} {'peak GiB':>9} {'model GiB':>10}"
        f" {'(figure)':>9} {'meas/model':>10}"
    )
    for r in records:
        ratio = r["measured_over_predicted"]
        print(
            f"{r['step']:>4} {r['phase']:>9} {r['llm_tokens']:>8}"
            f" {gib(r['measured_peak_bytes']):>9} {gib(r['predicted_bytes']):>10}"
            f" {r['predicted_figure'] or '-':>9}"
            f" {'-' if ratio is None else f'{ratio:.3f}':>10}"
        )
    r0 = records[0]
    print(
        f"recipe: {r0['precision']}, checkpointing {r0['checkpointing']}, loss chunk "
        f"{r0['loss_chunk']}; parameters: the memory model counts "
        f"{r0['sim_parameters'] / 1e6:,.1f} M, the model has {r0['model_parameters'] / 1e6:,.1f} M"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="run config (default: mllm-10b-1gpu on CUDA)")
    ap.add_argument("--steps", type=int, default=None, help="steps (5 on CUDA, 2 on CPU)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds the trainer may run")
    ap.add_argument("--quick", action="store_true", help="tiny config on CPU, seconds")
    ap.add_argument("--json", default=None, help="write the records (a JSON list) here")
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.config and (k := load_config(args.config).train.grad_accum) > 1:
        # the trainer's memory report has a line per micro-step, the optimizer's on the last
        ap.error(f"--config: train.grad_accum must be 1 here (one step, one report), got {k}")
    return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()  # the trainer computes on the GPU whenever there is one
    full = cuda and not args.quick
    default = "mllm-10b-1gpu.yaml" if full else "tiny.yaml"
    # absolute, not resolved: configs/ links to the packaged configs, and records name it
    config = (Path(args.config) if args.config else ROOT / "configs" / default).absolute()
    steps = args.steps or (5 if full else 2)
    with tempfile.TemporaryDirectory(prefix="train_memory_") as tmp:
        report = run_trainer(config, steps=steps, workdir=Path(tmp), timeout=args.timeout)
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    records = records_of(report, config=config, device=device)
    print_table(records)
    if args.json:
        write_records(args.json, records)
    return records


if __name__ == "__main__":
    main(sys.argv[1:])
