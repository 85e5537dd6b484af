"""One training run's parts, built on every rank: the process group, the orchestrator, the
data loader, the sharded model and its optimizer (:func:`setup`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from orchmllm import compat
from orchmllm.config import RunConfig, load_config
from orchmllm.data.loader import BalancedDataLoader
from orchmllm.data.options import LoaderOptions, SamplingOptions
from orchmllm.data.orchestrated import orchestrated_loader
from orchmllm.dist import watch
from orchmllm.dist.calibrator import Calibrator
from orchmllm.dist.orchestrator import Orchestrator
from orchmllm.dist.topology import Topology, attempt_store
from orchmllm.models import MLLM, build_model
from orchmllm.models.parallelize import compute_dtype, parallelize, storage_dtype
from orchmllm.planner.measured_cost import FitOptions
from orchmllm.planner.step_options import StepOptions, default_phases
from orchmllm.plugins import load_plugins
from orchmllm.schema import LLM
from orchmllm.train import launch
from orchmllm.train.dataset import prepare_dataset


def init_distributed(timeout_s: float = 300.0) -> tuple[bool, torch.device]:
    """Join the torchrun group (NCCL on CUDA, gloo otherwise) unless one already exists.

    A group created here also publishes this rank's progress in the launcher's store
    (:mod:`orchmllm.dist.watch`), so a step that times out names the ranks that did not arrive.
    Both use this launch attempt's own namespace of the store
    (:func:`orchmllm.dist.topology.attempt_store`): under ``torchrun --max-restarts`` a restarted
    attempt must not read the keys of the attempt that died.
    Returns (whether we created the group, the device this rank computes on).
    """
    created = False
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        timeout = timedelta(seconds=timeout_s)
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        store = attempt_store(store, rank=rank, world_size=world, timeout=timeout_s)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        watch.install(watch.Progress(store, rank=rank, world_size=world, timeout=timeout_s))
        created = True
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return created, device


def ranks_per_node(cfg: RunConfig, world_size: int) -> int:
    """Config override, else the launcher's LOCAL_WORLD_SIZE; must divide the world size (a
    :class:`orchmllm.train.launch.LaunchError` naming the fixes otherwise)."""
    rpn = cfg.balance.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    rpn = min(rpn, world_size)
    launch.check_ranks_per_node(rpn, world_size, configured=cfg.balance.ranks_per_node is not None)
    return rpn


def make_orchestrator(
    cfg: RunConfig, *, mode: str, placement: str, topology: Topology, dtype: torch.dtype
) -> Orchestrator:
    """The orchestrator with this run's phases and policies (it plans in the loader's
    prefetch thread, which gathers metadata on the topology's gloo group)."""
    phases = default_phases(
        cfg.rates,
        feature_dims=cfg.model.feature_dims,
        policies={name: cfg.balance.policy(name) for name in cfg.model.encoders},
        costs={name: cfg.balance.cost_model(name) for name in cfg.model.encoders},
        max_loads={k: v for k, v in cfg.balance.max_load.items() if k != LLM},
    )
    options = StepOptions(
        phases,
        mode=mode,
        llm_policy=cfg.balance.policy(LLM),
        llm_cost=cfg.balance.cost_model(LLM),
        placement=placement,
        encoded_token_bytes=cfg.model.llm.hidden * dtype.itemsize,
        context_parallel=cfg.balance.context_parallel,
        llm_max_load=cfg.balance.max_load.get(LLM),
    )
    return Orchestrator(options, topology=topology)


def set_sum_reduction(model: MLLM) -> None:
    """FSDP2 averages gradients over ranks by default; our loss is already normalised by the
    global target count, so gradients must be summed."""
    for module in model.modules():
        if compat.is_fsdp_module(module):
            compat.set_gradient_sum(module)


@dataclass
class Run:
    """Everything one training run holds: model, optimizer, orchestrator, data source."""

    args: argparse.Namespace
    cfg: RunConfig
    rpn: int
    device: torch.device
    model: MLLM
    optim: torch.optim.Optimizer
    orch: Orchestrator
    loader: BalancedDataLoader
    calibrator: Calibrator | None = None

    @property
    def steps(self) -> int:
        return self.cfg.train.steps

    @property
    def placement(self) -> str:
        return self.cfg.balance.placement


def run_config(args: argparse.Namespace) -> RunConfig:
    """The config file with the command line's overrides (``args.overrides``) laid on it, the
    ``--plugin`` modules imported first, on every rank (a config's ``plugins:`` follow)."""
    load_plugins(args.plugin)
    return load_config(args.config, args.overrides)


def setup(args: argparse.Namespace) -> Run:
    """Load the config and data, build and shard the model (collective: every rank)."""
    cfg = run_config(args)
    _, device = init_distributed(args.timeout)
    rpn = ranks_per_node(cfg, dist.get_world_size())
    # The process groups, built once: the loader plans on the gloo metadata group in its
    # background thread while training collectives run on the default group.
    topology = Topology.build(
        ranks_per_node=rpn, timeout=args.timeout, context_parallel=cfg.balance.context_parallel
    )
    orch = make_orchestrator(
        cfg,
        mode=args.balance,
        placement=cfg.balance.placement,
        topology=topology,
        dtype=compute_dtype(cfg.recipe),
    )
    loader = make_loader(args, cfg, orch)
    model = build_model(
        cfg.model, seed=cfg.train.seed, dtype=storage_dtype(cfg.recipe), device=device
    )
    model = parallelize(model, recipe=cfg.recipe)
    set_sum_reduction(model)
    optim = torch.optim.AdamW(
        model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay
    )
    calibrator = make_calibrator(cfg, orch, device, model)
    return Run(args, cfg, rpn, device, model, optim, orch, loader, calibrator)


def make_loader(args: argparse.Namespace, cfg: RunConfig, orch: Orchestrator) -> BalancedDataLoader:
    """The run's dataset (one epoch of exactly its steps) behind the orchestrated loader.

    It samples like a DistributedSampler and plans each micro-step in a background thread
    ahead of it (a time-limited ILP placement on rank 0 alone, broadcast: see
    agreement.agreed_plan). A step takes its K micro-steps at once (their target count
    normalises each), so the thread plans ``--prefetch`` whole steps ahead.
    """
    per_rank, accum, seed = cfg.data.examples_per_rank, cfg.train.grad_accum, cfg.train.seed
    examples = cfg.train.steps * accum * dist.get_world_size() * per_rank
    dataset = prepare_dataset(cfg, num_examples=examples, seed=seed, data_dir=args.data_dir)
    return orchestrated_loader(
        dataset,
        orch,
        batch_size=per_rank,
        sampling=SamplingOptions(seed=seed),
        options=LoaderOptions(prefetch=args.prefetch * accum),
        topology=orch.topology,
    )


def make_calibrator(
    cfg: RunConfig, orch: Orchestrator, device: torch.device, model: MLLM
) -> Calibrator | None:
    """With ``balance.cost: measured``, the calibrator that times the model's phases."""
    if cfg.balance.cost != "measured":
        return None
    b = cfg.balance
    calibrator = Calibrator.for_options(
        orch.options,
        device=device,
        steps=b.calibrate_steps,
        every=b.calibrate_every,
        fit=FitOptions(min_r2=b.min_r2),
    )
    calibrator.watch(model)  # its phases' times less FSDP's all-gather waits
    return calibrator
