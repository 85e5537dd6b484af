"""The trainer's peak memory per phase of a step, measured, beside the memory model's prediction.

Runs the real entry point on one process, ``torchrun --standalone --nproc_per_node=1 -m
orchmllm.train`` (NCCL and one GPU on CUDA, gloo on CPU), for a few steps with
``--memory-report`` (:mod:`orchmllm.phase_memory`: ``torch.cuda.max_memory_allocated`` reset
and read around the forward, the backward and the optimizer step, and the step's batch). For
every step it then predicts the same step's batch with the simulator's memory model
(:class:`orchmllm.sim.memory.MemoryModel`) set to the trainer's recipe as it is today:

- one rank holds everything (shard group 1); FSDP2 still gathers its units into buffers of
  their own (the model's three units);
- parameters, gradients and AdamW's two moments all in the storage dtype (``--precision``):
  four times its bytes per parameter, no fp32 master copy;
- no activation checkpointing (every block keeps its activations) and the loss takes the
  logits of all the rank's tokens at once (no chunking).

Compared per phase: the backward against the model's peak (its largest backward moment), the
optimizer step against the model's static bytes (parameters, gradients, optimizer state; the
step's temporaries are not modelled). The model has no forward moment: the forward is
reported measured only. Step 0 has no optimizer state yet (AdamW creates it in its first
step), so its backward lies below the model's; compare from step 1. What the model leaves out
(it is a lower bound): the token embedding's parameters (the records give the model's own
parameter count beside the simulator's), connectors and the audio front end, allocator
fragmentation, intermediates inside a block's backward.

On CUDA the default is ``configs/mllm-10b-1gpu.yaml`` in bfloat16 for 5 steps; with ``--quick``
or without a GPU, ``configs/tiny.yaml`` in float32 for 2 steps. On CPU there is no allocator
counter: the measured figures are null and only the path is exercised.

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

from orchmllm.config import PRECISIONS, TrainRecipe, load_config
from orchmllm.models import MLLM, storage_dtype
from orchmllm.phase_memory import PHASES as STEP_PHASES
from orchmllm.provenance import write_records
from orchmllm.schema import LLM
from orchmllm.sim.batch import Batch
from orchmllm.sim.compute import submodules
from orchmllm.sim.memory import MemoryModel, phase_tokens

ROOT = Path(__file__).resolve().parents[1]
# What the memory model predicts for each phase of the trainer's step (module docstring).
PREDICTED = {"forward": None, "backward": "peak", "optimizer": "static"}


def trainer_memory(dtype: torch.dtype) -> MemoryModel:
    """The memory model set to the trainer's recipe today (module docstring)."""
    return MemoryModel(
        shard_group=1,
        trained_param_bytes=4 * dtype.itemsize,  # parameter, gradient, two AdamW moments
        logit_chunk_tokens=2**62,  # the whole sequence's logits at once
    )


def predict(config: Path, batch: Batch, dtype: torch.dtype) -> dict[str, float]:
    """The memory model's ``peak`` and ``static`` bytes for one rank holding ``batch``."""
    cfg = load_config(str(config)).model
    modules = submodules(cfg, checkpointing=False)
    lengths = {name: batch.encoder_lengths(name, cfg) for name in cfg.encoders}
    lengths[LLM] = batch.llm_lengths(cfg)
    tokens = {
        p: phase_tokens(modules[p].kind, n, np.zeros(n.size, dtype=np.int64), 1)
        for p, n in lengths.items()
    }
    mem = trainer_memory(dtype)
    return {
        "peak": float(mem.peak_bytes(modules, tokens, 1)[0]),
        "static": float(mem.static_bytes(modules, 1)),
        "sim_parameters": float(sum(m.parameters for m in modules.values())),
        "llm_tokens": int(lengths[LLM].sum()),
    }


def model_parameters(config: Path) -> int:
    """The reference model's own parameter count (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = MLLM(load_config(str(config)).model)
    return sum(p.numel() for p in model.parameters())


def run_trainer(
    config: Path, *, steps: int, precision: str, workdir: Path, timeout: float
) -> list[dict]:
    """Train ``steps`` steps on one process with ``--memory-report``; its report's lines."""
    report = workdir / "memory.jsonl"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
        "-m", "orchmllm.train", "--config", str(config), "--steps", str(steps),
        "--precision", precision, "--balance", "full", "--progress", "lines",
        "--memory-report", str(report), "--data-dir", str(workdir / "data"),
    ]  # fmt: skip
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout, check=True)
    return [json.loads(line) for line in report.read_text().splitlines() if line.strip()]


def _shown(path: Path) -> str:
    """``path`` relative to the checkout when inside it (records stay machine-independent)."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def records_of(report: list[dict], *, config: Path, precision: str, device: str) -> list[dict]:
    """One flat record per (step, phase): measured and predicted bytes."""
    params = model_parameters(config)
    records = []
    for line in report:
        batch = Batch.from_record(line["batch"])
        pred = predict(config, batch, storage_dtype(TrainRecipe(precision=precision)))
        for phase in STEP_PHASES:
            measured = line["phases"][phase]
            figure = PREDICTED[phase]
            predicted = pred[figure] if figure else None
            peak = measured["peak_bytes"]
            records.append(
                {
                    "step": line["step"],
                    "phase": phase,
                    "device": device,
                    "config": _shown(config),
                    "precision": precision,
                    "source": line["source"],
                    "measured_peak_bytes": peak,
                    "measured_allocated_bytes": measured["allocated_bytes"],
                    "predicted_figure": figure,
                    "predicted_bytes": predicted,
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
        f"parameters: the memory model counts {r0['sim_parameters'] / 1e6:,.1f} M, the model "
        f"has {r0['model_parameters'] / 1e6:,.1f} M (the token embedding, connectors and the "
        "audio front end are not in the memory model)"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="run config (default: mllm-10b-1gpu on CUDA)")
    ap.add_argument("--steps", type=int, default=None, help="steps (5 on CUDA, 2 on CPU)")
    ap.add_argument("--precision", choices=PRECISIONS, default=None)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds the trainer may run")
    ap.add_argument("--quick", action="store_true", help="tiny config on CPU, seconds")
    ap.add_argument("--json", default=None, help="write the records (a JSON list) here")
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()  # the trainer computes on the GPU whenever there is one
    full = cuda and not args.quick
    default = "mllm-10b-1gpu.yaml" if full else "tiny.yaml"
    config = (Path(args.config) if args.config else ROOT / "configs" / default).resolve()
    steps = args.steps or (5 if full else 2)
    precision = args.precision or ("bf16-mixed" if full else "float32")
    with tempfile.TemporaryDirectory(prefix="train_memory_") as tmp:
        report = run_trainer(
            config, steps=steps, precision=precision, workdir=Path(tmp), timeout=args.timeout
        )
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    records = records_of(report, config=config, precision=precision, device=device)
    print_table(records)
    if args.json:
        write_records(args.json, records)
    return records


if __name__ == "__main__":
    main(sys.argv[1:])
