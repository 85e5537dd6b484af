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

import orchmllm
from orchmllm import compat
from orchmllm.data import EncodingRates, SyntheticConfig, synthetic
from orchmllm.data.loader import BalancedDataLoader, PlannedBatch
from orchmllm.data.orchestrated import orchestrated_loader
from orchmllm.data.synthetic import load_dataset, save_dataset
from orchmllm.models import MLLM, ModelConfig, build_model, shard_model
from orchmllm.orchestrator import (
    IGNORE_INDEX,
    LLMBatch,
    Orchestrator,
    default_phases,
)

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
    for key in ("vision_policy", "audio_policy", "llm_policy"):
        policy = getattr(cfg.balance, key)
        if policy not in orchmllm.POLICIES:
            raise ValueError(f"balance.{key} must be one of {orchmllm.POLICIES}, got {policy!r}")
    for section, key in (("data", "examples_per_rank"), ("train", "steps")):
        value = getattr(getattr(cfg, section), key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{section}.{key} must be a positive integer, got {value!r}")
    if not (isinstance(cfg.train.lr, (int, float)) and cfg.train.lr > 0):
        raise ValueError(f"train.lr must be a positive number, got {cfg.train.lr!r}")
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
    p.add_argument("--save", default=None, help="write the final full parameters (torch.save)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--data-dir", default=None, help="where rank 0 stores the synthetic dataset")
    p.add_argument("--prefetch", type=int, default=1, help="steps planned ahead (0: inline)")
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
    """The first rank of every node generates the HF dataset once (cached under a key of its
    parameters and the generator's source); then every rank loads it."""
    syn = synthetic_config(cfg, num_examples=num_examples, seed=seed)
    with open(synthetic.__file__, "rb") as f:
        generator = f.read()
    key = hashlib.sha256(repr((syn, cfg.rates)).encode() + generator).hexdigest()[:16]
    root = data_dir or os.path.join(tempfile.gettempdir(), "orchmllm-data")
    path = os.path.join(root, f"synthetic-{key}")
    first_on_node = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    if first_on_node and not os.path.exists(os.path.join(path, "dataset_info.json")):
        os.makedirs(root, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        save_dataset(syn, cfg.rates, tmp)
        os.replace(tmp, path)
    dist.barrier()
    return load_dataset(path)


# --------------------------------------------------------------------------------------------
# training loop


def make_orchestrator(
    cfg: RunConfig, *, mode: str, placement: str, rpn: int, timeout: float
) -> Orchestrator:
    """The orchestrator with this run's phases and policies (it plans in the loader's
    prefetch thread, which gathers metadata on a gloo group of its own)."""
    phases = default_phases(
        cfg.rates,
        patch_dim=cfg.model.vision.patch_dim,
        n_mels=cfg.model.audio.n_mels,
        vision_policy=cfg.balance.vision_policy,
        audio_policy=cfg.balance.audio_policy,
    )
    return Orchestrator(
        phases,
        mode=mode,
        llm_policy=cfg.balance.llm_policy,
        placement=placement,
        ranks_per_node=rpn,
        timeout=timeout,
    )


def step_forward(orch: Orchestrator, planned: PlannedBatch, *, dtype: torch.dtype, device):
    """The whole multimodal forward of one step, run inside the FSDP root call.

    Returns this rank's share of the loss (summed over its targets, divided by the global
    target count) and the orchestrator's LLM batch (for metrics).
    """
    batch = planned.batch.to(device)

    def forward(model: MLLM):
        encoders = {
            "vision": lambda x, lengths: model.vision(x.to(dtype), lengths),
            "audio": lambda x, lengths: model.audio(x.to(dtype), lengths),
        }
        out = orch.run(batch, encoders, plan=planned.plan)
        logits = model.llm(out.assemble(model.llm.embed(out.input_ids)), out.lengths)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32
        loss = F.cross_entropy(logits, out.targets, ignore_index=IGNORE_INDEX, reduction="sum")
        return loss / max(out.num_targets, 1), out

    return forward


def _set_sum_reduction(model: MLLM) -> None:
    """FSDP2 averages gradients over ranks by default; our loss is already normalised by the
    global target count, so gradients must be summed."""
    for module in model.modules():
        if compat.is_fsdp_module(module):
            compat.set_gradient_sum(module)


def _all_reduce_sum(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


@dataclass
class Run:
    """Everything one training run holds: model, optimizer, orchestrator, data source."""

    args: argparse.Namespace
    cfg: RunConfig
    steps: int
    placement: str
    rpn: int
    dtype: torch.dtype
    device: torch.device
    model: MLLM
    optim: torch.optim.Optimizer
    orch: Orchestrator
    loader: BalancedDataLoader


def setup(args: argparse.Namespace, *, timeout: float = 300.0) -> Run:
    """Load the config and data, build and shard the model (collective: every rank)."""
    cfg = load_config(args.config)
    steps = args.steps or cfg.train.steps
    seed = cfg.train.seed if args.seed is None else args.seed
    placement = args.placement or cfg.balance.placement
    dtype = DTYPES[args.dtype]
    world = dist.get_world_size()
    _, device = init_distributed()
    rpn = ranks_per_node(cfg, world)
    per_rank = cfg.data.examples_per_rank
    dataset = prepare_dataset(
        cfg, num_examples=steps * world * per_rank, seed=seed, data_dir=args.data_dir
    )
    orch = make_orchestrator(cfg, mode=args.balance, placement=placement, rpn=rpn, timeout=timeout)
    # Samples like a DistributedSampler; plans each step in a background thread ahead of it
    # (a time-limited ILP placement on rank 0 alone, broadcast: see exchange.agreed_plan).
    loader = orchestrated_loader(
        dataset, orch, batch_size=per_rank, prefetch=args.prefetch, seed=seed, timeout=timeout
    )
    model = shard_model(build_model(cfg.model, seed=seed, dtype=dtype, device=str(device)))
    _set_sum_reduction(model)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=0.0)
    return Run(args, cfg, steps, placement, rpn, dtype, device, model, optim, orch, loader)


def forward_backward(run: Run, planned: PlannedBatch) -> tuple[Tensor, LLMBatch]:
    """One step's forward over all phases and its backward (gradients reduce-scattered)."""
    loss, out = run.model(step_forward(run.orch, planned, dtype=run.dtype, device=run.device))
    loss.backward()
    return loss, out


def train(args: argparse.Namespace, *, timeout: float = 300.0) -> tuple[list[dict], MLLM]:
    """Run the training loop; returns this rank's per-step records and the (sharded) model."""
    run = setup(args, timeout=timeout)
    world = dist.get_world_size()
    records = []
    with run.loader:
        for step, planned in enumerate(run.loader):
            t0 = time.perf_counter()
            loss, out = forward_backward(run, planned)
            run.optim.step()
            run.optim.zero_grad(set_to_none=True)
            global_loss, n_tokens = _all_reduce_sum(
                [loss.item(), float(out.lengths.sum())], run.device
            )
            dt = time.perf_counter() - t0
            records.append(
                {
                    "step": step,
                    "loss": global_loss,
                    "step_time_s": dt,
                    "tokens_per_s": n_tokens / dt,
                    "balance": args.balance,
                    "world_size": world,
                    "ranks_per_node": run.rpn,
                    "placement": run.placement,
                    "plan_s": planned.info.plan_s,
                    "prep_s": planned.info.prep_s,
                    "phases": {name: out.stats[name] for name in PHASES},
                }
            )
            if dist.get_rank() == 0 and not args.quiet:
                print(_progress(records[-1]), flush=True)
    return records, run.model


def _progress(r: dict) -> str:
    imb = "  ".join(
        f"{name} {p['imbalance_before']:.2f}->{p['imbalance_after']:.2f}"
        for name, p in r["phases"].items()
    )
    return (
        f"step {r['step']:4d}  loss {r['loss']:.4f}  {r['step_time_s'] * 1e3:7.1f} ms  "
        f"{r['tokens_per_s']:8.0f} tok/s  imbalance {imb}"
    )


def summary_table(records: list[dict]) -> str:
    """Per-phase means over the steps: imbalance before/after (max/mean load), bytes moved
    intra- and inter-node per step, planning time; then the mean step time."""
    lines = [
        f"{'phase':<8}{'imbalance before':>18}{'imbalance after':>17}"
        f"{'KB intra/step':>15}{'KB inter/step':>15}{'plan ms':>9}"
    ]
    for name in PHASES:
        ph = [r["phases"][name] for r in records]

        def mean(key, ph=ph):
            return float(np.mean([p[key] for p in ph]))

        lines.append(
            f"{name:<8}{mean('imbalance_before'):>18.3f}{mean('imbalance_after'):>17.3f}"
            f"{mean('bytes_intra') / 1e3:>15.1f}{mean('bytes_inter') / 1e3:>15.1f}"
            f"{mean('plan_ms'):>9.2f}"
        )
    times = [r["step_time_s"] for r in records[1:] or records]  # step 0 includes warm-up
    r0 = records[0]
    lines.append(
        f"balance={r0['balance']} placement={r0['placement']} world={r0['world_size']} "
        f"ranks/node={r0['ranks_per_node']} steps={len(records)} "
        f"mean step {np.mean(times) * 1e3:.1f} ms (after step 0)  "
        f"final loss {records[-1]['loss']:.4f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    """Entry point; also callable inside an existing process group (tests). Returns this
    rank's per-step records."""
    args = parse_args(argv)
    created, _ = init_distributed()
    try:
        records, model = train(args)
        if args.save:
            # Collective: every rank contributes its shards; rank 0 writes.
            state = {n: p.full_tensor().detach().cpu() for n, p in model.named_parameters()}
            if dist.get_rank() == 0:
                torch.save(state, args.save)
        if dist.get_rank() == 0:
            if args.metrics:
                with open(args.metrics, "w") as f:
                    for r in records:
                        f.write(json.dumps(r) + "\n")
            print(summary_table(records), flush=True)
        return records
    finally:
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
