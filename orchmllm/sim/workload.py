"""A step's global batch for the simulator: the shared example recipe, read as a :class:`Batch`.

The recipe (tasks, items per example, length distributions and their sources) is
:mod:`orchmllm.data.recipe`, the same one the synthetic training data draws from; this module only
reads a run config's ``data:`` section (a recipe) with its model's encoding rates.
"""

from __future__ import annotations

from collections.abc import Sequence

from orchmllm.config import DataConfig, ModelConfig
from orchmllm.data.recipe import sample_examples
from orchmllm.sim.batch import Batch


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
