"""Smoke test of benchmarks/soak.py: a short run's memory figures are there and sane."""

import numpy as np
import pytest

pytestmark = pytest.mark.integration  # starts the trainer under torchrun


def test_quick_json(run_benchmark):
    run = run_benchmark("soak.py", "--steps", "12", "--warmup", "4", timeout=300)
    (rec,) = run.records
    assert rec["steps"] == 12 and rec["warmup_steps"] == 4 and rec["native_cache"] >= 1
    for kind in ("anon", "file"):
        assert rec[f"{kind}_mb_at_warmup"] > 0 and rec[f"{kind}_mb_end"] > 0
        assert np.isfinite(rec[f"{kind}_growth_mb_per_100"])
        assert len(rec[f"{kind}_mb_every_100"]) == 1
    assert "anonymous" in run.stdout and "MB per 100 steps" in run.stdout
