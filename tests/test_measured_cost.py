"""orchmllm.planner.measured_cost: a phase's cost fitted to timed batches, or a reason to keep the
default."""

from __future__ import annotations

import numpy as np
import pytest

from orchmllm.planner.cost import CostModel
from orchmllm.planner.measured_cost import FitOptions, cost_kind, features, fit_phase


def _records(model: CostModel, batches: list[list[int]], rng, noise: float) -> np.ndarray:
    rows = []
    for lengths in batches:
        t = model.batch_cost(lengths) * (1 + noise * rng.standard_normal())
        rows.append((*features(model.kind, np.array(lengths)), t))
    return np.array(rows)


@pytest.mark.parametrize("kind", ["packed", "padded"])
def test_the_fit_recovers_the_cost_it_was_timed_from(kind, rng):
    """Batches timed under a known cost (1% noise) give back its coefficients, and the fitted
    model ranks batches as the true one does."""
    true = CostModel(kind, alpha=0.5, beta=2e-3, const=30.0)
    batches = [rng.integers(10, 400, size=rng.integers(1, 8)).tolist() for _ in range(40)]
    fit = fit_phase(kind, _records(true, batches, rng, 0.01))
    assert fit.ok and fit.r2 > 0.99 and fit.samples == 40
    assert fit.model.kind == kind
    np.testing.assert_allclose([fit.model.alpha, fit.model.beta], [0.5, 2e-3], rtol=0.05)
    assert fit.model.const == pytest.approx(30.0, rel=0.3)  # small beside a batch's cost
    costs = [true.batch_cost(b) for b in batches]
    assert np.argmax([fit.model.batch_cost(b) for b in batches]) == np.argmax(costs)


def test_the_same_records_give_the_same_coefficients_bit_for_bit(rng):
    records = _records(CostModel("packed", 1.0, 1e-3, 2.0), [[5, 50], [80], [7] * 9] * 4, rng, 0.2)
    a, b = fit_phase("packed", records), fit_phase("packed", records.copy())
    assert a.model == b.model


def test_collinear_batches_never_get_a_negative_term(rng):
    """Batches of one item length make sum(l) and sum(l^2) proportional: the fit keeps every
    coefficient >= 0 (a cost cannot shrink as its batch grows)."""
    true = CostModel("packed", alpha=1.0, beta=0.0, const=0.5)
    fit = fit_phase("packed", _records(true, [[64] * k for k in range(1, 13)], rng, 0.05))
    assert fit.ok
    assert min(fit.model.alpha, fit.model.beta, fit.model.const) >= 0


def test_a_bad_fit_keeps_the_default_and_says_why(rng):
    few = _records(CostModel("packed"), [[3], [4]], rng, 0.0)
    assert fit_phase("packed", few).reason == "2 timed batches, fewer than 6"
    tokens = rng.integers(1, 100, 30).astype(float)
    noisy = np.column_stack([tokens, tokens**2, 0.01 * tokens + rng.random(30)])
    refused = fit_phase("packed", noisy, FitOptions(min_r2=0.9))
    assert not refused.ok and refused.model is None and "below 0.9" in refused.reason
    flat = np.column_stack([np.arange(1, 9), np.arange(1, 9) ** 2, np.full(8, 5.0)])
    assert "no term grows" in fit_phase("packed", flat.astype(float)).reason
    # a rank that ran no batch of the phase (features 0) is not a record
    empty = np.vstack([_records(CostModel("packed"), [[3]] * 6, rng, 0.0), np.zeros((4, 3))])
    assert fit_phase("packed", empty).samples == 6


def test_the_cost_form_follows_the_policy():
    assert cost_kind("greedy") == cost_kind("kk") == "packed"
    assert cost_kind("binary_search") == cost_kind("conv") == "padded"
    assert features("packed", np.array([2, 3])) == (5.0, 13.0)
    assert features("padded", np.array([2, 3])) == (6.0, 18.0)
    assert features("padded", np.array([], dtype=int)) == (0.0, 0.0)
    with pytest.raises(ValueError, match="kind must be one of"):
        features("dense", np.array([1]))
    with pytest.raises(ValueError, match="min_r2 must be in"):
        FitOptions(min_r2=2.0)
