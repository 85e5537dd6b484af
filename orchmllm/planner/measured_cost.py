"""Cost models learned from the running job: one least-squares fit per phase.

The planner's default costs are token counts, or fits to H100 block timings
(:mod:`orchmllm.planner.cost`); a user's GPU, kernels and model differ. With ``balance.cost:
measured`` every rank times each phase it runs during the first steps of the job and records, beside
the time, its batch's features in the phase policy's own cost form (:func:`features`: packed
``sum(l)``, ``sum(l^2)``; padded ``b*max(l)``, ``b*max(l)^2``). Here those records, gathered
from every rank, become a :class:`~orchmllm.planner.cost.CostModel` per phase (:func:`fit_phase`),
or a reason to keep the default: too few records, no term that grows with the batch, or a
fit that explains too little of the times (R^2 below a floor). The coefficients are fitted
non-negative, as a cost is.

Pure and torch-free: the runtime that times, gathers and swaps the plans' costs is
:mod:`orchmllm.dist.calibrator`. The fit is of forward times: a phase's backward costs a fixed
multiple of its forward (two matmuls per forward matmul), so the fitted model is proportional
to the phase's whole cost, which is all balancing needs (it compares ranks within a phase).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from orchmllm.planner.cost import KINDS, CostModel
from orchmllm.planner.policies import PADDED_POLICIES

__all__ = ["COSTS", "FitOptions", "PhaseFit", "cost_kind", "features", "fit_phase"]

#: What ``balance.cost`` accepts: the policies' default costs, or costs measured in the run.
COSTS = ("default", "measured")


def cost_kind(policy: str) -> str:
    """The cost form a policy balances: ``padded`` for the padded policies, else ``packed``."""
    return "padded" if policy in PADDED_POLICIES else "packed"


def features(kind: str, lengths: np.ndarray) -> tuple[float, float]:
    """A batch's two cost features in ``kind``'s form (:class:`~orchmllm.planner.cost.CostModel`):
    packed ``(sum(l), sum(l^2))``, padded ``(b*max(l), b*max(l)^2)``; ``(0, 0)`` when empty.

    Raises:
        ValueError: ``kind`` is not one of ``orchmllm.planner.cost.KINDS``.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    l = np.asarray(lengths, dtype=np.float64).reshape(-1)
    if l.size == 0:
        return 0.0, 0.0
    if kind == "packed":
        return float(l.sum()), float((l * l).sum())
    top = float(l.max())
    return l.size * top, l.size * top * top


@dataclass(frozen=True)
class FitOptions:
    """When a fit is trusted.

    Attributes:
        min_samples: fewer records than this (batches with items, over all ranks) keep the
            default cost.
        min_r2: a fit whose R^2 on its own records is below this keeps the default cost.
    """

    min_samples: int = 6
    min_r2: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.min_samples, bool) or not isinstance(self.min_samples, int):
            raise ValueError(f"min_samples must be an integer >= 3, got {self.min_samples!r}")
        if self.min_samples < 3:
            raise ValueError(f"min_samples must be an integer >= 3, got {self.min_samples!r}")
        if not 0.0 <= self.min_r2 <= 1.0:
            raise ValueError(f"min_r2 must be in [0, 1], got {self.min_r2!r}")


@dataclass(frozen=True)
class PhaseFit:
    """One phase's fit.

    Attributes:
        model: the fitted cost (time units: those of the records, ms in the runtime), or None
            when the default is kept.
        r2: the fit's R^2 on its records (NaN when not fitted).
        samples: the records it was fitted on.
        reason: why the default is kept (None when ``model`` is used).
    """

    model: CostModel | None
    r2: float
    samples: int
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.model is not None


def fit_phase(kind: str, records: np.ndarray, options: FitOptions | None = None) -> PhaseFit:
    """Non-negative least squares ``t ~ alpha*A + beta*B + const`` over ``records``.

    A cost cannot shrink as a batch grows, so the coefficients are fitted non-negative
    (``scipy.optimize.nnls``): where the two features are nearly collinear (batches of
    similar items), plain least squares trades a negative term for a larger other one.

    Args:
        kind: the cost form of the phase's policy (:func:`cost_kind`).
        records: float64 ``(n, 3)``: each batch's features ``A, B`` (:func:`features`) and
            its time, in a fixed order (the gathered ranks' records in rank order), so every
            process fitting them gets the same coefficients.
        options: when the fit is trusted.

    Returns:
        The :class:`PhaseFit`: a model, or why the default is kept: too few batches, no term
        that grows with the batch (``alpha = beta = 0``), or R^2 below ``options.min_r2``.
    """
    options = options or FitOptions()
    records = np.asarray(records, dtype=np.float64).reshape(-1, 3)
    records = records[records[:, 0] > 0]  # a rank without items ran no batch of the phase
    n = len(records)
    if n < options.min_samples:
        reason = f"{n} timed batches, fewer than {options.min_samples}"
        return PhaseFit(None, float("nan"), n, reason)
    # Columns scaled to unit size so that the solver weighs them alike; undone after.
    a = np.column_stack([records[:, 0], records[:, 1], np.ones(n)])
    scale = np.abs(a).max(axis=0)
    y = records[:, 2]
    coef = nnls(a / scale, y)[0] / scale
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((a @ coef - y) ** 2).sum()) / ss_tot if ss_tot > 0 else 0.0
    alpha, beta, const = (float(c) for c in coef)
    if alpha == beta == 0.0:
        return PhaseFit(None, r2, n, "no term grows with the batch (alpha = beta = 0)")
    if r2 < options.min_r2:
        return PhaseFit(None, r2, n, f"R^2 {r2:.3f} below {options.min_r2}")
    return PhaseFit(CostModel(kind, alpha=alpha, beta=beta, const=const), r2, n)
