"""The training recipe applied to a built model from outside it, as FSDP is applied.

A model knows its layers, not how a step runs on the hardware. The recipe
(:class:`orchmllm.config.TrainRecipe`) decides that, and the functions here apply it:

1. :func:`apply_checkpointing`: every k-th transformer block of each trained encoder and the
   LLM keeps only its input and is recomputed in backward (``checkpoint_wrapper``: the
   state dict keeps the unwrapped names, so a checkpoint loads with checkpointing on or off);
2. :func:`shard_model`: FSDP2 ``fully_shard`` per block, connector, encoder, token embedding,
   the LLM and the root, with the recipe's mixed precision: ``bf16-mixed`` keeps sharded fp32
   master weights (so the optimizer state is fp32), gathers and computes in bf16, and reduces
   gradients in fp32.

:func:`parallelize` does both, in that order (checkpointing wraps the blocks FSDP then shards,
as torchtitan does). The loss is chunked inside the LLM's forward (``loss_chunk``), so the
recipe needs no hook there.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from orchmllm import compat
from orchmllm.config import TrainRecipe

from .mllm import MLLM

__all__ = ["apply_checkpointing", "compute_dtype", "parallelize", "shard_model", "storage_dtype"]

# Parameter storage (the master weights the optimizer updates) and compute dtype per precision.
_STORAGE = {"float32": torch.float32, "float64": torch.float64, "bf16-mixed": torch.float32}
_COMPUTE = {"float32": torch.float32, "float64": torch.float64, "bf16-mixed": torch.bfloat16}


def storage_dtype(recipe: TrainRecipe) -> torch.dtype:
    """The dtype to build the model in: its master weights and optimizer state."""
    return _STORAGE[recipe.precision]


def compute_dtype(recipe: TrainRecipe) -> torch.dtype:
    """The dtype forward and backward run in (inputs are cast to it)."""
    return _COMPUTE[recipe.precision]


def _trained_towers(model: MLLM) -> list[nn.Module]:
    """The modules whose blocks run backward: every encoder not frozen, and the LLM."""
    return [*(e for e in model.encoders.values() if not e.cfg.frozen), model.llm]


def apply_checkpointing(model: MLLM, *, recipe: TrainRecipe) -> int:
    """Wrap the blocks the recipe checkpoints (every k-th of each trained tower, counting
    from the first); returns how many were wrapped. A frozen encoder runs no backward, so
    it has nothing to recompute."""
    wrapped = 0
    for tower in _trained_towers(model):
        for i, block in enumerate(tower.blocks):
            if recipe.checkpointed(i):
                tower.blocks[i] = checkpoint_wrapper(block)
                wrapped += 1
    return wrapped


def shard_model(model: MLLM, *, recipe: TrainRecipe, mesh=None) -> MLLM:
    """Apply FSDP2 ``fully_shard`` with the recipe's mixed precision: each transformer block,
    each connector, the token embedding (called on its own through ``LLM.embed``), each
    submodule, then the root.

    Unused-parameter reduce-scatter stays off (torch's default): every module runs on every
    rank whenever any rank has an item of its phase (on empty inputs where a rank has none),
    so each rank reduces the same gradients; a phase no rank has an item of runs nowhere, and
    its parameters keep ``None`` gradients as in a plain run. Reducing zeros for them instead
    would let AdamW move them (momentum, weight decay, step count).
    """
    mp = compat.mixed_precision(torch.bfloat16, reduce=torch.float32) if recipe.mixed else None

    def shard(module: nn.Module) -> None:
        compat.fully_shard(module, mesh=mesh, mp_policy=mp)

    for encoder in model.encoders.values():
        for block in encoder.blocks:
            shard(block)
        shard(encoder.connector)
        shard(encoder)
    for block in model.llm.blocks:
        shard(block)
    shard(model.llm.embed_tokens)
    shard(model.llm)
    shard(model)
    return model


def parallelize(model: MLLM, *, recipe: TrainRecipe, mesh=None) -> MLLM:
    """The whole recipe: checkpointing, then FSDP2 (module docstring)."""
    apply_checkpointing(model, recipe=recipe)
    return shard_model(model, recipe=recipe, mesh=mesh)
