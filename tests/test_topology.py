"""Topology: the owner of the process groups, and what a forked child (a DataLoader worker)
may do with the copies it inherits."""

from __future__ import annotations

import gc
import os

import pytest
import torch.distributed as dist

from orchmllm import topology  # noqa: F401  (the fork hook is registered on import)
from orchmllm.testing import run_distributed


class _Cycle:
    """Holds a process group in a reference cycle: freed only by the garbage collector."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.me = self


def _fork_collects_garbage(rank: int, world: int) -> int:
    gc.disable()  # keep the cycle uncollected here, so the child inherits it as garbage
    try:
        cycle = _Cycle(dist.new_group(backend="gloo"))
        dist.barrier(group=cycle.group)
        dist.destroy_process_group(cycle.group)
        del cycle
        pid = os.fork()
        if pid == 0:  # the child: what a DataLoader worker's collector does
            gc.collect()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
    finally:
        gc.enable()
    return status


@pytest.mark.integration
def test_a_forked_child_never_destroys_an_inherited_process_group():
    """Without the fork hook the child's collector frees the gloo group copy and its
    destructor joins threads the child does not have: the child hangs or crashes (seen as a
    DataLoader worker's "Unexpected segmentation fault"), and this times out."""
    assert run_distributed(_fork_collects_garbage, 2, timeout=30) == [0, 0]
