"""benchmarks/soak.py: a short run's memory figures are there and sane, and the growth is
judged on the worst rank, not the one with the most memory."""

import numpy as np
import pytest

from tests.conftest import ROOT, load_script

soak = load_script(ROOT / "benchmarks" / "soak.py")


@pytest.mark.integration  # starts the trainer under torchrun
def test_quick_json(run_benchmark):
    run = run_benchmark("soak.py", "--steps", "12", "--warmup", "4", timeout=300)
    (rec,) = run.records
    assert rec["steps"] == 12 and rec["warmup_steps"] == 4 and rec["native_cache"] >= 1
    for kind in ("anon", "file"):
        assert rec[f"{kind}_mb_at_warmup"] > 0 and rec[f"{kind}_mb_end"] > 0
        growth = rec[f"{kind}_growth_mb_per_100_per_rank"]
        assert len(growth) == 2 and np.all(np.isfinite(growth))
        assert rec[f"{kind}_growth_mb_per_100"] == max(growth)
        assert len(rec[f"{kind}_mb_every_100"]) == 1
    assert "anonymous MB per 100 steps: rank 0" in run.stdout and "worst rank" in run.stdout


def test_the_worst_rank_is_judged_not_the_largest():
    """Rank 0 holds the most memory and stays flat; rank 1, smaller, grows 3 MB per 100
    steps: the run is over the target, on rank 1's slope (the largest rank's is 0)."""
    records = [
        {
            "step": s,
            **{f"rss_{k}_mb_max": 500.0 for k in ("anon", "file")},
            **{f"rss_{k}_mb_per_rank": [500.0, 300.0 + 0.03 * s] for k in ("anon", "file")},
        }
        for s in range(300)
    ]
    rec = soak.summarize(records, warmup=100)
    np.testing.assert_allclose(rec["anon_growth_mb_per_100_per_rank"], [0.0, 3.0], atol=1e-9)
    assert rec["anon_growth_worst_rank"] == 1 and rec["anon_growth_mb_per_100"] == pytest.approx(3)
    assert not rec["anon_growth_within_target"]
