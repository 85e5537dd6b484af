"""benchmarks/reproduce_paper.py: --quick records, the Figure 8 decomposition, OOM marking, and
the comparison with benchmarks/gpu_step.py records."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.paper_repro.cli import QUICK_RANKS, QUICK_SENSITIVITY_SCALES
from benchmarks.paper_repro.figure8 import AUDIO_SHARES
from benchmarks.paper_repro.paper import PAPER
from benchmarks.paper_repro.validation import gpu_batch, gpu_setup
from orchmllm.config import load_config
from tests.conftest import ROOT, load_script

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
    empty = tmp_path_factory.mktemp("no_gpu_records")
    run = run_benchmark(
        "reproduce_paper.py", "--out", str(out), "--gpu-results", str(empty), timeout=240
    )
    assert "Figure 8" in run.stdout and "Table 2" in run.stdout
    for title in ("at the paper's mini-batches", "Figure 9", "Sensitivity", "Figure 12"):
        assert title in run.stdout, title
    # the closing note quotes Figure 8 at the paper's mini-batches and the derived scale
    assert "MFU ratio full/none at the paper's mini-batches: mllm-10b" in run.stdout
    assert "is matched at length scale" in run.stdout
    assert "Defaults from the simulator" in run.stdout
    assert "no GPU record" in run.stdout
    return run.records, out


@pytest.mark.integration
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
    assert {r["seed"] for r in cases if "seed" in r} == {0, 1}  # --quick: two seeds


@pytest.mark.integration
def test_defaults_section_compares_both_batches_at_its_scales(quick) -> None:
    """The defaults table reads the Figure 13 records of its scales (--quick: 64 GPUs): both
    kinds of batches, per model, with an MFU ratio and a reduction each."""
    records, _ = quick
    rows = [r for r in records if r["figure"] == "fig13_summary" and r["ranks"] == 64]
    assert {(r["model"], r["batches"]) for r in rows} == {
        (m, b) for m in ("mllm-10b", "mllm-18b", "mllm-84b") for b in ("greedy", "greedy_stay")
    }
    for r in rows:
        assert 0.5 < r["speedup_placement"]["mean"] < 2.0
        assert r["reduction_max_rank"]["max"] <= 1.0


@pytest.mark.integration
def test_figure8_factors_come_from_the_memory_model_and_multiply(quick) -> None:
    """Per seed: both mini-batches fit and are the simulator's own (one more example runs out
    of memory is the search's test); balancing at equal mini-batch is faster; the MFU ratio
    is the balance factor times the mini-batch factor. The summary carries both factors and
    their spread over seeds."""
    records, _ = quick
    cases: dict[tuple, dict[str, dict]] = {}
    for r in records:
        if r.get("figure") == "fig8_case":
            cases.setdefault((r["model"], r["ranks"], r["seed"]), {})[r["role"]] = r
    assert cases
    for key, c in cases.items():
        none, full0, full = c["none@b_none"], c["full@b_none"], c["full@b_full"]
        assert not none["oom"] and not full["oom"], key
        assert full0["examples_per_rank"] == none["examples_per_rank"]
        assert full["examples_per_rank"] >= none["examples_per_rank"] >= 1
        assert full0["step_time_s"] < none["step_time_s"], key
        assert full0["imbalance_llm"] < none["imbalance_llm"], key
        balance, minibatch = full0["mfu"] / none["mfu"], full["mfu"] / full0["mfu"]
        assert balance * minibatch == pytest.approx(full["mfu"] / none["mfu"])
    summaries = [r for r in records if r.get("figure") == "fig8"]
    assert len(summaries) == 3 * len(QUICK_RANKS)
    for s in summaries:
        per_seed = [cases[s["model"], s["ranks"], seed] for seed in (0, 1)]
        b_none = [c["none@b_none"]["examples_per_rank"] for c in per_seed]
        assert s["b_none"]["min"] == min(b_none) and s["b_none"]["max"] == max(b_none)
        for factor in ("balance_factor", "minibatch_factor", "product"):
            f = s[factor]
            assert f["n"] == 2 and f["min"] <= f["mean"] <= f["max"], (factor, s)
        balance = [c["full@b_none"]["mfu"] / c["none@b_none"]["mfu"] for c in per_seed]
        assert s["balance_factor"]["mean"] == pytest.approx(np.mean(balance))


def _cases(records: list[dict], figure: str, prefix: str) -> dict[tuple, dict[str, dict]]:
    """Case records of one decomposition, keyed by (model, ranks, seed), then by role."""
    out: dict[tuple, dict[str, dict]] = {}
    for r in records:
        if r.get("figure") == figure and r["role"].startswith(prefix):
            key = (r["model"], r["ranks"], r["seed"], r.get("length_scale"), r.get("varied"))
            out.setdefault(key, {})[r["role"].removeprefix(prefix)] = r
    return out


@pytest.mark.integration
def test_figure8_at_the_papers_minibatches_multiplies_and_spreads(quick) -> None:
    """At the paper's mini-batches: the cases run exactly those mini-batches on the seed's
    steps, the factors multiply per seed, and the summary's spread is over the seeds that
    fit; an out-of-memory seed contributes no factor."""
    records, _ = quick
    cases = _cases(records, "fig8_case", "paper_")
    assert cases
    factors: dict[tuple, list[float]] = {}
    for (model, ranks, _seed, *_), c in cases.items():
        none, full0, full = c["none@b_none"], c["full@b_none"], c["full@b_full"]
        b0, b1 = (PAPER[f"minibatch_{k}"][model] for k in ("none", "full"))
        assert none["examples_per_rank"] == full0["examples_per_rank"] == b0
        assert full["examples_per_rank"] == b1
        assert none["steps"] == full["steps"] >= 1
        if not (none["oom"] or full0["oom"] or full["oom"]):
            balance, minibatch = full0["mfu"] / none["mfu"], full["mfu"] / full0["mfu"]
            assert balance > 1.0
            assert balance * minibatch == pytest.approx(full["mfu"] / none["mfu"])
            factors.setdefault((model, ranks), []).append(full["mfu"] / none["mfu"])
    assert factors  # some model fits the paper's mini-batches at the quick scales
    for s in (r for r in records if r.get("figure") == "fig8"):
        got = factors.get((s["model"], s["ranks"]))
        if got:
            p = s["at_paper_product"]
            assert p["n"] == len(got) and p["mean"] == pytest.approx(np.mean(got))
            assert p["min"] == pytest.approx(min(got)) and p["max"] == pytest.approx(max(got))
        assert s["at_paper_oom_seeds"] == 2 - len(got or [])


@pytest.mark.integration
def test_figure9_is_llm_tokens_per_second_per_gpu(quick) -> None:
    """Throughput is the LLM tokens of the step over its time, per GPU; at one mini-batch
    (same tokens) full over none is the step-time ratio; the summary is the cases' mean."""
    records, _ = quick
    for key, c in _cases(records, "fig8_case", "").items():
        none, full0 = c["none@b_none"], c["full@b_none"]
        ratio = full0["tokens_per_s_per_gpu"] / none["tokens_per_s_per_gpu"]
        assert ratio == pytest.approx(none["step_time_s"] / full0["step_time_s"]), key
    fig9 = [r for r in records if r.get("figure") == "fig9"]
    assert len(fig9) == 3 * len(QUICK_RANKS)
    cases = _cases(records, "fig8_case", "")
    for r in fig9:
        seeds = [cases[r["model"], r["ranks"], s, None, None] for s in (0, 1)]
        want = [c["full@b_full"]["tokens_per_s_per_gpu"] for c in seeds]
        assert r["tpt_full"]["mean"] == pytest.approx(np.mean(want))
        assert r["paper_tpt_ratio_range"] == [1.4, 1.9]


@pytest.mark.integration
def test_sensitivity_mini_batches_fall_as_lengths_grow(quick) -> None:
    """Per model, the largest fitting mini-batches never grow with the length scale; the
    mix rows hold the audio shares asked for; Table 2's matching scale gives the paper's
    forward time within the search's 1%, above scale 1 exactly when the sim's time at 1 is
    below the paper's."""
    records, _ = quick
    rows = [r for r in records if r.get("figure") == "sensitivity"]
    for model in ("mllm-10b", "mllm-18b", "mllm-84b"):
        scaled = sorted(
            (r for r in rows if r["model"] == model and r["varied"] == "scale"),
            key=lambda r: r["length_scale"],
        )
        assert [r["length_scale"] for r in scaled] == list(QUICK_SENSITIVITY_SCALES)
        for key in ("b_none", "b_full"):
            assert all(a[key] >= b[key] for a, b in itertools.pairwise(scaled)), (model, key)
        mixes = {
            round(r["audio_share"], 6) for r in rows if r["model"] == model and r["varied"] == "mix"
        }
        assert mixes == set(AUDIO_SHARES)
    (match,) = [r for r in records if r.get("figure") == "table2_scale"]
    assert match["ranks"] == 64 and match["scale"] is not None
    assert match["forward_s"] == pytest.approx(match["paper_forward_s"], rel=0.02)
    assert (match["scale"] > 1) == (match["forward_s_at_1"] < match["paper_forward_s"])


@pytest.mark.integration
def test_figure12_all_gather_is_slower_and_never_lighter(quick) -> None:
    """Per model and seed, the all-gather communicator's dispatch takes longer than the
    all-to-all's and its peak memory is at least as high; the largest mini-batch it fits is
    recorded (and fits) for every seed of a model that fits one example."""
    records, _ = quick
    per: dict[tuple, dict[str, dict]] = {}
    for r in records:
        if r.get("figure") == "fig12":
            per.setdefault((r["model"], r["seed"]), {})[r["communicator"]] = r
    assert len(per) == 3 * 2
    for key, c in per.items():
        a2a, gather = c["all_to_all"], c["all_gather"]
        assert a2a["examples_per_rank"] == gather["examples_per_rank"]
        assert gather["dispatch_fwd_ms"] > a2a["dispatch_fwd_ms"], key
        assert gather["peak_memory_gb"] >= a2a["peak_memory_gb"] - 1e-9, key
    largest = [r for r in records if r.get("figure") == "fig12_max"]
    assert largest and all(not r["oom"] for r in largest)
    summaries = [r for r in records if r.get("figure") == "fig12_summary"]
    assert {(r["model"], r["communicator"]) for r in summaries} == {
        (m, c) for m in ("mllm-10b", "mllm-18b", "mllm-84b") for c in ("all_to_all", "all_gather")
    }


@pytest.mark.integration
def test_out_of_memory_cases_report_no_mfu(quick) -> None:
    records, _ = quick
    summaries = [r for r in records if r.get("figure") == "fig10_summary"]
    assert summaries
    for s in summaries:
        per_seed = [
            r
            for r in records
            if r.get("figure") == "fig10" and r["model"] == s["model"] and r["mode"] == s["mode"]
        ]
        assert s["oom"] == any(r["oom"] for r in per_seed)
        if s["oom"]:
            assert s["mfu"] is None
    # MLLM-84B at the quick scale (32 GPUs, shard group 32) does not fit 25 examples
    assert any(s["oom"] for s in summaries if s["model"] == "mllm-84b")


@pytest.mark.integration
def test_plots_and_table2(quick) -> None:
    records, out = quick
    table2 = [r for r in records if r.get("figure") == "table2"]
    assert table2 and all(r["plan_hidden"] for r in table2)
    assert any(r["paper_overhead_ms"] for r in table2)
    for name in (
        "fig8_mfu",
        "fig10_ablation",
        "fig11_algorithms",
        "fig13_internode",
        "sensitivity",
        "table2_overhead",
    ):
        assert (out / f"{name}.png").stat().st_size > 1000


# -- validation against gpu_step records -----------------------------------------------------


def _fake_record(tmp_path: Path) -> Path:
    """A gpu_step --json record set as the script writes it (tiny config, 4 ranks)."""
    steps = {"none": 0.012, "llm": 0.010, "full": 0.008}
    records = [
        {
            "mode": mode,
            "device": "NVIDIA H100 80GB HBM3",
            "ranks": 4,
            "examples_per_rank": 6,
            "steps": 2,
            "llm_layers": 2,
            "vision_layers": 1,
            "audio_layers": 2,
            "step_time_s": t,
            "speedup_vs_none": steps["none"] / t,
            "config": "configs/tiny.yaml",
            "layer_divisor": 1,
            "seed": 3,
            "link_gbs": 450.0,
            "run_id": "run-1",
            "method": "warm-median",
            "sound": True,
            # per phase, mean and slowest rank (the LLM's share of the step, the rest equal)
            **{f"{p}_{s}_s": t * share * (1.5 if s == "max" else 1.0)
               for p, share in (("vision", 0.25), ("audio", 0.25), ("llm", 0.5))
               for s in ("mean", "max")},
        }
        for mode, t in steps.items()
    ]  # fmt: skip
    path = tmp_path / "gpu_step_fake.json"
    path.write_text(json.dumps(records))
    return path


def _validation(results_dir, run_benchmark):
    """The validation section alone, reading gpu_step records from ``results_dir`` (a
    folder or one file)."""
    out = results_dir.parent if results_dir.is_file() else results_dir
    return run_benchmark(
        "reproduce_paper.py", "--sections", "validation", "--gpu-results", str(results_dir),
        "--no-plots", "--out", str(out / "out"), timeout=120,
    )  # fmt: skip


@pytest.mark.integration
def test_validation_compares_simulated_and_measured(tmp_path, run_benchmark) -> None:
    path = _fake_record(tmp_path)  # a file (a directory of them: test_no_gpu_record_is_said)
    fake = json.loads(path.read_text())
    run = _validation(path, run_benchmark)
    rows = {r["mode"]: r for r in run.records if r.get("figure") == "gpu_validation"}
    assert set(rows) == {"none", "llm", "full"}
    assert "Simulated vs measured" in run.stdout
    for rec in fake:
        row = rows[rec["mode"]]
        assert row["source"] == "gpu_step_fake.json" and row["model"] == "tiny"
        assert (row["ranks"], row["examples_per_rank"], row["steps"]) == (4, 6, 2)
        assert row["layers"] == [1, 2, 2]
        assert row["measured_step_s"] == rec["step_time_s"]
        assert row["sim_step_s"] > 0
        assert row["step_ratio"] == pytest.approx(row["sim_step_s"] / rec["step_time_s"])
        assert row["sim_speedup"] == pytest.approx(rows["none"]["sim_step_s"] / row["sim_step_s"])
        assert row["speedup_ratio"] == pytest.approx(row["sim_speedup"] / rec["speedup_vs_none"])
    assert rows["none"]["sim_speedup"] == 1.0
    # per phase: measured over simulated, for the same examples in the same layout
    phases = [r for r in run.records if r.get("figure") == "gpu_phase_validation"]
    assert [(r["mode"], r["phase"]) for r in phases] == [
        (m, p) for m in ("none", "llm", "full") for p in ("vision", "audio", "llm")
    ]
    for row in phases:
        rec = next(r for r in fake if r["mode"] == row["mode"])
        assert row["gpu_run_id"] == "run-1" and row["sound"] is True
        for s in ("mean", "max"):
            assert row[f"measured_{s}_s"] == rec[f"{row['phase']}_{s}_s"]
            if row[f"sim_{s}_s"] > 0:
                want = row[f"measured_{s}_s"] / row[f"sim_{s}_s"]
                assert row[f"{s}_ratio"] == pytest.approx(want)
            else:  # tiny's LLM block fit is below zero, clipped: no ratio to a zero time
                assert row[f"{s}_ratio"] is None and row["phase"] == "llm"
        assert 0 <= row["sim_mean_s"] <= row["sim_max_s"]
        assert row["sim_mean_s"] > 0 or row["phase"] == "llm"
    assert rows["full"]["gpu_run_id"] == "run-1"
    assert "Per phase, measured / simulated on identical work" in run.stdout


@pytest.mark.integration
def test_no_gpu_record_is_said(tmp_path, run_benchmark) -> None:
    run = _validation(tmp_path, run_benchmark)
    assert "no GPU record" in run.stdout
    rows = [r for r in run.records if r.get("figure") == "gpu_validation"]
    assert len(rows) == 1 and rows[0]["gpu_records"] == 0


def test_gpu_batch_holds_the_examples_gpu_step_runs() -> None:
    """The simulated set-up runs the very examples gpu_step samples for that step and seed
    (the ids of step 1 cross a recipe block boundary)."""
    gpu_step = load_script(ROOT / "benchmarks" / "gpu_step.py")

    rec = {"device": "cpu", "vision_layers": 2, "audio_layers": 2, "llm_layers": 2, "ranks": 4}
    rec["config"] = "configs/tiny.yaml"
    setup = gpu_setup(rec)
    model = setup.model
    assert setup.ranks_per_node == 2  # tiny.yaml's ranks_per_node
    ranks, per_rank, step, seed = 4, 40, 1, 5
    batch = gpu_batch(model, ranks, per_rank, step, seed)
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"))
    ranks_examples = gpu_step.sample_ranks(
        cfg, step=step, ranks=ranks, per_rank=per_rank, seed=seed
    )
    examples = [ex for rank in ranks_examples for ex in rank]
    assert batch.text.tolist() == [len(ex["input_ids"]) for ex in examples]
    for name, key in (("vision", "image_patches"), ("audio", "audio_mels")):
        items = batch.of(name)
        got = [items.raw[items.example == i].tolist() for i in range(len(examples))]
        assert got == [[len(item) for item in ex[key]] for ex in examples], key
