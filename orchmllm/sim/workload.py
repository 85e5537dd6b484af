"""A step's global batch for the simulator: the shared example recipe, read as a :class:`Batch`.

The recipe (tasks, items per example, length distributions and their sources) is
:mod:`orchmllm.recipe`, the same one the synthetic training data draws from; this module only
maps a run config's ``data:`` and ``model:`` sections onto it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from orchmllm.config import ModelConfig
from orchmllm.recipe import RecipeConfig, sample_examples
from orchmllm.schema import EncodingRates
from orchmllm.sim.batch import Batch


def recipe_config(data: Mapping[str, Any], config: ModelConfig) -> RecipeConfig:
    """The recipe of a run config's ``data:`` section for ``config``'s patch size."""
    return RecipeConfig(
        task_weights=data["mix"],
        patch=config.vision.patch,
        max_image_side=int(data["max_image_side"]),
        max_audio_s=float(data["max_audio_s"]),
        max_text_tokens=int(data["max_text_tokens"]),
        scale=float(data.get("scale", 1.0)),
    )


def encoding_rates(config: ModelConfig) -> EncodingRates:
    """Raw units per LLM token of ``config``'s encoders."""
    return EncodingRates(
        vision_downsample=config.vision.downsample,
        audio_conv_stride=config.audio.conv_stride,
        audio_downsample=config.audio.downsample,
    )


def sample_batch(
    data: Mapping[str, Any],
    config: ModelConfig,
    *,
    num_ranks: int,
    examples_per_rank: int,
    seed: int | Sequence[int],
) -> Batch:
    """One step's global batch: ``examples_per_rank`` i.i.d. examples on each of ``num_ranks``
    (rank ``r`` holds examples ``r*b .. r*b+b-1``); ``seed`` seeds ``numpy.random.default_rng``."""
    if num_ranks < 1 or examples_per_rank < 1:
        raise ValueError(
            f"num_ranks and examples_per_rank must be >= 1, got {num_ranks}, {examples_per_rank}"
        )
    ex = sample_examples(
        recipe_config(data, config),
        num_ranks * examples_per_rank,
        seed,
        rates=encoding_rates(config),
    )
    return Batch(
        num_ranks, ex.text, ex.image_example, ex.image_patches, ex.audio_example, ex.audio_frames
    )
