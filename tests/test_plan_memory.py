"""python -m orchmllm.sim.plan_memory: the predicted memory per GPU and the largest mini-batch."""

from __future__ import annotations

import pytest

from benchmarks.paper_repro.figure8 import figure8
from benchmarks.paper_repro.sweep import Sweep
from orchmllm.sim import plan_memory
from orchmllm.sim.sweep import load_model
from tests.conftest import ROOT

CONFIG = str(ROOT / "configs" / "mllm-10b.yaml")


def test_prints_the_peak_per_phase_and_the_largest_minibatch_that_fits(capsys) -> None:
    """The largest mini-batch of each mode fits the budget in every sampled step (the search
    checks that one more does not); the peaks at it and at the config's mini-batch are
    printed per phase, with the recipe and the static bytes."""
    record = plan_memory.main(["--config", CONFIG, "--gpu-memory", "80", "--gpus", "16"])
    out = capsys.readouterr().out
    assert "precision bf16-mixed, checkpointing every block, loss chunk 4096" in out
    assert "16 GPUs, FSDP over 16: budget 74.0 GB" in out
    assert record["budget_gb"] == pytest.approx(74.0)
    for mode in ("none", "full"):
        (b,) = record["largest"][mode]
        assert b >= 1 and f"{mode:<5} {b:>5}" in out
        at = record["peaks"][mode]
        largest, rec = at["largest"]
        assert largest == b and not rec["oom"]
        assert rec["peak_memory_gb"] <= record["budget_gb"]
        assert rec["peak_memory_gb"] == pytest.approx(
            max(rec[f"{p}_memory_gb"] for p in ("forward", "backward", "optimizer"))
        )
        configured, _ = at["config"]
        assert configured == 80
    assert record["largest"]["full"][0] >= record["largest"]["none"][0]


def test_gradients_held_between_micro_steps_come_out_of_the_budget(tmp_path, capsys) -> None:
    """With ``train.grad_accum`` > 1 the sharded gradients live across micro-steps, which the
    one-micro-step replay does not hold: they are taken from the budget, so the largest
    mini-batch can only shrink, and the report says so."""
    argv = ["--gpu-memory", "80", "--gpus", "16"]
    one = plan_memory.main(["--config", CONFIG, *argv])
    accumulated = tmp_path / "accumulated.yaml"
    accumulated.write_text(f"base: {CONFIG}\ntrain: {{grad_accum: 4}}\n")
    four = plan_memory.main(["--config", str(accumulated), *argv])
    out = capsys.readouterr().out
    held = four["held_gradients_gb"]
    # fp32 gradients of the trained parameters, sharded over the 16 GPUs
    assert held == pytest.approx(4 * four["trained_parameters"] / 16 / 1e9)
    assert four["budget_gb"] == pytest.approx(one["budget_gb"] - held)
    assert one["held_gradients_gb"] == 0.0
    for mode in ("none", "full"):
        assert four["largest"][mode][0] <= one["largest"][mode][0]
    assert f"grad_accum 4: the sharded gradients held between micro-steps, {held:.2f} GB" in out


def test_bad_arguments_are_rejected(capsys) -> None:
    for argv, name in (
        (["--config", CONFIG, "--gpus", "0"], "--gpus"),
        (["--config", CONFIG, "--gpu-memory", "4"], "--gpu-memory"),
        (["--config", "no/such.yaml"], "--config"),
    ):
        with pytest.raises(SystemExit):
            plan_memory.main(argv)
        assert name in capsys.readouterr().err


def test_it_prints_the_minibatches_reproduce_paper_prints() -> None:
    """Figure 8 of benchmarks/reproduce_paper.py and plan_memory search the same sampled
    steps with the same memory model and recipe: the same largest mini-batches per seed."""
    sw = Sweep({"mllm-10b": load_model("mllm-10b")}, None, (0, 1))
    figure8(sw, [64])
    (fig8,) = [r for r in sw.records if r["figure"] == "fig8"]
    record = plan_memory.plan(
        plan_memory.parse_args(["--config", CONFIG, "--gpus", "64", "--seeds", "2"])
    )
    for mode in ("none", "full"):
        bs = record["largest"][mode]
        spread = fig8[f"b_{mode}"]
        assert (min(bs), max(bs), sum(bs) / len(bs)) == (
            spread["min"],
            spread["max"],
            pytest.approx(spread["mean"]),
        ), mode


def test_the_oracle_source_plans_with_fitted_forms_traced_once(tmp_path, capsys) -> None:
    """``--memory-source oracle``: the peaks come from forms fitted to torch's tracker, within
    10% of the replay's at the config's mini-batch, the largest mini-batch that fits within
    10% of the replay's, and the forms are cached: a second run traces nothing."""
    argv = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--gpus", "2", "--gpu-memory",
            "0.03", "--reserve", "0", "--steps", "2"]  # fmt: skip
    replay = plan_memory.main(argv)
    oracle = plan_memory.main([*argv, "--memory-source", "oracle", "--cache-dir", str(tmp_path)])
    assert "memory from the oracle" in capsys.readouterr().out
    assert len(oracle["traced"]) == 1 and list(tmp_path.glob("*.json"))
    for mode in ("none", "full"):
        got, want = oracle["peaks"][mode]["config"][1], replay["peaks"][mode]["config"][1]
        for ph in ("forward", "backward", "optimizer"):
            r = got[f"{ph}_memory_gb"] / want[f"{ph}_memory_gb"]
            assert 0.9 <= r <= 1.1, (mode, ph, r)
        r = oracle["largest"][mode][0] / replay["largest"][mode][0]
        assert 0.9 <= r <= 1.1, (mode, oracle["largest"], replay["largest"])
    again = plan_memory.main([*argv, "--memory-source", "oracle", "--cache-dir", str(tmp_path)])
    assert again["traced"] == [] and again["largest"] == oracle["largest"]
