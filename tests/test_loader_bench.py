"""Smoke test of benchmarks/loader_bench.py: records have the fields and sane values."""

import pytest

pytestmark = pytest.mark.integration  # every test here starts processes


def test_quick_json(run_benchmark):
    records = run_benchmark("loader_bench.py", "--step-ms", "30", timeout=240).records
    assert {(r["mode"], r["prefetch"]) for r in records} == {
        ("index", 0),
        ("index", 2),
        ("move", 0),
        ("move", 2),
    }
    for r in records:
        for key in (
            "mode",
            "step_s",
            "plan_s",
            "prep_s",
            "wait_s",
            "hidden_fraction",
            "bytes_sent",
            "bytes_meta",
            "bytes_payload",
        ):
            assert key in r
        assert 0.0 <= r["hidden_fraction"] <= 1.0
        assert r["plan_s"] > 0 and r["prep_s"] >= r["plan_s"] and r["steps"] == 5
        assert r["bytes_sent"] == r["bytes_meta"] + r["bytes_payload"]
    index = [r for r in records if r["mode"] == "index"]
    move = [r for r in records if r["mode"] == "move"]
    assert all(r["bytes_payload"] == 0 and r["bytes_meta"] > 0 for r in index)
    assert all(r["bytes_payload"] > 10 * r["bytes_meta"] for r in move)  # examples dominate
    assert all(0 < r["bytes_saved_vs_move"] < 1 for r in index)
    # Without prefetch the loop waits for every batch: nothing is hidden.
    assert all(r["hidden_fraction"] < 0.5 for r in records if r["prefetch"] == 0)
