"""Smoke test of benchmarks/balance_bench.py: --quick --json records are complete and sane."""

import math

import pytest

from orchmllm.data.workloads import DISTRIBUTIONS
from orchmllm.planner.policies import POLICIES
from tests.conftest import ROOT, load_script

pytestmark = pytest.mark.integration  # every test here starts processes

FIELDS = {"policy", "dist", "ranks", "per_rank", "imbalance_before", "imbalance_after", "plan_ms"}


def test_balance_bench_quick(run_benchmark):
    records = run_benchmark("balance_bench.py", timeout=120).records
    summary = [r for r in records if r["policy"] == "summary"]
    extra = ("summary", "peers", "movement", "movement_node", "scale", "wrapper")
    cases = [r for r in records if r["policy"] not in extra and r["cost"] != "h100_audio_10b"]
    assert len(summary) == 1
    assert {r["policy"] for r in cases} == set(POLICIES) | {"greedy_alg1"}
    assert {r["dist"] for r in cases} == set(DISTRIBUTIONS)
    assert {r["ranks"] for r in cases} == {8, 64}
    for r in cases:
        assert FIELDS | {"gap_to_lb"} <= r.keys()
        assert r["imbalance_before"] >= 1.0 and r["imbalance_after"] >= 1.0
        assert r["gap_to_lb"] >= 1.0 - 1e-9 and r["plan_ms"] >= 0
        if r["policy"] == "identity":
            assert math.isclose(r["imbalance_after"], r["imbalance_before"])
        if r["policy"] in ("greedy", "greedy_alg1", "greedy_cost", "kk"):
            assert r["gap_to_lb"] <= 1.05
            assert r["imbalance_after"] <= r["imbalance_before"] + 1e-9
    # The refinement never leaves greedy worse than Alg. 1 alone on the same case.
    alg1 = {(r["dist"], r["ranks"]): r for r in cases if r["policy"] == "greedy_alg1"}
    for r in cases:
        if r["policy"] == "greedy":
            assert r["gap_to_lb"] <= alg1[(r["dist"], r["ranks"])]["gap_to_lb"] + 1e-12
    assert summary[0]["speedup_min"] > 1.0  # C++ faster than the reference on every timed case
    # Issue 16: greedy is never worse than the LPT/KK/MULTIFIT references on any instance;
    # greedy_stay's movement is compared with HiGHS's exact minimum (>= 1 by optimality).
    peers = [r for r in records if r["policy"] == "peers"]
    assert peers and summary[0]["peer_instances"] == len(peers)
    for r in peers:
        for ref in ("lpt", "kk", "multifit"):
            assert r["greedy_max_load"] <= r[f"{ref}_max_load"]
    for policy, key in (("movement", "greedy_stay"), ("movement_node", "greedy_stay_node")):
        moves = [r for r in records if r["policy"] == policy]
        assert moves and all(r["moved_over_exact"] >= 1.0 - 1e-9 for r in moves)
        assert summary[0][f"{key}_over_exact_max"] == max(r["moved_over_exact"] for r in moves)
    (wrapper,) = [r for r in records if r["policy"] == "wrapper"]
    assert wrapper["core_us"] > 0 and wrapper["wrapper_us"] > 0
    assert summary[0]["wrapper_overhead_us"] == wrapper["overhead_us"]
    audio = [r for r in records if r.get("cost") == "h100_audio_10b"]
    assert audio  # the packaged H100 calibration is always there
    bs = {(r["dist"], r["ranks"]): r for r in audio if r["policy"] == "binary_search"}
    for r in audio:
        if r["policy"] == "padded_cost":
            assert r["slowest_ms"] <= bs[(r["dist"], r["ranks"])]["slowest_ms"] + 1e-9


def test_the_scale_part_judges_its_targets_by_its_own_records(capsys):
    """What ``--scale-only`` reports (here at a small size): every ratio is its record's own
    times, and the greedy target names the distribution that sets it."""
    bench = load_script(ROOT / "benchmarks" / "balance_bench.py")
    scale = bench.scale_cases(0, ("text", "video_2fps"), {}, d=256, per=8, reps=2)
    steps = bench.step_plan_cases(0, d=64, per=4, reps=2)
    summary = bench.scale_summary(scale) | bench.step_plan_summary(steps)
    for r in scale:
        assert r["greedy_over_argsort"] == r["greedy_ms"] / r["argsort_ms"]
        assert r["greedy_auto_ms"] <= r["greedy_auto_ms_median"] <= r["greedy_auto_ms_max"]
    worst = max(scale, key=lambda r: r["greedy_over_argsort"])
    assert summary["scale_greedy_over_argsort_max"] == worst["greedy_over_argsort"]
    assert summary["scale_auto_ms_max"] == max(r["greedy_auto_ms_max"] for r in scale)
    assert summary["scale_plan_step_ms_max"] == max(r["plan_ms_max"] for r in steps)
    assert f"(max {worst['greedy_over_argsort']:.2f}x, {worst['dist']};" in capsys.readouterr().out
