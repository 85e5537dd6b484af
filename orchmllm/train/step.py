"""One optimizer step: the forward of every phase and the backward of each micro-step, the
figures gathered over the ranks, and the check that the step is finite."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from orchmllm import compat
from orchmllm.config import TrainRecipe
from orchmllm.data.loader import PlannedBatch
from orchmllm.dist.calibrator import Calibrator
from orchmllm.dist.orchestrator import LLMBatch, Orchestrator
from orchmllm.models import MLLM, compute_dtype
from orchmllm.schema import LLM
from orchmllm.train import host_memory
from orchmllm.train.phase_memory import MemoryReport, PhaseMemory
from orchmllm.train.run import Run

NONFINITE = ("stop", "skip")


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
            name: (lambda x, lengths, *rest, enc=enc, **kw: enc(x.to(dtype), lengths, *rest, **kw))
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
                pieces=out.pieces,
            )
        return loss, out

    return forward


def forward_backward(
    run: Run,
    planned: PlannedBatch,
    *,
    denom: int | None = None,
    memory: PhaseMemory | MemoryReport | None = None,
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


def accumulate_gradients(
    run: Run, group: list[PlannedBatch], *, step: int, memory: PhaseMemory | MemoryReport
) -> tuple[Tensor, float, list[dict[str, dict]]]:
    """Forward and backward of every micro-step of optimizer step ``step``, each loss divided
    by the global target count of the whole group (known from the plans before the first
    forward), so the summed gradients are one step's over all the group's examples.

    Gradients are reduce-scattered after every micro-step, or only after the last one
    (``train.sync_micro_steps: false``). Returns this rank's share of the step's loss (summed
    over the micro-steps, detached), its LLM tokens, and each micro-step's per-phase
    statistics. With ``--memory-report``/``--memory-trace`` each micro-step but the last writes
    its lines here
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


@dataclass(frozen=True)
class StepSums:
    """One step's figures summed over the ranks, and each rank's own: ``per_rank[r]`` is
    (rank r's share of the loss, its target tokens, its gradient shard's squared norm, its
    anonymous and its file-backed resident memory in MB: :mod:`orchmllm.train.host_memory`)."""

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
