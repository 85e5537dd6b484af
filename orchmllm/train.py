"""Train the reference MLLM data-parallel with FSDP2, with or without OrchMLLM balancing.

    torchrun --nproc_per_node=4 -m orchmllm.train --config configs/tiny.yaml --balance full

``--balance none`` trains every rank on the mini-batch it sampled, ``llm`` balances only the
LLM phase (the pre-balancing ablation of the paper), ``full`` balances every phase (OrchMLLM).
The loss is normalised by the global number of target tokens, so the three give the same
gradients: rebalancing changes which rank computes an example, never the result.

With ``--grad-accum K`` (``train.grad_accum``) an optimizer step is K micro-steps, each a
balanced step of ``data.examples_per_rank`` examples per rank, and the loss is normalised by
the target tokens of all K micro-steps on all ranks: the update equals one step over the K
micro-batches' examples. Steps, checkpoints, ``--checkpoint-every`` and the metrics count
optimizer steps.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from orchmllm import checkpoint, compat, host_memory, launch, preempt
from orchmllm.config import PRECISIONS, RunConfig, TrainRecipe, load_config
from orchmllm.data import SyntheticConfig, synthetic
from orchmllm.data.accumulation import accumulate
from orchmllm.data.loader import BalancedDataLoader, PlannedBatch
from orchmllm.data.options import LoaderOptions, SamplingOptions
from orchmllm.data.orchestrated import orchestrated_loader
from orchmllm.data.synthetic import load_dataset, save_dataset
from orchmllm.dirlock import DirectoryLock
from orchmllm.dist import watch
from orchmllm.dist.calibrator import Calibrator
from orchmllm.dist.orchestrator import LLMBatch, Orchestrator
from orchmllm.dist.topology import Topology, attempt_store, job_token
from orchmllm.models import MLLM, build_model
from orchmllm.models.parallelize import compute_dtype, parallelize, storage_dtype
from orchmllm.phase_memory import PhaseMemory
from orchmllm.planner.balance import PLACEMENTS
from orchmllm.planner.measured_cost import COSTS, FitOptions
from orchmllm.planner.step_plan import MODES, StepOptions, default_phases
from orchmllm.plugins import load_plugins
from orchmllm.progress import PROGRESS, StepProgress
from orchmllm.schema import LLM
from orchmllm.tracking import Trackers

NONFINITE = ("stop", "skip")


# --------------------------------------------------------------------------------------------
# command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m orchmllm.train", description=__doc__.split("\n")[0])
    p.add_argument(
        "--config",
        required=True,
        help="run config YAML (keys: configs/tiny.yaml, defaults: orchmllm/config.py)",
    )
    # -- plugins (orchmllm.plugins): a user's registrations, imported before the config
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE_OR_PATH",
        help="import a module name or a .py file before the config is read (repeatable)",
    )
    p.add_argument("--steps", type=int, default=None, help="override train.steps")
    p.add_argument(
        "--grad-accum",
        type=int,
        default=None,
        metavar="K",
        help="override train.grad_accum: K balanced micro-steps per optimizer step, the loss "
        "normalised over the targets of all K on all ranks",
    )
    p.add_argument("--seed", type=int, default=None, help="override train.seed (model and data)")
    p.add_argument("--balance", choices=MODES, default="full")
    p.add_argument(
        "--placement", choices=PLACEMENTS, default=None, help="override balance.placement"
    )
    p.add_argument(
        "--cost", choices=COSTS, default=None,
        help="override balance.cost: measured fits every phase's cost to the times of the "
        "first balance.calibrate_steps steps on all ranks and plans with the fits",
    )  # fmt: skip
    p.add_argument(
        "--metrics",
        default=None,
        help="append one JSON line per step to this path as training goes (rank 0; flushed)",
    )
    p.add_argument(
        "--metrics-per-rank",
        action="store_true",
        help="also record every rank's load per phase (world_size numbers per phase and step)",
    )
    p.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="also log each step's metrics to TensorBoard in DIR (rank 0; orchmllm.tracking)",
    )
    p.add_argument(
        "--wandb",
        default=None,
        metavar="PROJECT",
        help="also log each step's metrics to this Weights & Biases project (rank 0; needs "
        "wandb installed)",
    )
    p.add_argument("--save", default=None, help="write the final full parameters (torch.save)")
    p.add_argument(
        "--memory-report",
        default=None,
        metavar="PATH",
        help="write one JSON line per step: rank 0's peak CUDA memory in the forward, backward "
        "and optimizer step, and the step's batch (orchmllm.phase_memory); with --grad-accum "
        "one line per micro-step, the optimizer's in the last",
    )
    p.add_argument(
        "--precision", choices=PRECISIONS, default=None, help="override recipe.precision"
    )
    p.add_argument(
        "--checkpointing",
        type=int,
        default=None,
        metavar="K",
        help="override recipe.checkpointing: 0 off, K > 0 every K-th block",
    )
    p.add_argument(
        "--loss-chunk", type=int, default=None, metavar="N", help="override recipe.loss_chunk"
    )
    p.add_argument("--data-dir", default=None, help="where rank 0 stores the synthetic dataset")
    p.add_argument(
        "--prefetch", type=int, default=1, help="optimizer steps planned ahead (0: inline)"
    )
    p.add_argument(
        "--progress",
        choices=PROGRESS,
        default="auto",
        help="rank 0's per-step report: a tqdm bar, one line per step, or nothing (auto: a "
        "bar on a terminal, else lines)",
    )
    p.add_argument("--quiet", action="store_true", help="same as --progress off")
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="write sharded checkpoints here (one filesystem all nodes share); rerunning the "
        "same command resumes from the newest complete one",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="N",
        help="checkpoint every N steps (0: only after the last step); needs --checkpoint-dir",
    )
    p.add_argument(
        "--keep-last",
        type=int,
        default=0,
        metavar="N",
        help="keep only the newest N checkpoints, deleting older ones once a newer one has "
        "verified (0: keep all); needs --checkpoint-dir",
    )
    p.add_argument(
        "--on-nonfinite",
        choices=NONFINITE,
        default="stop",
        help="a step whose loss or gradient norm is not finite (nan, inf): stop the run with "
        "an error naming the step and the ranks, before the optimizer step and before any "
        "checkpoint (stop), or skip the step's update and go on (skip; the step's metrics "
        "record says skipped)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long any collective may wait for the other ranks; a step that waits longer "
        "fails on every healthy rank, naming the ranks that did not arrive. It also bounds the "
        "uneven phases: writing the dataset on a first run, writing a checkpoint",
    )
    p.add_argument(
        "--preempt-grace",
        type=float,
        default=25.0,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT (a scheduler preempting the job), every rank stops after "
        "the step in progress, writes a checkpoint (with --checkpoint-dir) and exits with "
        f"status {preempt.PREEMPTED}; a job still running SECONDS after the signal is abandoned "
        "there (keep it below the scheduler's kill delay and torchrun's --shutdown-timeout)",
    )
    p.add_argument(
        "--preempt-signal",
        default=None,
        metavar="NAME",
        help="one more signal that preempts like SIGTERM, e.g. USR1 for SLURM's "
        "--signal=USR1@90 warning",
    )
    args = p.parse_args(argv)
    if not args.preempt_grace > 0:
        p.error(f"--preempt-grace must be > 0 seconds, got {args.preempt_grace}")
    try:
        args.preempt_signals = [
            preempt.parse_signal(s)
            for s in (*preempt.DEFAULT_SIGNALS, *filter(None, [args.preempt_signal]))
        ]
    except ValueError as exc:
        p.error(str(exc))
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.grad_accum is not None and args.grad_accum < 1:
        p.error(f"--grad-accum must be >= 1, got {args.grad_accum}")
    if not args.timeout > 0:
        p.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.checkpoint_every < 0:
        p.error(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.checkpoint_every and args.checkpoint_dir is None:
        p.error(f"--checkpoint-every {args.checkpoint_every} needs --checkpoint-dir")
    if args.keep_last < 0:
        p.error(f"--keep-last must be >= 0, got {args.keep_last}")
    if args.keep_last and args.checkpoint_dir is None:
        p.error(f"--keep-last {args.keep_last} needs --checkpoint-dir")
    return args


# --------------------------------------------------------------------------------------------
# distributed set-up and data


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
    :class:`orchmllm.launch.LaunchError` naming the fixes otherwise)."""
    rpn = cfg.balance.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    rpn = min(rpn, world_size)
    launch.check_ranks_per_node(rpn, world_size, configured=cfg.balance.ranks_per_node is not None)
    return rpn


def dataset_location(
    cfg: RunConfig, *, num_examples: int, seed: int, data_dir: str | None
) -> tuple[SyntheticConfig, str]:
    """The synthetic dataset's parameters and its directory: cached under a key of the
    parameters and the generator's source, so a changed generator never reads a stale copy."""
    syn = SyntheticConfig.for_run(cfg, num_examples=num_examples, seed=seed)
    key = synthetic.fingerprint(syn, cfg.rates)
    root = data_dir or os.path.join(tempfile.gettempdir(), "orchmllm-data")
    return syn, os.path.join(root, f"synthetic-{key}")


def prepare_dataset(cfg: RunConfig, *, num_examples: int, seed: int, data_dir: str | None):
    """Generate the HF dataset once per data directory, then load it on every rank
    (collective; a section of the job's progress, so a rank that stops meanwhile is named)."""
    syn, path = dataset_location(cfg, num_examples=num_examples, seed=seed, data_dir=data_dir)
    with watch.section("dataset write"):
        write_once(path, lambda tmp: save_dataset(syn, cfg.rates, tmp))
        return load_dataset(path)


def write_once(path: str, write: Callable[[str], object]) -> bool:
    """Make sure directory ``path`` exists on every rank's filesystem, written by exactly one
    rank per filesystem; returns whether this rank wrote it (collective, default group).

    Which ranks share a directory is found out, not assumed from the launcher: each rank
    drops a probe file, named by a token rank 0 drew, next to ``path``, and the lowest rank
    among those whose probes it sees is the writer. So a ``--data-dir`` on a filesystem all
    nodes share gets one writer in the world, a node-local one gets one per node. The writer
    calls ``write(tmp)`` on a private temporary directory and renames it into place; if
    another job finished a copy first (a filesystem whose listings lag), that copy is kept and
    the temporary one removed, so ``path`` only ever exists complete. The others wait for the
    writers; a writer's failure is raised on every rank.
    """
    root = os.path.dirname(os.path.abspath(path))
    os.makedirs(root, exist_ok=True)
    rank = dist.get_rank()
    token = [secrets.randbits(62) if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    prefix = f".orchmllm-probe-{token[0]:x}-"
    probe = os.path.join(root, f"{prefix}{rank}")
    with open(probe, "w"):
        pass
    dist.barrier()
    sharers = [int(n[len(prefix) :]) for n in os.listdir(root) if n.startswith(prefix)]
    wrote, error = False, None
    if rank == min(sharers) and not os.path.isdir(path):
        print(f"rank {rank}: writing {path}", file=sys.stderr, flush=True)
        tmp = f"{path}.tmp-{token[0]:x}-{rank}"
        try:
            write(tmp)
            os.replace(tmp, path)
            wrote = True
        except Exception as exc:
            if not (isinstance(exc, OSError) and os.path.isdir(path)):  # else: a finished copy won
                error = exc
        shutil.rmtree(tmp, ignore_errors=True)
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else repr(error))
    os.remove(probe)
    if error is not None:
        raise error
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        raise RuntimeError(f"rank {bad[0][0]} failed to write {path}: {bad[0][1]}")
    return wrote


# --------------------------------------------------------------------------------------------
# training loop


def run_config(args: argparse.Namespace) -> RunConfig:
    """The config file with the command line's overrides of its recipe and micro-steps (the
    ``--plugin`` modules imported first, on every rank)."""
    load_plugins(args.plugin)
    cfg = load_config(args.config)
    if args.cost is not None:
        cfg = dataclasses.replace(cfg, balance=dataclasses.replace(cfg.balance, cost=args.cost))
    if args.grad_accum is not None:
        cfg = dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, grad_accum=args.grad_accum)
        )
    overrides = {
        name: value
        for name, value in (
            ("precision", args.precision),
            ("checkpointing", args.checkpointing),
            ("loss_chunk", args.loss_chunk),
        )
        if value is not None
    }
    return dataclasses.replace(cfg, recipe=dataclasses.replace(cfg.recipe, **overrides))


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
    )
    options = StepOptions(
        phases,
        mode=mode,
        llm_policy=cfg.balance.policy(LLM),
        llm_cost=cfg.balance.cost_model(LLM),
        placement=placement,
        encoded_token_bytes=cfg.model.llm.hidden * dtype.itemsize,
    )
    return Orchestrator(options, topology=topology)


def step_forward(
    orch: Orchestrator,
    planned: PlannedBatch,
    *,
    recipe: TrainRecipe,
    device,
    denom: int,
    calibrator: Calibrator | None = None,
):
    """The whole multimodal forward of one (micro-)step, run inside the FSDP root call.

    Returns this rank's share of the loss (summed over its targets in the recipe's loss
    chunks, divided by ``denom``: the global target count of the optimizer step, all its
    micro-steps) and the orchestrator's LLM batch (metrics). With a ``calibrator`` every
    phase's forward is timed.
    """
    batch = planned.batch.to(device)
    dtype = compute_dtype(recipe)

    def forward(model: MLLM):
        encoders = {
            name: (lambda x, lengths, enc=enc: enc(x.to(dtype), lengths))
            for name, enc in model.encoders.items()
        }
        if calibrator is not None:
            encoders = calibrator.encoders(encoders)
        out = orch.run(batch, encoders, plan=planned.plan, assembly=planned.assembly)
        timed = calibrator.timed(LLM, out.lengths) if calibrator else contextlib.nullcontext()
        with timed:
            embeds = out.assemble(model.llm.embed(out.input_ids))
            loss = model.llm(
                embeds,
                out.lengths,
                out.targets,
                denom=denom,
                loss_chunk=recipe.loss_chunk,
            )
        return loss, out

    return forward


def _set_sum_reduction(model: MLLM) -> None:
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
    steps: int
    placement: str
    rpn: int
    device: torch.device
    model: MLLM
    optim: torch.optim.Optimizer
    orch: Orchestrator
    loader: BalancedDataLoader
    calibrator: Calibrator | None = None


def setup(args: argparse.Namespace) -> Run:
    """Load the config and data, build and shard the model (collective: every rank)."""
    cfg = run_config(args)
    steps = args.steps or cfg.train.steps
    seed = cfg.train.seed if args.seed is None else args.seed
    placement = args.placement or cfg.balance.placement
    world = dist.get_world_size()
    _, device = init_distributed(args.timeout)
    rpn = ranks_per_node(cfg, world)
    per_rank, accum = cfg.data.examples_per_rank, cfg.train.grad_accum
    dataset = prepare_dataset(
        cfg, num_examples=steps * accum * world * per_rank, seed=seed, data_dir=args.data_dir
    )
    # The process groups, built once: the loader plans on the gloo metadata group in its
    # background thread while training collectives run on the default group.
    topology = Topology.build(ranks_per_node=rpn, timeout=args.timeout)
    orch = make_orchestrator(
        cfg,
        mode=args.balance,
        placement=placement,
        topology=topology,
        dtype=compute_dtype(cfg.recipe),
    )
    # Samples like a DistributedSampler; plans each micro-step in a background thread ahead
    # of it (a time-limited ILP placement on rank 0 alone, broadcast: see
    # agreement.agreed_plan). A step takes its K micro-steps at once (their target count
    # normalises each), so the thread plans --prefetch whole steps ahead.
    loader = orchestrated_loader(
        dataset,
        orch,
        batch_size=per_rank,
        sampling=SamplingOptions(seed=seed),
        options=LoaderOptions(prefetch=args.prefetch * accum),
        topology=topology,
    )
    model = build_model(cfg.model, seed=seed, dtype=storage_dtype(cfg.recipe), device=device)
    model = parallelize(model, recipe=cfg.recipe)
    _set_sum_reduction(model)
    optim = torch.optim.AdamW(
        model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay
    )
    calibrator = None
    if cfg.balance.cost == "measured":
        b = cfg.balance
        calibrator = Calibrator.for_options(
            orch.options,
            device=device,
            steps=b.calibrate_steps,
            every=b.calibrate_every,
            fit=FitOptions(min_r2=b.min_r2),
        )
        calibrator.watch(model)  # its phases' times less FSDP's all-gather waits
    return Run(args, cfg, steps, placement, rpn, device, model, optim, orch, loader, calibrator)


def forward_backward(
    run: Run,
    planned: PlannedBatch,
    *,
    denom: int | None = None,
    memory: PhaseMemory | None = None,
    timed: bool = False,
) -> tuple[Tensor, LLMBatch]:
    """One (micro-)step's forward over all phases and its backward (gradients
    reduce-scattered, added to those of the step's earlier micro-steps), each measured by
    ``memory`` when given. ``denom``: the global target count the loss is divided by (None:
    this micro-step's own). ``timed``: the run's calibrator times the phases."""
    memory = memory or PhaseMemory(None, run.device)
    denom = max(planned.plan.num_targets if denom is None else denom, 1)
    forward = step_forward(
        run.orch, planned, recipe=run.cfg.recipe, device=run.device, denom=denom,
        calibrator=run.calibrator if timed else None,
    )  # fmt: skip
    with memory.phase("forward"):
        loss, out = run.model(forward)
    with memory.phase("backward"):
        loss.backward()
    return loss, out


def train(args: argparse.Namespace) -> tuple[RunningSummary, MLLM]:
    """Run the training loop; returns the run's summary and the (sharded) model.

    Each step's record goes to ``--metrics`` as soon as the step ends (rank 0), so memory
    holds only running aggregates however long the run. A step that fails (a collective
    timed out, a peer failed, left or died) raises :class:`orchmllm.dist.watch.StepFailed` naming
    the ranks that did not arrive, when this process publishes its progress (see
    :func:`init_distributed`); so does a failure in start-up, the dataset write or a
    checkpoint, each a section of its own. The loader is then abandoned, not closed: closing
    waits for collectives that cannot complete. A non-finite loss or gradient norm stops the
    run before the optimizer step (:class:`NonFiniteStep`) or skips the step
    (``--on-nonfinite skip``). With ``--checkpoint-dir`` the job holds the directory's lock
    (:func:`orchmllm.checkpoint.claim`) until it ends. A stop signal ends it at a step all
    ranks agree on, with a checkpoint (:mod:`orchmllm.preempt`).
    """
    lock = None

    def abandon() -> None:  # the grace ran out: leave the directory to the requeued job
        if lock is not None:
            lock.release()

    with preempt.Preemption(
        args.preempt_signals,
        grace=args.preempt_grace,
        saving=bool(args.checkpoint_dir),
        on_abandon=abandon,
    ) as preemption:
        with watch.section("start-up"):
            run = setup(args)
        try:
            start = 0
            if args.checkpoint_dir:
                with watch.section("checkpoint load"):
                    preemption.where = "checkpoint load"
                    lock = checkpoint.claim(
                        args.checkpoint_dir, stale_after=args.timeout, job=job_token()
                    )
                    start = resume(run)
            return _loop(run, start, lock, preemption), run.model
        finally:
            if lock is not None:
                lock.release()


def _loop(
    run: Run, start: int, lock: DirectoryLock | None, preemption: preempt.Preemption
) -> RunningSummary:
    """The steps from ``start`` on (see :func:`train`)."""
    args = run.args
    world = dist.get_world_size()
    summary = RunningSummary()
    metrics = args.metrics if dist.get_rank() == 0 else None
    if metrics:
        start_metrics(metrics, start=start)
    trackers = _trackers(run, start)
    memory = PhaseMemory(args.memory_report if dist.get_rank() == 0 else None, run.device)
    groups = accumulate(run.loader, grad_accum=run.cfg.train.grad_accum)
    progress = StepProgress(
        total=run.steps,
        initial=start,
        rank=dist.get_rank(),
        mode="off" if args.quiet else args.progress,
    )
    skips: list[int] = []  # the consecutive skipped steps up to now
    for step in range(start, run.steps):
        preemption.where = f"training step {step}"
        t0 = time.perf_counter()
        try:
            group = next(groups)  # the step's micro-steps, planned
        except StopIteration:  # the data is sized for --steps: running out is a bug, not an end
            raise RuntimeError(
                f"the data ran out at step {step} of {run.steps} (--steps): the dataset holds "
                f"fewer examples than steps x ranks x examples_per_rank x grad_accum"
            ) from None
        except Exception as exc:
            _step_failed(exc, "exchange", t0)
        watch.arrive("train", step)
        t0 = time.perf_counter()
        try:
            loss, tokens, micro_stats = accumulate_gradients(run, group, step=step, memory=memory)
            sums = step_sums(run, loss, tokens)
            calibration = calibrate(run, step)
            skipped = check_finite(sums, step=step, on_nonfinite=args.on_nonfinite)
            skips = [*skips, step] if skipped else []
            check_skips(skips, limit=run.cfg.train.max_skipped_steps)
            with memory.phase("optimizer"):
                if not skipped:
                    run.optim.step()
                run.optim.zero_grad(set_to_none=True)
            stop = preemption.agreed(run.device) and step + 1 < run.steps
        except NonFiniteStep:  # the same decision on every rank, already named
            progress.close()
            run.loader.close()  # every rank consumed this step's batch: closing is safe
            raise
        except BaseException as exc:
            _step_failed(exc, "train", t0)
        dt = time.perf_counter() - t0
        record = {
            "step": step,
            "loss": sums.loss,
            "grad_norm": sums.grad_norm,
            "skipped": skipped,
            "step_time_s": dt,
            "tokens_per_s": sums.tokens / dt,
            "balance": args.balance,
            "world_size": world,
            "ranks_per_node": run.rpn,
            "placement": run.placement,
            "micro_steps": len(group),
            "plan_s": sum(p.info.plan_s for p in group),
            "prep_s": sum(p.info.prep_s for p in group),
            **sums.memory(per_rank=args.metrics_per_rank),
            "phases": {
                name: phase_record(stats, per_rank=args.metrics_per_rank)
                for name, stats in step_phase_stats(micro_stats).items()
            },
        }
        if calibration is not None:
            record["calibration"] = calibration
        summary.add(record)
        memory.end_step(step, group[-1].plan)
        if metrics:
            append_metrics(metrics, record)
        if trackers is not None:
            trackers.log(record)
        progress.step(
            _progress(record),
            loss=f"{sums.loss:.4f}",
            imbalance=f"{record['phases'][LLM]['imbalance_after']:.3f}",
        )
        del group, loss  # nothing of this step outlives it
        saved = None
        if args.checkpoint_dir and (stop or _checkpoint_due(step + 1, run)):
            preemption.where = f"checkpoint save at step {step + 1}"
            with watch.section(f"checkpoint save at step {step + 1}"):
                saved = checkpoint.save(
                    args.checkpoint_dir, step + 1, model=run.model, optim=run.optim,
                    run=_run_state(run), keep_last=args.keep_last, lock=lock,
                )  # fmt: skip
        if stop:
            progress.close()
            run.loader.close()  # every rank consumed this step's batch: closing is safe
            raise preempt.Preempted(
                f"rank {dist.get_rank()}: {preemption.signal_name}: stopped after step {step} "
                f"of {run.steps}; checkpoint {saved} written and the lock released: rerun the "
                f"same command to resume at step {step + 1}",
                signal_name=preemption.signal_name or "",
                step=step + 1,
            )
    progress.close()
    run.loader.close()
    if trackers is not None:
        trackers.close()
    return summary


def _trackers(run: Run, start: int) -> Trackers | None:
    """Rank 0's experiment trackers (``--tensorboard``, ``--wandb``), None when none."""
    args = run.args
    if dist.get_rank() != 0 or not (args.tensorboard or args.wandb):
        return None
    config = {"balance": args.balance, "placement": run.placement, "config": args.config,
              "world_size": dist.get_world_size(), "steps": run.steps}  # fmt: skip
    return Trackers(tensorboard=args.tensorboard, wandb=args.wandb, config=config, start=start)


def accumulate_gradients(
    run: Run, group: list[PlannedBatch], *, step: int, memory: PhaseMemory
) -> tuple[Tensor, float, list[dict[str, dict]]]:
    """Forward and backward of every micro-step of optimizer step ``step``, each loss divided
    by the global target count of the whole group (known from the plans before the first
    forward), so the summed gradients are one step's over all the group's examples.

    Gradients are reduce-scattered after every micro-step, or only after the last one
    (``train.sync_micro_steps: false``). Returns this rank's share of the step's loss (summed
    over the micro-steps, detached), its LLM tokens, and each micro-step's per-phase
    statistics. With ``--memory-report`` each micro-step but the last writes its line here
    (the last one's holds the optimizer).
    """
    denom = max(sum(p.plan.num_targets for p in group), 1)
    total, tokens, stats = None, 0.0, []
    for m, planned in enumerate(group):
        if not run.cfg.train.sync_micro_steps:
            compat.set_gradient_sync(run.model, m == len(group) - 1)
        timed = run.calibrator is not None and run.calibrator.active(step)
        loss, out = forward_backward(run, planned, denom=denom, memory=memory, timed=timed)
        total = loss.detach() if total is None else total + loss.detach()
        tokens += float(out.lengths.sum())
        stats.append(out.stats)
        if m < len(group) - 1:
            memory.end_step(step, planned.plan)
        del loss, out  # one micro-step's activations and outputs at a time
    return total, tokens, stats


def calibrate(run: Run, step: int) -> dict[str, dict] | None:
    """With ``balance.cost: measured``, during the timed steps: gather every rank's phase
    times (collective), and on a refit step give the loader the trusted fits, which it plans
    with from a step its prefetcher cannot have begun. Returns the step's calibration metrics
    (None: not timed)."""
    if run.calibrator is None or not run.calibrator.active(step):
        return None
    report = run.calibrator.end_step(step, timeout=run.args.timeout)
    costs = report.costs()
    if costs:
        run.loader.set_costs(costs)
    return report.record()


def step_phase_stats(micro: list[dict[str, dict]]) -> dict[str, dict]:
    """One optimizer step's per-phase statistics from its micro-steps' (one micro-step: its
    own, unchanged). Each micro-step waits for its slowest rank, so a phase's
    ``load_max_before``/``after`` is the sum of the micro-steps' slowest loads and its
    imbalance that sum over the sum of their mean loads; per-rank loads, bytes, items and
    planning times add up."""
    if len(micro) == 1:
        return micro[0]
    out = {}
    for name in micro[0]:
        parts = [m[name] for m in micro]
        merged = {
            key: sum(p[key] for p in parts) for key in parts[0] if not key.startswith("loads_")
        }
        for when in ("before", "after"):
            loads = np.asarray([p[f"loads_{when}"] for p in parts], dtype=np.float64)
            slowest, mean = float(loads.max(axis=1).sum()), float(loads.mean(axis=1).sum())
            merged[f"loads_{when}"] = loads.sum(axis=0).tolist()
            merged[f"load_max_{when}"] = slowest
            merged[f"imbalance_{when}"] = slowest / mean if mean > 0 else 1.0
        out[name] = merged
    return out


@dataclass(frozen=True)
class StepSums:
    """One step's figures summed over the ranks, and each rank's own: ``per_rank[r]`` is
    (rank r's share of the loss, its target tokens, its gradient shard's squared norm, its
    anonymous and its file-backed resident memory in MB: :mod:`orchmllm.host_memory`)."""

    loss: float
    tokens: float
    grad_norm: float
    per_rank: list[list[float]]

    def memory(self, *, per_rank: bool) -> dict[str, Any]:
        """The step record's memory fields: rank 0's and the largest rank's anonymous and
        file-backed resident MB (and every rank's, when ``per_rank``)."""
        out: dict[str, Any] = {}
        for col, kind in ((3, "anon"), (4, "file")):
            mb = [row[col] for row in self.per_rank]
            out[f"rss_{kind}_mb"], out[f"rss_{kind}_mb_max"] = mb[0], max(mb)
            if per_rank:
                out[f"rss_{kind}_mb_per_rank"] = mb
        return out


def step_sums(run: Run, loss: Tensor, tokens: float) -> StepSums:
    """Gather every rank's loss share, token count, squared gradient-shard norm and resident
    memory (after the step's last backward, before the optimizer step; collective). FSDP2's
    gradient shards are disjoint, so the global gradient norm is the root of the ranks'
    squared norms summed."""
    grads = [p.grad for p in run.model.parameters() if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    norms = [torch.linalg.vector_norm(g, dtype=torch.float64) for g in local if g.numel()]
    grad_sq = torch.stack(norms).square().sum() if norms else torch.zeros((), dtype=torch.float64)
    memory = host_memory.resident_mb()
    host = [tokens, memory.get("anon", np.nan), memory.get("file", np.nan)]
    tokens, anon_file = torch.tensor(host, dtype=torch.float64, device=loss.device).split([1, 2])
    mine = torch.cat(
        [loss.detach().to(torch.float64).reshape(1), tokens, grad_sq.to(loss.device).reshape(1),
         anon_file]
    )  # fmt: skip
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(table, mine)
    per_rank = torch.stack(table).cpu()
    total = per_rank[:, :3].sum(dim=0).tolist()
    return StepSums(total[0], total[1], float(np.sqrt(total[2])), per_rank.tolist())


class NonFiniteStep(RuntimeError):
    """A step's loss or gradient norm is not finite (raised on every rank together)."""


def check_finite(sums: StepSums, *, step: int, on_nonfinite: str) -> bool:
    """Whether to skip the step's update: False when its loss and gradient norm are finite.
    Otherwise raises :class:`NonFiniteStep` naming the step and the ranks whose own loss (or
    gradient shard) is not finite (``on_nonfinite="stop"``), or returns True (``"skip"``).
    Every rank decides alike from the same gathered figures."""
    if on_nonfinite not in NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {NONFINITE}, got {on_nonfinite!r}")
    if np.isfinite(sums.loss) and np.isfinite(sums.grad_norm):
        return False
    table = np.asarray(sums.per_rank)
    bad_loss = np.flatnonzero(~np.isfinite(table[:, 0])).tolist()
    bad_grad = np.flatnonzero(~np.isfinite(table[:, 2])).tolist()
    what = (
        f"the loss is {sums.loss} (not finite on rank(s) {bad_loss})"
        if bad_loss
        else f"the gradient norm is {sums.grad_norm} (not finite on rank(s) {bad_grad})"
    )
    if on_nonfinite == "skip":
        if dist.get_rank() == 0:
            print(f"training step {step} skipped: {what}", file=sys.stderr, flush=True)
        return True
    raise NonFiniteStep(
        f"rank {dist.get_rank()}: training step {step}: {what}; stopped before the optimizer "
        "step and before any checkpoint of it was written (--on-nonfinite skip skips such "
        "steps instead)"
    )


def check_skips(skips: list[int], *, limit: int) -> None:
    """Raise :class:`NonFiniteStep` once ``limit`` consecutive steps (``skips``) were skipped:
    a run whose every step is skipped has diverged, and going on would only burn the
    allocation (every rank decides alike)."""
    if len(skips) >= limit:
        raise NonFiniteStep(
            f"rank {dist.get_rank()}: {len(skips)} consecutive training steps skipped (steps "
            f"{skips[0]}-{skips[-1]}; train.max_skipped_steps is {limit}), the first at step "
            f"{skips[0]}: the run has diverged (the learning rate, the data?); stopped"
        )


def phase_record(stats: dict[str, Any], *, per_rank: bool) -> dict[str, Any]:
    """A phase's metrics for the step record: scalars (imbalance, the slowest rank's load
    before and after, bytes, planning time), plus every rank's load when ``per_rank``
    (summed over micro-steps: :func:`step_phase_stats`)."""
    out = {k: v for k, v in stats.items() if k not in ("loads_before", "loads_after")}
    out.setdefault("load_max_before", max(stats["loads_before"]))
    out.setdefault("load_max_after", max(stats["loads_after"]))
    if per_rank:
        out["loads_before"], out["loads_after"] = stats["loads_before"], stats["loads_after"]
    return out


def start_metrics(path: str, *, start: int) -> None:
    """Begin ``--metrics`` for a run starting at step ``start``: empty, or, when resuming,
    only the lines of the steps before ``start`` (later ones are not in the checkpoint)."""
    kept = []
    if start > 0 and os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] < start]
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def append_metrics(path: str, record: dict[str, Any]) -> None:
    """One JSON line, on disk when this returns (opened per step: a crash keeps the record,
    and nothing stays open across steps)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class RunningSummary:
    """Running means of the step records, for the closing table: its memory does not grow
    with the number of steps (the records themselves go to ``--metrics``)."""

    _KEYS = (
        "imbalance_before", "imbalance_after", "load_max_before", "load_max_after",
        "bytes_intra", "bytes_inter", "plan_ms",
    )  # fmt: skip

    def __init__(self) -> None:
        self.steps = 0
        self.sums: dict[str, dict[str, float]] = {}  # phase -> key -> sum, from the first step
        self.timed_s = 0.0  # step times after the first step of this process (warm-up)
        self.first: dict[str, Any] | None = None
        self.last_loss = float("nan")

    def add(self, record: dict[str, Any]) -> None:
        if self.first is None:
            self.first = {k: v for k, v in record.items() if k != "phases"}
        else:
            self.timed_s += record["step_time_s"]
        self.steps += 1
        self.last_loss = record["loss"]
        for name, phase in record["phases"].items():
            sums = self.sums.setdefault(name, dict.fromkeys(self._KEYS, 0.0))
            for key in self._KEYS:
                sums[key] += phase[key]

    def table(self) -> str:
        """Per-phase means over the steps: imbalance before/after (max/mean load), the
        slowest rank's load before -> after (the phase's cost units: what a step waits for;
        under a padded cost the ratio's mean shrinks with the padding a plan removes), bytes
        moved intra- and inter-node per step, planning time; then the mean step time."""
        if self.first is None:
            return "no steps run"
        lines = [
            f"{'phase':<8}{'imbalance before':>18}{'imbalance after':>17}{'slowest rank':>17}"
            f"{'KB intra/step':>15}{'KB inter/step':>15}{'plan ms':>9}"
        ]
        for name, sums in self.sums.items():
            m = {k: v / self.steps for k, v in sums.items()}
            slowest = f"{m['load_max_before']:.0f} -> {m['load_max_after']:.0f}"
            lines.append(
                f"{name:<8}{m['imbalance_before']:>18.3f}{m['imbalance_after']:>17.3f}"
                f"{slowest:>17}{m['bytes_intra'] / 1e3:>15.1f}{m['bytes_inter'] / 1e3:>15.1f}"
                f"{m['plan_ms']:>9.2f}"
            )
        f = self.first
        step_s = self.timed_s / (self.steps - 1) if self.steps > 1 else f["step_time_s"]
        lines.append(
            f"balance={f['balance']} placement={f['placement']} world={f['world_size']} "
            f"ranks/node={f['ranks_per_node']} steps={self.steps} "
            f"mean step {step_s * 1e3:.1f} ms (after the first)  final loss {self.last_loss:.4f}"
        )
        return "\n".join(lines)


def _checkpoint_due(done: int, run: Run) -> bool:
    every = run.args.checkpoint_every
    return done == run.steps or (every > 0 and done % every == 0)


# Config keys that do not change the training: the balancing (mode, policies, placement), the
# layout (its global batch is compared instead) and the run's stopping rule.
# (train.steps, train.seed and recipe.precision are compared as the command line sets them.)
_FREE_KEYS = (
    "balance.", "data.examples_per_rank", "train.grad_accum", "train.sync_micro_steps",
    "train.max_skipped_steps", "train.steps", "train.seed", "recipe.precision",
)  # fmt: skip


def _config_fields(cfg: RunConfig) -> dict[str, Any]:
    """The config as flat ``section.key`` values (JSON ones) that a resumed run must keep."""

    def flat(value: Any, prefix: str) -> dict[str, Any]:
        if isinstance(value, dict):
            return {k: v for key, x in value.items() for k, v in flat(x, f"{prefix}{key}.").items()}
        return {prefix[:-1]: value}

    fields = json.loads(json.dumps(flat(dataclasses.asdict(cfg), "")))
    return {k: v for k, v in fields.items() if not k.startswith(_FREE_KEYS)}


def _identity(run: Run) -> dict[str, Any]:
    """What a checkpoint must have been written by to resume this run: everything that
    changes the training itself. Not the balance mode, policies, placement or gradient sync,
    which do not, nor the world size, examples per rank or micro-steps: the global batch
    (ranks x examples per rank x micro-steps) stands for them, so a run that keeps it may
    resume on another number of ranks or micro-steps (see :func:`resume`)."""
    a, cfg = run.args, run.cfg
    return {
        "config": _config_fields(cfg), "steps": run.steps, "precision": cfg.recipe.precision,
        "seed": cfg.train.seed if a.seed is None else a.seed,
        "global_batch": dist.get_world_size() * cfg.data.examples_per_rank
        * cfg.train.grad_accum,
    }  # fmt: skip


def _run_state(run: Run) -> dict[str, Any]:
    """The run state a checkpoint keeps: the run's identity, the layout that wrote it and
    the loader's position (micro-steps of the layout that wrote it: see
    :func:`loader_position`)."""
    layout = {
        "world_size": dist.get_world_size(),
        "per_rank": run.cfg.data.examples_per_rank,
        "grad_accum": run.cfg.train.grad_accum,
    }
    return {"run": _identity(run), "layout": layout, "loader": run.loader.state_dict()}


def resume(run: Run) -> int:
    """Restore the newest checkpoint of ``--checkpoint-dir`` that verifies (model, optimizer,
    loader position, RNG; see :func:`orchmllm.checkpoint.load`) and return the step to
    continue at; 0 when there is none. Collective.

    A checkpoint of another run (config, steps, seed, precision, global batch) is refused
    with a ValueError rather than resumed. One written on another number of ranks or
    micro-steps resumes when the global batch is the same (4 ranks x 8 examples -> 2 x 16,
    or 2 x 8 x 2 micro-steps): DCP reshards the model and optimizer, and every step's global
    batch is the same examples (the sampler deals the epoch's permutation to the ranks in
    turn, so ranks x examples per rank consecutive examples make one micro-step, and K
    consecutive micro-steps one step, on any layout), so the losses go on as in an
    uninterrupted run. Otherwise the refusal says which ``data.examples_per_rank`` would
    allow it. The run is compared before any tensor is loaded (:func:`check_resumable`)."""
    directory = run.args.checkpoint_dir
    loaded = checkpoint.load(
        directory,
        model=run.model,
        optim=run.optim,
        check=lambda step, state: check_resumable(run, directory, step, state),
    )
    if loaded is None:
        return 0
    step, state = loaded
    run.loader.load_state_dict(
        loader_position(state["loader"], step, grad_accum=run.cfg.train.grad_accum)
    )
    if dist.get_rank() == 0:
        layout = state.get("layout", {})
        moved = (
            f" (written by {layout['world_size']} ranks, resharded onto {dist.get_world_size()})"
            if layout.get("world_size", dist.get_world_size()) != dist.get_world_size()
            else ""
        )
        print(f"resumed at step {step} from {checkpoint.step_dir(directory, step)}{moved}")
        sys.stdout.flush()
    return step


def check_resumable(run: Run, directory: str, step: int, state: dict[str, Any]) -> None:
    """Refuse (ValueError, the same on every rank) the checkpoint of ``step`` whose run state
    ``state`` is another run's. The first line names every differing config key with both
    values: a model's (a width, a layer count, an encoder added or removed, the vocabulary)
    would not even load."""
    where = f"--checkpoint-dir {directory!r}: {checkpoint.step_dir(directory, step)}"
    mine, theirs = _identity(run), state["run"]
    if not isinstance(theirs.get("config"), dict):
        raise ValueError(
            f"{where} was written by an older orchmllm that did not record its config key by "
            "key; resume it with that version or use another directory"
        )
    ours, saved = mine["config"], theirs["config"]
    missing = "(absent)"
    changed = [
        f"{key} {saved.get(key, missing)!r} there, {ours.get(key, missing)!r} now"
        for key in sorted(ours.keys() | saved.keys())
        if ours.get(key, missing) != saved.get(key, missing)
    ]
    if changed:
        model = any(c.startswith("model.") for c in changed)
        what = "another model, which cannot load into this one" if model else "another run"
        raise ValueError(
            f"{where} was written for {what}: {'; '.join(changed)}. Resume with the same "
            "config or use another directory"
        )
    for key, value in mine.items():
        if theirs.get(key) == value:
            continue
        if key == "global_batch" and "layout" in state:
            raise ValueError(f"{where} {_layout_refusal(state['layout'], run)}")
        raise ValueError(
            f"{where} was written by another run ({key} {theirs.get(key)!r} there, {value!r} "
            "now); resume with the same settings or use another directory"
        )


def loader_position(state: dict[str, int], step: int, *, grad_accum: int) -> dict[str, int]:
    """The loader state that resumes optimizer step ``step`` with ``grad_accum`` micro-steps
    each: the checkpoint's (epoch, seed), at micro-step ``step * grad_accum``. The run's data
    is one epoch of exactly its steps, so that is where the loader stood at the end of
    ``step``, on any layout of the same global batch."""
    return {**state, "step": step * grad_accum}


def _layout_refusal(layout: dict[str, int], run: Run) -> str:
    """Why a checkpoint of another global batch cannot resume here, and what would."""
    world, per_rank = dist.get_world_size(), run.cfg.data.examples_per_rank
    accum, theirs = run.cfg.train.grad_accum, layout.get("grad_accum", 1)
    batch = layout["world_size"] * layout["per_rank"] * theirs
    written = f" x {theirs} micro-steps" if theirs > 1 else ""
    here, with_accum = (f" x {accum}", f" (with grad_accum {accum})") if accum > 1 else ("", "")
    head = (
        f"was written by {layout['world_size']} ranks x {layout['per_rank']} examples per rank"
        f"{written} (global batch {batch}); this run has {world} x {per_rank}{here} = "
        f"{world * per_rank * accum}. A resumed run must keep the global batch (it decides "
        "every step's examples and loss): "
    )
    if batch % (world * accum) == 0:
        return head + (
            f"on {world} ranks set data.examples_per_rank to {batch // (world * accum)}{with_accum}"
        )
    sizes = [w for w in range(1, batch + 1) if batch % w == 0]
    over, unit = (f"{world} ranks x {accum} micro-steps", "ranks x micro-steps")
    if accum == 1:
        over, unit = f"{world} ranks", "ranks"
    return head + f"{batch} examples do not split over {over}; use {sizes} {unit}"


def _step_failed(exc: BaseException, stream: str, t0: float) -> NoReturn:
    """Raise ``exc`` as the diagnosis of the step it ended (see :mod:`orchmllm.dist.watch`)."""
    progress = watch.current()
    if progress is None or not watch.is_failure(exc):
        raise exc
    raise progress.diagnose(exc, stream=stream, elapsed_s=time.perf_counter() - t0) from exc


def _progress(r: dict) -> str:
    imb = "  ".join(
        f"{name} {p['imbalance_before']:.2f}->{p['imbalance_after']:.2f}"
        for name, p in r["phases"].items()
    )
    return (
        f"step {r['step']:4d}  loss {r['loss']:.4f}  {r['step_time_s'] * 1e3:7.1f} ms  "
        f"{r['tokens_per_s']:8.0f} tok/s  imbalance {imb}"
    )


def main(argv: list[str] | None = None) -> RunningSummary:
    """Entry point; also callable inside an existing process group (tests). Returns the
    run's summary.

    When it created the process group (torchrun), any failure prints the error and ends
    the process at once with status 1: tearing the group down would wait on the peers that
    caused the failure. A launch mistake found before that (no launcher, a config that does
    not load or does not fit the world size: :func:`orchmllm.launch.preflight`) ends it with
    status 2, its fix printed once (so does a bad command line).
    """
    with launch.quiet_peers():
        args = parse_args(argv)
    if not dist.is_initialized():
        try:
            launch.preflight(args, sys.argv[1:] if argv is None else argv, run_config)
        except launch.LaunchError as exc:
            launch.exit_with(exc)
    host_memory.bound_native_caches()  # else CPU convolutions cache a kernel per shape
    created, _ = init_distributed(args.timeout)
    try:
        summary, model = train(args)
        if args.save:
            # Collective: every rank contributes its shards; rank 0 writes.
            # the state dict's names are the model's (no activation-checkpoint wrapper)
            state = {n: t.full_tensor().detach().cpu() for n, t in model.state_dict().items()}
            if dist.get_rank() == 0:
                torch.save(state, args.save)
        if dist.get_rank() == 0:
            print(summary.table(), flush=True)
    except BaseException as exc:
        if created:
            _exit_failed(exc)
        raise
    if created:
        watch.current().close()
        watch.install(None)
        dist.destroy_process_group()
    return summary


def _exit_failed(exc: BaseException) -> NoReturn:
    preempted = isinstance(exc, preempt.Preempted)
    if preempted:
        print(f"{exc} (exit status {preempt.PREEMPTED})", file=sys.stderr)
    else:
        traceback.print_exception(exc)
    progress = watch.current()
    if progress is not None and not isinstance(exc, watch.StepFailed):
        with contextlib.suppress(Exception):
            progress.close("preempted" if preempted else f"failed: {type(exc).__name__}")
    compat.leave_process(preempt.PREEMPTED if preempted else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
    compat.leave_process(0)  # a finished run must not abort in gloo's exit (see there)
