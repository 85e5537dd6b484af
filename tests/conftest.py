"""Shared fixtures, and the ``integration`` marker's guard. Multi-process helpers live in
``orchmllm.testing``."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
INTEGRATION = "integration"

# Tests never reach the network: the Hugging Face libraries' hub lookups and telemetry (TRL's
# trainers send it from a thread, its request without a timeout) are off here and in every
# process the tests start. Set before any test module imports those libraries.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"


@contextlib.contextmanager
def recording_process_starts(started: list[str]) -> Iterator[None]:
    """Append a line to ``started`` for every process started inside the block, and let it
    start: ``subprocess.Popen`` (``subprocess.run``, torchrun) and ``multiprocessing``'s
    ``Process.start`` (``torch.multiprocessing``, ``orchmllm.testing``, DataLoader workers)."""
    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start

    def popen(self, args, *rest, **kwargs):
        started.append(f"subprocess {str(args)[:160]}")
        popen_init(self, args, *rest, **kwargs)

    def start(self):
        started.append(f"process running {getattr(self, '_target', None)!r}"[:200])
        process_start(self)

    subprocess.Popen.__init__ = popen
    multiprocessing.process.BaseProcess.start = start
    try:
        yield
    finally:
        subprocess.Popen.__init__ = popen_init
        multiprocessing.process.BaseProcess.start = process_start


@contextlib.contextmanager
def no_unmarked_process_starts(item: pytest.Item, phase: str) -> Iterator[None]:
    """Fail a test that starts a process without the ``integration`` marker, so that
    ``pytest -m "not integration"`` stays the fast, single-process inner loop."""
    if item.get_closest_marker(INTEGRATION):
        yield
        return
    started: list[str] = []
    with recording_process_starts(started):
        yield
    if started:
        pytest.fail(
            f"{item.nodeid} started {len(started)} process(es) in its {phase} (first: "
            f"{started[0]}) but is not marked {INTEGRATION}: add @pytest.mark.{INTEGRATION} "
            f"(pytestmark = pytest.mark.{INTEGRATION} for a whole module)",
            pytrace=False,
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with no_unmarked_process_starts(item, "set-up"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with no_unmarked_process_starts(item, "call"):
        return (yield)


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded generator, so a failing case can be replayed."""
    return np.random.default_rng(12345)


@pytest.fixture(scope="session")
def repo_env() -> dict[str, str]:
    """This environment with the checkout first on ``PYTHONPATH``, for subprocesses."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


@dataclass(frozen=True)
class BenchmarkRun:
    """What one ``--quick --json`` benchmark run produced."""

    records: list[dict]
    stdout: str
    stderr: str


@pytest.fixture(scope="session")
def run_benchmark(tmp_path_factory, repo_env) -> Callable[..., BenchmarkRun]:
    """``run_benchmark(script, *args, timeout=s)`` runs ``benchmarks/<script> --quick *args
    --json PATH`` in a subprocess from the checkout (the smoke test every benchmark gets),
    fails the test with the tail of stderr if it exits non-zero, and returns its records."""

    def run(script: str, *args: str, timeout: float) -> BenchmarkRun:
        out = tmp_path_factory.mktemp(Path(script).stem) / "records.json"
        cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--quick", *args]
        proc = subprocess.run(
            [*cmd, "--json", str(out)],
            cwd=ROOT,
            env=repo_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return BenchmarkRun(json.loads(out.read_text()), proc.stdout, proc.stderr)

    return run


def load_script(path: Path) -> ModuleType:
    """Import a benchmark script by file path (benchmarks/ is not a package and is not put
    on the import path); registered in ``sys.modules`` so its dataclasses resolve their module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def every_plan(num_items: int, num_ranks: int) -> np.ndarray:
    """All ``num_ranks ** num_items`` plans (rank per item), one per row: the exhaustive
    yardstick of the tests on tiny instances."""
    plans = itertools.product(range(num_ranks), repeat=num_items)
    return np.array(list(plans), dtype=np.int64).reshape(-1, num_items)


def brute_force_min_load(lengths, num_ranks: int, cost, max_items: int) -> float:
    """The smallest busiest-rank cost of any plan with at most ``max_items`` items per rank,
    by trying every plan (tiny instances only): the exact yardstick the planner's quality,
    caps and exact solver are tested against."""
    l = np.asarray(lengths, dtype=np.int64)
    plans = every_plan(l.size, num_ranks)
    counts = np.stack([np.bincount(p, minlength=num_ranks) for p in plans])
    ok = counts.max(axis=1) <= max_items
    return min(float(cost.loads(l, p, num_ranks).max()) for p in plans[ok])
