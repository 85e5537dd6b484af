"""A step's global batch for the simulator: the shared example recipe, read as a :class:`Batch`.

The recipe (tasks, items per example, length distributions and their sources) is
:mod:`orchmllm.data.recipe`, the same one the synthetic training data draws from; this module only
reads a run config's ``data:`` section (a recipe) with its model's encoding rates.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from orchmllm.config import DataConfig, ModelConfig
from orchmllm.data.recipe import ItemLengths, sample_examples
from orchmllm.data.workload_facts import fact
from orchmllm.sim.batch import Batch

# The long-item stream's tag, appended to a step's seed so its draw never shifts the mix's.
LONG_STREAM = 40


def sample_batch(
    data: DataConfig,
    config: ModelConfig,
    *,
    num_ranks: int,
    examples_per_rank: int,
    seed: int | Sequence[int],
) -> Batch:
    """One step's global batch: ``examples_per_rank`` i.i.d. examples on each of ``num_ranks``
    (rank ``r`` holds examples ``r*b .. r*b+b-1``); ``seed`` seeds ``numpy.random.default_rng``.

    Raises:
        ValueError: a size below 1, or a mix whose tasks hold a modality the model does not
            encode.
    """
    if num_ranks < 1 or examples_per_rank < 1:
        raise ValueError(
            f"num_ranks and examples_per_rank must be >= 1, got {num_ranks}, {examples_per_rank}"
        )
    ex = sample_examples(data, num_ranks * examples_per_rank, seed, rates=config.rates)
    batch = Batch(num_ranks, ex.text, {n: it for n, it in ex.items.items() if it.raw.size})
    batch.check_encoded_by(config)
    return batch


def with_long_text(batch: Batch, share: float, seed: int | Sequence[int]) -> Batch:
    """``batch`` with about ``share`` of its examples (each independently) replaced by one long
    text of ``long_text.tokens`` tokens (uniform; :data:`orchmllm.data.workload_facts.FACTS`),
    its items dropped: issue 40's long-item mix, the rest the config's own mix. The draw has
    its own stream (``seed`` plus :data:`LONG_STREAM`), so the other examples are those the
    seed gives without long items, and a share of 0 returns ``batch``.

    Raises:
        ValueError: ``share`` outside [0, 1].
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share!r}")
    if share == 0.0:
        return batch
    rng = np.random.default_rng([*np.atleast_1d(seed).tolist(), LONG_STREAM])
    n = batch.text.size
    long = rng.random(n) < share
    lo, hi = fact("long_text.tokens")
    text = batch.text.copy()
    text[long] = rng.integers(int(lo), int(hi) + 1, size=int(long.sum()))
    items = {
        name: ItemLengths(it.example[~long[it.example]], it.raw[~long[it.example]])
        for name, it in batch.items.items()
    }
    return Batch(batch.num_ranks, text, items)
