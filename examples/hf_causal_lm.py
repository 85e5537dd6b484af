"""A Hugging Face causal LM, data-parallel with FSDP2 on packed sequences, balanced by OrchMLLM.

    torchrun --nproc_per_node=2 examples/hf_causal_lm.py                 # balanced
    torchrun --nproc_per_node=2 examples/hf_causal_lm.py --balance none  # plain PyTorch

The model is a ``transformers`` ``LlamaForCausalLM`` built from a tiny config with random
weights (nothing is downloaded). Each rank packs its examples into one row: ``position_ids``
restart at 0 for every sequence and there is no attention mask, so ``transformers`` builds the
block-diagonal causal mask itself (its packed-sequence path). Both runs see the same global
batch at every step (``BalancedDataLoader`` samples like ``DistributedSampler``); balancing only
changes which rank computes which sequence, so they print the same losses.

``--balance none`` is the plain script (``DataLoader`` + ``DistributedSampler``). From it to the
balanced one, three statements change (marked ``# orchmllm`` below)::

    + import orchmllm
    - sampler = DistributedSampler(dataset, seed=seed)
    - loader = DataLoader(dataset, batch_size=8, sampler=sampler, collate_fn=pack)
    + loader = orchmllm.BalancedDataLoader(dataset, batch_size=8, collate_fn=pack,
    +                                      lengths=[len(e["input_ids"]) for e in dataset],
    +                                      sampling=orchmllm.SamplingOptions(seed=seed))
    - sampler.set_epoch(epoch)
    + loader.set_epoch(epoch)

plus the loss normalisation (two lines; right for the plain script too, and needed once ranks
hold unequal token counts, which is what balancing changes)::

    - loss = model(**batch).loss
    + n = orchmllm.global_num_items((batch["labels"][:, 1:] != -100).sum())
    + loss = model(**batch, num_items_in_batch=n).loss * world_size  # FSDP averages over ranks

``--loss local`` keeps HF's default per-rank mean, to see the runs drift apart without it.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler

import orchmllm  # orchmllm
from orchmllm.train.progress import PROGRESS, StepProgress

IGNORE_INDEX = -100  # HF's label for "no loss here"


def make_dataset(num_examples: int, *, vocab: int, max_len: int, seed: int) -> list[dict]:
    """Tokenised examples with heavy-tailed lengths (as chat and code data have)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(3.5, 0.9, num_examples), 8, max_len).astype(np.int64)
    return [{"input_ids": torch.from_numpy(rng.integers(0, vocab, n))} for n in lengths]


def pack(examples: list[dict]) -> dict[str, torch.Tensor]:
    """Concatenate a batch into one row; positions restart per sequence.

    The first token of each sequence gets no label: the token before it ends another sequence.
    """
    ids = [e["input_ids"] for e in examples]
    input_ids = torch.cat(ids)[None]
    labels = input_ids.clone()
    starts = np.cumsum([0] + [len(x) for x in ids[:-1]])
    labels[0, starts] = IGNORE_INDEX
    position_ids = torch.cat([torch.arange(len(x)) for x in ids])[None]
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}


def build_model(*, vocab: int, max_len: int, seed: int, dtype: torch.dtype, device: torch.device):
    """A tiny Llama with random weights, the same on every rank, sharded with FSDP2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        use_cache=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def make_loader(dataset: list[dict], args: argparse.Namespace):
    """The data pipeline: the plain one, or the balanced one (returns loader, its sampler)."""
    if args.balance == "none":
        sampler = DistributedSampler(dataset, seed=args.seed)
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, collate_fn=pack)
        return loader, sampler
    loader = orchmllm.BalancedDataLoader(  # orchmllm
        dataset, batch_size=args.batch_size, collate_fn=pack,
        lengths=[len(e["input_ids"]) for e in dataset],  # index mode: no example is moved
        sampling=orchmllm.SamplingOptions(seed=args.seed),
        planning=orchmllm.PlanningOptions(policy=args.balance),
        topology=orchmllm.Topology.build(timeout=args.timeout),
    )  # fmt: skip
    return loader, loader  # orchmllm: loader.set_epoch(epoch) replaces sampler.set_epoch(epoch)


def train(args: argparse.Namespace) -> list[dict]:
    """Train; returns per-step records (global loss, target tokens per rank), equal on all ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = make_dataset(args.examples, vocab=args.vocab, max_len=args.max_len, seed=args.seed)
    dtype, device = getattr(torch, args.dtype), _device()
    model = build_model(
        vocab=args.vocab, max_len=args.max_len, seed=args.seed, dtype=dtype, device=device
    )
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader, sampler = make_loader(dataset, args)
    records = []
    progress = StepProgress(total=len(loader) * args.epochs, rank=rank, mode=args.progress)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            n_local = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
            if args.loss == "global":
                n = orchmllm.global_num_items(n_local)  # orchmllm
                loss = model(**batch, num_items_in_batch=n).loss * world  # orchmllm
            else:
                loss = model(**batch).loss  # HF's default: mean over this rank's tokens
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            # Logging only: the mean of the ranks' losses (with "global", the global mean).
            row = torch.zeros(world + 1, dtype=torch.float64, device=device)
            row[0], row[1 + rank] = loss.item() / world, float(n_local)
            dist.all_reduce(row)
            tokens = row[1:].cpu().numpy()
            records.append(
                {
                    "epoch": epoch,
                    "loss": float(row[0]),
                    "tokens": tokens.astype(np.int64).tolist(),
                    "imbalance": float(tokens.max() / tokens.mean()),
                }
            )
            r = records[-1]
            progress.step(
                f"step {len(records) - 1:3d}  loss {r['loss']:.6f}  target tokens per rank "
                f"{r['tokens']}  imbalance (max/mean) {r['imbalance']:.3f}",
                loss=f"{r['loss']:.4f}",
                imbalance=f"{r['imbalance']:.3f}",
            )
    progress.close()
    if rank == 0:
        mean = np.mean([r["imbalance"] for r in records])
        print(f"balance={args.balance}: mean imbalance {mean:.3f} over {len(records)} steps")
    return records


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--balance", default="greedy", help="'none' (plain DataLoader) or an orchmllm policy"
    )
    p.add_argument("--loss", choices=("global", "local"), default="global")
    p.add_argument("--examples", type=int, default=256, help="dataset size")
    p.add_argument("--batch-size", type=int, default=8, help="examples per rank per step")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any collective may wait")
    p.add_argument("--progress", choices=PROGRESS, default="auto", help="rank 0's per-step report")
    args = p.parse_args(argv)
    if args.balance != "none" and args.balance not in orchmllm.POLICIES:
        p.error(f"--balance must be 'none' or one of {orchmllm.POLICIES}, got {args.balance!r}")
    return args


def _device() -> torch.device:
    """This rank's GPU under NCCL (torchrun on a GPU node), else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> list[dict]:
    """Entry point; also runs inside an existing process group (the tests)."""
    args = parse_args(argv)
    created = not dist.is_initialized()
    if created:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        return train(args)
    finally:
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])  # the library closes its loaders and groups at exit: nothing to call
