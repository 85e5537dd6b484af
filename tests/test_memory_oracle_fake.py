"""The memory oracle on fake tensors: torch's tracker of a step nothing of which is allocated.

:func:`orchmllm.memory_oracle.step_peaks` runs one rank's step under ``FakeTensorMode`` on a
fake process group, the step's integer tensors real (``HostIntegers``). Here it measures what
the same step on real tensors measures, and a model of the paper's widths at 64 ranks,
whose parameters alone would take gigabytes, without allocating them; the memory model
(:mod:`orchmllm.sim.memory`) lies within 10% of it there. One process, no collectives of
gloo: the world sizes of ``tests/test_memory_oracle.py``'s real ranks are elsewhere.
"""

from __future__ import annotations

import dataclasses
import resource

import numpy as np
import pytest

from orchmllm.config import TrainRecipe, load_config
from orchmllm.memory_oracle import PHASES, RankBatch, step_peaks
from orchmllm.recipe import ItemLengths
from orchmllm.sim.allocations import units
from orchmllm.sim.batch import Batch
from orchmllm.sim.layout import Layout
from orchmllm.sim.memory import MemoryModel
from tests.conftest import ROOT


def _symmetric(world: int, items: dict[str, tuple[int, ...]], text: tuple[int, ...]):
    """A batch in which every rank samples and runs ``items`` and ``text`` (nothing moves)."""
    n = len(text)
    lengths = {}
    where = {}
    for name, raw in items.items():
        owner = np.concatenate([np.arange(len(raw)) % n + r * n for r in range(world)])
        lengths[name] = ItemLengths(owner, np.tile(np.asarray(raw, np.int64), world))
        where[name] = owner // n
    batch = Batch(world, np.tile(np.asarray(text, np.int64), world), lengths)
    return batch, Layout(np.arange(world * n) // n, where)


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


def test_paper_widths_at_64_ranks_without_allocating_them() -> None:
    """MLLM-10B's widths and vocabulary (one block per module) at 64 ranks: the memory model
    within 10% of the oracle in every phase and in the static bytes, and the process grows
    by far less than the model's fp32 parameters (4.9 GB)."""
    cfg = load_config(str(ROOT / "configs" / "mllm-10b.yaml"))
    one = {n: dataclasses.replace(e, layers=1) for n, e in cfg.model.encoders.items()}
    model = dataclasses.replace(
        cfg.model, encoders=one, llm=dataclasses.replace(cfg.model.llm, layers=1)
    )
    world = 64
    batch, layout = _symmetric(world, {"vision": (1024, 4096), "audio": (3000,)}, (2000, 3000))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    measured = step_peaks(model, cfg.recipe, world, RankBatch.of_layout(model, batch, layout, 0))
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    params = sum(u.params for u in units(model).values())
    assert grown < params, (grown, params)  # a quarter of the fp32 parameters' bytes
    memory = MemoryModel(device="cpu", threads=1, shard_group=world, previous_batch=False)
    features = memory.rank_features(model, cfg.recipe, batch, layout)
    bare = {k: 0 * v if k.endswith((".attn_fwd", ".attn_bwd")) else v for k, v in features.items()}
    predicted = memory.phase_peaks(model, cfg.recipe, bare, num_ranks=world, moves=frozenset())
    ratios = {ph: measured.peaks[ph] / float(predicted[ph][0]) for ph in PHASES}
    ratios["static"] = measured.static / memory.static_bytes(model, cfg.recipe, world)
    print({ph: (measured.peaks[ph], round(float(predicted[ph][0])), round(r, 4))
           for ph, r in ratios.items() if ph != "static"}, "static", ratios["static"])  # fmt: skip
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios


def test_bad_arguments_are_named() -> None:
    model = load_config(str(ROOT / "configs" / "tiny.yaml")).model
    batch = RankBatch({}, (10,))
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        step_peaks(model, TrainRecipe(), 0, batch)
    with pytest.raises(ValueError, match="recipe.precision.*'float64'"):
        step_peaks(model, TrainRecipe(precision="float64"), 2, batch)
