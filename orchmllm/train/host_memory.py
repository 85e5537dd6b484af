"""This process's resident memory on the host, split by kind.

The resident set size alone cannot tell a leak from a cache: a trainer reading a memory-mapped
dataset (HF ``datasets``: Arrow files) shows the pages it touched as resident, up to the whole
dataset, on every rank, yet those are page cache the kernel drops under pressure. So the
trainer's metrics report the three kinds Linux keeps apart (``/proc/self/status``):

- ``anon``: anonymous memory (the Python and C heaps, tensors, thread stacks), what a leak
  grows and what only this process can give back;
- ``file``: file-backed pages mapped by this process (the dataset, shared libraries);
- ``shmem``: shared memory (DataLoader workers' tensors, ``/dev/shm``).

What grew. A trainer's anonymous memory grew by 10-60 MB per 100 steps for hundreds of steps
(on every rank of the tiny config on CPU), and tracemalloc saw no Python object grow: it was
torch's CPU convolutions (the audio encoder's conv front end), which oneDNN runs through a
compiled primitive per input shape, cached in two LRU caches of 1024 entries each (oneDNN's
own and ideep's, torch's wrapper), about 150 kB per shape for forward and backward. Padded
audio batches take a new length almost every step, so the caches filled for ~1000 steps and
held 100+ MB per rank, for almost no hits. :func:`bound_native_caches` bounds both.
"""

from __future__ import annotations

import os

__all__ = ["CACHE_CAPACITY", "KINDS", "NATIVE_CACHES", "bound_native_caches", "resident_mb"]

KINDS = {"RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
CACHE_CAPACITY = 64
#: The environment variables that bound torch's per-shape caches of CPU kernels (read when
#: the first such kernel is created, so they take effect if set before the first convolution).
NATIVE_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def resident_mb(path: str = "/proc/self/status") -> dict[str, float]:
    """This process's resident memory per kind (:data:`KINDS`) in MB; empty where there is no
    /proc (not Linux)."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in KINDS:
                    out[KINDS[key]] = int(value.split()[0]) / 1024  # kB
    except OSError:
        return {}
    return out


def bound_native_caches(capacity: int = CACHE_CAPACITY) -> dict[str, str]:
    """Bound torch's per-shape CPU kernel caches (:data:`NATIVE_CACHES`) to ``capacity``
    entries each, unless the environment already sets them; returns what it set.

    Call it before the first CPU convolution runs (the trainer does, at start). A repeated
    shape is still served from the cache; a new one costs a primitive's creation (about a
    millisecond for a small convolution, on CPU only: CUDA does not use these caches).
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    set_now = {name: str(capacity) for name in NATIVE_CACHES if name not in os.environ}
    os.environ.update(set_now)
    return set_now
