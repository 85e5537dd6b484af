"""benchmarks/results_doc.py: docs/results.md is what the committed ``--json`` files give, and
its figures and target verdicts follow the records, not text typed beside them."""

import json
import subprocess
import sys

import pytest

from benchmarks.results_render.document import (
    BLOCKS,
    DOC,
    README,
    RESULTS,
    SECTIONS,
    main,
    render,
    render_readme,
)
from benchmarks.results_render.gpu import gpu_runs
from benchmarks.results_render.tables import provenance
from tests.conftest import ROOT

# What orchmllm.provenance.run_info writes, fixed.
RUN = {
    "run_date": "2026-01-02T03:04:05Z",
    "run_command": "python benchmarks/x.py --json x.json",
    "host_cpu": "Test CPU",
    "host_simd": "avx2",
    "host_cores": 2,
    "host_load_avg": [3.5, 2.0, 1.25],
    "host_gpu": None,
    "host_note": "a shared VM",
    "python_version": "3.11.7",
    "numpy_version": "2.0.0",
    "torch_version": "2.13.0",
}


def _train(mode: str, *, loss: float, vision_after: float) -> dict:
    phase = {
        "vision": (1.5, vision_after, 2000.0),
        "llm": (1.2, 1.0 if mode == "full" else 1.2, 0.0),
    }
    rec = {
        "mode": mode,
        "config": "configs/tiny.yaml",
        "nproc": 4,
        "steps": 2,
        "phase_names": list(phase),
        "world_size": 4,
        "balance": mode,
        "placement": "auto",
        "timed_steps": 1,
        "step_time_mean_s": 0.25,
        "loss_first": 6.3,
        "loss_last": loss,
    }
    for name, (before, after, inter) in phase.items():
        rec[f"{name}_imbalance_before_mean"] = before
        rec[f"{name}_imbalance_after_mean"] = after
        rec[f"{name}_bytes_inter_total"] = inter if mode == "full" else 0.0
    return {**rec, **RUN}


def _gpu(mode: str, *, speedup_vs_none: float) -> dict:
    """A gpu_step record; its simulated figures (the targets) are fixed: 1.3x none, 1.1x llm."""
    rec = {
        "mode": mode,
        "device": "NVIDIA H100",
        "ranks": 8,
        "examples_per_rank": 60,
        "vision_layers": 9,
        "audio_layers": 8,
        "llm_layers": 7,
        "step_time_s": 1.0,
        "speedup_vs_none": speedup_vs_none,
        "speedup_vs_llm": 1.2,
        "step_over_ideal": 1.01,
        "peak_mem_bytes": 2**34,
        "tokens_per_s": 5000.0,
        "sim_step_time_s": 0.9,
        "sim_step_over_ideal": 1.0,
        "repeats": 1,
        "steps": 1,
        "sim_speedup_vs_none": 1.0 if mode == "none" else 1.3,
        "sim_speedup_vs_llm": 1.1,
        "sim_peak_mem_bytes": 2**33,
    }
    return {**rec, **RUN, "host_gpu": "NVIDIA H100"}


def _sound(mode: str, *, speedup_vs_none: float, run_id: str = "run-A", audio: float = 1.02):
    """A record of the sound step: ``audio`` is the audio phase's llm/none check ratio."""
    phases = {}
    for p, (mean, sim) in {"vision": (0.2, 0.25), "audio": (0.1, 0.125), "llm": (0.6, 0.5)}.items():
        phases |= {f"{p}_mean_s": mean, f"{p}_max_s": 1.5 * mean, f"sim_{p}_mean_s": sim,
                   f"sim_{p}_max_s": 1.5 * sim, f"{p}_mean_over_sim": mean / sim,
                   f"{p}_max_over_sim": mean / sim, f"{p}_spread_max": 0.02}  # fmt: skip
    ok = abs(audio - 1) <= 0.05
    check = {"check_tolerance": 0.05, "check_vision_max_ratio": 1.01,
             "check_vision_mean_ratio": 0.99, "check_audio_max_ratio": audio,
             "check_audio_mean_ratio": 1.0, "sound": ok,
             "unsound_phases": [] if ok else ["audio"]}  # fmt: skip
    rec = _gpu(mode, speedup_vs_none=speedup_vs_none)
    return {**rec, **phases, **check, "method": "warm-median", "repeats": 3, "run_id": run_id}


def _write(folder, name: str, records: list[dict]) -> None:
    (folder / name).write_text(json.dumps(records))


def _section(text: str, title: str) -> str:
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_committed_document_is_what_the_committed_json_gives():
    expected = render(RESULTS)
    assert DOC.read_text() == expected, (
        "docs/results.md is stale or was edited by hand: run python benchmarks/results_doc.py"
    )


def test_the_readme_blocks_are_what_the_committed_json_gives():
    text = README.read_text()
    assert render_readme(text) == text, (
        "README.md's results blocks are stale or were edited: run python benchmarks/results_doc.py"
    )


@pytest.mark.integration
def test_the_command_writes_what_render_gives(tmp_path):
    """``python benchmarks/results_doc.py``, the documented command, run from elsewhere: its
    files are the renderers' output (it finds its package beside it, not on the path)."""
    results = tmp_path / "results"
    results.mkdir()
    _write(results, "train_modes.json", [_train("none", loss=6.25, vision_after=1.5)])
    readme = tmp_path / "README.md"
    blank = "".join(f"<!-- results:{b.name} -->\n<!-- /results:{b.name} -->\n" for b in BLOCKS)
    readme.write_text(blank)
    doc = tmp_path / "results.md"
    args = ["--results", str(results), "--doc", str(doc), "--readme", str(readme)]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "results_doc.py"), *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert doc.read_text() == render(results)
    assert readme.read_text() == render_readme(blank, results) != blank


def test_a_readme_block_is_rewritten_from_the_records_and_says_when_there_are_none(tmp_path):
    text = "intro\n<!-- results:main-job -->\nold\n<!-- /results:main-job -->\n"
    text += "<!-- results:gpu -->\n<!-- /results:gpu -->\n"
    text += "<!-- results:sim -->\n<!-- /results:sim -->\nend\n"
    empty = render_readme(text, tmp_path)
    assert "(no `train_modes.json` record yet)" in empty and "old" not in empty
    assert empty.startswith("intro\n") and empty.endswith("end\n")
    _write(tmp_path, "gpu_step_h100.json", [_gpu(m, speedup_vs_none=1.2) for m in ("none", "full")])
    old = render_readme(text, tmp_path)
    assert "No GPU measurement by the sound method yet" in old and "1.200" not in old
    _write(
        tmp_path, "gpu_step_h100.json", [_sound(m, speedup_vs_none=1.2) for m in ("none", "full")]
    )
    filled = render_readme(text, tmp_path)
    assert (
        "8 ranks x 60 examples: `full` over `none` 1.200, the simulator predicted 1.300" in filled
    )
    assert "run `run-A`" in filled
    assert render_readme(filled, tmp_path) == filled  # idempotent
    with pytest.raises(ValueError, match="no <!-- results:main-job --> block"):
        render_readme("nothing marked", tmp_path)


def test_a_section_without_its_file_says_so_and_names_the_command(tmp_path):
    text = render(tmp_path)
    for section in SECTIONS:
        body = _section(text, section.title)
        assert section.missing in body and f"`{section.command}`" in body
    assert "No GPU record" in _section(text, "A training step on a GPU")


def test_the_machine_line_says_when_numpys_fastest_kernels_were_turned_off():
    assert "turned off" not in provenance([RUN])
    text = provenance([{**RUN, "numpy_disabled_features": "X86_V4"}])
    assert "widest SIMD `avx2` (numpy's `X86_V4` kernels turned off)" in text


def test_a_changed_figure_changes_the_text_and_the_run_is_named(tmp_path):
    title = SECTIONS[0].title
    _write(
        tmp_path,
        "train_modes.json",
        [
            _train("none", loss=6.25, vision_after=1.5),
            _train("full", loss=6.25, vision_after=1.125),
        ],
    )
    body = _section(render(tmp_path), title)
    assert "| `full` | 1.500 → 1.125 | 1.200 → 1.000 | 1.0 / 0.0 | 6.2500 | 250.0 |" in body
    assert "differ by at most 0.0e+00" in body
    assert "`python benchmarks/x.py --json x.json`, run 2026-01-02 03:04:05 UTC" in body
    assert "load average 3.5 / 2 / 1.25" in body and "The machine: a shared VM." in body
    _write(
        tmp_path,
        "train_modes.json",
        [_train("none", loss=6.25, vision_after=1.5), _train("full", loss=6.5, vision_after=1.25)],
    )
    changed = _section(render(tmp_path), title)
    assert "| `full` | 1.500 → 1.250 |" in changed and "| 6.5000 |" in changed
    assert "1.125" not in changed and "differ by at most 2.5e-01" in changed


@pytest.mark.parametrize(("speedup", "word"), [(1.4, "met"), (1.3, "met"), (1.2, "**NOT met**")])
def test_a_speed_up_is_judged_by_the_recorded_prediction(tmp_path, speedup, word):
    _write(
        tmp_path,
        "gpu_step_h100.json",
        [_sound(m, speedup_vs_none=1.0 if m == "none" else speedup)
         for m in ("none", "llm", "full")],
    )  # fmt: skip
    body = _section(render(tmp_path), "A training step on a GPU")
    assert "No GPU record" not in body and "GPU NVIDIA H100" in body
    where = "8 ranks x 60/rank, `full`"
    line = f"| {where}: × `none` ≥ the prediction 1.300 | {speedup:.3f} | {word} |"
    assert line in body
    assert f"| {where}: × `llm` ≥ the prediction 1.100 | 1.200 | met |" in body
    assert "| 9/8/7 |" in body  # each encoder's layers, then the LLM's
    # the self-check and per-phase measured/simulated, from the same records
    assert "| 8 x 60 | 5% | vision_max 1.010, vision_mean 0.990, audio_max 1.020, " in body
    assert "| 8 x 60 | `full` | llm | 0.6000 | 0.5000 | 1.20 |" in body
    assert "History" not in body


def test_an_unsound_set_up_is_named_and_its_targets_not_judged(tmp_path):
    recs = [_sound(m, speedup_vs_none=1.4, audio=0.9) for m in ("none", "llm", "full")]
    _write(tmp_path, "gpu_step_h100.json", recs)
    body = _section(render(tmp_path), "A training step on a GPU")
    assert "audio_max 0.900" in body and "| **unsound**: audio |" in body
    assert "the prediction 1.300" not in body  # no verdict on an unsound measurement


def test_the_replaced_methods_records_are_history_with_their_flaw_measured(tmp_path):
    old = [{**_gpu(m, speedup_vs_none=1.0), "audio_mean_s": a} for m, a in
           (("none", 0.5), ("llm", 0.2), ("full", 0.3))]  # fmt: skip
    _write(tmp_path, "gpu_step_h100.json", old)
    body = _section(render(tmp_path), "A training step on a GPU")
    assert "No record of the sound step yet" in body
    assert "**History: the replaced method, unsound.**" in body
    assert "its audio phase timed 2.5x faster at 8 x 60 (mean rank)" in body
    assert "the prediction" not in body  # no target verdicts on history


def test_the_documents_gpu_figures_come_from_one_run(tmp_path):
    """Records of the sound step from two runs cannot both be quoted: render refuses."""
    _write(
        tmp_path, "gpu_step_h100.json", [_sound(m, speedup_vs_none=1.2) for m in ("none", "full")]
    )
    shape = {"figure": "new_shape_cost", "device": "NVIDIA H100", "encoder": "audio",
             "items": 60, "shapes": 5, "first_s": 0.2, "warm_s": 0.05, "cost_s": 0.15,
             "cost_over_warm": 3.0}  # fmt: skip
    _write(tmp_path, "new_shape_h100.json", [{**shape, **RUN, "run_id": "run-A"}])
    assert gpu_runs(tmp_path) == {"run-A": ["gpu_step_h100.json", "new_shape_h100.json"]}
    assert "| NVIDIA H100 | audio | 60 | 5 | 200.00 | 50.00 | 150.00 | 3.00 |" in render(tmp_path)
    _write(tmp_path, "new_shape_h100.json", [{**shape, **RUN, "run_id": "run-B"}])
    with pytest.raises(ValueError, match="GPU records from 2 runs"):
        render(tmp_path)
    with pytest.raises(ValueError, match="GPU records from 2 runs"):
        render_readme("", tmp_path)
    # CPU records and the replaced method's are not quoted as GPU figures
    _write(tmp_path, "new_shape_h100.json", [{**shape, **RUN, "device": "cpu", "run_id": "x"}])
    assert list(gpu_runs(tmp_path)) == ["run-A"]


def test_the_committed_gpu_figures_come_from_one_run():
    assert len(gpu_runs(RESULTS)) <= 1


def _scale_run(run_date: str, *, greedy_ms: float, flag: str | None) -> list[dict]:
    """One ``balance_bench.py --scale-only`` file: a distribution, plan_step, the summary."""
    info = {**RUN, "run_date": run_date, "numpy_disabled_features": flag}
    scale = {"policy": "scale", "dist": "text", "greedy_ms": greedy_ms, "argsort_ms": 10.0,
             "greedy_over_argsort": greedy_ms / 10.0, "greedy_auto_ms_max": 90.0}  # fmt: skip
    summary = {
        "policy": "summary",
        "scale_greedy_over_argsort_max": greedy_ms / 10.0,
        "scale_auto_ms_max": 90.0,
        "scale_plan_step_ms_max": 120.0,
        "target_max_scale_greedy_over_argsort_max": 2.0,
        "target_max_scale_auto_ms_max": 100.0,
        "target_max_scale_plan_step_ms_max": 100.0,
    }
    return [{**scale, **info}, {"policy": "step_plan", **info}, {**summary, **info}]


def test_the_planner_on_other_cpus_is_judged_per_run(tmp_path):
    _write(tmp_path, "balance_scale_a.json", _scale_run("2026-01-02T03:04:05Z", greedy_ms=15.0,
                                                         flag=None))  # fmt: skip
    _write(tmp_path, "balance_scale_b.json", _scale_run("2026-01-02T03:05:05Z", greedy_ms=25.0,
                                                         flag="X86_V4"))  # fmt: skip
    body = _section(render(tmp_path), "The planner at 16,384 ranks on other CPUs")
    assert "| text | 15.0 / 10.0 = 1.50×, 90 | 25.0 / 10.0 = 2.50×, 90 |" in body
    assert "| Test CPU | `greedy` ≤ 2× argsort | max 1.50× (text) | met |" in body
    assert (
        "| Test CPU, numpy's `X86_V4` off | `greedy` ≤ 2× argsort | max 2.50× (text) "
        "| **NOT met** |" in body
    )
    assert body.count("| `plan_step` ≤ 100 ms | max 120 ms | **NOT met** |") == 2


def test_check_fails_on_a_stale_or_edited_document(tmp_path, capsys):
    _write(tmp_path, "train_modes.json", [_train("none", loss=6.25, vision_after=1.5)])
    doc, readme = tmp_path / "results.md", tmp_path / "README.md"
    readme.write_text("<!-- results:main-job -->\n<!-- /results:main-job -->\n"
                      "<!-- results:gpu -->\n<!-- /results:gpu -->\n"
                      "<!-- results:sim -->\n<!-- /results:sim -->\n")  # fmt: skip
    args = ["--results", str(tmp_path), "--doc", str(doc), "--readme", str(readme)]
    assert main([*args, "--check"]) == 1  # no document yet
    assert main(args) == 0
    assert main([*args, "--check"]) == 0
    doc.write_text(doc.read_text().replace("6.2500", "6.2000"))  # a hand edit
    assert main([*args, "--check"]) == 1
    assert "run benchmarks/results_doc.py" in capsys.readouterr().out


def _s(mean: float) -> dict:
    return {"mean": mean, "min": mean - 0.01, "max": mean + 0.01, "n": 5}


def _sim_records(*, product: float, scale: float) -> list[dict]:
    """reproduce_paper records: one Figure 8 point with both decompositions, its Figure 9,
    and Table 2's matching length scale."""
    fig8 = {
        "figure": "fig8", "model": "mllm-10b", "ranks": 2560, "seeds": 5, "steps": 3,
        "b_none": _s(120.0), "b_full": _s(140.0), "paper_b_none": 65, "paper_b_full": 80,
        "paper_mfu_ratio": 1.5, "mfu_none": _s(0.3), "mfu_full": _s(0.4),
        **{k: _s(1.2) for k in ("balance", "product", "tpt_ratio")}, "minibatch": _s(1.0),
        **{f"at_paper_{k}": _s(v) for k, v in (
            ("balance", product), ("minibatch", 1.0), ("product", product), ("mfu_none", 0.3),
            ("mfu_full", 0.4), ("tpt_none", 6000.0), ("tpt_full", 7000.0),
            ("tpt_ratio", product))},
    }  # fmt: skip
    fig9 = {
        "figure": "fig9", "model": "mllm-10b", "ranks": 2560, "seeds": 5,
        "paper_tpt_ratio_range": [1.4, 1.9],
        **{k: fig8[k] for k in ("tpt_ratio", "at_paper_tpt_none", "at_paper_tpt_full",
                                "at_paper_tpt_ratio")},
        "tpt_none": _s(6000.0), "tpt_full": _s(7000.0),
    }  # fmt: skip
    match = {
        "figure": "table2_scale", "model": "mllm-10b", "ranks": 64, "examples_per_rank": 60,
        "seed": 0, "paper_forward_s": 3.79, "forward_s_at_1": 1.39, "searched": [0.5, 4.0],
        "scale": scale, "forward_s": 3.78, "oom": True, "peak_memory_gb": 79.6,
    }  # fmt: skip
    return [{**r, **RUN} for r in (fig8, fig9, match)]


def test_the_simulators_shortfalls_and_summary_follow_the_records(tmp_path) -> None:
    """Figure 8 at the paper's mini-batches, Figure 9, the derived length scale and the
    shortfall list are read from the records: a changed figure changes the text, in
    docs/results.md and in the README's block alike."""
    readme = "<!-- results:main-job -->\n<!-- /results:main-job -->\n"
    readme += "<!-- results:gpu -->\n<!-- /results:gpu -->\n"
    readme += "<!-- results:sim -->\n<!-- /results:sim -->\n"
    title = "At cluster scale: the paper's section 8 on the simulator"
    texts = {}
    for product, scale in ((1.41, 2.61), (1.52, 2.2)):
        _write(tmp_path, "reproduce_paper.json", _sim_records(product=product, scale=scale))
        body = _section(render(tmp_path), title)
        block = render_readme(readme, tmp_path)
        for text in (body, block):
            assert f"mllm-10b {product:.3g} ({product - 0.01:.3g}-{product + 0.01:.3g})" in text
        assert f"length scale **{scale:.2f}**" in body and f"× {scale:.2f}, not used" in block
        assert "Where the simulation falls short of the paper" in body
        assert "more than the budget" in body  # the matching scale does not fit mini-batch 60
        assert "| mllm-10b | 2,560 | 65→80 |" in body  # Figure 8 at the paper's mini-batches
        texts[product] = body
    assert texts[1.41] != texts[1.52]
