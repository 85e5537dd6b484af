"""benchmarks/gpu_check.py: its CPU path end to end in a fresh clone, and its pieces."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
gpu_check = load_script(ROOT / "benchmarks" / "gpu_check.py")

CPU_PARTS = [
    "env", "build", "gpu-step-4x4", "new-shape", "cuda-tests", "calibration", "train",
    "gpu-step-8x2",
]  # fmt: skip


def test_the_limits_keep_the_run_under_8_minutes():
    todo = gpu_check.parts(cuda=True, tmp=Path("t"), out=Path("o"), gpu="h100")
    assert [p.name for p in todo] == [
        "build", "gpu-step-8x60", "new-shape", "cuda-tests", "calibration", "train",
        "gpu-step-32x20",
    ]  # fmt: skip
    assert gpu_check.ENV_LIMIT_S + sum(p.limit_s for p in todo) <= 8 * 60
    # the sound step: 3 timed repeats at both reported set-ups, on the layers the limits assume
    for part in (todo[1], todo[-1]):
        command = list(part.command)
        assert command[command.index("--repeats") + 1] == "3"
        assert command[command.index("--layer-divisor") + 1] == "8"
    # 128 x 10 only when asked for, after the rest, and only on CUDA
    large = gpu_check.parts(cuda=True, tmp=Path("t"), out=Path("o"), gpu="h100", large=True)
    assert [p.name for p in large] == [p.name for p in todo] + ["gpu-step-128x10"]
    cpu = gpu_check.parts(cuda=False, tmp=Path("t"), out=Path("o"), gpu="cpu", large=True)
    assert "gpu-step-128x10" not in [p.name for p in cpu]


@pytest.mark.parametrize(
    "name, short",
    [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("Tesla V100-SXM2-16GB", "v100"),
     ("NVIDIA GeForce RTX 4090", "4090"), (None, "cpu")],
)  # fmt: skip
def test_short_gpu_name(name, short):
    assert gpu_check.short_gpu_name(name) == short


def test_a_missing_package_is_named_with_the_parts_that_need_it():
    todo = gpu_check.parts(cuda=True, tmp=Path("t"), out=Path("o"), gpu="h100")
    error = "ModuleNotFoundError: No module named 'datasets'"
    info = {"cuda": True, "import_errors": {"datasets": error}}
    assert gpu_check.check_env(todo, info) == [f"datasets ({error}), needed by train"]
    info = {"cuda": True, "import_errors": {"pytest": error.replace("datasets", "pytest")}}
    assert gpu_check.check_env(todo, info) == [
        f"pytest ({info['import_errors']['pytest']}), needed by cuda-tests"
    ]
    # without a GPU the CUDA tests do not run, so they need nothing
    assert gpu_check.check_env(todo, {**info, "cuda": False}) == []
    assert gpu_check.check_env(todo, {"cuda": True, "import_errors": {}}) == []


def test_cuda_tests_are_collected_from_the_modules_that_mark_them():
    files = gpu_check.cuda_test_files()
    assert {"tests/test_cuda.py", "tests/test_gpu_step.py", "tests/test_phase_memory.py"} <= set(
        files
    )
    assert "tests/test_loader.py" not in files  # imports datasets, holds no CUDA test


def _fresh_clone(tmp_path: Path) -> Path:
    """``git clone`` of this checkout, with this checkout's compiled core copied in (it is
    git-ignored; copied, it is newer than the clone's sources, so the build part skips)."""
    cores = list((ROOT / "orchmllm").glob("_core*"))
    if shutil.which("git") is None or not cores:
        pytest.skip("needs git and a built orchmllm._core")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=60)
    for core in cores:
        shutil.copy(core, clone / "orchmllm")
    return clone


@pytest.mark.integration
def test_cpu_path_in_a_fresh_clone(tmp_path):
    """Without a GPU: no CUDA test, gpu_step at two small set-ups merged into one file, the
    trainer's memory report on gloo; every part in the final table and the status file."""
    clone = _fresh_clone(tmp_path)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(out)],
        cwd=clone, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == [
        "gpu_check_cpu.json", "gpu_check_cpu.log", "gpu_memory_cpu.json", "gpu_step_cpu.json",
        "new_shape_cpu.json",
    ]  # fmt: skip

    report = json.loads((out / "gpu_check_cpu.json").read_text())
    assert report["env"]["cuda"] is False and report["env"]["gpu"] is None
    status = {r["name"]: r["status"] for r in report["parts"]}
    assert list(status) == CPU_PARTS
    assert status["build"] == "ok (core up to date)"
    assert status["cuda-tests"] == status["calibration"] == "skipped (no CUDA GPU)"
    ran = ("env", "gpu-step-4x4", "new-shape", "gpu-step-8x2", "train")
    assert {status[p] for p in ran} == {"ok"}
    table = proc.stdout[proc.stdout.index("\npart ") :]
    for name in CPU_PARTS:
        assert f"\n{name} " in table, name

    steps = json.loads((out / "gpu_step_cpu.json").read_text())
    assert [(r["ranks"], r["examples_per_rank"], r["mode"]) for r in steps] == [
        (ranks, b, mode) for ranks, b in ((4, 4), (8, 2)) for mode in ("none", "llm", "full")
    ]
    for r in steps:
        assert r["device"] == "cpu" and r["config"] == "configs/tiny.yaml" and r["steps"] == 1
        assert r["sim_step_time_s"] > 0 and r["sim_speedup_vs_none"] > 0
        assert r["repeats"] == 3 and isinstance(r["sound"], bool)
    shapes = json.loads((out / "new_shape_cpu.json").read_text())
    assert [r["encoder"] for r in shapes] == ["vision", "audio"]

    memory = json.loads((out / "gpu_memory_cpu.json").read_text())
    assert [(r["step"], r["phase"]) for r in memory] == [
        (s, p) for s in (0, 1) for p in ("forward", "backward", "optimizer")
    ]
    assert all(r["predicted_bytes"] > 0 for r in memory if r["phase"] != "forward")
    # one run: every record of every part carries the check's run id
    assert report["run_id"]
    assert {r["run_id"] for r in steps + shapes + memory} == {report["run_id"]}
    # the log holds every command run and its whole output
    log = (out / "gpu_check_cpu.log").read_text()
    commands = [line.split()[3] for line in log.splitlines() if line.startswith("$ ")]
    assert commands == [
        "benchmarks.gpu_step", "benchmarks.gpu_step", "benchmarks.train_memory",
        "benchmarks.gpu_step",
    ]  # fmt: skip
    assert "-m orchmllm.train" in log and "memory model counts" in log
