"""watch: per-rank progress in a real c10d TCPStore, and the diagnosis of a failed step.

Several ranks' entries are written from one process (each Progress is one rank's); a silent
rank is an entry whose heartbeat stopped long ago. The multi-process path (a SIGSTOPped rank
named by every healthy one) is in test_train.
"""

import json
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from orchmllm.dist import watch


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_diagnosis_names_behind_silent_and_finished_ranks_not_failed_peers(store):
    world = 6
    ranks = [watch.Progress(store, rank=r, world_size=world, timeout=60) for r in range(5)]
    for r, p in enumerate(ranks):
        p.arrive("exchange", 8)
        p.arrive("train", 4 if r == 2 else 7)  # rank 2 hangs loading its batch
    ranks[3].diagnose(RuntimeError("Timed out"), stream="train", elapsed_s=60.0)  # gave up first
    ranks[4].close("done")  # left the epoch early
    # Rank 5 was stopped 100 s ago (its heartbeat is that old).
    entry = {"t": time.time() - 100, "steps": {"train": 7, "exchange": 8}, "state": "running"}
    store.set("orchmllm/progress/5", json.dumps(entry))
    err = ranks[0].diagnose(RuntimeError("Timed out waiting"), stream="train", elapsed_s=60.4)
    assert isinstance(err, watch.StepFailed)
    assert err.missing == [2, 4, 5] and err.step == 7 and err.stream == "train"
    text = str(err)
    assert text.startswith("rank 0: training step 7 failed after 60.4 s: RuntimeError: Timed out")
    assert "ranks that did not arrive at training step 7: [2, 4, 5]" in text
    assert "rank 2: alive but behind (last entered training step 4" in text
    assert "rank 4: finished the run" in text
    assert "rank 5: silent for 10" in text
    assert "rank 3: failed at training step 7: RuntimeError: Timed out (arrived)" in text
    assert "rank 1" not in text  # arrived and healthy
    # The exchange stream is judged on its own: everyone entered exchange 8 except the
    # silent rank 5 and the finished rank 4.
    err = ranks[1].diagnose(TimeoutError(), stream="exchange", elapsed_s=1.0)
    assert err.missing == [4, 5] and err.step == 8


def test_every_rank_arrived_and_bad_arguments(store):
    ranks = [watch.Progress(store, rank=r, world_size=2, timeout=60) for r in range(2)]
    for p in ranks:
        p.arrive("train", 3)
    err = ranks[1].diagnose(ValueError("bad batch"), stream="train", elapsed_s=0.1)
    assert err.missing == [] and "every rank arrived at training step 3" in str(err)
    with pytest.raises(ValueError, match="stream must be one of"):
        ranks[0].arrive("backward", 1)
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0, got 0"):
        watch.Progress(store, rank=0, world_size=1, timeout=0)


def test_arrive_reports_to_the_installed_progress_only(store):
    watch.arrive("train", 5)  # nothing installed: a no-op
    p = watch.Progress(store, rank=0, world_size=1, timeout=60)
    watch.install(p)
    try:
        watch.arrive("exchange", 2)
        assert watch.current() is p and p.position("exchange") == 2
        assert json.loads(store.get("orchmllm/progress/0"))["steps"]["exchange"] == 2
    finally:
        watch.install(None)


def test_a_dead_peer_is_named_dead_not_arrived(store):
    """A peer that died arrived at the step (its entry says so, and its heartbeat is still
    fresh) but its collectives failed at once: one on this host is named dead from its process
    (gone), one on another host once its heartbeat fails to advance for two intervals."""
    world, timeout = 4, 2.0  # heartbeat interval 0.2 s
    me = watch.Progress(store, rank=0, world_size=world, timeout=timeout)
    alive = watch.Progress(store, rank=1, world_size=world, timeout=timeout)
    for p in (me, alive):
        p.arrive("train", 6)
    now = time.time()
    for rank, proc in ((2, [socket.gethostname(), 2**22 + 11, 5]), (3, ["node-b", 4242, 9])):
        entry = {"t": now, "steps": {"train": 6, "exchange": 7, "job": 3}, "state": "running",
                 "section": "", "proc": proc}  # fmt: skip
        store.set(f"orchmllm/progress/{rank}", json.dumps(entry))
    t0 = time.monotonic()
    err = me.diagnose(RuntimeError("Connection closed by peer"), stream="train", elapsed_s=0.0)
    waited = time.monotonic() - t0
    assert err.missing == [2, 3], str(err)
    text = str(err)
    assert "ranks that did not arrive at training step 6 or died: [2, 3]" in text
    assert f"rank 2: dead: its process {2**22 + 11} on {socket.gethostname()} exited" in text
    assert "rank 3: dead or stopped: no heartbeat for" in text
    assert "(last entered training step 6 and loader exchange of step 7 and section 3)" in text
    assert "rank 1" not in text  # alive: its heartbeat advanced
    assert 0.4 <= waited < 3.0, waited  # two heartbeat intervals and a second, at most
    alive.close()


def test_a_failed_section_is_diagnosed_and_names_it(store):
    p = watch.Progress(store, rank=0, world_size=2, timeout=60)
    peer = watch.Progress(store, rank=1, world_size=2, timeout=60)
    watch.install(p)
    try:
        with peer.section("start-up"):
            pass  # the peer finished start-up and is stuck before the dataset write
        with (
            pytest.raises(watch.StepFailed) as err,
            watch.section("start-up"),
            watch.section("dataset write"),
        ):
            raise RuntimeError("Timed out waiting 20000ms")
        text = str(err.value)
        assert text.startswith(
            "rank 0: dataset write (section 1) failed after 0.0 s: RuntimeError: Timed out"
        )
        assert "ranks that did not arrive at dataset write (section 1): [1]" in text
        behind = "rank 1: alive but behind (last entered training step -1 and loader exchange "
        assert behind + "of step -1 and section 0 (start-up))" in text
        with pytest.raises(KeyboardInterrupt), watch.section("checkpoint load"):
            raise KeyboardInterrupt  # an interrupt is not a failure to diagnose
    finally:
        watch.install(None)
        peer.close()
    assert watch.is_failure(ValueError()) and not watch.is_failure(SystemExit(1))


_THREADED_CHILD = (
    "import sys, threading, time\n"
    "for _ in range(4): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    "print('ready', flush=True); time.sleep(60)\n"
)


@pytest.mark.integration  # starts processes
def test_a_killed_peer_is_dead_from_the_instant_it_is_killed(store):
    """The race: a SIGKILLed process closes its sockets (its peers' collectives fail at once)
    before it becomes a zombie, and in between /proc lists it as running; a diagnosis then
    called it alive. 20 times: a multi-threaded process, the entry of rank 1 (arrived,
    heartbeat fresh), SIGKILL, and at once the diagnosis: rank 1 dead, every time."""
    verdicts = []
    for _ in range(20):
        me = watch.Progress(store, rank=0, world_size=2, timeout=60)
        me.arrive("train", 3)
        child = subprocess.Popen(
            [sys.executable, "-c", _THREADED_CHILD], stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout.readline() == "ready\n"
            proc = watch.Process(socket.gethostname(), child.pid, 0)
            entry = {"t": time.time(), "steps": {"train": 3}, "state": "running",
                     "section": "", "proc": [proc.host, proc.pid, proc.start]}  # fmt: skip
            store.set("orchmllm/progress/1", json.dumps(entry))
            child.kill()
            err = me.diagnose(RuntimeError("Connection closed by peer"), stream="train",
                              elapsed_s=0.0)  # fmt: skip
            verdicts.append((err.missing, str(err).splitlines()[-1]))
        finally:
            child.kill()
            child.wait()
            me.close()
    for missing, line in verdicts:
        assert missing == [1] and line.startswith("  rank 1: dead: its process"), line
