import numpy as np
import pytest

from orchmllm.planner.cost import CALIBRATIONS, CostModel, fit_packed, fit_padded, load_calibration


def test_packed_batch_cost_matches_formula():
    m = CostModel("packed", alpha=2.0, beta=0.5, const=3.0, multiplier=1.5)
    assert m.batch_cost([1, 2, 3]) == pytest.approx(1.5 * (2 * 6 + 0.5 * 14 + 3))
    assert m.batch_cost([]) == 0.0
    assert m.item_costs([1, 2]).tolist() == pytest.approx([1.5 * 2.5, 1.5 * 6.0])


def test_padded_batch_cost_matches_formula():
    m = CostModel("padded", alpha=2.0, beta=0.5, const=3.0)
    assert m.batch_cost([1, 4, 3]) == pytest.approx(2 * 3 * 4 + 0.5 * 3 * 16 + 3)
    with pytest.raises(ValueError, match="padded"):
        m.item_costs([1, 2])


@pytest.mark.parametrize("kind", ["packed", "padded"])
def test_loads_equal_per_batch_costs(kind, rng):
    m = CostModel(kind, alpha=1.0, beta=1e-3, const=7.0, multiplier=0.5)
    lengths = rng.integers(0, 500, size=200)
    dst = rng.integers(0, 9, size=200)
    expected = [m.batch_cost(lengths[dst == r]) for r in range(9)]
    assert m.loads(lengths, dst, 9) == pytest.approx(expected)


def test_forward_only_scales_multiplier():
    m = CostModel("packed", alpha=3.0, multiplier=2.0)
    assert m.forward_only().multiplier == pytest.approx(2.0 / 3.0)
    assert m.forward_only(0.5).batch_cost([10]) == pytest.approx(30.0)
    with pytest.raises(ValueError, match="fraction"):
        m.forward_only(0.0)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="kind"):
        CostModel("dense")
    with pytest.raises(ValueError, match="multiplier"):
        CostModel("packed", multiplier=0.0)
    with pytest.raises(ValueError, match="records"):
        fit_packed([{"tokens": 1, "sum_l2": 1, "ms": 1.0}])
    with pytest.raises(ValueError, match="records"):
        fit_packed([{"tokens": 1, "ms": 1.0}] * 3)


def test_fit_recovers_exact_model_from_lengths(rng):
    true = CostModel("packed", alpha=0.3, beta=2e-4, const=5.0)
    records = []
    for _ in range(20):
        l = rng.integers(1, 3000, size=rng.integers(1, 20))
        records.append({"lengths": l.tolist(), "ms": true.batch_cost(l)})
    fit = fit_packed(records)
    assert fit.model.alpha == pytest.approx(0.3, rel=1e-6)
    assert fit.model.beta == pytest.approx(2e-4, rel=1e-6)
    assert fit.model.const == pytest.approx(5.0, rel=1e-6)
    assert fit.stats["max_rel_err"] < 1e-9
    padded_true = CostModel("padded", alpha=0.1, beta=1e-5, const=1.0)
    padded = [
        {"lengths": r["lengths"], "ms": padded_true.batch_cost(r["lengths"])} for r in records
    ]
    assert fit_padded(padded).model.beta == pytest.approx(1e-5, rel=1e-6)


@pytest.mark.parametrize("hidden,crossover", [(1280, 11_600), (3584, 33_000)])
def test_h100_block_fit_crossover(hidden, crossover):
    records = [r for r in load_calibration("h100_block_fwd_bwd.json") if r["hidden"] == hidden]
    fit = fit_packed(records)
    assert fit.model.alpha > 0 and fit.model.beta > 0
    assert fit.stats["r2"] > 0.99
    assert fit.model.crossover_length() == pytest.approx(crossover, rel=0.02)


def test_table1_shapes_fit():
    records = load_calibration("h100_table1_blocks.json")
    shapes = sorted({r["shape"] for r in records})
    assert any(s.startswith("audio") for s in shapes)
    for shape in shapes:
        rows = [r for r in records if r["shape"] == shape]
        if rows[0]["attention"] == "padded":
            fit = fit_padded(rows)
            assert fit.stats["max_rel_err"] < 0.13, shape
        else:
            fit = fit_packed(rows)
            # Every packed shape: RMS relative residual within 4%, no point off by 5%+.
            assert fit.stats["rms_rel_err"] < 0.04, shape
            assert fit.stats["max_rel_err"] < 0.05, shape
        assert np.isfinite(fit.model.alpha) and fit.model.alpha > 0, shape


def test_load_calibration_reads_packaged_records():
    for name in CALIBRATIONS:
        records = load_calibration(name)
        assert len(records) >= 3 and all(r["ms"] > 0 for r in records), name
    with pytest.raises(ValueError, match="name"):
        load_calibration("missing.json")
