"""Experiment trackers: the trainer's step records as TensorBoard scalars (real event files,
read back with TensorBoard's own reader), and a clear launch error for a tracker not
installed."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from orchmllm.testing import run_distributed
from orchmllm.train import main
from orchmllm.train.tracking import PHASE_SCALARS, missing_packages, scalars

RECORD = {
    "step": 3, "loss": 6.25, "grad_norm": 1.5, "step_time_s": 0.2, "tokens_per_s": 900.0,
    "plan_s": 0.01, "prep_s": 0.02, "balance": "full", "rss_anon_mb": 400.0,
    "phases": {"llm": {"imbalance_before": 1.3, "imbalance_after": 1.0, "load_max_before": 90,
                       "load_max_after": 70, "bytes_intra": 10, "bytes_inter": 20,
                       "plan_ms": 0.5, "loads_before": [90, 50]}},
}  # fmt: skip


def test_a_step_record_becomes_named_scalars():
    got = scalars(RECORD)
    assert got["loss"] == 6.25 and got["rss_anon_mb"] == 400.0
    assert {f"llm/{k}" for k in PHASE_SCALARS} <= set(got)
    assert got["llm/load_max_after"] == 70.0
    assert "balance" not in got and "llm/loads_before" not in got  # numbers, one per step


def test_a_tracker_not_installed_is_named():
    absent = [p for p in ("tensorboard", "wandb") if importlib.util.find_spec(p) is None]
    assert missing_packages({"tensorboard": "dir", "wandb": "proj"}) == absent
    assert missing_packages({"tensorboard": None, "wandb": None}) == []


def _run(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    main(
        ["--config", "tiny", "--steps", "2", "--quiet", "--data-dir", os.path.join(tmp, "data"),
         "--metrics", os.path.join(tmp, "m.jsonl"), "--tensorboard", os.path.join(tmp, "tb")]
    )  # fmt: skip


@pytest.mark.integration
def test_the_trainer_logs_each_step_to_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_distributed(_run, 2, str(tmp_path), timeout=180)
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert set(scalars(records[0])) == tags
    for tag in ("loss", "step_time_s", "rss_anon_mb_max", "llm/imbalance_after",
                "vision/load_max_before", "audio/bytes_intra"):  # fmt: skip
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        expected = [(r["step"], scalars(r)[tag]) for r in records]
        assert [s for s, _ in logged] == [s for s, _ in expected] == [0, 1], tag
        assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6), tag
