"""Smoke test of benchmarks/reproduce_paper.py --quick --json: record fields and sanity."""

from __future__ import annotations

from pathlib import Path

import pytest

REQUIRED = (
    "model",
    "ranks",
    "mode",
    "placement",
    "step_time_s",
    "mfu",
    "inter_node_bytes_max_rank",
    "plan_ms",
)


@pytest.fixture(scope="module")
def quick(tmp_path_factory, run_benchmark) -> tuple[list[dict], Path]:
    out = tmp_path_factory.mktemp("reproduce")
    run = run_benchmark("reproduce_paper.py", "--out", str(out), timeout=240)
    assert "Figure 8" in run.stdout and "Table 2" in run.stdout
    return run.records, out


def test_records_have_the_fields_and_sane_values(quick) -> None:
    records, _ = quick
    cases = [r for r in records if "step_time_s" in r]
    assert len(cases) >= 30
    for r in cases:
        for key in REQUIRED:
            assert key in r, (key, r)
        assert r["model"] in ("mllm-10b", "mllm-18b", "mllm-84b")
        assert r["mode"] in ("none", "llm", "disttrain", "full")
        assert r["placement"] in ("none", "node")
        assert r["step_time_s"] > 0 and 0 < r["mfu"] < 1, r
        assert r["inter_node_bytes_max_rank"] >= 0 and r["plan_ms"] >= 0
        if r["mode"] in ("none", "disttrain"):  # nothing moves at run time
            assert r["inter_node_bytes_max_rank"] == 0 and r["dispatch_fwd_ms"] == 0
        else:
            assert r["dispatch_fwd_ms"] > 0
        for phase in ("vision", "audio", "llm"):
            assert r[f"imbalance_{phase}"] >= 1 - 1e-9


def test_full_balance_beats_none_at_the_same_minibatch(quick) -> None:
    records, _ = quick
    none = {
        (r["model"], r["ranks"]): r
        for r in records
        if r.get("figure") == "fig8" and r["mode"] == "none"
    }
    fixed = [r for r in records if r.get("figure") == "fig8_fixed_minibatch"]
    assert fixed
    for r in fixed:
        base = none[r["model"], r["ranks"]]
        assert r["examples_per_rank"] == base["examples_per_rank"]
        if r["mode"] == "full":
            assert r["step_time_s"] < base["step_time_s"]
            assert r["imbalance_llm"] < base["imbalance_llm"]
            assert r["peak_memory_gb"] < base["peak_memory_gb"]


def test_memory_search_and_paper_comparisons(quick) -> None:
    records, out = quick
    found = {
        (r["model"], r["mode"]): r["max_examples_per_rank"]
        for r in records
        if r.get("figure") == "max_minibatch"
    }
    for model in ("mllm-10b", "mllm-18b", "mllm-84b"):
        assert found[model, "full"] >= found[model, "none"] >= 1
    table2 = [r for r in records if r.get("figure") == "table2"]
    assert table2 and all(r["plan_hidden"] for r in table2)
    assert any(r["paper_overhead_ms"] for r in table2)
    for name in (
        "fig8_mfu",
        "fig10_ablation",
        "fig11_algorithms",
        "fig13_internode",
        "table2_overhead",
    ):
        assert (out / f"{name}.png").stat().st_size > 1000
