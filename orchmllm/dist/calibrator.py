"""Costs learned from the running job: every rank times its phases, the ranks agree on a fit.

During the first ``steps`` optimizer steps of a run with ``balance.cost: measured``:

1. every rank times each phase it runs (:meth:`Calibrator.encoders` wraps the encoders,
   :meth:`Calibrator.timed` the LLM's forward): CUDA events on a GPU, read once the step is
   over, so nothing waits for the device on the critical path; ``time.perf_counter`` on CPU.
   A phase's forward holds FSDP's parameter all-gathers, where a rank with less work waits
   for the slowest, so timing it whole would give every rank the same time. The waits are
   cut out: :meth:`Calibrator.watch` puts a hook before and after FSDP's own pre-forward hook
   of every sharded module (where the all-gather is awaited), and a phase's time is its
   span less those waits, its own work. Beside each time it keeps the batch's features in
   the phase policy's cost form (:func:`orchmllm.planner.measured_cost.features`) in the units the
   policy balances;
2. after the step (:meth:`Calibrator.end_step`, a collective on the training group, where the
   step's other collectives are) the records of every rank are gathered in rank order into a
   window per phase; every ``every`` steps every rank fits each phase
   (:func:`orchmllm.planner.measured_cost.fit_phase`) on the same gathered records, so every rank
   holds the same models, bit for bit. A bad fit keeps the phase's cost as it was (the last
   trusted fit, else the configured or default one), with a warning;
3. the caller hands the models to the loader (:meth:`BalancedDataLoader.set_costs`), which
   plans with them from a step no rank has begun to plan.

Each report also gives the step's measured imbalance per phase (max over mean of the ranks'
phase times) beside the planned one, in the metrics.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from orchmllm import compat
from orchmllm.dist import comm
from orchmllm.planner.cost import CostModel, imbalance
from orchmllm.planner.measured_cost import FitOptions, PhaseFit, cost_kind, features, fit_phase
from orchmllm.planner.step_options import StepOptions
from orchmllm.schema import LLM

__all__ = ["Calibrator", "CalibrationReport"]


@dataclass
class CalibrationReport:
    """What one calibration step found (equal on every rank but ``reasons``).

    Attributes:
        step: the optimizer step.
        measured_imbalance: phase -> max/mean over ranks of the phase's measured time.
        fits: phase -> its fit, when this step refitted (empty otherwise); a fit without a
            model keeps the default cost.
    """

    step: int
    measured_imbalance: dict[str, float]
    fits: dict[str, PhaseFit] = field(default_factory=dict)

    def costs(self) -> dict[str, CostModel]:
        """The fitted cost of every phase whose fit is trusted; a refused fit leaves its
        phase's cost as it was (the last trusted fit, else the configured or default one)."""
        return {name: fit.model for name, fit in self.fits.items() if fit.model is not None}

    def record(self) -> dict[str, dict[str, float | bool]]:
        """The metrics' view: per phase the measured imbalance and, when refitted, whether the
        fit is used, its records, its R^2 (where defined) and its coefficients (where used);
        no NaN, so that the same report compares equal on every rank."""
        out: dict[str, dict[str, float | bool]] = {}
        for name, value in self.measured_imbalance.items():
            out[name] = {"measured_imbalance": value}
        for name, fit in self.fits.items():
            out[name].update(used=fit.ok, samples=fit.samples)
            if np.isfinite(fit.r2):
                out[name]["r2"] = fit.r2
            if fit.model is not None:
                m = fit.model
                out[name].update(alpha=m.alpha, beta=m.beta, const=m.const)
        return out


class Calibrator:
    """Times every phase on this rank and fits the phases' costs with the other ranks.

    Args:
        kinds: phase name (encoders and ``"llm"``) -> its policy's cost form
            (:func:`orchmllm.planner.measured_cost.cost_kind`).
        strides: encoder phase name -> raw rows per encoder position (the policy balances
            ``raw // stride``); the LLM balances tokens.
        device: where the phases run (CUDA events there; the host clock otherwise).
        steps: the first optimizer steps that are timed (0: none).
        every: refit every this many timed steps (and after the last).
        window: records kept per phase (all ranks'), the newest.
        fit: when a fit is trusted.

    Raises:
        ValueError: ``steps`` < 0, or ``every`` or ``window`` < 1.
    """

    def __init__(
        self,
        kinds: Mapping[str, str],
        strides: Mapping[str, int],
        *,
        device: torch.device,
        steps: int = 8,
        every: int = 2,
        window: int = 256,
        fit: FitOptions | None = None,
    ) -> None:
        if steps < 0 or every < 1 or window < 1:
            raise ValueError(
                f"steps must be >= 0 and every, window >= 1, got {steps}, {every}, {window}"
            )
        self.kinds, self.strides = dict(kinds), dict(strides)
        self.names = list(self.kinds)
        self.device, self.cuda = device, device.type == "cuda"
        self.steps, self.every, self.fit = steps, every, fit or FitOptions()
        self.window = {name: deque(maxlen=window) for name in self.names}
        self._pending: list[tuple[int, float, float, list]] = []
        self._marks: list | None = None  # the open phase's clock marks, None when closed

    def watch(self, model: nn.Module) -> None:
        """Cut FSDP's all-gather waits out of the phases' times: a mark before and after
        FSDP's pre-forward hook of every sharded module of ``model`` (FSDP's hook comes
        first among the appended ones, and first of all before a prepended one).

        Args:
            model: the sharded model (after ``fully_shard``); call once.
        """
        for module in model.modules():
            if compat.is_fsdp_module(module):
                module.register_forward_pre_hook(lambda *_: self._mark(), prepend=True)
                module.register_forward_pre_hook(lambda *_: self._mark())

    def _clock(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _mark(self) -> None:
        if self._marks is not None:
            self._marks.append(self._clock())

    def _ms(self, a: object, b: object) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return 1e3 * (b - a)

    @classmethod
    def for_options(
        cls, options: StepOptions, *, device: torch.device, **settings: Any
    ) -> Calibrator:
        """The calibrator of a step's phases: each encoder phase and the LLM in its policy's
        cost form, the encoders in the units their policies balance.

        Args:
            options: the step's options (its phases, their policies and strides).
            device: where the phases run.
            settings: as the constructor's (``steps``, ``every``, ``window``, ``fit``).

        Returns:
            The :class:`Calibrator`.
        """
        kinds = {p.name: cost_kind(p.policy) for p in options.phases}
        kinds[LLM] = cost_kind(options.llm_policy)
        strides = {p.name: p.stride for p in options.phases}
        return cls(kinds, strides, device=device, **settings)

    def active(self, step: int) -> bool:
        """Whether a step is timed.

        Args:
            step: the optimizer step (or, in a wrapped model, the forward) counted from 0.

        Returns:
            True for the first ``steps`` steps.
        """
        return step < self.steps

    @contextlib.contextmanager
    def timed(self, name: str, lengths: torch.Tensor | np.ndarray) -> Iterator[None]:
        """Time the body as a phase's batch (less FSDP's all-gather waits inside it).

        Args:
            name: the phase.
            lengths: its items' lengths in the units its policy balances.

        Returns:
            A context manager; the time is recorded when it exits.
        """
        a, b = features(self.kinds[name], np.asarray(torch.as_tensor(lengths).cpu()))
        self._marks = [self._clock()]
        try:
            yield
        finally:
            marks, self._marks = self._marks, None
        marks.append(self._clock())
        self._pending.append((self.names.index(name), a, b, marks))

    def encoders(self, encoders: Mapping[str, Callable]) -> dict[str, Callable]:
        """Encoders whose calls are timed.

        Args:
            encoders: phase name -> ``encoder(rows, lengths, ...)``, as
                ``Orchestrator.run`` takes them (raw rows per item in ``lengths``).

        Returns:
            The same mapping with each call timed as its phase, over ``lengths // stride``.
        """

        def timed(name: str, encoder: Callable) -> Callable:
            def call(rows: torch.Tensor, lengths: torch.Tensor, *rest, **kw):
                with self.timed(name, lengths // self.strides[name]):
                    return encoder(rows, lengths, *rest, **kw)

            return call

        return {name: timed(name, enc) for name, enc in encoders.items()}

    def _records(self) -> np.ndarray:
        """This rank's records of the step, ``(n, 4)``: phase index, features, ms."""
        rows = []
        for index, a, b, marks in self._pending:
            # marks: start, (before, after) each all-gather wait, end
            spans = [self._ms(x, y) for x, y in zip(marks[:-1], marks[1:], strict=True)]
            rows.append((index, a, b, sum(spans[0::2])))  # the spans between the waits
        self._pending.clear()
        return np.asarray(rows, dtype=np.float64).reshape(-1, 4)

    def end_step(
        self, step: int, *, group: dist.ProcessGroup | None = None, timeout: float | None = None
    ) -> CalibrationReport:
        """Gather the step's records of every rank and, on a refit step, fit every phase.

        A collective on ``group``: every rank calls it at the same steps (those
        :meth:`active`). Every rank fits the same gathered records, bit for bit in rank
        order, so every rank gets the same coefficients (the loader's per-step check of the
        planners' signatures would name a rank that did not).

        Args:
            step: the step just ended.
            group: the process group (None: the default, the training group).
            timeout: seconds the gather may wait for the other ranks (None: the group's).

        Returns:
            The :class:`CalibrationReport`, equal on every rank (its fits on refit steps).
        """
        # float64 records travel as their int64 bits: comm's row gather, exact.
        rows, src = comm.all_gather_rows(
            self._records().view(np.int64), group=group, timeout=timeout
        )
        rows = rows.view(np.float64)
        times = np.zeros((len(self.names), dist.get_world_size(group)))
        for (index, a, b, ms), rank in zip(rows, src, strict=True):
            self.window[self.names[int(index)]].append((a, b, ms))
            times[int(index), rank] += ms
        measured = {name: imbalance(times[i]) for i, name in enumerate(self.names)}
        report = CalibrationReport(step, measured)
        if (step + 1) % self.every == 0 or step + 1 == self.steps:
            report.fits = {
                name: fit_phase(self.kinds[name], np.asarray(self.window[name]), self.fit)
                for name in self.names
            }
            if dist.get_rank(group) == 0:
                for name, fit in report.fits.items():
                    if not fit.ok:
                        print(
                            f"orchmllm: the {name} phase keeps its cost: {fit.reason}",
                            file=sys.stderr,
                            flush=True,
                        )
        return report
