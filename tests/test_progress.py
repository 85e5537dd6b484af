"""Rank 0's per-step report: a bar or lines on rank 0 only, never on the other ranks."""

import io

import pytest
import torch.distributed as dist

from orchmllm.testing import run_distributed
from orchmllm.train.progress import StepProgress


def _report(rank: int, world: int, mode: str, steps: int) -> str:
    stream = io.StringIO()  # not a terminal: "auto" prints lines
    with StepProgress(total=steps, rank=dist.get_rank(), mode=mode, stream=stream) as progress:
        for step in range(steps):
            progress.step(f"step {step} done", loss=f"{step / 10:.1f}")
    return stream.getvalue()


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["bar", "lines", "auto", "off"])
def test_only_rank_zero_reports(mode):
    steps = 5
    out = run_distributed(_report, 2, mode, steps, timeout=60)
    assert out[1] == ""
    if mode == "bar":
        assert f"{steps}/{steps}" in out[0] and "loss=0.4" in out[0]
    elif mode in ("lines", "auto"):
        assert out[0].splitlines() == [f"step {s} done" for s in range(steps)]
    else:
        assert out[0] == ""


def test_a_resumed_bar_starts_at_its_step_and_bad_modes_are_named():
    stream = io.StringIO()
    with StepProgress(total=6, initial=4, rank=0, mode="bar", stream=stream) as progress:
        progress.step("ignored")
    assert "5/6" in stream.getvalue()
    with pytest.raises(ValueError, match="progress mode must be one of.*'fancy'"):
        StepProgress(total=1, rank=0, mode="fancy")
