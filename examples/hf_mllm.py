"""A Hugging Face vision-language model, data-parallel, balanced by its orchmllm adapter.

    torchrun --nproc_per_node=2 examples/hf_mllm.py --model qwen2-vl                 # balanced
    torchrun --nproc_per_node=2 examples/hf_mllm.py --model qwen2-vl --balance none  # plain
    torchrun --nproc_per_node=2 examples/hf_mllm.py --model qwen2.5-omni --modalities audio

``--model`` is any adapted family (``orchmllm.integrations.transformers.tiny.FAMILIES``),
built from a tiny config with random weights; the dataset holds the rows its processor would
give (placeholders expanded, pixel values, grids, audio features, labels), images, videos and
audio mixed (``--modalities`` picks a subset; ``text`` alone: text-only).

``--balance none`` is the plain script: ``DataLoader`` + ``DistributedSampler`` + DDP and the
model's own ``forward`` on padded batches (DDP, because FSDP2 needs every rank to call every
tower, and plain mixed batches do not). ``--balance full`` (or ``llm``) is the same script
with the lines marked ``# orchmllm`` changed: the adapter runs each tower as its own balanced
phase and the language model on packed sequences, sharded with FSDP2::

    +from orchmllm.integrations import transformers as omt
    -model = DDP(model, find_unused_parameters=True)
    +model = omt.shard(omt.wrap(model))
    -sampler = DistributedSampler(dataset, seed=seed)
    -loader = DataLoader(dataset, batch_size=8, sampler=sampler, collate_fn=collate)
    +loader = model.loader(dataset, batch_size=8, sampling=orchmllm.SamplingOptions(seed=seed))
    -    sampler.set_epoch(epoch)
    +    loader.set_epoch(epoch)
    -        n = orchmllm.global_num_items((batch["labels"][:, 1:] != -100).sum())
    -        loss = model(**batch, num_items_in_batch=n).loss * world_size
    +        loss = model(batch).loss * world_size

(Some transformers releases' Qwen3-VL and Omni forwards drop ``num_items_in_batch``, so the
plain run here takes the model's own loss function on its logits: ``hf_compat.plain_loss``.)
Both see the same global batch each step, so they print the same losses; the balanced run's
ranks are closer to equal in every phase (the imbalance is max/mean over ranks of the raw rows
each tower encoded and the tokens the language model ran).

``--loss exact`` computes the cross-entropy here, in the model's dtype, from each path's logits
(transformers' own loss upcasts to float32, so a float64 model is not float64 end to end);
``--save PATH`` writes every parameter and its AdamW state at the end (rank 0, full tensors),
which the tests compare between the plain and the balanced runs to 1e-10.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import orchmllm
from orchmllm.integrations import hf_compat
from orchmllm.integrations import transformers as omt  # orchmllm
from orchmllm.integrations.transformers import tiny
from orchmllm.train.progress import PROGRESS, StepProgress


def plain_loads(adapter: omt.Adapter, rows: list[dict]) -> dict[str, float]:
    """What the plain step computes per phase: each tower's raw rows, the LLM's tokens."""
    loads = dict.fromkeys([p.name for p in adapter.phases()], 0.0)
    loads["llm"] = 0.0
    for row in rows:
        ex = adapter.to_example(row)
        for p in adapter.phases():
            loads[p.name] += sum(len(a) for a in ex[p.key])
        loads["llm"] += len(row["input_ids"])
    return loads


def train(args: argparse.Namespace) -> list[dict]:
    """Train; returns per-step records (global loss; per-rank loads per phase), equal on all
    ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny.build_model(args.model, seed=args.seed, dtype=getattr(torch, args.dtype))
    modalities = [] if args.modalities == ["text"] else args.modalities
    dataset = tiny.make_rows(
        args.model,
        model,
        args.examples,
        modalities=modalities,
        seed=args.seed,
        text_only=args.text_only,
    )
    adapter = omt.adapter_for(model)
    phases = [p.name for p in adapter.phases()] + ["llm"]
    if args.balance == "none":
        model = DDP(model, find_unused_parameters=True)
        sampler = DistributedSampler(dataset, seed=args.seed)
        loader = DataLoader(
            dataset, batch_size=args.batch_size, sampler=sampler, collate_fn=tiny.collate
        )
    else:
        model = omt.shard(omt.wrap(model, mode=args.balance, cost=args.cost))  # orchmllm
        sampling = orchmllm.SamplingOptions(seed=args.seed)
        loader = sampler = model.loader(dataset, batch_size=args.batch_size, sampling=sampling)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    records = []
    progress = StepProgress(total=len(loader) * args.epochs, rank=rank, mode=args.progress)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        mine = list(sampler) if args.balance == "none" else []  # the plain loader's examples
        for step, batch in enumerate(loader):
            if args.balance == "none":
                n = orchmllm.global_num_items((batch["labels"][:, 1:] != -100).sum())
                if args.loss == "exact":
                    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
                    loss = exact_loss(logits[:, :-1], batch["labels"][:, 1:], n) * world
                else:
                    loss = hf_compat.plain_loss(model, batch, n) * world
                taken = mine[step * args.batch_size : (step + 1) * args.batch_size]
                loads = plain_loads(adapter, [dataset[i] for i in taken])
            else:
                out = model(batch)
                loss = out.loss * world  # orchmllm
                if args.loss == "exact":
                    n = out.batch.num_targets  # over all ranks
                    loss = exact_loss(out.logits[0], out.batch.targets, n) * world
                loads = model.loads
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            records.append(_record(loss, loads, phases, rank, world))
            if args.balance != "none" and model.calibration:  # --cost measured: timed steps
                records[-1]["calibration"] = model.calibration
            r = records[-1]
            imb = "  ".join(f"{n} {v:.3f}" for n, v in r["imbalance"].items())
            progress.step(
                f"step {len(records) - 1:3d}  loss {r['loss']:.6f}  imbalance {imb}",
                loss=f"{r['loss']:.4f}",
                imbalance=f"{r['imbalance']['llm']:.3f}",
            )
    progress.close()
    if args.save:
        save_state(model, optim, args.save)
    if rank == 0:
        mean = {n: np.mean([r["imbalance"][n] for r in records]) for n in phases}
        print(
            f"{args.model} balance={args.balance}: mean imbalance (max/mean per rank) "
            + "  ".join(f"{n} {v:.3f}" for n, v in mean.items())
        )
    return records


def exact_loss(logits: torch.Tensor, targets: torch.Tensor, n: int | torch.Tensor) -> torch.Tensor:
    """The summed next-token cross-entropy over ``n`` targets, in the logits' dtype."""
    logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum") / n


def save_state(model: torch.nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    """Every parameter and its optimizer state as full tensors keyed by the HF model's names
    (``param/NAME``, ``exp_avg/NAME``, ...), written by rank 0; a parameter that never had a
    gradient has no state. A collective under FSDP2 (every rank gathers the shards)."""
    inner = model.module if isinstance(model, DDP) else model.model
    state = {}
    for name, p in inner.named_parameters():
        state[f"param/{name}"] = _full(p.detach())
        for key, value in optim.state.get(p, {}).items():
            state[f"{key}/{name}"] = _full(value)
    if dist.get_rank() == 0:
        torch.save(state, path)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()


def _record(
    loss: torch.Tensor, loads: dict[str, float], phases: list[str], rank: int, world: int
) -> dict:
    """The step's global loss and every rank's loads, all-reduced (equal on every rank)."""
    row = torch.zeros(1 + world * len(phases), dtype=torch.float64)
    row[0] = loss.item() / world
    for i, name in enumerate(phases):
        row[1 + i * world + rank] = float(loads.get(name, 0.0))
    dist.all_reduce(row)
    per_rank = row[1:].numpy().reshape(len(phases), world)
    return {
        "loss": float(row[0]),
        "loads": {n: per_rank[i].tolist() for i, n in enumerate(phases)},
        "imbalance": {n: _imbalance(per_rank[i]) for i, n in enumerate(phases)},
    }


def _imbalance(loads: np.ndarray) -> float:
    return float(loads.max() / loads.mean()) if loads.mean() > 0 else 1.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=tuple(tiny.FAMILIES), default="qwen2-vl")
    p.add_argument("--balance", choices=("none", "llm", "full"), default="full")
    p.add_argument(
        "--modalities", nargs="+", choices=(*tiny.MODALITIES, "text"), default=None,
        help="the item kinds examples draw from (default: all the model takes; text: none)",
    )  # fmt: skip
    p.add_argument("--examples", type=int, default=96, help="dataset size")
    p.add_argument(
        "--text-only", type=float, default=0.0, help="the share of examples with no item"
    )
    p.add_argument("--batch-size", type=int, default=6, help="examples per rank per step")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's (its default)")
    p.add_argument(
        "--loss", choices=("model", "exact"), default="model",
        help="model: the model's own loss (float32 inside transformers); exact: computed here "
        "in the model's dtype",
    )  # fmt: skip
    p.add_argument("--save", default=None, help="write parameters and AdamW state here at the end")
    p.add_argument(
        "--cost", choices=orchmllm.COSTS, default="default",
        help="measured: fit every phase's cost to the first steps' times on all ranks",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any collective may wait")
    p.add_argument("--progress", choices=PROGRESS, default="auto", help="rank 0's per-step report")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    """Entry point; also runs inside an existing (gloo) process group (the tests)."""
    args = parse_args(argv)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        return train(args)
    finally:
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])  # the library closes its loaders and groups at exit: nothing to call
