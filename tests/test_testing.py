"""The multi-process helper itself: results come back per rank, failures and hangs surface."""

import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist

from orchmllm.testing import run_distributed

pytestmark = pytest.mark.integration  # every test here starts processes


def _all_reduce_rank(rank: int, world_size: int, offset: int) -> int:
    t = torch.tensor([rank + offset])
    dist.all_reduce(t)
    return int(t.item())


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()


def _hang(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.barrier()  # rank 1 never joins


def _stuck_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(120)  # stuck outside any collective: only the harness's deadline ends it


def _child_waits_forever(started) -> None:
    started.set()
    time.sleep(120)


def _fail_while_rank_one_waits_on_a_child(rank: int, world_size: int) -> None:
    """Rank 1 waits on a forked child (as a loader waits on its DataLoader worker) that
    never finishes; rank 0 fails once the child runs."""
    ctx = multiprocessing.get_context("fork")
    started = ctx.Event()
    if rank == 1:
        child = ctx.Process(target=_child_waits_forever, args=(started,))
        child.start()
        started.wait()
        dist.barrier()
        child.join()
    else:
        dist.barrier()
        raise ValueError("boom on rank 0")


def test_results_per_rank():
    out = run_distributed(_all_reduce_rank, 3, 10, timeout=30)
    assert out == [33, 33, 33]


def test_worker_error_surfaces_with_traceback():
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        run_distributed(_fail_on_rank_one, 2, timeout=20)


def test_hang_fails_within_timeout():
    with pytest.raises((TimeoutError, RuntimeError)):
        run_distributed(_hang, 2, timeout=5)


def test_a_hung_rank_is_reported_with_its_stack():
    with pytest.raises(TimeoutError) as info:
        run_distributed(_stuck_on_rank_one, 2, timeout=3, startup_s=15)
    report = str(info.value)
    assert "rank 1, its threads when the run was stopped" in report
    assert "_stuck_on_rank_one" in report
    assert "rank 0, its threads" not in report  # rank 0 finished: nothing to report


def test_when_a_rank_fails_its_stuck_peers_and_their_children_are_reported():
    with pytest.raises(RuntimeError) as info:
        run_distributed(_fail_while_rank_one_waits_on_a_child, 2, timeout=20)
    report = str(info.value)
    assert "boom on rank 0" in report  # the failure itself
    peer = report.split("--- rank 1, its threads when the run was stopped ---")[1]
    assert "in join" in peer.split("--- rank 1, its child")[0]  # where the peer waits
    child = report.split("--- rank 1, its child process")[1]
    assert "_child_waits_forever" in child  # and where its child is
