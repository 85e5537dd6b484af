"""orchmllm.dist.calibrator in the trainer: costs learned from the run, the same on every rank.

2 gloo ranks train the tiny model (a wider vision encoder on larger images, so that its time
follows its patches) starting from a deliberately wrong vision cost: every batch costs the
same, so the planner deals images out by count. With ``--cost measured`` every rank times its
phases, every rank fits the gathered times alike, and the ranks plan with the fits from a step
no prefetcher has begun: the measured vision imbalance (max/mean of the ranks' vision time)
falls once they do, every rank holds the same fitted models, and the losses are those of
``--balance none``.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import yaml

from orchmllm.testing import run_distributed
from orchmllm.train import parse_args, setup
from orchmllm.train.loop import _loop
from orchmllm.train.preempt import Preemption
from tests.conftest import ROOT

STEPS = 10
PREFETCH = 1  # the trainer's default --prefetch


def _config(tmp_path) -> str:
    raw = {
        "base": str(ROOT / "configs" / "tiny.yaml"),
        "model": {"encoders": {"vision": {"hidden": 128, "ffn": 256}}},
        "data": {
            "tasks": {
                name: {"weight": w}
                for name, w in {
                    "caption": 0.5,
                    "vqa": 0.2,
                    "asr": 0.1,
                    "spoken_qa": 0.0,
                    "chat": 0.2,
                }.items()
            },
            "examples_per_rank": 4,
            "scale": 0.5,
        },
        "balance": {
            "costs": {"vision": {"alpha": 0.0, "beta": 0.0, "const": 1.0}},
            "calibrate_steps": STEPS,
            "calibrate_every": 2,
            "min_r2": 0.2,  # CPU times of a tiny model are noisy; the test checks the effect
        },
    }
    path = os.path.join(tmp_path, "calibrate.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    return path


def _worker(rank: int, world: int, config: str, tmp_path: str, cost: str, mode: str):
    torch.set_num_threads(1)
    argv = [
        "--config", config, "--steps", str(STEPS), "--balance", mode, "--cost", cost,
        "--precision", "float64", "--data-dir", os.path.join(tmp_path, "data"), "--quiet",
        "--timeout", "60", "--metrics", os.path.join(tmp_path, f"{mode}-{cost}.jsonl"),
    ]  # fmt: skip
    run = setup(parse_args(argv))
    with Preemption((), grace=60, saving=False) as preemption:  # no signal stops this run
        _loop(run, 0, None, preemption)
    final = run.loader.planner.at(0, STEPS).options  # the costs the last steps planned with
    return {**{p.name: p.cost for p in final.phases}, "llm": final.llm_cost}


def _records(tmp_path, name: str) -> list[dict]:
    with open(os.path.join(tmp_path, f"{name}.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.integration
def test_measured_costs_correct_a_wrong_default_on_every_rank_alike(tmp_path):
    config = _config(tmp_path)
    costs = run_distributed(_worker, 2, config, str(tmp_path), "measured", "full", timeout=240)
    run_distributed(_worker, 2, config, str(tmp_path), "default", "none", timeout=240)
    measured, plain = _records(tmp_path, "full-measured"), _records(tmp_path, "none-default")
    np.testing.assert_allclose([r["loss"] for r in measured], [r["loss"] for r in plain], rtol=1e-5)
    assert costs[0] == costs[1]  # the same fitted models on both ranks, bit for bit
    vision = costs[0]["vision"]
    assert vision.kind == "packed" and vision.alpha + vision.beta > 0  # no longer count-only
    fitted = [r["step"] for r in measured if r["calibration"]["vision"].get("used")]
    assert fitted, [r["calibration"]["vision"] for r in measured]
    switch = fitted[0] + 1 + PREFETCH + 1  # the first step planned with the fit
    imb = [r["calibration"]["vision"]["measured_imbalance"] for r in measured]
    before, after = np.mean(imb[: fitted[0] + 1]), np.mean(imb[switch:])
    print(f"measured vision imbalance {before:.3f} -> {after:.3f}; fit {vision}")
    assert switch < STEPS and after < before
