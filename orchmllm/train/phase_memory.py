"""Peak memory per phase of a training step: ``python -m orchmllm.train --memory-report PATH``.

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

import torch

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
