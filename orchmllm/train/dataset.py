"""The run's synthetic dataset, generated once per data directory and cached under a key of
its parameters and the generator's source; written by exactly one rank per filesystem."""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable

import torch.distributed as dist

from orchmllm.config import RunConfig
from orchmllm.data import SyntheticConfig, synthetic
from orchmllm.data.synthetic import load_dataset, save_dataset
from orchmllm.dist import watch


def dataset_location(
    cfg: RunConfig, *, num_examples: int, seed: int, data_dir: str | None
) -> tuple[SyntheticConfig, str]:
    """The synthetic dataset's parameters and its directory: cached under a key of the
    parameters and the generator's source, so a changed generator never reads a stale copy."""
    syn = SyntheticConfig.for_run(cfg, num_examples=num_examples, seed=seed)
    key = synthetic.fingerprint(syn, cfg.rates)
    root = data_dir or os.path.join(tempfile.gettempdir(), "orchmllm-data")
    return syn, os.path.join(root, f"synthetic-{key}")


def prepare_dataset(cfg: RunConfig, *, num_examples: int, seed: int, data_dir: str | None):
    """Generate the HF dataset once per data directory, then load it on every rank
    (collective; a section of the job's progress, so a rank that stops meanwhile is named)."""
    syn, path = dataset_location(cfg, num_examples=num_examples, seed=seed, data_dir=data_dir)
    with watch.section("dataset write"):
        write_once(path, lambda tmp: save_dataset(syn, cfg.rates, tmp))
        return load_dataset(path)


def write_once(path: str, write: Callable[[str], object]) -> bool:
    """Make sure directory ``path`` exists on every rank's filesystem, written by exactly one
    rank per filesystem; returns whether this rank wrote it (collective, default group).

    Which ranks share a directory is found out, not assumed from the launcher: each rank
    drops a probe file, named by a token rank 0 drew, next to ``path``, and the lowest rank
    among those whose probes it sees is the writer. So a ``--data-dir`` on a filesystem all
    nodes share gets one writer in the world, a node-local one gets one per node. The writer
    calls ``write(tmp)`` on a private temporary directory and renames it into place; if
    another job finished a copy first (a filesystem whose listings lag), that copy is kept and
    the temporary one removed, so ``path`` only ever exists complete. The others wait for the
    writers; a writer's failure is raised on every rank.
    """
    root = os.path.dirname(os.path.abspath(path))
    os.makedirs(root, exist_ok=True)
    rank = dist.get_rank()
    token = [secrets.randbits(62) if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    prefix = f".orchmllm-probe-{token[0]:x}-"
    probe = os.path.join(root, f"{prefix}{rank}")
    with open(probe, "w"):
        pass
    dist.barrier()
    sharers = [int(n[len(prefix) :]) for n in os.listdir(root) if n.startswith(prefix)]
    wrote, error = False, None
    if rank == min(sharers) and not os.path.isdir(path):
        print(f"rank {rank}: writing {path}", file=sys.stderr, flush=True)
        tmp = f"{path}.tmp-{token[0]:x}-{rank}"
        try:
            write(tmp)
            os.replace(tmp, path)
            wrote = True
        except Exception as exc:
            if not (isinstance(exc, OSError) and os.path.isdir(path)):  # else: a finished copy won
                error = exc
        shutil.rmtree(tmp, ignore_errors=True)
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else repr(error))
    os.remove(probe)
    if error is not None:
        raise error
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        raise RuntimeError(f"rank {bad[0][0]} failed to write {path}: {bad[0][1]}")
    return wrote
