"""A balanced (and sharded) HF model saved as the plain model's checkpoint: :func:`save_pretrained`.

After :func:`~orchmllm.integrations.transformers.shard` every parameter is an FSDP2 shard
(a ``DTensor``) and the HF model's own ``save_pretrained`` cannot write them. The full
tensors are gathered with torch's distributed state-dict API onto rank 0's CPU, one tensor at a
time, and written by the HF model's ``save_pretrained``, so ``ModelClass.from_pretrained``
loads a plain model, nothing of orchmllm needed.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from orchmllm.integrations.transformers.balanced import BalancedModel


def save_pretrained(model: BalancedModel, directory: str | os.PathLike, **kwargs: Any) -> None:
    """Write the HF model inside ``model`` as a plain HF checkpoint in ``directory``.

    Collective when ``model`` is sharded: every rank calls it; rank 0 writes, and every rank
    returns once the files are there.

    Args:
        model: from :func:`~orchmllm.integrations.transformers.wrap`, sharded or not.
        directory: where the checkpoint goes (created).
        kwargs: passed to the HF model's ``save_pretrained`` (``safe_serialization``, ...).
    """
    if not isinstance(model, BalancedModel):
        raise TypeError(
            f"model must be a BalancedModel (omt.wrap's), got {type(model).__name__}; a plain "
            "HF model saves with its own save_pretrained"
        )
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    if sharded:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(model, options=options)  # only rank 0 holds tensors
        prefix = "model."
        state = {k.removeprefix(prefix): v for k, v in full.items()}
    else:
        state = model.model.state_dict()
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        model.model.save_pretrained(directory, state_dict=state, **kwargs)
    if sharded and distributed:
        dist.barrier()
