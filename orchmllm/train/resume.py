"""Checkpoints of a run: what one records besides the tensors (the run's identity, the
layout, the loader's position), when one is due, and resuming from the newest that verifies,
refusing another run's."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import torch.distributed as dist

from orchmllm.config import RunConfig
from orchmllm.dist import watch
from orchmllm.train import checkpoint
from orchmllm.train.dirlock import DirectoryLock
from orchmllm.train.run import Run


def checkpoint_due(done: int, run: Run) -> bool:
    """Whether a run that has done ``done`` steps writes a checkpoint now: after its last step
    and every ``--checkpoint-every``."""
    every = run.args.checkpoint_every
    return done == run.steps or (every > 0 and done % every == 0)


def save(run: Run, done: int, lock: DirectoryLock | None) -> str:
    """Write the checkpoint of a run that has done ``done`` steps into ``--checkpoint-dir``
    (collective, a section of the job's progress); returns its directory."""
    with watch.section(f"checkpoint save at step {done}"):
        return checkpoint.save(
            run.args.checkpoint_dir, done, model=run.model, optim=run.optim,
            run=run_state(run), keep_last=run.args.keep_last, lock=lock,
        )  # fmt: skip


# Config keys that do not change the training: the balancing (mode, policies, placement), the
# layout (its global batch is compared instead) and the run's stopping rule.
# (train.steps, train.seed and recipe.precision are compared on their own: see _identity.)
_FREE_KEYS = (
    "balance.", "data.examples_per_rank", "train.grad_accum", "train.sync_micro_steps",
    "train.max_skipped_steps", "train.steps", "train.seed", "recipe.precision",
)  # fmt: skip


def _config_fields(cfg: RunConfig) -> dict[str, Any]:
    """The config as flat ``section.key`` values (JSON ones) that a resumed run must keep."""

    def flat(value: Any, prefix: str) -> dict[str, Any]:
        if isinstance(value, dict):
            return {k: v for key, x in value.items() for k, v in flat(x, f"{prefix}{key}.").items()}
        return {prefix[:-1]: value}

    fields = json.loads(json.dumps(flat(dataclasses.asdict(cfg), "")))
    return {k: v for k, v in fields.items() if not k.startswith(_FREE_KEYS)}


def _identity(run: Run) -> dict[str, Any]:
    """What a checkpoint must have been written by to resume this run: everything that
    changes the training itself. Not the balance mode, policies, placement or gradient sync,
    which do not, nor the world size, examples per rank or micro-steps: the global batch
    (ranks x examples per rank x micro-steps) stands for them, so a run that keeps it may
    resume on another number of ranks or micro-steps (see :func:`resume`)."""
    cfg = run.cfg
    return {
        "config": _config_fields(cfg), "steps": run.steps, "precision": cfg.recipe.precision,
        "seed": cfg.train.seed,
        "global_batch": dist.get_world_size() * cfg.data.examples_per_rank
        * cfg.train.grad_accum,
    }  # fmt: skip


def run_state(run: Run) -> dict[str, Any]:
    """The run state a checkpoint keeps: the run's identity, the layout that wrote it and
    the loader's position (micro-steps of the layout that wrote it: see
    :func:`loader_position`)."""
    layout = {
        "world_size": dist.get_world_size(),
        "per_rank": run.cfg.data.examples_per_rank,
        "grad_accum": run.cfg.train.grad_accum,
    }
    return {"run": _identity(run), "layout": layout, "loader": run.loader.state_dict()}


def resume(run: Run) -> int:
    """Restore the newest checkpoint of ``--checkpoint-dir`` that verifies (model, optimizer,
    loader position, RNG; see :func:`orchmllm.train.checkpoint.load`) and return the step to
    continue at; 0 when there is none. Collective.

    A checkpoint of another run (config, steps, seed, precision, global batch) is refused
    with a ValueError rather than resumed. One written on another number of ranks or
    micro-steps resumes when the global batch is the same (4 ranks x 8 examples -> 2 x 16,
    or 2 x 8 x 2 micro-steps): DCP reshards the model and optimizer, and every step's global
    batch is the same examples (the sampler deals the epoch's permutation to the ranks in
    turn, so ranks x examples per rank consecutive examples make one micro-step, and K
    consecutive micro-steps one step, on any layout), so the losses go on as in an
    uninterrupted run. Otherwise the refusal says which ``data.examples_per_rank`` would
    allow it. The run is compared before any tensor is loaded (:func:`check_resumable`)."""
    directory = run.args.checkpoint_dir
    loaded = checkpoint.load(
        directory,
        model=run.model,
        optim=run.optim,
        check=lambda step, state: check_resumable(run, directory, step, state),
    )
    if loaded is None:
        return 0
    step, state = loaded
    run.loader.load_state_dict(
        loader_position(state["loader"], step, grad_accum=run.cfg.train.grad_accum)
    )
    if dist.get_rank() == 0:
        layout = state.get("layout", {})
        moved = (
            f" (written by {layout['world_size']} ranks, resharded onto {dist.get_world_size()})"
            if layout.get("world_size", dist.get_world_size()) != dist.get_world_size()
            else ""
        )
        print(f"resumed at step {step} from {checkpoint.step_dir(directory, step)}{moved}")
        sys.stdout.flush()
    return step


def check_resumable(run: Run, directory: str, step: int, state: dict[str, Any]) -> None:
    """Refuse (ValueError, the same on every rank) the checkpoint of ``step`` whose run state
    ``state`` is another run's. The first line names every differing config key with both
    values: a model's (a width, a layer count, an encoder added or removed, the vocabulary)
    would not even load."""
    where = f"--checkpoint-dir {directory!r}: {checkpoint.step_dir(directory, step)}"
    mine, theirs = _identity(run), state["run"]
    if not isinstance(theirs.get("config"), dict):
        raise ValueError(
            f"{where} was written by an older orchmllm that did not record its config key by "
            "key; resume it with that version or use another directory"
        )
    ours, saved = mine["config"], theirs["config"]
    missing = "(absent)"
    changed = [
        f"{key} {saved.get(key, missing)!r} there, {ours.get(key, missing)!r} now"
        for key in sorted(ours.keys() | saved.keys())
        if ours.get(key, missing) != saved.get(key, missing)
    ]
    if changed:
        model = any(c.startswith("model.") for c in changed)
        what = "another model, which cannot load into this one" if model else "another run"
        raise ValueError(
            f"{where} was written for {what}: {'; '.join(changed)}. Resume with the same "
            "config or use another directory"
        )
    for key, value in mine.items():
        if theirs.get(key) == value:
            continue
        if key == "global_batch" and "layout" in state:
            raise ValueError(f"{where} {_layout_refusal(state['layout'], run)}")
        raise ValueError(
            f"{where} was written by another run ({key} {theirs.get(key)!r} there, {value!r} "
            "now); resume with the same settings or use another directory"
        )


def loader_position(state: dict[str, int], step: int, *, grad_accum: int) -> dict[str, int]:
    """The loader state that resumes optimizer step ``step`` with ``grad_accum`` micro-steps
    each: the checkpoint's (epoch, seed), at micro-step ``step * grad_accum``. The run's data
    is one epoch of exactly its steps, so that is where the loader stood at the end of
    ``step``, on any layout of the same global batch."""
    return {**state, "step": step * grad_accum}


def _layout_refusal(layout: dict[str, int], run: Run) -> str:
    """Why a checkpoint of another global batch cannot resume here, and what would."""
    world, per_rank = dist.get_world_size(), run.cfg.data.examples_per_rank
    accum, theirs = run.cfg.train.grad_accum, layout.get("grad_accum", 1)
    batch = layout["world_size"] * layout["per_rank"] * theirs
    written = f" x {theirs} micro-steps" if theirs > 1 else ""
    here, with_accum = (f" x {accum}", f" (with grad_accum {accum})") if accum > 1 else ("", "")
    head = (
        f"was written by {layout['world_size']} ranks x {layout['per_rank']} examples per rank"
        f"{written} (global batch {batch}); this run has {world} x {per_rank}{here} = "
        f"{world * per_rank * accum}. A resumed run must keep the global batch (it decides "
        "every step's examples and loss): "
    )
    if batch % (world * accum) == 0:
        return head + (
            f"on {world} ranks set data.examples_per_rank to {batch // (world * accum)}{with_accum}"
        )
    sizes = [w for w in range(1, batch + 1) if batch % w == 0]
    over, unit = (f"{world} ranks x {accum} micro-steps", "ranks x micro-steps")
    if accum == 1:
        over, unit = f"{world} ranks", "ranks"
    return head + f"{batch} examples do not split over {over}; use {sizes} {unit}"
