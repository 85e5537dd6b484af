"""benchmarks/train_memory.py on CPU: the trainer's per-phase report beside the memory model."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT, load_script

PHASES = ("forward", "backward", "optimizer")


@pytest.mark.integration
def test_quick_cpu_records(run_benchmark):
    run = run_benchmark("train_memory.py", timeout=240)
    records = run.records
    assert [(r["step"], r["phase"]) for r in records] == [(s, p) for s in (0, 1) for p in PHASES]
    for r in records:
        assert r["device"] == "cpu" and r["config"] == "configs/tiny.yaml"
        # the config's recipe (tiny: float32, no checkpointing)
        assert (r["precision"], r["checkpointing"]) == ("float32", 0) and r["source"] is None
        # no allocator counter on CPU: nothing measured, nothing compared
        assert r["measured_peak_bytes"] is None and r["measured_over_predicted"] is None
        assert r["llm_tokens"] > 0
        # the memory model counts every parameter the model has
        assert r["model_parameters"] == r["sim_parameters"] > 0
        assert r["predicted_figure"] == r["phase"]
    by = {(r["step"], r["phase"]): r for r in records}
    for step in (0, 1):
        fwd, bwd, opt = (by[step, p] for p in PHASES)
        # static: float32 master weights and two AdamW moments, 12 bytes per parameter
        assert opt["predicted_static_bytes"] == 12 * opt["sim_parameters"]
        # the optimizer step adds the gradients (and a parameter's temporaries) to static
        assert opt["predicted_static_bytes"] + 4 * opt["sim_parameters"] < opt["predicted_bytes"]
        assert bwd["predicted_bytes"] > opt["predicted_bytes"]
        assert fwd["predicted_bytes"] > opt["predicted_bytes"]
    assert "memory model counts" in run.stdout


def test_a_config_with_gradient_accumulation_is_refused(tmp_path, capsys):
    """Its report has a line per micro-step, the optimizer's on the last only: refused by name
    before the trainer starts."""
    train_memory = load_script(ROOT / "benchmarks" / "train_memory.py")
    config = tmp_path / "accumulated.yaml"
    config.write_text(f"base: {ROOT / 'configs' / 'tiny.yaml'}\ntrain: {{grad_accum: 2}}\n")
    with pytest.raises(SystemExit):
        train_memory.parse_args(["--config", str(config)])
    err = capsys.readouterr().err
    assert "train.grad_accum must be 1 here (one step, one report), got 2" in err
