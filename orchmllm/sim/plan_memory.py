"""Will a run fit? The trainer's predicted memory per GPU, and the largest mini-batch that fits.

    python -m orchmllm.sim.plan_memory --config configs/mllm-10b.yaml --gpu-memory 80 --gpus 64

For the config's model and training recipe (``recipe:``: precision, activation checkpointing,
loss chunk) on ``--gpus`` GPUs of ``--gpu-memory`` GB, FSDP sharding over ``--shard-group``
ranks (default: all of them, as ``orchmllm.train`` shards), this prints in seconds and without
a GPU:

- the static bytes per GPU (the sharded master weights and AdamW's moments);
- the largest ``examples_per_rank`` whose worst rank fits in every sampled step, without
  balancing (``none``) and with OrchMLLM (``full``), per seed: the paper's rule, on the
  simulator's workload (the config's data mix) and the real step planner
  (:func:`orchmllm.sim.sweep.fitting_minibatches`, the search ``benchmarks/reproduce_paper.py``
  runs for Figure 8: with its shard group, the paper's 256 (``--shard-group 256``), and its
  seeds, the two print the same mini-batches);
- the worst rank's predicted peak per phase (forward, backward, optimizer step) at the
  config's ``examples_per_rank`` and at the largest that fits.

With ``train.grad_accum`` > 1 the replay is one micro-step; the sharded gradients held between
micro-steps (:meth:`~orchmllm.sim.memory.MemoryModel.held_gradient_bytes`) come out of the
budget (with ``sync_micro_steps: false`` the unsharded ones are not modelled: it says so).

The memory model (:mod:`orchmllm.sim.memory`) takes its per-phase peaks from one of two
sources (``--memory-source``): ``replay`` (the default), the trainer's step replayed op by op
(:mod:`orchmllm.sim.allocations`, checked against the allocator on CPU and torch's tracker);
``oracle``, forms fitted to torch's own tracker of the step (:mod:`orchmllm.train.memory_fit`:
a few traced rank shapes, on fake tensors and a fake process group of the shard group's size),
cached under ``--cache-dir`` by the config's hash, plus what the tracker cannot see (the
attention kernels' workspaces, the moves, the previous batch: from the replay). The oracle
needs no memory code for a new architecture, but its first call for a config traces about
twenty steps of the whole model (fake tensors: seconds per step with one block per module,
minutes with a paper config's every block), so ``replay`` stays the default. ``--reserve`` GB
per GPU stand for the CUDA context, NCCL's buffers and fragmentation, which neither models.

This command imports the trainer's oracle, so it sits on the trainer's floor
(``tests/test_layering.py``); the simulator it drives stays torch-free.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchmllm.config import load_config
from orchmllm.sim.memory import PHASES, MemoryModel
from orchmllm.sim.step import Cluster
from orchmllm.sim.sweep import fitting_minibatches, load_model, placement_for, run_case
from orchmllm.train.memory_fit import OracleForms

GB = 1e9
MODES = ("none", "full")
SOURCES = ("replay", "oracle")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m orchmllm.sim.plan_memory", description=__doc__.split("\n")[0]
    )
    p.add_argument("--config", required=True, help="run config YAML")
    p.add_argument("--gpu-memory", type=float, default=80.0, help="GB per GPU (default 80)")
    p.add_argument("--gpus", type=int, default=None, help="data-parallel GPUs (default: one node)")
    p.add_argument(
        "--shard-group",
        type=int,
        default=None,
        help="ranks FSDP shards over (default: all GPUs, as orchmllm.train shards)",
    )
    p.add_argument(
        "--reserve", type=float, default=6.0, help="GB per GPU the step may not use (default 6)"
    )
    p.add_argument("--seeds", type=int, default=1, help="sampled seeds (0, 1, ...; default 1)")
    p.add_argument("--steps", type=int, default=None, help="sampled steps per seed")
    p.add_argument(
        "--memory-source",
        choices=SOURCES,
        default="replay",
        help="per-phase peaks from the hand replay (default) or forms fitted to torch's tracker",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="where fitted forms are cached (default: $ORCHMLLM_CACHE_DIR/memory_forms or "
        "~/.cache/orchmllm/memory_forms)",
    )
    args = p.parse_args(argv)
    for name in ("gpus", "shard_group", "seeds", "steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not args.gpu_memory > args.reserve >= 0:
        p.error(f"--gpu-memory ({args.gpu_memory}) must exceed --reserve ({args.reserve}) >= 0")
    if not Path(args.config).is_file():
        p.error(f"--config: no file at {args.config}")
    return args


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """Everything the command prints, as one record."""
    model = load_model(args.config)
    # default: one node (the config's ranks per node, 8 when unset)
    ranks = args.gpus or load_config(args.config).balance.ranks_per_node or 8
    group = args.shard_group or ranks
    train = load_config(args.config).train
    memory = MemoryModel(shard_group=group)
    held = memory.held_gradient_bytes(model.config, model.recipe, ranks)
    # gradients held between micro-steps: out of every phase's budget (the replay has none)
    held = held if train.grad_accum > 1 and train.sync_micro_steps else 0.0
    forms = OracleForms(cache=args.cache_dir) if args.memory_source == "oracle" else None
    memory = MemoryModel(
        gpu_bytes=args.gpu_memory * GB,
        reserve_bytes=args.reserve * GB + held,
        shard_group=group,
        forms=forms,
    )
    cluster = Cluster(memory=memory)
    total, trained = memory.parameters(model.config)
    record: dict[str, Any] = {
        "config": args.config,
        "memory_source": args.memory_source,
        "recipe": model.recipe,
        "gpus": ranks,
        "shard_group": min(group, ranks),
        "budget_gb": memory.budget_bytes / GB,
        "parameters": total,
        "trained_parameters": trained,
        "static_gb": memory.static_bytes(model.config, model.recipe, ranks) / GB,
        "train": train,
        "held_gradients_gb": held / GB,
        "largest": {m: [] for m in MODES},
        "peaks": {},
        "traced": forms.traced if forms else [],  # the fitted forms' keys traced (not cached)
    }
    for seed in range(args.seeds):
        pools, found = fitting_minibatches(
            model, ranks, MODES, seed=seed, steps=args.steps, cluster=cluster
        )
        for mode, (b, _) in found.items():
            record["largest"][mode].append(b)
        if seed == 0:
            for mode, (b, rec) in found.items():
                at = {"largest": (b, rec)}
                configured = model.data.examples_per_rank
                if configured < min(p.examples_per_rank for p in pools.values()):
                    at["config"] = (
                        configured,
                        _case(model, ranks, mode, configured, pools, cluster),
                    )
                record["peaks"][mode] = {k: v for k, v in at.items() if v[1] is not None}
    return record


def _case(model, ranks, mode, b, pools, cluster) -> dict[str, Any]:
    return run_case(
        model, ranks, mode, examples_per_rank=b, placement=placement_for(mode),
        steps=len(pools), pools=pools, cluster=cluster,
    )  # fmt: skip


def report(record: dict[str, Any]) -> str:
    r = record["recipe"]
    ck = {0: "off", 1: "every block"}.get(r.checkpointing, f"every {r.checkpointing}th block")
    lines = [
        f"{record['config']}: precision {r.precision}, checkpointing {ck}, loss chunk "
        f"{r.loss_chunk} tokens; memory from the {record['memory_source']}",
        f"{record['gpus']} GPUs, FSDP over {record['shard_group']}: budget "
        f"{record['budget_gb']:.1f} GB per GPU",
        f"static per GPU: {record['static_gb']:.2f} GB ({record['parameters'] / 1e9:.2f} B "
        f"parameters, {record['trained_parameters'] / 1e9:.2f} B trained: sharded master "
        "weights and AdamW moments)",
        "largest examples_per_rank that fits every sampled step (per seed):",
    ]
    for mode, bs in record["largest"].items():
        lines.append(f"  {mode:<5} {min(bs):>5}   seeds: {' '.join(map(str, bs))}")
    lines.append("peak per GPU, worst rank (GB, static included):")
    lines.append(f"  {'mode':<5} {'examples/rank':>14} " + " ".join(f"{p:>10}" for p in PHASES))
    for mode, at in record["peaks"].items():
        for which, (b, rec) in at.items():
            cells = " ".join(f"{rec[f'{p}_memory_gb']:>10.2f}" for p in PHASES)
            label = f"{b} ({which})"
            lines.append(f"  {mode:<5} {label:>14} {cells}")
    train = record["train"]
    if train.grad_accum > 1:  # the replay is one micro-step (MemoryModel.held_gradient_bytes)
        lines.append(
            f"grad_accum {train.grad_accum}: the sharded gradients held between micro-steps, "
            f"{record['held_gradients_gb']:.2f} GB per GPU, are taken from the budget; the peaks "
            "above are one micro-step's"
            if train.sync_micro_steps
            else f"grad_accum {train.grad_accum}, sync_micro_steps false: the unsharded "
            "gradients held between micro-steps are NOT counted; leave room for them"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    start = time.perf_counter()
    record = plan(args)
    print(report(record))
    print(f"({time.perf_counter() - start:.1f} s)")
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
