"""Sharded checkpoints of a training run with ``torch.distributed.checkpoint`` (DCP) that
cannot lie, and a resume that always finds one.

One checkpoint is one DCP directory ``DIR/step-00000012`` (the step count it resumes at):
every rank writes its own shards of the FSDP2 model and optimizer state (taken with
``torch.distributed.checkpoint.state_dict``, so DCP can also reshard them onto another world
size), plus the run state every rank shares (the loader's position, what the run was) and its
own RNG state.

Complete. A checkpoint is written to ``step-N.partial``; after DCP's save returned on every
rank (DCP writes its ``.metadata`` last), the ranks checksum its files (each a share), and
rank 0 writes ``manifest.json`` (every file's size and SHA-256) and renames the directory to
``step-N``. So a ``.partial`` directory (a job killed while writing) is never loaded, and
leftovers are removed when the next job takes the directory.

Verified. A checkpoint is loaded only after every file of its manifest has the size and
checksum the manifest says (the ranks share the reading). One that does not verify (a file
corrupted, cut or removed, no manifest) is reported with the reason and the next older one is
tried; a run whose checkpoints all fail stops with every reason rather than start over.

Kept. With ``keep_last=N``, once a new checkpoint verified (read back after writing), older
ones are deleted so that N remain: the disk never fills with checkpoints, and a checkpoint is
never deleted before a newer one is known good. A save that fails (a full disk) removes its
partial directory and leaves the earlier checkpoints.

One writer. :func:`claim` takes the directory's lock (:mod:`orchmllm.train.dirlock`) for the job
before anything is read or written. DIR must be one filesystem all nodes share.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from orchmllm.train.dirlock import DirectoryLock

__all__ = [
    "MANIFEST",
    "NoSpace",
    "NoUsableCheckpoint",
    "claim",
    "latest_step",
    "load",
    "prune",
    "save",
    "step_dir",
    "steps",
    "verify",
]

MANIFEST = "manifest.json"
_COMPLETE = re.compile(r"step-(\d{8})")
_CHUNK = 1 << 22  # bytes read at a time while checksumming
_FULL_BELOW = 1 << 20  # a write that failed with fewer bytes free than this hit a full disk


class NoUsableCheckpoint(RuntimeError):
    """Checkpoints exist but none verifies (the message gives each one's reason)."""


class NoSpace(OSError):
    """A checkpoint does not fit on its filesystem (the message: the path, the bytes it
    needs, the bytes free)."""


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}")


def steps(directory: str) -> list[int]:
    """The steps of the complete (renamed) checkpoints in ``directory``, newest first; pure
    file listing, verified by :func:`verify`."""
    if not os.path.isdir(directory):
        return []
    found = [
        int(m.group(1))
        for name in os.listdir(directory)
        if (m := _COMPLETE.fullmatch(name)) and os.path.isdir(os.path.join(directory, name))
    ]
    return sorted(found, reverse=True)


def latest_step(directory: str) -> int | None:
    """The step of the newest complete checkpoint in ``directory`` (None: there is none)."""
    return next(iter(steps(directory)), None)


# -- collective helpers (default group; a single process needs none) ------------------------


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


def _from_rank0(compute: Callable[[], Any]) -> Any:
    """``compute()`` on rank 0, the same value on every rank; an error there is raised on
    every rank."""
    box: list[Any] = [None]
    if _rank() == 0:
        try:
            box[0] = (True, compute())
        except Exception as exc:
            box[0] = (False, exc)
    if _distributed():
        dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _gather(value: Any) -> list[Any]:
    if not _distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# -- manifest --------------------------------------------------------------------------------


def _digest(path: str) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _files(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n != MANIFEST and not n.endswith(".tmp"))


def _write_manifest(path: str, step: int) -> None:
    """Checksum every file of checkpoint ``path`` (each rank a share) and write the
    manifest (rank 0), durably (collective)."""
    names = _from_rank0(lambda: _files(path))
    mine = {}
    for name in names[_rank() :: _world()]:
        size, sha = _digest(os.path.join(path, name))
        mine[name] = {"size": size, "sha256": sha}
    files = {k: v for part in _gather(mine) for k, v in part.items()}
    if _rank() == 0:
        tmp = os.path.join(path, f"{MANIFEST}.tmp")
        with open(tmp, "w") as f:
            json.dump({"format": 1, "step": step, "files": files}, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, MANIFEST))


def verify(path: str) -> list[str]:
    """What is wrong with checkpoint ``path`` (empty: every file has its manifest's size and
    checksum), the same list on every rank (collective: the ranks share the reading)."""

    def read_manifest() -> dict | str:
        try:
            with open(os.path.join(path, MANIFEST)) as f:
                manifest = json.load(f)
            return manifest["files"]
        except FileNotFoundError:
            return f"no {MANIFEST} (a job stopped before it finished, or an older version)"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"{MANIFEST} unreadable ({type(exc).__name__}: {exc})"

    files = _from_rank0(read_manifest)
    if isinstance(files, str):
        return [files]
    problems = []
    for name in sorted(files)[_rank() :: _world()]:
        want = files[name]
        try:
            size, sha = _digest(os.path.join(path, name))
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        except OSError as exc:
            problems.append(f"{name} unreadable ({exc})")
            continue
        if size != want["size"]:
            problems.append(f"{name} has {size} bytes, its manifest {want['size']} (cut or grown)")
        elif sha != want["sha256"]:
            problems.append(f"{name}: checksum differs from its manifest's (corrupted bytes)")
    return sorted(p for part in _gather(problems) for p in part)


# -- save, load, prune -----------------------------------------------------------------------


def claim(directory: str, *, stale_after: float, job: str | None) -> DirectoryLock | None:
    """Take ``directory`` for this job (collective): rank 0 takes its lock
    (:class:`~orchmllm.train.dirlock.DirectoryLock`) and removes the partial checkpoints an earlier
    job left. Returns the lock on rank 0 (None elsewhere); every rank raises
    :class:`~orchmllm.train.dirlock.LockHeld` naming the owner when another live job holds it. A
    lock whose owner stopped heartbeating is waited for until it is abandoned (less than
    ``stale_after``, the collectives' timeout: the other ranks wait in a broadcast)."""

    lock = None

    def take() -> None:
        nonlocal lock
        lock = DirectoryLock(directory, stale_after=stale_after, job=job)
        took_over = lock.acquire(log=_log)
        if took_over:
            _log(f"{directory}: {took_over}")
        for name in sorted(os.listdir(directory)):
            if name.endswith(".partial"):
                _log(f"{directory}: removing {name}, a checkpoint an earlier job did not finish")
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)

    _from_rank0(take)
    return lock


def _rng_key() -> str:
    return f"rng.rank{_rank()}"


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
    keep_last: int = 0,
    lock: DirectoryLock | None = None,
) -> str:
    """Write the checkpoint that resumes at ``step`` (collective: every rank, default group),
    verify it, then keep only the newest ``keep_last`` checkpoints (0: keep all).

    ``run``: the state every rank shares (JSON values: the loader's ``state_dict()``, what
    the run is), given back by :func:`load`. ``lock``: the directory's lock (rank 0's, from
    :func:`claim`): the save refuses to write once another job took it over. Returns the
    checkpoint's directory. A failed write removes its partial directory and raises on every
    rank; earlier checkpoints are kept. A full disk raises :class:`NoSpace`, checked before
    writing when an earlier checkpoint tells the size.
    """
    final = step_dir(directory, step)
    partial = f"{final}.partial"

    def prepare() -> tuple[int, str] | None:
        if lock is not None:
            lock.check()
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # a write that a killed job left
        need = _last_size(directory)
        if need is not None and shutil.disk_usage(directory).free < need[0]:
            what = f"no space for the checkpoint of step {step} in {directory}"
            raise NoSpace(_space_message(what, need, directory))
        return need

    need = _from_rank0(prepare)
    model_state, optim_state = get_state_dict(model, optim)
    state = {
        "model": model_state,
        "optim": optim_state,
        "run": json.dumps(run),  # one leaf: DCP loads only the keys a template names
        _rng_key(): _rng_state(),
    }
    try:
        dcp.save(state, checkpoint_id=partial, no_dist=not _distributed())
        _write_manifest(partial, step)
    except BaseException as exc:
        full = _no_space(exc)
        if isinstance(exc, CheckpointException) and not full:  # every rank has it, in step
            # torch.save's zip writer reports a full disk without errno ("unexpected pos")
            full = _from_rank0(lambda: shutil.disk_usage(directory).free < _FULL_BELOW)
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        if full:
            what = f"writing the checkpoint of step {step} to {partial} failed: no space left"
            raise NoSpace(_space_message(what, need, directory)) from exc
        raise

    def publish() -> None:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)

    _from_rank0(publish)
    problems = verify(final)
    if problems:
        raise OSError(f"{final} does not read back as written: " + "; ".join(problems))
    if keep_last:
        _from_rank0(lambda: prune(directory, keep_last=keep_last, newest=step))
    return final


def _last_size(directory: str) -> tuple[int, str] | None:
    """The bytes of the newest complete checkpoint by its manifest, and its path (None:
    there is none to tell)."""
    for step in steps(directory):
        path = step_dir(directory, step)
        try:
            with open(os.path.join(path, MANIFEST)) as f:
                files = json.load(f)["files"]
            return sum(int(v["size"]) for v in files.values()), path
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def _space_message(what: str, need: tuple[int, str] | None, directory: str) -> str:
    free = shutil.disk_usage(directory).free
    needs = f"about {need[0]} bytes (the size of {need[1]})" if need else "more"
    return f"{what}: it needs {needs}, {free} bytes are free there. Free some space"


def _no_space(exc: BaseException | None) -> bool:
    """Whether ``exc`` (DCP's CheckpointException holds every rank's) is a full disk."""
    if exc is None:
        return False
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    if isinstance(exc, CheckpointException):
        return any(_no_space(e) for e, _ in exc.failures.values())
    return _no_space(exc.__cause__ or exc.__context__)


def prune(directory: str, *, keep_last: int, newest: int) -> list[int]:
    """Delete the checkpoints older than ``newest`` (which verified) but the ``keep_last -
    1`` newest of them; returns the deleted steps. Checkpoints newer than ``newest`` (left by
    a run that resumed from an older one) are left: the run overwrites them as it goes."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    older = [s for s in steps(directory) if s < newest]
    deleted = older[keep_last - 1 :]
    for s in deleted:
        shutil.rmtree(step_dir(directory, s), ignore_errors=True)
    return deleted


def load(
    directory: str,
    *,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    check: Callable[[int, dict[str, Any]], None] | None = None,
) -> tuple[int, dict[str, Any]] | None:
    """Restore the newest checkpoint in ``directory`` that verifies into ``model``, ``optim``
    and this rank's RNG; returns ``(step, run state)``, or None when there is no complete
    checkpoint (collective: rank 0 lists the directory, so every rank loads the same one).

    A newer checkpoint that does not verify is reported (stderr, rank 0) with why, and the
    next older one is tried. ``check(step, run state)`` is called (every rank) before any
    tensor is read: it raises to refuse the checkpoint of another run, which DCP would
    otherwise fail on, or load, tensor by tensor. DCP reshards model and optimizer onto this
    world size; a rank the checkpoint has no RNG state for keeps its own.

    Raises:
        NoUsableCheckpoint: complete checkpoints exist but none verifies.
    """
    rejected = []
    for step in _from_rank0(lambda: steps(directory)):
        path = step_dir(directory, step)
        problems = verify(path)
        if problems:
            rejected.append(f"{path}: " + "; ".join(problems))
            _log(f"checkpoint {path} is not usable: {'; '.join(problems)}; trying an older one")
            continue
        run = {"run": ""}
        dcp.load(run, checkpoint_id=path, no_dist=not _distributed())
        if check is not None:
            check(step, json.loads(run["run"]))
        model_state, optim_state = get_state_dict(model, optim)
        state = {"model": model_state, "optim": optim_state, "run": ""}
        rng = _rng_key()
        has_rng = _has_key(path, rng)
        if has_rng:
            state[rng] = _rng_state()
        dcp.load(state, checkpoint_id=path, no_dist=not _distributed())
        set_state_dict(model, optim, model_state_dict=model_state, optim_state_dict=optim_state)
        if has_rng:
            torch.set_rng_state(state[rng]["cpu"])
            if "cuda" in state[rng]:
                torch.cuda.set_rng_state(state[rng]["cuda"])
        return step, json.loads(state["run"])
    if rejected:
        raise NoUsableCheckpoint(
            f"no checkpoint in {directory} verifies: " + " | ".join(rejected) + ". Move them "
            "aside to start over, or restore a copy"
        )
    return None


def _has_key(path: str, key: str) -> bool:
    """Whether checkpoint ``path`` holds the top-level key ``key`` (this rank's RNG state is
    absent when it was written by fewer ranks)."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    return any(fqn.startswith(f"{key}.") for fqn in metadata.state_dict_metadata)


def _log(message: str) -> None:
    if _rank() == 0:
        print(message, file=sys.stderr, flush=True)
