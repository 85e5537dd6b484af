"""Peak memory per phase of a training step: ``--memory-report PATH`` and ``--memory-trace PATH``.

The trainer runs each step's forward, backward and optimizer step inside :meth:`PhaseMemory.phase`.
On CUDA the allocator's peak (``torch.cuda.max_memory_allocated``) is reset before each phase and
read after it, with the bytes still allocated when it ends. :meth:`PhaseMemory.end_step` appends
one JSON line per step: those figures and the step's global batch as lengths (the fields of
:class:`orchmllm.sim.batch.Batch`), so the memory model can predict the very same step
(``benchmarks/train_memory.py``). Without CUDA there is no allocator counter and the figures are
null. Measuring synchronises the device around every phase, so a reported run's step times
include those waits.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from orchmllm.config import ModelConfig, TrainRecipe
from orchmllm.sim.memory import MemoryModel, step_of_plan

PHASES = ("forward", "backward", "optimizer")


class PhaseMemory:
    """Collects one step's per-phase peaks and writes them to ``path`` (None: does nothing)."""

    def __init__(self, path: str | None, device: torch.device) -> None:
        self.path = path
        self.device = device
        self.cuda = device.type == "cuda"
        self.step: dict[str, dict[str, int | None]] = {}
        if path is not None:
            open(path, "w").close()  # a fresh report per run

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the code run inside as phase ``name`` of the current step."""
        if self.path is None:
            yield
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        yield
        peak = allocated = None
        if self.cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            allocated = torch.cuda.memory_allocated(self.device)
        self.step[name] = {"peak_bytes": peak, "allocated_bytes": allocated}

    def end_step(self, step: int, plan: Any) -> None:
        """Append step ``step``'s line: its phases and its global batch (``plan``, the
        step's :class:`~orchmllm.planner.step_plan.StepPlan`)."""
        if self.path is None:
            return
        batch = {
            "num_ranks": plan.num_ranks,
            "text": plan.text_len.tolist(),
            "items": {
                name: {"example": p.example.tolist(), "raw": p.raw.tolist()}
                for name, p in plan.phases.items()
            },
        }
        source = "cuda_max_memory_allocated" if self.cuda else None
        record = {"step": step, "source": source, "phases": self.step, "batch": batch}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.step = {}


class MemoryReport:
    """``--memory-report PATH``: one JSON line per step, rank and phase, each rank's measured
    peak beside the memory model's prediction for the batch it ran.

    Each line has ``step``, ``rank``, ``phase``, ``measured_bytes`` and ``predicted_bytes``:
    the phase's peak above the bytes allocated when the step began (the static footprint:
    sharded parameters, optimizer state, anything the caller keeps across steps), measured by
    CUDA's allocator (``max_memory_allocated``) on a GPU and by the allocator's events seen by
    ``torch.profiler`` on the CPU (which has no counter), and predicted by
    :class:`~orchmllm.sim.memory.MemoryModel` from the step's plan for this rank
    (:func:`~orchmllm.sim.memory.step_of_plan`: its items, sequences and moves). The model's
    figure assumes the previous step's batch is released before the step, as a trainer that
    reports drops it, and AdamW's moments held from the start: a run's first optimizer step
    (not resumed) allocates them, and measures above the figure by their bytes.

    Every rank measures its own phases with :meth:`phase`; :meth:`end_step` is a collective
    of the default group: rank 0 gathers every rank's lines and appends them to ``path``
    (created afresh), in rank order. With ``path`` None nothing is measured or gathered.
    """

    def __init__(
        self,
        path: str | None,
        device: torch.device,
        *,
        config: ModelConfig,
        recipe: TrainRecipe,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank!r}")
        self.path, self.device, self.rank, self.world_size = path, device, rank, world_size
        self.config, self.recipe = config, recipe
        self.cuda = device.type == "cuda"
        self.model = MemoryModel(
            device=device.type,
            threads=torch.get_num_threads(),
            shard_group=world_size,
            previous_batch=False,
        )
        self.measured: dict[str, int] = {}
        self._start: int | None = None  # CUDA: bytes allocated when the step began
        self._above = 0  # CPU: bytes allocated above the step's start when a phase begins
        if path is not None and rank == 0:
            open(path, "w").close()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the code run inside as phase ``name`` of the current step (the first
        phase of a step marks its start)."""
        if self.path is None:
            yield
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
            if self._start is None:
                self._start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.measured[name] = torch.cuda.max_memory_allocated(self.device) - self._start
            return
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as prof:
            yield
        events = sorted(
            (e.start_ns(), e.nbytes())
            for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]"
        )
        running = np.cumsum([0] + [n for _, n in events])
        self.measured[name] = self._above + int(running.max())
        self._above += int(running[-1])

    def predicted(self, plan: Any) -> dict[str, float]:
        """The memory model's phase peaks for this rank in the step ``plan`` (a
        :class:`~orchmllm.planner.step_plan.StepPlan`)."""
        batch, layout, moves = step_of_plan(plan)
        features = self.model.rank_features(self.config, self.recipe, batch, layout)
        peaks = self.model.phase_peaks(
            self.config, self.recipe, features, num_ranks=plan.num_ranks, moves=moves
        )
        return {ph: float(np.asarray(v)[self.rank]) for ph, v in peaks.items()}

    def end_step(self, step: int, plan: Any) -> list[dict[str, Any]]:
        """This rank's lines of step ``step`` (run as ``plan``); rank 0 appends every
        rank's. Returns this rank's lines (none without a path)."""
        if self.path is None:
            return []
        predicted = self.predicted(plan)
        lines = [
            {"step": step, "rank": self.rank, "phase": ph,
             "measured_bytes": self.measured.get(ph), "predicted_bytes": round(predicted[ph])}
            for ph in PHASES
        ]  # fmt: skip
        every = [lines]
        if self.world_size > 1:
            every = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(lines, every, dst=0)
        if self.rank == 0:
            with open(self.path, "a") as f:
                f.writelines(json.dumps(line) + "\n" for rank in every for line in rank)
        self.measured, self._start, self._above = {}, None, 0
        return lines
