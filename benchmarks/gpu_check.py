"""The GPU proof in one command: every check that needs a CUDA GPU, each part under its own
time limit, every figure in a file.

From the checkout's root, on a machine with one CUDA GPU and torch installed (no network and
no install needed; the C++ core is built in place)::

    python -m benchmarks.gpu_check [--out DIR] [--skip PART ...]

Parts, in order (the figure the proof is for first); a part that fails or times out does not
stop the later ones:

- ``env``: Python, torch, CUDA and the GPU; installs the wheels carried in ``wheels/`` (see
  ``--download-wheels``) into ``wheels/site`` and checks that every package the selected parts
  need imports, failing in seconds and naming the missing ones;
- ``build``: ``python setup.py build_ext --inplace`` (skipped when ``orchmllm/_core`` for this
  Python is newer than every file of ``cpp/``);
- ``gpu-step-8x60``: ``benchmarks/gpu_step.py``'s sound step at 8 emulated ranks x 60
  examples, every mode, one measured step (every rank's exact inputs once untimed, then 3 timed
  repeats per mode, interleaved; the identical-work self-check), the simulator's prediction and
  per-phase measured/simulated beside every figure;
- ``new-shape``: ``gpu_step --new-shape-cost``: what an encoder's first call on a new input
  shape costs over a warm call;
- ``cuda-tests``: ``pytest -m cuda`` over the test modules that hold such tests: the fused
  ``varlen_attn`` kernel against per-sequence SDPA in bf16 and fp32, every encoder on an empty
  batch, NCCL at world size 1 through the dispatcher and the orchestrator (equal to gloo), the
  single-process NCCL training smoke test, the per-phase CUDA memory report;
- ``calibration``: costs learned on this GPU: the trainer (``torchrun --nproc_per_node=1``) on
  the tiny config with ``--cost measured`` for 12 steps; each phase's fitted coefficients, R^2
  and measured imbalance go to ``calibration_<gpu>.jsonl`` (its ``--metrics``);
- ``train``: ``benchmarks/train_memory.py``: the trainer (``torchrun --nproc_per_node=1``,
  bf16) for 5 steps of ``configs/mllm-10b-1gpu.yaml``, peak memory per phase beside the
  memory model's prediction;
- ``gpu-step-32x20``: gpu_step at 32 emulated ranks x 20 examples;
- ``gpu-step-128x10``: with ``--large`` only (it does not fit the 8 minutes).

Every part runs with one ``ORCHMLLM_RUN_ID``, written into every record as ``run_id`` (and into
``gpu_check_<gpu>.json``), so the documents can check that their GPU figures come from one run.

It writes into ``--out`` (default ``benchmarks/results``), ``<gpu>`` being the GPU's short name
(``h100``) or ``cpu``: ``gpu_step_<gpu>.json`` (gpu_step's records of every set-up),
``new_shape_<gpu>.json``, ``gpu_memory_<gpu>.json`` (train_memory's records),
``gpu_check_<gpu>.json`` (the run id, the environment and every part's status, seconds and
limit) and ``gpu_check_<gpu>.log`` (every part's whole output), and ends with a table of the
parts. The limits sum to 480 s, so the whole run stays within 8 minutes.

Without a GPU the same script runs its CPU path, which the test suite runs: ``cuda-tests`` is
skipped, gpu_step runs the tiny config at 4 x 4 and 8 x 2, the trainer the tiny config on
gloo.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "wheels"
SITE = WHEELS / "site"  # where the carried wheels are installed (git-ignored with wheels/)
# Packages the GPU image lacks, carried as wheels (pinned: the versions the suite passes with).
# datasets stores the trainer's synthetic data; dill and multiprocess are its pure-Python
# dependencies; the image has the rest of them (pyarrow, pandas, fsspec, xxhash, ...).
CARRIED = {"datasets": "5.2.0", "dill": "0.4.1", "multiprocess": "0.70.19"}
GPU_PYTHON = "3.12"  # the GPU image's Python, for --download-wheels

# Module -> distribution name (for the message when one is missing).
DISTRIBUTIONS = {
    "numpy": "numpy",
    "yaml": "pyyaml",
    "tqdm": "tqdm",
    "torch": "torch",
    "setuptools": "setuptools",
    "pybind11": "pybind11",
    "pytest": "pytest",
    "pytest_timeout": "pytest-timeout",
    "datasets": "datasets",
    "dill": "dill",
    "multiprocess": "multiprocess",
}
RUNTIME = ("numpy", "yaml", "tqdm", "torch")  # what importing orchmllm's training path needs


@dataclass(frozen=True)
class Part:
    """One step of the check: a command run under a time limit (seconds)."""

    name: str
    limit_s: int
    needs: tuple[str, ...]  # modules (DISTRIBUTIONS keys) the part imports
    command: tuple[str, ...] = ()
    cuda_only: bool = False


# Limits: each part's estimated H100 time with margin, so that the whole run ends within 8
# minutes (they sum to 480 s), with what the first run on the lent H100 measured (2026-11-26).
# FLOPs are counted at 400 TFLOP/s, half the 800 TFLOP/s a large bf16 matrix product reaches
# on the lent H100.
# - env, ~5 s: one process imports torch, datasets and the rest; installing the carried wheels
#   ~5 s. Measured 9.8 s.
# - build, ~10 s: ten C++17 files at -O3 compile in parallel; the slowest takes 8 s on one core
#   (35 s serial on the 2-core development machine). Measured 10.8 s.
# - gpu-step 8x60 and 32x20: below, at GPU_STEP_RUNS (the replaced method's single pass took
#   81 s and 95 s at layers / 4; the run was then the start-up the issue 38 found).
# - cuda-tests, ~40 s (limit 50): collecting the suite ~10 s; the attention tests are a few
#   GFLOP; the NCCL test starts two one-process groups (~10 s each); the training smoke test
#   is a tiny torchrun of 3 steps. Measured 39 s.
# - train, ~30 s (limit 45): MLLM-10B widths with 4 layers (2.35 B parameters) and 8 examples
#   (~6k LLM tokens) a step: 6 x 2.35 B x 6k = 85 TFLOP, well under a second; 5 steps plus
#   torchrun and a 40-example dataset written. Measured 49 s to its fifth step, then 27 s.
# - calibration, ~15 s (limit 30): torchrun and the tiny model's start-up (~10 s, as the
#   cuda-tests' smoke test), then 12 steps of a few milliseconds each.
ENV_LIMIT_S = 20
# The gpu_step runs: (emulated ranks, examples per rank, limit in seconds); the reported
# set-ups on CUDA, small ones of the tiny config on CPU. Each rank runs 1 untimed + 3 timed
# times per mode (gpu_step's sound step), 12 passes over all ranks, 3x the replaced method's 4:
# the CUDA runs divide the layers by 8 instead of 4 to stay within 8 minutes (LLM 4, vision 4,
# audio 4 layers; the simulator predicts the same layers). Estimates from the 2026-11-26 H100
# run (one pass over all ranks, layers / 4: 14.5 s at 8 x 60, 24 s at 32 x 20, host work
# included), about 0.6x at layers / 8:
# - 8 x 60: 12 x 9 s = 108 s, plus ~20 s start-up and sampling;
# - 32 x 20: 12 x 11 s of GPU work (the host's per-rank work is done once per rank and mode, not
#   per repeat) = ~130 s, plus ~25 s start-up;
# - 128 x 10 (``--large`` only, outside the 8 minutes): ~2x 32 x 20, ~300 s.
GPU_STEP_RUNS = {"cuda": ((8, 60, 140), (32, 20, 150)), "cpu": ((4, 4, 140), (8, 2, 140))}
LARGE_RUN = (128, 10, 420)  # CUDA only, with --large
GPU_STEP_LAYER_DIVISOR = 8  # on CUDA (above); the CPU path runs the tiny config whole
GPU_STEP_REPEATS = 3
# - new-shape, ~10 s: the model built, then per encoder 1 + 5 x (1 + 3) encoder passes of 60
#   items.
NEW_SHAPE_LIMIT_S = 20
SKIPPABLE = ("build", "cuda-tests", "gpu-step", "new-shape", "calibration", "train")


def cuda_test_files() -> list[str]:
    """The test modules that hold ``cuda``-marked tests: collecting only these keeps the part
    fast and free of what the rest of the suite imports (datasets, hypothesis)."""
    tests = sorted((ROOT / "tests").glob("test_*.py"))
    return [str(t.relative_to(ROOT)) for t in tests if "pytest.mark.cuda" in t.read_text()]


def parts(*, cuda: bool, tmp: Path, out: Path, gpu: str, large: bool = False) -> list[Part]:
    """The parts after ``env`` for this device (module docstring; limits above)."""
    py = sys.executable
    step = (py, "-m", "benchmarks.gpu_step", "--repeats", str(GPU_STEP_REPEATS))
    step += ("--layer-divisor", str(GPU_STEP_LAYER_DIVISOR)) if cuda else ("--device", "cpu")

    def gpu_step(ranks: int, per_rank: int, limit_s: int) -> Part:
        command = [*step, "--ranks", str(ranks), "--examples-per-rank", str(per_rank)]
        command += ["--steps", "1", "--json", str(tmp / f"gpu_step_{ranks}x{per_rank}.json")]
        return Part(f"gpu-step-{ranks}x{per_rank}", limit_s, RUNTIME, tuple(command))

    first, second = GPU_STEP_RUNS["cuda" if cuda else "cpu"]
    new_shape = (*step, "--new-shape-cost", "--json", str(out / f"new_shape_{gpu}.json"))
    train = (py, "-m", "benchmarks.train_memory", "--json", str(out / f"gpu_memory_{gpu}.json"))
    calibration = (
        py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
        "-m", "orchmllm.train", "--config", "tiny", "--steps", "12", "--cost", "measured",
        "--quiet", "--metrics", str(out / f"calibration_{gpu}.jsonl"),
    )  # fmt: skip
    todo = [
        Part("build", 25, ("setuptools", "pybind11"), (py, "setup.py", "build_ext", "--inplace")),
        gpu_step(*first),
        Part("new-shape", NEW_SHAPE_LIMIT_S, RUNTIME, new_shape),
        Part("cuda-tests", 50, (*RUNTIME, "pytest", "pytest_timeout"),
             (py, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", *cuda_test_files()),
             cuda_only=True),
        Part("calibration", 30, RUNTIME, calibration, cuda_only=True),
        Part("train", 45, (*RUNTIME, *CARRIED), train),
        gpu_step(*second),
    ]  # fmt: skip
    if large and cuda:
        todo.append(gpu_step(*LARGE_RUN))
    return todo


# -- running a part ------------------------------------------------------------------------


def run_command(command: Sequence[str], *, limit_s: float, log, env: dict) -> tuple[str, str]:
    """Run ``command`` from the checkout's root in a process group of its own, its output
    appended to ``log``; on time-out the whole group is killed (torchrun's workers too).
    Returns (status, the output's last lines)."""
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    start = log.tell()
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        rc = proc.wait(timeout=limit_s)
        status = "ok" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        status = "timed out"
    log.flush()
    with open(log.name, errors="replace") as f:
        f.seek(start)
        tail = f.read().splitlines()[-14:]
    return status, "\n".join(tail)


def core_is_current() -> bool:
    """Whether ``orchmllm/_core`` for this Python is newer than every source in ``cpp/``."""
    built = [
        ROOT / "orchmllm" / f"_core{suffix}"
        for suffix in importlib.machinery.EXTENSION_SUFFIXES
        if (ROOT / "orchmllm" / f"_core{suffix}").exists()
    ]
    sources = [p.stat().st_mtime for p in (ROOT / "cpp").iterdir()]
    return bool(built) and min(p.stat().st_mtime for p in built) > max(sources)


# -- environment ---------------------------------------------------------------------------


def install_carried_wheels() -> str | None:
    """Install ``wheels/*.whl`` into ``wheels/site`` (no network, no dependencies; once per
    set of wheels). Returns what was done, or None when no wheel is carried."""
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        return None
    stamp = SITE / ".installed"
    names = "\n".join(w.name for w in wheels)
    if stamp.exists() and stamp.read_text() == names:
        return f"{len(wheels)} carried wheels already in wheels/site"
    shutil.rmtree(SITE, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet"]
    command += ["--target", str(SITE), *map(str, wheels)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=ENV_LIMIT_S)
    if proc.returncode:
        shutil.rmtree(SITE, ignore_errors=True)  # nothing half-installed on the path
        return f"installing wheels/ failed: {proc.stderr.strip()[-300:]}"
    stamp.write_text(names)
    return f"installed {len(wheels)} carried wheels into wheels/site"


PROBE = """
import json, sys
errors = {}
for name in sys.argv[1:]:
    try:
        __import__(name)
    except Exception as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"
info = {"python": sys.version.split()[0], "import_errors": errors, "cuda": False, "gpu": None}
if "torch" not in errors:
    import torch
    info.update(torch=torch.__version__, cuda=torch.cuda.is_available())
    if info["cuda"]:
        info.update(gpu=torch.cuda.get_device_name(0), cuda_version=torch.version.cuda)
print(json.dumps(info))
"""


def probe(env: dict) -> dict:
    """The machine as torch sees it, and every module of :data:`DISTRIBUTIONS` imported for
    real (a package can be installed and still fail, e.g. against another version of one of
    its dependencies)."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *DISTRIBUTIONS], env=env, cwd=ROOT, capture_output=True,
        text=True, timeout=ENV_LIMIT_S, check=True,
    )  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


def short_gpu_name(name: str | None) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100``: the first word with a digit, lower case; ``cpu``
    without a GPU."""
    if not name:
        return "cpu"
    words = [w for w in re.split(r"[^A-Za-z0-9]+", name) if w and w.upper() != "NVIDIA"]
    return next((w.lower() for w in words if any(c.isdigit() for c in w)), "_".join(words).lower())


# -- the whole check -----------------------------------------------------------------------


def merge_gpu_step(tmp: Path, out: Path, gpu: str) -> None:
    """gpu_step's records of every set-up run so far, in one file."""
    records = []
    for path in sorted(tmp.glob("gpu_step_*.json"), key=lambda p: p.stat().st_mtime):
        records += json.loads(path.read_text())
    if records:
        (out / f"gpu_step_{gpu}.json").write_text(json.dumps(records, indent=1) + "\n")


def print_summary(rows: Sequence[dict]) -> None:
    print(f"\n{'part':<16} {'status':<28} {'seconds':>8} {'limit':>6}")
    for r in rows:
        seconds = "-" if r["seconds"] is None else f"{r['seconds']:.1f}"
        print(f"{r['name']:<16} {r['status']:<28} {seconds:>8} {r['limit_s']:>6}")


def download_wheels(python_version: str) -> int:
    """Fetch the carried wheels into ``wheels/`` (on a machine with the package index)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", python_version, "--platform", "manylinux2014_x86_64"]
    command += ["-d", str(WHEELS), *(f"{name}=={v}" for name, v in CARRIED.items())]
    subprocess.run(command, check=True)
    total = sum(p.stat().st_size for p in WHEELS.glob("*.whl"))
    print(f"{WHEELS}: {total / 1e6:.1f} MB; carry it with the checkout (it is git-ignored)")
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results dir")
    ap.add_argument("--skip", nargs="+", choices=SKIPPABLE, default=[], help="parts not to run")
    ap.add_argument(
        "--large",
        action="store_true",
        help=f"also gpu_step at {LARGE_RUN[0]} x {LARGE_RUN[1]} (CUDA; outside the 8 minutes)",
    )
    ap.add_argument(
        "--download-wheels",
        action="store_true",
        help=f"only fetch the carried wheels ({', '.join(CARRIED)}) into wheels/ for Python "
        f"{GPU_PYTHON} (needs the package index), then stop",
    )
    return ap.parse_args(argv)


def check_env(todo: Sequence[Part], info: dict) -> list[str]:
    """Lines naming each package a part to run needs and cannot import (empty: all there)."""
    runnable = [p for p in todo if info["cuda"] or not p.cuda_only]
    lines = []
    for m in sorted({m for p in runnable for m in p.needs} | set(RUNTIME)):
        if m in info["import_errors"]:
            users = [p.name for p in runnable if m in p.needs] or ["every part"]
            why = info["import_errors"][m]
            lines.append(f"{DISTRIBUTIONS[m]} ({why}), needed by {', '.join(users)}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.download_wheels:
        return download_wheels(GPU_PYTHON)
    started, started_at = time.perf_counter(), time.time()
    out = Path(args.out).resolve()
    tmp = out / ".gpu_check"  # gpu_step's records of each set-up, before they are merged
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    # env: carried wheels, then one process imports everything and reports the GPU
    carried = install_carried_wheels()
    path = [str(ROOT), str(SITE) if SITE.exists() else "", os.environ.get("PYTHONPATH", "")]
    # One run id in every record any part writes (provenance.RUN_ID_ENV): the docs' GPU
    # figures are checked to come from one run.
    run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    env["ORCHMLLM_RUN_ID"] = run_id
    info = probe(env)
    gpu = short_gpu_name(info["gpu"])
    todo = parts(cuda=info["cuda"], tmp=tmp, out=out, gpu=gpu, large=args.large)
    missing = check_env([p for p in todo if not p.name.startswith(tuple(args.skip))], info)
    print(
        f"gpu_check: python {info['python']}, torch {info.get('torch')}, "
        f"GPU {info['gpu'] or 'none (CPU path)'}; {carried or 'no carried wheels'}",
        flush=True,
    )
    for line in missing:
        print(f"  missing: {line}")
    if missing:
        print(
            "  carry them: run `python -m benchmarks.gpu_check --download-wheels` where the "
            "package index is reachable and copy wheels/ along; or leave parts out with --skip"
        )
    env_status = "failed (missing packages)" if missing else "ok"
    rows = [_row("env", env_status, time.perf_counter() - started, ENV_LIMIT_S)]

    log_path = out / f"gpu_check_{gpu}.log"
    log_path.write_text("")
    with open(log_path, "a") as log:  # appended to by every part's process too
        log.write(json.dumps({"env": info, "wheels": carried, "missing": missing}) + "\n")
        for part in todo:
            if part.name.startswith(tuple(args.skip)):
                rows.append(_row(part.name, "skipped (--skip)", None, part.limit_s))
            elif missing:
                rows.append(_row(part.name, "not run (env failed)", None, part.limit_s))
            elif part.cuda_only and not info["cuda"]:
                rows.append(_row(part.name, "skipped (no CUDA GPU)", None, part.limit_s))
            elif part.name == "build" and core_is_current():
                rows.append(_row(part.name, "ok (core up to date)", 0.0, part.limit_s))
            else:
                print(f"\n== {part.name} (limit {part.limit_s} s)", flush=True)
                t0 = time.perf_counter()
                status, tail = run_command(part.command, limit_s=part.limit_s, log=log, env=env)
                rows.append(_row(part.name, status, time.perf_counter() - t0, part.limit_s))
                print(tail, flush=True)
                if part.name.startswith("gpu-step"):
                    merge_gpu_step(tmp, out, gpu)
    shutil.rmtree(tmp, ignore_errors=True)
    total = time.perf_counter() - started
    report = {
        "run_id": run_id, "env": info, "wheels": carried, "missing": missing, "total_s": total,
        "parts": rows,
    }  # fmt: skip
    (out / f"gpu_check_{gpu}.json").write_text(json.dumps(report, indent=1) + "\n")
    print_summary(rows)
    written = sorted(p.name for p in out.iterdir() if p.stat().st_mtime >= started_at)
    print(f"total {total:.1f} s; wrote in {out}: {', '.join(written)}")
    return 0 if all(r["status"].startswith(("ok", "skipped")) for r in rows) else 1


def _row(name: str, status: str, seconds: float | None, limit_s: int) -> dict:
    return {"name": name, "status": status, "seconds": seconds, "limit_s": limit_s}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
