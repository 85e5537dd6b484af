"""Train the reference MLLM data-parallel with FSDP2, with or without OrchMLLM balancing.

    torchrun --nproc_per_node=4 -m orchmllm.train --config configs/tiny.yaml --balance full

``--balance none`` trains every rank on the mini-batch it sampled, ``llm`` balances only the
LLM phase (the pre-balancing ablation of the paper), ``full`` balances every phase (OrchMLLM).
The loss is normalised by the global number of target tokens, so the three give the same
gradients: rebalancing changes which rank computes an example, never the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch import Tensor

from orchmllm.data import IMAGE, TEXT, EncodingRates, SyntheticConfig, as_example
from orchmllm.data.sampling import local_batches
from orchmllm.data.synthetic import load_dataset, save_dataset
from orchmllm.models import MLLM, ModelConfig, build_model, shard_model

BALANCE_MODES = ("none", "llm", "full")
PLACEMENTS = ("none", "assign", "ilp", "auto")
PHASES = ("vision", "audio", "llm")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


# --------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class DataConfig:
    mix: dict[str, float]
    examples_per_rank: int
    max_image_side: int
    max_audio_s: float
    scale: float
    max_text_tokens: int


@dataclass(frozen=True)
class BalanceConfig:
    vision_policy: str
    audio_policy: str
    llm_policy: str
    placement: str
    ranks_per_node: int | None


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    lr: float
    seed: int


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    data: DataConfig
    balance: BalanceConfig
    train: TrainConfig

    @property
    def rates(self) -> EncodingRates:
        return EncodingRates(
            vision_downsample=self.model.vision.downsample,
            audio_conv_stride=self.model.audio.conv_stride,
            audio_downsample=self.model.audio.downsample,
        )


def _section(cls: type, name: str, raw: Any) -> Any:
    keys = {f.name for f in dataclasses.fields(cls)}
    if not isinstance(raw, dict) or set(raw) != keys:
        got = sorted(raw) if isinstance(raw, dict) else raw
        raise ValueError(f"config section {name!r} must have keys {sorted(keys)}, got {got}")
    return cls(**raw)


def load_config(path: str) -> RunConfig:
    """Read and validate a run config (schema documented at the top of configs/tiny.yaml)."""
    with open(path) as f:
        raw = yaml.safe_load(f)
    if not isinstance(raw, dict) or set(raw) != {"model", "data", "balance", "train"}:
        raise ValueError(f"config {path!r} must have sections model, data, balance, train")
    cfg = RunConfig(
        model=ModelConfig.from_dict(raw["model"]),
        data=_section(DataConfig, "data", raw["data"]),
        balance=_section(BalanceConfig, "balance", raw["balance"]),
        train=_section(TrainConfig, "train", raw["train"]),
    )
    if cfg.balance.placement not in PLACEMENTS:
        raise ValueError(
            f"balance.placement must be one of {PLACEMENTS}, got {cfg.balance.placement!r}"
        )
    rpn = cfg.balance.ranks_per_node
    if rpn is not None and (not isinstance(rpn, int) or rpn < 1):
        raise ValueError(f"balance.ranks_per_node must be a positive integer or null, got {rpn!r}")
    return cfg


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m orchmllm.train", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="run config YAML (see configs/tiny.yaml)")
    p.add_argument("--steps", type=int, default=None, help="override train.steps")
    p.add_argument("--seed", type=int, default=None, help="override train.seed (model and data)")
    p.add_argument("--balance", choices=BALANCE_MODES, default="full")
    p.add_argument(
        "--placement", choices=PLACEMENTS, default=None, help="override balance.placement"
    )
    p.add_argument("--metrics", default=None, help="write one JSON object per step to this path")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--data-dir", default=None, help="where rank 0 stores the synthetic dataset")
    p.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    return args


# --------------------------------------------------------------------------------------------
# distributed set-up and data


def init_distributed(timeout_s: float = 300.0) -> tuple[bool, torch.device]:
    """Join the torchrun group (NCCL on CUDA, gloo otherwise) unless one already exists.

    Returns (whether we created the group, the device this rank computes on).
    """
    created = False
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        created = True
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return created, device


def ranks_per_node(cfg: RunConfig, world_size: int) -> int:
    """Config override, else the launcher's LOCAL_WORLD_SIZE; must divide the world size."""
    rpn = cfg.balance.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    rpn = min(rpn, world_size)
    if world_size % rpn:
        raise ValueError(f"ranks_per_node={rpn} does not divide world size {world_size}")
    return rpn


def synthetic_config(cfg: RunConfig, *, num_examples: int, seed: int) -> SyntheticConfig:
    d = cfg.data
    return SyntheticConfig(
        num_examples=num_examples,
        seed=seed,
        task_weights=dict(d.mix),
        patch=cfg.model.vision.patch,
        max_image_side=d.max_image_side,
        n_mels=cfg.model.audio.n_mels,
        max_audio_s=d.max_audio_s,
        vocab_size=cfg.model.vocab,
        max_text_tokens=d.max_text_tokens,
        scale=d.scale,
    )


def prepare_dataset(cfg: RunConfig, *, num_examples: int, seed: int, data_dir: str | None):
    """Rank 0 generates the HF dataset once (cached by its parameters); all ranks load it."""
    syn = synthetic_config(cfg, num_examples=num_examples, seed=seed)
    key = hashlib.sha256(repr((syn, cfg.rates)).encode()).hexdigest()[:16]
    root = data_dir or os.path.join(tempfile.gettempdir(), "orchmllm-data")
    path = os.path.join(root, f"synthetic-{key}")
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(path, "dataset_info.json")):
        os.makedirs(root, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        save_dataset(syn, cfg.rates, tmp)
        os.replace(tmp, path)
    dist.barrier()
    return load_dataset(path)


# --------------------------------------------------------------------------------------------
# one step on this rank's own examples (no rebalancing)


@dataclass
class LocalBatch:
    """Flat tensors of some examples plus the index that assembles their LLM sequences.

    ``gather`` indexes ``cat([text embeds, image tokens, audio tokens])`` and yields every
    example's interleaved sequence in template order; ``targets`` holds, per LLM position, the
    next token to predict or -100.
    """

    input_ids: Tensor
    patches: Tensor
    image_lengths: Tensor
    mels: Tensor
    audio_lengths: Tensor
    seq_lengths: Tensor
    gather: Tensor
    targets: Tensor

    @property
    def n_targets(self) -> int:
        return int((self.targets >= 0).sum())


def local_batch(examples: list[dict], rates: EncodingRates, cfg: ModelConfig, dtype) -> LocalBatch:
    n_text = sum(len(e["input_ids"]) for e in examples)
    img_tokens = sum(
        c // rates.divisor(IMAGE) for e in examples for k, c in e["segments"] if k == IMAGE
    )
    text_at, img_at, aud_at = 0, n_text, n_text + img_tokens
    gather, targets, seq_lengths = [], [], []
    for e in examples:
        ids, mask = np.asarray(e["input_ids"]), np.asarray(e["loss_mask"])
        pos_in_text, start = 0, len(targets)
        for kind, count in e["segments"]:
            if kind == TEXT:
                gather.append(np.arange(text_at, text_at + count))
                for j in range(count):
                    # position p predicts the token at p+1: a target token labels its predecessor
                    if mask[pos_in_text + j] and len(targets) > start:
                        targets[-1] = int(ids[pos_in_text + j])
                    targets.append(-100)
                text_at += count
                pos_in_text += count
            else:
                n = count // rates.divisor(kind)
                at = img_at if kind == IMAGE else aud_at
                gather.append(np.arange(at, at + n))
                targets.extend([-100] * n)
                if kind == IMAGE:
                    img_at += n
                else:
                    aud_at += n
        seq_lengths.append(len(targets) - start)
    images = [np.asarray(a) for e in examples for a in e["image_patches"]]
    audios = [np.asarray(a) for e in examples for a in e["audio_mels"]]

    def cat(arrays, width):
        if not arrays:
            return torch.zeros(0, width, dtype=dtype)
        return torch.from_numpy(np.concatenate(arrays)).to(dtype)

    def lengths(arrays):
        return torch.tensor([len(a) for a in arrays], dtype=torch.int64)

    return LocalBatch(
        input_ids=torch.from_numpy(
            np.concatenate([np.asarray(e["input_ids"]) for e in examples])
        ).long(),
        patches=cat(images, cfg.vision.patch_dim),
        image_lengths=lengths(images),
        mels=cat(audios, cfg.audio.n_mels),
        audio_lengths=lengths(audios),
        seq_lengths=torch.tensor(seq_lengths, dtype=torch.int64),
        gather=torch.from_numpy(np.concatenate(gather)).long()
        if gather
        else torch.zeros(0, dtype=torch.int64),
        targets=torch.tensor(targets, dtype=torch.int64),
    )


def local_step(batch: LocalBatch, n_targets_global: int):
    """Forward of all phases on this rank's own examples; returns the rank's loss share."""

    def step(model: MLLM) -> Tensor:
        image_tokens = model.vision(batch.patches, batch.image_lengths)
        audio_tokens = model.audio(batch.mels, batch.audio_lengths)
        text = model.llm.embed(batch.input_ids)
        embeds = torch.cat([text, image_tokens, audio_tokens])[batch.gather]
        logits = model.llm(embeds, batch.seq_lengths)
        return (
            F.cross_entropy(logits, batch.targets, ignore_index=-100, reduction="sum")
            / n_targets_global
        )

    return step


# --------------------------------------------------------------------------------------------
# training loop


def _set_sum_reduction(model: MLLM) -> None:
    """FSDP2 averages gradients over ranks by default; our loss is already globally normalised,
    so gradients must be summed."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def _all_reduce_sum(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def train(args: argparse.Namespace) -> list[dict]:
    cfg = load_config(args.config)
    steps = args.steps or cfg.train.steps
    seed = cfg.train.seed if args.seed is None else args.seed
    dtype = DTYPES[args.dtype]
    rank, world = dist.get_rank(), dist.get_world_size()
    _, device = init_distributed()
    rpn = ranks_per_node(cfg, world)
    per_rank = cfg.data.examples_per_rank
    dataset = prepare_dataset(
        cfg, num_examples=steps * world * per_rank, seed=seed, data_dir=args.data_dir
    )
    batches = local_batches(
        len(dataset), rank=rank, num_replicas=world, batch_size=per_rank, seed=seed
    )

    model = shard_model(build_model(cfg.model, seed=seed, dtype=dtype, device=str(device)))
    _set_sum_reduction(model)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=0.0)

    records = []
    for step in range(steps):
        t0 = time.perf_counter()
        examples = [as_example(dataset[int(i)]) for i in batches[step]]
        batch = local_batch(examples, cfg.rates, cfg.model, dtype)
        n_targets, n_tokens = _all_reduce_sum(
            [batch.n_targets, int(batch.seq_lengths.sum())], device
        )
        loss = model(local_step(batch, int(n_targets)))
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        (global_loss,) = _all_reduce_sum([loss.item()], device)
        dt = time.perf_counter() - t0
        record = {
            "step": step,
            "loss": global_loss,
            "step_time_s": dt,
            "tokens_per_s": n_tokens / dt,
            "balance": args.balance,
            "world_size": world,
            "ranks_per_node": rpn,
            "phases": {},
        }
        records.append(record)
        if rank == 0 and not args.quiet:
            print(
                f"step {step:4d}  loss {global_loss:.4f}  {dt * 1e3:7.1f} ms  "
                f"{n_tokens / dt:9.0f} tok/s",
                flush=True,
            )
    return records


def main(argv: list[str] | None = None) -> list[dict]:
    """Entry point; also callable inside an existing process group (tests). Returns this
    rank's per-step records."""
    args = parse_args(argv)
    created, _ = init_distributed()
    try:
        records = train(args)
        if args.metrics and dist.get_rank() == 0:
            with open(args.metrics, "w") as f:
                for r in records:
                    f.write(json.dumps(r) + "\n")
        return records
    finally:
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
