"""Topology: the owner of the process groups, what a forked child (a DataLoader worker) may
do with the copies it inherits, and the store namespace of each restart attempt."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from orchmllm.dist import topology  # the fork hook is registered on import
from orchmllm.dist.topology import Topology
from orchmllm.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]


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


def _attempt(port: int, world: int, delays: list[float]) -> list[bool]:
    """One launch attempt: ``world`` ranks (threads, each with its own store client, as
    worker processes have), rank r starting after ``delays[r]`` s. Each rank checks whether
    its own key is already there (left by an earlier attempt), writes it, and waits for every
    rank's key in the namespace it got. Returns, per rank, whether it saw a stale key."""
    stale: list[bool] = [False] * world
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            time.sleep(delays[r])
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_TIMEOUT)
            scoped = topology.attempt_store(client, rank=r, world_size=world, timeout=20)
            stale[r] = scoped.check([f"mine/{r}"])
            scoped.set(f"mine/{r}", "here")  # as a group's connect writes "0/", counters
            scoped.wait([f"mine/{q}" for q in range(world)])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "an attempt did not finish"
    return stale


_TIMEOUT = timedelta(seconds=20)


def test_each_restart_attempt_meets_in_its_own_store_namespace():
    """Three attempts on one store, as torchrun's agent keeps it across restarts: no rank
    sees a key of an earlier attempt, and every attempt's ranks meet, whichever rank starts
    first (rank 0 first reads the dead attempt's ranks' hellos; a late rank still joins)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert _attempt(store.port, 3, [0.0, 0.0, 0.0]) == [False] * 3
    assert _attempt(store.port, 3, [0.0, 0.3, 0.6]) == [False] * 3
    assert _attempt(store.port, 3, [0.5, 0.0, 0.2]) == [False] * 3
    # The same writes on the bare store: the second attempt finds the first one's keys.
    for _ in range(2):
        seen = store.check(["mine/0"])
        store.set("mine/0", "here")
    assert seen


def _threads() -> int:
    # All of them, not those named pt_gloo: a new thread is named only once it has started.
    return len(os.listdir("/proc/self/task"))


def _close_stops_users_then_frees_the_group(rank: int, world: int) -> list:
    before = _threads()
    topo = Topology.build(timeout=30)
    group = weakref.ref(topo.meta_group)
    opened = _threads() - before
    events = []

    class User:  # talks on the group until closed, as a loader's prefetch thread does
        def stop(self) -> None:
            t = torch.tensor([rank])
            dist.all_reduce(t, group=topo.meta_group)
            events.append(("stopped", int(t)))

    user, gone = User(), User()
    topo.on_close(user, User.stop)
    topo.on_close(gone, User.stop)
    del gone  # held weakly: a user already dropped is not called
    topo.close()
    events.append(("group freed", group() is None))
    deadline = time.monotonic() + 5  # a joined thread can linger in /proc for a moment
    while _threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    events.append(("threads left", _threads() - before))
    with pytest.raises(RuntimeError, match="closed"):
        topo.meta_group  # noqa: B018
    topo.close()  # idempotent
    return [opened > 0, *events]


@pytest.mark.integration
def test_close_stops_its_users_then_frees_its_group():
    """Closing a topology runs its users' close first (a collective on the group, still
    open), then destroys its gloo group and lets it go: the group's threads are joined there,
    not left to interpreter finalisation (orchmllm.dist.topology: "Exit")."""
    expected = [True, ("stopped", 1), ("group freed", True), ("threads left", 0)]
    assert run_distributed(_close_stops_users_then_frees_the_group, 2, timeout=60) == [expected] * 2


@pytest.mark.integration
def test_a_finished_job_exits_zero_every_time():
    """tests/exit_job.py: 16 runs of a 2-rank job that iterates a balanced loader (a DataLoader
    worker, an epoch left mid-way) and simply ends. Without the exit hook many processes die of
    SIGABRT in finalisation (``python -m tests.exit_job --runs 30 --without-hook``); with it
    every one exits 0."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.exit_job", "--runs", "16"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["exit_codes"] == {"0": 32}, (result, out.stderr[-2000:])
