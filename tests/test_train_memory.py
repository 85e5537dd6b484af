"""benchmarks/train_memory.py on CPU: the trainer's per-phase report beside the memory model."""

from __future__ import annotations

import pytest

PHASES = ("forward", "backward", "optimizer")


@pytest.mark.integration
def test_quick_cpu_records(run_benchmark):
    run = run_benchmark("train_memory.py", timeout=240)
    records = run.records
    assert [(r["step"], r["phase"]) for r in records] == [(s, p) for s in (0, 1) for p in PHASES]
    for r in records:
        assert r["device"] == "cpu" and r["config"] == "configs/tiny.yaml"
        assert r["precision"] == "float32" and r["source"] is None
        # no allocator counter on CPU: nothing measured, nothing compared
        assert r["measured_peak_bytes"] is None and r["measured_over_predicted"] is None
        assert r["llm_tokens"] > 0
        # the memory model leaves out the token embedding, connectors and audio front end
        assert r["model_parameters"] > r["sim_parameters"] > 0
    by = {(r["step"], r["phase"]): r for r in records}
    for step in (0, 1):
        fwd, bwd, opt = (by[step, p] for p in PHASES)
        assert fwd["predicted_figure"] is None and fwd["predicted_bytes"] is None
        assert (bwd["predicted_figure"], opt["predicted_figure"]) == ("peak", "static")
        # static: parameter, gradient and two AdamW moments in float32 per counted parameter,
        # plus FSDP's gathered units (a few blocks' worth here)
        params = opt["sim_parameters"]
        assert 16 * params < opt["predicted_bytes"] < 1.1 * 16 * params
        assert bwd["predicted_bytes"] > opt["predicted_bytes"]
    assert "memory model counts" in run.stdout
