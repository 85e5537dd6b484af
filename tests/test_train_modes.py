"""Smoke test of benchmarks/train_modes.py: the main job's records, per --balance mode."""

import math

import pytest

pytestmark = pytest.mark.integration  # every test here starts processes


def test_train_modes_quick(run_benchmark):
    records = run_benchmark("train_modes.py", timeout=300).records
    by_mode = {r["mode"]: r for r in records}
    assert sorted(by_mode) == ["full", "none"]
    for r in records:
        assert r["steps"] == 2 and r["world_size"] == 4 and r["step_time_mean_s"] > 0
        assert r["phase_names"] == ["vision", "audio", "llm"]
        assert r["run_command"].startswith("python ") and r["host_cores"] >= 1
    none, full = by_mode["none"], by_mode["full"]
    for phase in none["phase_names"]:
        # Without balancing nothing moves; with it, the same draws end no worse balanced.
        assert none[f"{phase}_imbalance_after_mean"] == none[f"{phase}_imbalance_before_mean"]
        assert none[f"{phase}_bytes_inter_total"] == none[f"{phase}_bytes_intra_total"] == 0
        assert full[f"{phase}_imbalance_before_mean"] == none[f"{phase}_imbalance_before_mean"]
        assert full[f"{phase}_imbalance_after_mean"] <= full[f"{phase}_imbalance_before_mean"]
    assert full["vision_bytes_inter_total"] > 0
    assert math.isclose(full["loss_last"], none["loss_last"], rel_tol=1e-5)
