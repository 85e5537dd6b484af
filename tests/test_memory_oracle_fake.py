"""The memory oracle on fake tensors: torch's tracker of a step nothing of which is allocated.

:func:`orchmllm.train.memory_oracle.step_peaks` runs one rank's step under ``FakeTensorMode`` on a
fake process group, the step's integer tensors real (``HostIntegers``). Here it measures what
the same step on real tensors measures, and a model of the paper's widths at 64 ranks,
whose parameters alone would take gigabytes, without allocating them; the memory model
(:mod:`orchmllm.sim.memory`) lies within 10% of it there. One process, no collectives of
gloo: the world sizes of ``tests/test_memory_oracle.py``'s real ranks are elsewhere.
"""

from __future__ import annotations

import resource

import pytest

from orchmllm.config import TrainRecipe, load_config
from orchmllm.train.memory_oracle import PHASES, RankBatch, main, step_peaks
from tests.conftest import ROOT


@pytest.mark.parametrize(
    "recipe",
    [TrainRecipe(precision="bf16-mixed", checkpointing=1), TrainRecipe(precision="float32")],
    ids=["bf16-ckpt", "fp32"],
)
def test_fake_tensors_measure_what_real_tensors_measure(recipe) -> None:
    """Every byte the tracker counts, per phase and per kind, on fake tensors as on real."""
    model = load_config(str(ROOT / "configs" / "tiny.yaml")).model
    batch = RankBatch({"vision": (64, 128), "audio": (200,)}, (138, 135, 60))
    fake = step_peaks(model, recipe, 4, batch)
    real = step_peaks(model, recipe, 4, batch, fake_tensors=False)
    assert fake.static == real.static > 0
    assert fake.peaks == real.peaks
    assert fake.by_kind == real.by_kind


def test_paper_widths_at_64_ranks_without_allocating_them(capsys) -> None:
    """``python -m orchmllm.train.memory_oracle`` on MLLM-10B's widths and vocabulary (12 blocks per
    module) at 64 ranks: the memory model within 10% of the oracle in every phase and in the
    static bytes, the backward within 1% (the replay recorded only its end blocks' moments
    once and missed the peak of an inner block: 1.2% here, 7.8% with all 28 LLM blocks), and
    the process grows by a quarter of the token embedding's and LM head's fp32 bytes at most
    (they alone are 4.4 GB)."""
    config = str(ROOT / "configs" / "mllm-10b.yaml")
    argv = ["--config", config, "--world-size", "64", "--layers", "12", "--text", "2000,3000,1500",
            "--items", "vision=1024,4096", "--items", "audio=3000"]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    main(argv)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    out = capsys.readouterr().out
    print(out)
    rows = {line.split()[0]: float(line.split()[-1]) for line in out.splitlines()[1:]}
    assert set(rows) == {*PHASES, "static"}
    assert all(0.9 <= r <= 1.1 for r in rows.values()), rows
    assert 0.99 <= rows["backward"] <= 1.01, rows
    model = load_config(config).model
    head = 2 * model.vocab * model.llm.hidden  # the token embedding's and LM head's weights
    assert grown < head, (grown, head)  # a quarter of their fp32 bytes


def test_bad_arguments_are_named() -> None:
    model = load_config(str(ROOT / "configs" / "tiny.yaml")).model
    batch = RankBatch({}, (10,))
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        step_peaks(model, TrainRecipe(), 0, batch)
    with pytest.raises(ValueError, match="recipe.precision.*'float64'"):
        step_peaks(model, TrainRecipe(precision="float64"), 2, batch)
