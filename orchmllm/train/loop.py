"""The training loop: start-up, resume, the steps, their records and checkpoints, and the stop
a preemption asks for (:func:`train`)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import torch.distributed as dist

from orchmllm.data.accumulation import accumulate
from orchmllm.data.loader import PlannedBatch
from orchmllm.dist import watch
from orchmllm.dist.topology import job_token
from orchmllm.models import MLLM
from orchmllm.schema import LLM
from orchmllm.train import checkpoint, preempt
from orchmllm.train.dirlock import DirectoryLock
from orchmllm.train.metrics import (
    RunningSummary,
    append_metrics,
    phase_record,
    progress_line,
    start_metrics,
    step_phase_stats,
)
from orchmllm.train.phase_memory import MemoryReport, PhaseMemory
from orchmllm.train.progress import StepProgress
from orchmllm.train.resume import checkpoint_due, resume, save
from orchmllm.train.run import Run, setup
from orchmllm.train.step import (
    NonFiniteStep,
    StepSums,
    accumulate_gradients,
    calibrate,
    check_finite,
    check_skips,
    step_sums,
)
from orchmllm.train.tracking import Trackers


def train(args: argparse.Namespace) -> tuple[RunningSummary, MLLM]:
    """Run the training loop; returns the run's summary and the (sharded) model.

    Each step's record goes to ``--metrics`` as soon as the step ends (rank 0), so memory
    holds only running aggregates however long the run. A step that fails (a collective
    timed out, a peer failed, left or died) raises :class:`orchmllm.dist.watch.StepFailed` naming
    the ranks that did not arrive, when this process publishes its progress (see
    :func:`orchmllm.train.run.init_distributed`); so does a failure in start-up, the dataset
    write or a checkpoint, each a section of its own. The loader is then abandoned, not
    closed: closing waits for collectives that cannot complete. A non-finite loss or gradient
    norm stops the run before the optimizer step (:class:`NonFiniteStep`) or skips the step
    (``--on-nonfinite skip``). With ``--checkpoint-dir`` the job holds the directory's lock
    (:func:`orchmllm.train.checkpoint.claim`) until it ends. A stop signal ends it at a step
    all ranks agree on, with a checkpoint (:mod:`orchmllm.train.preempt`).
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


def _memory(run: Run, rank0: bool) -> PhaseMemory | MemoryReport:
    """The step's memory measurement: ``--memory-report`` on every rank (measured beside
    predicted), else ``--memory-trace`` on rank 0 (absolute CUDA peaks and the batch), else
    nothing."""
    args = run.args
    if args.memory_report:
        return MemoryReport(
            args.memory_report, run.device, config=run.cfg.model, recipe=run.cfg.recipe,
            rank=dist.get_rank(), world_size=dist.get_world_size(),
        )  # fmt: skip
    return PhaseMemory(args.memory_trace if rank0 else None, run.device)


@dataclass
class _Outputs:
    """Where the steps' records go: the closing table's running means, and on rank 0
    ``--metrics``, the trackers, ``--memory-report`` (or ``--memory-trace``) and the progress
    report."""

    summary: RunningSummary
    metrics: str | None
    trackers: Trackers | None
    memory: PhaseMemory | MemoryReport
    progress: StepProgress

    @classmethod
    def open(cls, run: Run, start: int) -> _Outputs:
        args, rank0 = run.args, dist.get_rank() == 0
        metrics = args.metrics if rank0 else None
        if metrics:
            start_metrics(metrics, start=start)
        memory = _memory(run, rank0)
        mode = "off" if args.quiet else args.progress
        progress = StepProgress(total=run.steps, initial=start, rank=dist.get_rank(), mode=mode)
        return cls(RunningSummary(), metrics, _trackers(run, start), memory, progress)

    def add(self, record: dict[str, Any], last: PlannedBatch) -> None:
        """A step's record, everywhere it goes."""
        self.summary.add(record)
        self.memory.end_step(record["step"], last.plan)
        if self.metrics:
            append_metrics(self.metrics, record)
        if self.trackers is not None:
            self.trackers.log(record)
        imbalance = record["phases"][LLM]["imbalance_after"]
        self.progress.step(
            progress_line(record), loss=f"{record['loss']:.4f}", imbalance=f"{imbalance:.3f}"
        )

    def close(self, run: Run) -> None:
        """The run ends with every rank past its last batch: closing the loader is safe."""
        self.progress.close()
        run.loader.close()
        if self.trackers is not None:
            self.trackers.close()


@dataclass
class _Step:
    """What one optimizer step's training gives its record."""

    sums: StepSums
    skips: list[int]  # the consecutive skipped steps up to this one (empty: it was not)
    micro_stats: list[dict[str, dict]]
    calibration: dict[str, dict] | None
    stop: bool  # the ranks agreed to stop after it (a preemption)
    time_s: float

    @property
    def skipped(self) -> bool:
        return bool(self.skips)


def _loop(
    run: Run, start: int, lock: DirectoryLock | None, preemption: preempt.Preemption
) -> RunningSummary:
    """The steps from ``start`` on (see :func:`train`)."""
    out = _Outputs.open(run, start)
    groups = accumulate(run.loader, grad_accum=run.cfg.train.grad_accum)
    skips: list[int] = []  # the consecutive skipped steps up to now
    for step in range(start, run.steps):
        preemption.where = f"training step {step}"
        group = _next_group(groups, step, run.steps)
        watch.arrive("train", step)
        try:
            done = _train_step(run, group, step, out.memory, skips, preemption)
        except NonFiniteStep:  # the same decision on every rank, already named
            out.close(run)
            raise
        out.add(step_record(run, step, group, done), group[-1])
        del group  # nothing of this step outlives it
        skips, saved = done.skips, None
        if run.args.checkpoint_dir and (done.stop or checkpoint_due(step + 1, run)):
            preemption.where = f"checkpoint save at step {step + 1}"
            saved = save(run, step + 1, lock)
        if done.stop:
            out.close(run)
            _preempted(run, preemption, step, saved)
    out.close(run)
    return out.summary


def _next_group(groups: Iterator[list[PlannedBatch]], step: int, steps: int) -> list[PlannedBatch]:
    """Step ``step``'s micro-steps, planned. The data is sized for the run's steps: running
    out is a bug, not an end."""
    t0 = time.perf_counter()
    try:
        return next(groups)
    except StopIteration:
        raise RuntimeError(
            f"the data ran out at step {step} of {steps} (--steps): the dataset holds "
            f"fewer examples than steps x ranks x examples_per_rank x grad_accum"
        ) from None
    except Exception as exc:
        _step_failed(exc, "exchange", t0)


def _train_step(
    run: Run,
    group: list[PlannedBatch],
    step: int,
    memory: PhaseMemory | MemoryReport,
    skips: list[int],
    preemption: preempt.Preemption,
) -> _Step:
    """Step ``step``: forward and backward of its micro-steps, its figures gathered, the
    optimizer step unless it is skipped (``skips``: the consecutive skipped steps before it),
    and whether the ranks stop after it."""
    t0 = time.perf_counter()
    try:
        loss, tokens, micro_stats = accumulate_gradients(run, group, step=step, memory=memory)
        sums = step_sums(run, loss, tokens)
        del loss  # one step's tensors at a time
        calibration = calibrate(run, step)
        skipped = check_finite(sums, step=step, on_nonfinite=run.args.on_nonfinite)
        skips = [*skips, step] if skipped else []
        check_skips(skips, limit=run.cfg.train.max_skipped_steps)
        with memory.phase("optimizer"):
            if not skipped:
                run.optim.step()
            run.optim.zero_grad(set_to_none=True)
        stop = preemption.agreed(run.device) and step + 1 < run.steps
    except NonFiniteStep:
        raise
    except BaseException as exc:
        _step_failed(exc, "train", t0)
    return _Step(sums, skips, micro_stats, calibration, stop, time.perf_counter() - t0)


def step_record(run: Run, step: int, group: list[PlannedBatch], done: _Step) -> dict[str, Any]:
    """Step ``step``'s ``--metrics`` record (the same on every rank)."""
    per_rank, sums = run.args.metrics_per_rank, done.sums
    record = {
        "step": step,
        "loss": sums.loss,
        "grad_norm": sums.grad_norm,
        "skipped": done.skipped,
        "step_time_s": done.time_s,
        "tokens_per_s": sums.tokens / done.time_s,
        "balance": run.args.balance,
        "world_size": dist.get_world_size(),
        "ranks_per_node": run.rpn,
        "placement": run.placement,
        "micro_steps": len(group),
        "plan_s": sum(p.info.plan_s for p in group),
        "prep_s": sum(p.info.prep_s for p in group),
        **sums.memory(per_rank=per_rank),
        "phases": {
            name: phase_record(stats, per_rank=per_rank)
            for name, stats in step_phase_stats(done.micro_stats).items()
        },
    }
    if done.calibration is not None:
        record["calibration"] = done.calibration
    return record


def _preempted(run: Run, preemption: preempt.Preemption, step: int, saved: str | None) -> NoReturn:
    raise preempt.Preempted(
        f"rank {dist.get_rank()}: {preemption.signal_name}: stopped after step {step} "
        f"of {run.steps}; checkpoint {saved} written and the lock released: rerun the "
        f"same command to resume at step {step + 1}",
        signal_name=preemption.signal_name or "",
        step=step + 1,
    )


def _trackers(run: Run, start: int) -> Trackers | None:
    """Rank 0's experiment trackers (``--tensorboard``, ``--wandb``), None when none."""
    args = run.args
    if dist.get_rank() != 0 or not (args.tensorboard or args.wandb):
        return None
    config = {"balance": args.balance, "placement": run.placement, "config": args.config,
              "world_size": dist.get_world_size(), "steps": run.steps}  # fmt: skip
    return Trackers(tensorboard=args.tensorboard, wandb=args.wandb, config=config, start=start)


def _step_failed(exc: BaseException, stream: str, t0: float) -> NoReturn:
    """Raise ``exc`` as the diagnosis of the step it ended (see :mod:`orchmllm.dist.watch`)."""
    progress = watch.current()
    if progress is None or not watch.is_failure(exc):
        raise exc
    raise progress.diagnose(exc, stream=stream, elapsed_s=time.perf_counter() - t0) from exc
