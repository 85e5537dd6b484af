"""Smoke test of benchmarks/dispatch_bench.py: --quick --json records are complete and sane."""

import pytest

pytestmark = pytest.mark.integration  # every test here starts processes


def test_dispatch_bench_quick(run_benchmark):
    records = run_benchmark("dispatch_bench.py", timeout=240).records
    measured = [r for r in records if r["kind"] == "measured"]
    simulated = [r for r in records if r["kind"] == "simulated"]
    assert [r["world_size"] for r in measured] == [2, 4]
    assert [r["world_size"] for r in simulated] == [2, 4, 8, 16, 32]
    for r in measured:
        assert r["a2a_ms"] > 0 and r["allgather_ms"] > 0 and r["time_ratio"] > 0
        # Each rank sends at most its own batch; the all-gather receives (d-1) padded batches.
        assert r["a2a_sent_max_rank"] <= r["max_batch_bytes"]
        assert r["allgather_recv_rank"] == (r["world_size"] - 1) * r["max_batch_bytes"]
        assert r["a2a_extra_bytes_max_rank"] < r["allgather_extra_bytes_max_rank"]
        assert r["imbalance_after"] <= r["imbalance_before"] + 1e-9
    for r in simulated:
        assert r["a2a_sent_max_rank"] <= r["max_batch_bytes"]
        assert abs(r["allgather_over_max_batch"] - (r["world_size"] - 1)) < 1e-9
    # The paper's claim: all-gather traffic grows with d, all-to-all stays bounded.
    ratios = [r["bytes_ratio"] for r in simulated]
    assert ratios[-1] > 4 * ratios[0]
