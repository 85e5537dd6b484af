"""Smoke test of benchmarks/placement_bench.py: --quick --json records are complete and sane."""

import pytest

pytestmark = pytest.mark.integration  # every test here starts processes


def test_placement_bench_quick(run_benchmark):
    records = run_benchmark("placement_bench.py", timeout=240).records
    assert {r["num_ranks"] for r in records} == {16, 64}
    assert {r["examples_per_rank"] for r in records} == {15}
    assert {r["phase"] for r in records} == {"vision", "audio", "llm"}
    fields = {"inter_max_rank", "inter_total", "reduction_max_rank", "solve_ms", "optimal"}
    for r in records:
        assert fields <= r.keys()
        assert r["inter_max_rank"] <= r["inter_total"]
        assert r["reduction_max_rank"] <= 1.0 and r["optimal"] in (0.0, 1.0)
        assert r["solve_ms"] >= 0
        if r["method"] == "identity":
            assert r["reduction_max_rank"] == 0.0
        if r["method"] == "assign" and not r["policy"].startswith("greedy_stay"):
            # assign maximises the tokens kept on-node, so its total never exceeds identity's
            assert r["reduction_total"] >= 0.0
        if r["policy"].startswith("greedy_stay"):
            assert r["tokens_moved_lower_bound"] <= r["tokens_moved"]
            assert r["moved_over_bound"] >= 1.0
            assert r["makespan_over_greedy"] <= 1.005 + 1e-9
            assert r["tokens_moved"] < r["greedy_tokens_moved"]
    methods = {
        (r["num_ranks"], r["phase"], r["method"])
        for r in records
        if not r["policy"].startswith("greedy_stay")
    }
    assert len(methods) == 2 * 3 * 4  # identity, assign, auto, ilp at each size and phase
