"""Sharded checkpoints of a training run with ``torch.distributed.checkpoint`` (DCP).

One checkpoint is one DCP directory ``DIR/step-00000012`` (the step count it resumes at):
every rank writes its own shards of the FSDP2 model and optimizer state (taken with
``torch.distributed.checkpoint.state_dict``, so DCP can also reshard them), plus the run
state every rank shares (the loader's position, what the run was) and its own RNG state.

A checkpoint is complete only once every rank finished writing it: it is written to
``step-N.partial``, and rank 0 renames it to ``step-N`` after DCP's save returned (DCP writes
its metadata file last, after gathering every rank's write results), then all ranks meet.
So a directory named ``step-N`` is complete; a ``.partial`` one (a job killed while writing)
is never loaded, and the next save of that step replaces it. DIR must be one filesystem
all nodes share.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["latest_step", "load", "save", "step_dir"]

_COMPLETE = re.compile(r"step-(\d{8})")


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}")


def latest_step(directory: str) -> int | None:
    """The step of the newest complete checkpoint in ``directory`` (None: there is none).
    Pure file listing; :func:`load` agrees on it across ranks."""
    if not os.path.isdir(directory):
        return None
    steps = [
        int(m.group(1))
        for name in os.listdir(directory)
        if (m := _COMPLETE.fullmatch(name)) and os.path.isdir(os.path.join(directory, name))
    ]
    return max(steps, default=None)


def _rng_key() -> str:
    return f"rng.rank{dist.get_rank()}"


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save(
    directory: str,
    step: int,
    *,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    run: dict[str, Any],
) -> str:
    """Write the checkpoint that resumes at ``step`` (collective: every rank, default group).

    ``run``: the state every rank shares (JSON values: the loader's ``state_dict()``, what
    the run is), given back by :func:`load`. Returns the checkpoint's directory.
    """
    final = step_dir(directory, step)
    partial = f"{final}.partial"
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # a write that a killed job left
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optim)
    state = {
        "model": model_state,
        "optim": optim_state,
        "run": json.dumps(run),  # one leaf: DCP loads only the keys a template names
        _rng_key(): _rng_state(),
    }
    dcp.save(state, checkpoint_id=partial)
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
    dist.barrier()
    return final


def load(
    directory: str, *, model: torch.nn.Module, optim: torch.optim.Optimizer
) -> tuple[int, dict[str, Any]] | None:
    """Restore the newest complete checkpoint in ``directory`` into ``model``, ``optim`` and
    this rank's RNG; returns ``(step, run state)``, or None when there is none (collective:
    rank 0 picks the checkpoint, so every rank loads the same one)."""
    choice = [latest_step(directory) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    step = choice[0]
    if step is None:
        return None
    model_state, optim_state = get_state_dict(model, optim)
    state = {"model": model_state, "optim": optim_state, "run": "", _rng_key(): _rng_state()}
    dcp.load(state, checkpoint_id=step_dir(directory, step))
    set_state_dict(model, optim, model_state_dict=model_state, optim_state_dict=optim_state)
    torch.set_rng_state(state[_rng_key()]["cpu"])
    if "cuda" in state[_rng_key()]:
        torch.cuda.set_rng_state(state[_rng_key()]["cuda"])
    return step, json.loads(state["run"])
