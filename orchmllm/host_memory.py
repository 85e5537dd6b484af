"""This process's resident memory on the host, split by kind.

The resident set size alone cannot tell a leak from a cache: a trainer reading a memory-mapped
dataset (HF ``datasets``: Arrow files) shows the pages it touched as resident, up to the whole
dataset, on every rank, yet those are page cache the kernel drops under pressure. So the
trainer's metrics report the three kinds Linux keeps apart (``/proc/self/status``):

- ``anon``: anonymous memory (the Python and C heaps, tensors, thread stacks), what a leak
  grows and what only this process can give back;
- ``file``: file-backed pages mapped by this process (the dataset, shared libraries);
- ``shmem``: shared memory (DataLoader workers' tensors, ``/dev/shm``).
"""

from __future__ import annotations

__all__ = ["KINDS", "resident_mb"]

KINDS = {"RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}


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
