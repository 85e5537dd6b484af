"""benchmarks/gpu_step.py on CPU (tiny config), and the single-process NCCL training smoke path."""

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from orchmllm.config import load_config
from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


gpu_step = load_script(ROOT / "benchmarks" / "gpu_step.py")

FIELDS = ("mode", "device", "step_time_s", "speedup_vs_none", "peak_mem_bytes", "tokens_per_s")
PHASES = load_config(ROOT / "configs" / "tiny.yaml").phases


@pytest.fixture
def one_thread():
    """As the benchmark does on CPU: tiny ops on shared cores are fastest single-threaded."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.integration
def test_quick_cpu_records(run_benchmark):
    run = run_benchmark(
        "gpu_step.py", "--device", "cpu", "--repeats", "3", "--tolerance", "0.5", timeout=120
    )
    records = run.records
    by_mode = {r["mode"]: r for r in records}
    assert sorted(by_mode) == ["full", "llm", "none"] and len(records) == 3
    for r in records:
        assert all(k in r for k in FIELDS), r
        assert r["device"] == "cpu" and r["peak_mem_source"].startswith("cpu_proxy")
        assert r["peak_mem_bytes"] > 0 and r["tokens_per_s"] > 0
        # The emulated step waits for the slowest rank in every phase: never below the ideal.
        assert r["ideal_step_s"] <= r["step_time_s"] and r["step_over_ideal"] >= 1.0
        for p in PHASES:
            assert r[f"{p}_mean_s"] <= r[f"{p}_max_s"] and r[f"{p}_imbalance"] >= 1.0
        assert r["speedup_vs_none"] == pytest.approx(
            by_mode["none"]["step_time_s"] / r["step_time_s"]
        )
    none, llm, full = by_mode["none"], by_mode["llm"], by_mode["full"]
    assert none["speedup_vs_none"] == 1.0 and none["plan_s"] == 0.0 and none["a2a_est_s"] == 0.0
    # Same sampled batches in every mode: nothing lost or duplicated by a layout.
    for key in ("llm_tokens_per_step", "vision_items_per_step", "audio_items_per_step"):
        assert none[key] == llm[key] == full[key] > 0, key
    # The planner's cost-model imbalance: full balances every phase, llm only the LLM.
    for p in PHASES:
        assert full[f"{p}_plan_imbalance"] <= none[f"{p}_plan_imbalance"] + 1e-9, p
    assert llm["llm_plan_imbalance"] <= none["llm_plan_imbalance"] + 1e-9
    for p in ("vision", "audio"):
        assert llm[f"{p}_plan_imbalance"] == pytest.approx(none[f"{p}_plan_imbalance"])
    assert "speedup" not in run.stderr
    assert "x none" in run.stdout
    # Every measured figure has the simulator's prediction for the same set-up beside it, and
    # the full mode's targets are those predictions.
    for r in records:
        for key in ("step_time_s", "ideal_step_s", "step_over_ideal", "peak_mem_bytes"):
            assert r[f"sim_{key}"] > 0, key
        assert r["sim_step_time_s"] >= r["sim_ideal_step_s"]
        assert r["sim_speedup_vs_none"] == pytest.approx(
            by_mode["none"]["sim_step_time_s"] / r["sim_step_time_s"]
        )
    assert none["sim_speedup_vs_none"] == 1.0 and llm["sim_speedup_vs_llm"] == 1.0
    target = next(line for line in run.stdout.splitlines() if "/rank full:" in line)
    assert f"predicted {full['sim_speedup_vs_none']:.3f}" in target
    assert f"predicted {full['sim_speedup_vs_llm']:.3f}" in target
    # The sound step: 3 timed repeats per rank and mode after an untimed run, one run id.
    assert len({r["run_id"] for r in records}) == 1 and records[0]["run_id"]
    for r in records:
        assert r["method"] == "warm-median" and r["repeats"] == 3
        assert len(r["step_time_repeats_s"]) == 3
        assert {"step_time_s", "ideal_step_s", "speedup_vs_none", "sound"} <= set(r["definitions"])
        for p in PHASES:
            assert len(r[f"{p}_rank_s"]) == 4 and r[f"{p}_spread_max"] >= 0
            assert max(r[f"{p}_rank_s"]) == pytest.approx(r[f"{p}_max_s"])
            if r[f"sim_{p}_mean_s"] > 0:
                assert r[f"{p}_mean_over_sim"] == pytest.approx(
                    r[f"{p}_mean_s"] / r[f"sim_{p}_mean_s"]
                )
        assert r["step_time_s"] == pytest.approx(
            sum(r[f"{p}_max_s"] for p in PHASES) + r["plan_s"] + r["a2a_est_s"]
        )
    # The self-check: llm runs none's very encoder inputs on every rank, so the two time alike;
    # the verdict is the ratios against the tolerance (CPU timing on a shared machine is too
    # noisy for 5%: the test passes 50% and checks the verdict, not the machine's load).
    for p in ("vision", "audio"):
        assert none[f"check_{p}_identical_work"] is True
    ratios = {k: v for k, v in none.items() if k.startswith("check_") and k.endswith("_ratio")}
    assert len(ratios) == 4 and all(v > 0 for v in ratios.values())
    off = {k.split("_")[1] for k, v in ratios.items() if abs(v - 1) > 0.5}
    assert none["check_tolerance"] == 0.5 and none["unsound_phases"] == sorted(
        off, key=PHASES.index
    )
    assert none["sound"] is (not off) and all(r["sound"] == none["sound"] for r in records)
    assert "self-check (llm/none on identical work, tolerance 50%)" in run.stdout


def _step(times: list[list[float]], lengths: list[int]) -> gpu_step.StepResult:
    """A StepResult of phases (vision, audio, llm) x ranks; every rank's encoders hold items
    of ``lengths`` (rank r: one item of lengths[r])."""
    t = np.asarray(times, dtype=float)
    return gpu_step.StepResult(
        phases=tuple(PHASES), phase_times=t, phase_spread=np.zeros_like(t),
        repeat_steps=np.zeros(3), plan_s=0.0, a2a_s=0.0, plan_imbalance={}, peak_bytes=0,
        llm_tokens=0, items={},
        raw_lengths=[{n: torch.tensor([n_]) for n in ("vision", "audio")} for n_ in lengths],
    )  # fmt: skip


def test_identical_work_check_names_the_phase_off_by_more_than_the_tolerance():
    none = _step([[1.0, 2.0], [1.0, 1.0], [5.0, 5.0]], [4, 8])
    # vision 3% slower on the slowest rank: within 5%; audio 10% faster: outside
    llm = _step([[1.03, 2.06], [0.9, 0.9], [4.0, 6.0]], [4, 8])
    check = gpu_step.identical_work_check([{"none": none, "llm": llm}], ["vision", "audio"],
                                          tolerance=0.05)  # fmt: skip
    assert check["check_vision_max_ratio"] == pytest.approx(1.03)
    assert check["check_audio_mean_ratio"] == pytest.approx(0.9)
    assert check["unsound_phases"] == ["audio"] and check["sound"] is False
    loose = gpu_step.identical_work_check([{"none": none, "llm": llm}], ["vision", "audio"],
                                          tolerance=0.2)  # fmt: skip
    assert loose["sound"] is True and loose["unsound_phases"] == []
    # Different inputs under the two modes: nothing to compare, so the check fails.
    moved = _step([[1.0, 2.0], [1.0, 1.0], [5.0, 5.0]], [8, 4])
    check = gpu_step.identical_work_check([{"none": none, "llm": moved}], ["vision"],
                                          tolerance=0.05)  # fmt: skip
    assert check["check_vision_identical_work"] is False and check["unsound_phases"] == ["vision"]


@pytest.mark.integration
def test_new_shape_cost_records(run_benchmark):
    run = run_benchmark(
        "gpu_step.py", "--device", "cpu", "--new-shape-cost", "--shapes", "2", "--repeats", "2",
        timeout=120,
    )  # fmt: skip
    assert [r["encoder"] for r in run.records] == ["vision", "audio"]
    for r in run.records:
        assert r["figure"] == "new_shape_cost" and r["device"] == "cpu" and r["run_id"]
        assert r["items"] == 16 and r["shapes"] == 2 and len(r["cost_each_s"]) == 2
        assert r["first_s"] > 0 and r["warm_s"] > 0
        assert r["cost_s"] == pytest.approx(float(np.median(r["cost_each_s"])))
        assert r["cost_over_warm"] == pytest.approx(r["cost_s"] / r["warm_s"])
    assert "cost s" in run.stdout


def test_target_lines_say_which_side_of_the_prediction():
    rec = {"mode": "full", "ranks": 8, "examples_per_rank": 60}
    rec |= {"speedup_vs_none": 1.25, "sim_speedup_vs_none": 1.2}
    rec |= {"speedup_vs_llm": 1.05, "sim_speedup_vs_llm": 1.1}
    rec |= {"step_over_ideal": 1.01, "sim_step_over_ideal": 1.02}
    (line,) = gpu_step.target_lines([rec, {**rec, "mode": "none"}])
    assert line.startswith("8 ranks x 60/rank full:")
    assert "speedup_vs_none 1.250 (predicted 1.200: meets it)" in line
    assert "speedup_vs_llm 1.050 (predicted 1.100: MISSES it)" in line
    assert "step_over_ideal 1.010 (predicted 1.020: meets it)" in line


def test_sim_batch_is_the_sampled_examples():
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"))
    batches = gpu_step.sample_ranks(cfg, step=0, ranks=3, per_rank=5, seed=4)
    batch = gpu_step.sim_batch(batches)
    examples = [ex for b in batches for ex in b]
    assert batch.num_ranks == 3 and batch.examples_per_rank == 5
    assert batch.text.tolist() == [len(ex["input_ids"]) for ex in examples]
    for name, key in (("vision", "image_patches"), ("audio", "audio_mels")):
        items = batch.of(name)
        got = [items.raw[items.example == i].tolist() for i in range(len(examples))]
        assert got == [[len(item) for item in ex[key]] for ex in examples], key


def test_rank_work_conserves_items_and_targets():
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"))
    batches = gpu_step.sample_ranks(cfg, step=0, ranks=4, per_rank=4, seed=1)
    rows, src = gpu_step.gathered_rows(batches)
    examples = [ex for b in batches for ex in b]
    for mode in ("none", "full"):
        plan, _ = gpu_step.plan_mode(rows, src, cfg, ranks=4, mode=mode, repeats=1)
        works = [gpu_step.rank_work(plan, r, examples, cfg, torch.float32) for r in range(4)]
        patches = torch.cat([w.raw["vision"] for w in works])
        expected = np.concatenate([a for ex in examples for a in ex["image_patches"]])
        # Every image exactly once (order differs by layout): compare sorted row sums.
        assert torch.equal(
            patches.sum(1).sort().values, torch.from_numpy(expected).sum(1).sort().values
        )
        assert sum(int(w.raw_lengths["audio"].sum()) for w in works) == sum(
            len(a) for ex in examples for a in ex["audio_mels"]
        )
        assert sum(w.llm_tokens for w in works) == int(plan.seq_len.sum())
        # Targets are exactly the prediction targets the orchestrator normalises by.
        assert sum(int((w.targets != gpu_step.IGNORE_INDEX).sum()) for w in works) == (
            plan.num_targets
        )
        for w in works:
            n = w.llm_tokens
            assert sorted(w.order.tolist()) == list(range(n))
            assert w.input_ids.numel() + w.encoder_tokens == n


def test_emulator_runs_a_rank_with_no_image_or_audio(one_thread):
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"))
    emu = gpu_step.Emulator.build(cfg, device=torch.device("cpu"), seed=0)
    chat = {"caption": 0.0, "vqa": 0.0, "asr": 0.0, "spoken_qa": 0.0}
    text_only = dataclasses.replace(cfg, data=cfg.data.with_weights(chat))
    batches = gpu_step.sample_ranks(text_only, step=0, ranks=2, per_rank=2, seed=0)
    res = gpu_step.emulate_step(emu, batches, mode="full", link_bytes_per_s=1e11)
    assert res.items == {"vision": 0, "audio": 0} and res.llm_tokens > 0
    assert np.all(res.phase_times >= 0) and res.phase_times[2].min() > 0


@pytest.mark.cuda
@pytest.mark.integration
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for the NCCL backend")
def test_single_process_nccl_training_smoke(tmp_path, repo_env):
    """World size 1 on CUDA: the real entry point under torchrun, NCCL, FSDP2, orchestrator."""
    metrics = tmp_path / "metrics.jsonl"
    env = {**repo_env, "NCCL_DEBUG": "INFO"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
         "-m", "orchmllm.train", "--config", str(ROOT / "configs" / "tiny.yaml"),
         "--steps", "3", "--balance", "full", "--metrics", str(metrics),
         "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "NCCL INFO" in log, "no NCCL communicator was created"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    assert len(records) == 3
    for r in records:
        assert r["world_size"] == 1 and r["balance"] == "full"
        assert math.isfinite(r["loss"]) and r["step_time_s"] > 0
        assert set(r["phases"]) == set(PHASES)
        for ph in r["phases"].values():  # one rank: nothing to balance
            assert ph["imbalance_after"] == pytest.approx(1.0)
            assert ph["load_max_after"] == ph["load_max_before"]
