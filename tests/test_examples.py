"""The Hugging Face examples: balancing never changes the training of a real transformers model.

Each example's ``main(argv)`` runs on 2 gloo processes (tests/multiproc.py, with timeouts),
float64, once balanced and once with ``--balance none`` (the plain PyTorch pipeline), in one
session: the per-step losses agree to 1e-5 and the balanced run's ranks are closer to equal.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from tests.multiproc import run_distributed

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TOL = 1e-5


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _runs_worker(rank: int, world: int, name: str, runs: dict[str, list[str]]) -> dict:
    """Every run of ``runs`` through the example's main, in order; their records by key."""
    main = _example(name).main
    return {
        key: main([*argv, "--dtype", "float64", "--timeout", "60", "--quiet"])
        for key, argv in runs.items()
    }


def _max_loss_diff(a: list[dict], b: list[dict]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def causal_lm() -> dict[str, list[dict]]:
    data = ["--examples", "64", "--batch-size", "8"]
    runs = {
        f"{balance}/{loss}": [*data, "--balance", balance, "--loss", loss, "--epochs", epochs]
        for loss, epochs in (("global", "2"), ("local", "1"))
        for balance in ("none", "greedy")
    }
    per_rank = run_distributed(_runs_worker, 2, "hf_causal_lm", runs, timeout=120)
    assert per_rank[0] == per_rank[1]  # the records are all-reduced: equal on every rank
    return per_rank[0]


def test_causal_lm_balanced_equals_plain(causal_lm):
    plain, balanced = causal_lm["none/global"], causal_lm["greedy/global"]
    assert len(plain) == 8
    assert _max_loss_diff(plain, balanced) < TOL
    # The same global batch each step, spread differently.
    assert [sum(r["tokens"]) for r in plain] == [sum(r["tokens"]) for r in balanced]
    before = np.mean([r["imbalance"] for r in plain])
    after = np.mean([r["imbalance"] for r in balanced])
    print(f"hf_causal_lm: mean imbalance (max/mean target tokens) {before:.3f} -> {after:.3f}")
    assert before > after and after < 1.05


def test_causal_lm_per_rank_mean_breaks_invariance(causal_lm):
    """HF's default loss (mean over the rank's own tokens) trains differently once balanced."""
    assert _max_loss_diff(causal_lm["none/local"], causal_lm["greedy/local"]) > 1e-3
