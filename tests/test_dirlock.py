"""dirlock: one live owner per directory; a lock is taken over only when abandoned (its
heartbeat too old, its process gone, or this same job's), and an owner learns it lost it.

The owners here are all this process with different job tokens, or hand-written lock files
of processes that are gone or on other hosts; two live jobs are in test_train_faults. The
lock as a job takes it (``checkpoint.claim`` on 2 ranks) is at the end.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from orchmllm.testing import run_distributed
from orchmllm.train import checkpoint
from orchmllm.train.dirlock import LOCK_NAME, DirectoryLock, LockHeld, Owner


def _write(directory, **fields) -> Owner:
    now = time.time()
    owner = Owner(**{"host": socket.gethostname(), "pid": os.getpid(), "start": 0, "job": "old",
                     "token": "t0", "since": now - 100, "beat": now, **fields})  # fmt: skip
    with open(os.path.join(directory, LOCK_NAME), "w") as f:
        json.dump(asdict(owner), f)
    return owner


def test_a_live_owner_is_named_and_the_lock_is_released(tmp_path):
    first = DirectoryLock(str(tmp_path / "ckpt"), stale_after=30, job="a")
    assert first.acquire() is None
    owner = rf"\(host {socket.gethostname()}, pid {os.getpid()}, job a, started .*, last "
    with pytest.raises(
        LockHeld, match=rf"in use by another job {owner}heartbeat 0.\d s ago\)"
    ) as err:
        DirectoryLock(str(tmp_path / "ckpt"), stale_after=30, job="b").acquire()
    assert err.value.owner.token == first.owner.token
    first.release()
    assert not os.path.exists(first.path)
    with DirectoryLock(str(tmp_path / "ckpt"), stale_after=30, job="b") as second:
        assert json.loads(Path(second.path).read_text())["job"] == "b"


@pytest.mark.parametrize(
    ("fields", "job", "why"),
    [
        ({"beat": time.time() - 50}, "new", r"no heartbeat for \d+ s \(abandoned after 30 s\)"),
        ({"pid": 2**22 + 7, "start": 1}, "new", r"its process 4194311 on .* exited"),
        ({"host": "elsewhere"}, "old", "it is this job's, left by an earlier attempt"),
    ],
)
def test_an_abandoned_lock_is_taken_over_and_says_why(tmp_path, fields, job, why):
    _write(tmp_path, **fields)
    lock = DirectoryLock(str(tmp_path), stale_after=30, job=job)
    try:
        assert re.search(why, lock.acquire())
        assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]  # the old one was set aside, deleted
        assert json.loads(Path(lock.path).read_text())["token"] == lock.owner.token
    finally:
        lock.release()


def test_a_live_lock_on_another_host_is_not_taken(tmp_path):
    _write(tmp_path, host="elsewhere", pid=1)
    with pytest.raises(LockHeld, match="host elsewhere, pid 1, job old"):
        DirectoryLock(str(tmp_path), stale_after=30, job="new").acquire()


def test_the_heartbeat_refreshes_the_lock_and_notices_a_takeover(tmp_path):
    lock = DirectoryLock(str(tmp_path), stale_after=0.5, job="a")
    lock.acquire()
    try:
        beat = json.loads(Path(lock.path).read_text())["beat"]
        time.sleep(0.35)
        assert json.loads(Path(lock.path).read_text())["beat"] > beat
        lock.check()
        thief = _write(tmp_path, job="b", token="thief")
        time.sleep(0.35)
        assert lock.lost == thief
        with pytest.raises(LockHeld, match="another job took over this job's lock"):
            lock.check()
    finally:
        lock.release()
    assert os.path.exists(lock.path)  # the thief's lock stays
    with pytest.raises(ValueError, match="stale_after must be a number of seconds > 0, got 0"):
        DirectoryLock(str(tmp_path), stale_after=0)
    assert replace(thief, beat=0).describe().endswith("s ago")


def _claim_worker(rank: int, world: int, directory: str) -> list[tuple]:
    """Claim ``directory`` (a 4 s lock) twice, once rank 0 wrote the lock of a job on another
    host that last beat 0 s, then 2 s ago (written here: starting the ranks takes long)."""
    out = []
    for beat_age in (0.0, 2.0):
        if rank == 0:
            _write(directory, host="elsewhere", pid=1, beat=time.time() - beat_age)
        torch.distributed.barrier()
        t0 = time.monotonic()
        try:
            lock = checkpoint.claim(directory, stale_after=4.0, job="new")
        except LockHeld as exc:
            out.append(("refused", str(exc), exc.owner.host, time.monotonic() - t0))
            continue
        if lock is not None:
            lock.release()
        out.append(("took", None, None, time.monotonic() - t0))
    return out


@pytest.mark.integration
def test_every_rank_of_a_refused_job_names_the_owner_and_a_silent_owner_is_waited_for(
    tmp_path, capfd
):
    """A job of 2 ranks claims a directory. Its lock is held by a job on another host that
    beats now: every rank (not only rank 0, whose error crosses to the others) is refused
    naming that owner. The owner last beat 2 s ago, past two heartbeat intervals of a 4 s
    lock (stopped: a dead job on another host, a requeue's usual case): the job says it
    waits, with the owner and the heartbeat's age, and takes the lock once it is abandoned,
    4 s after that heartbeat: not at once, and not refused."""
    results = run_distributed(_claim_worker, 2, str(tmp_path), timeout=60)
    for (kind, message, host, _), _ in results:
        assert kind == "refused" and host == "elsewhere"
        assert "is in use by another job (host elsewhere, pid 1, job old" in message
    waited = [r[1] for r in results]
    assert [r[0] for r in waited] == ["took", "took"]
    assert all(1.5 < r[3] < 4.0 for r in waited), waited
    err = capfd.readouterr().err
    assert re.search(
        r"its lock's owner \(host elsewhere, pid 1, job old, started .*, last heartbeat 2\.\d s "
        r"ago\) stopped heartbeating; waiting up to 2 s more for the lock to count as abandoned "
        r"\(4 s without a heartbeat\)",
        err,
    ), err
    assert re.search(r"took over the lock of host elsewhere, pid 1.*: no heartbeat for 4 s", err)
    assert not os.path.exists(tmp_path / LOCK_NAME)
