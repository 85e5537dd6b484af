"""The prefetch thread: same results as synchronous, errors surface, close is deterministic."""

import gc
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from orchmllm.data.prefetch import Prefetcher


def _squares(stop):
    def produce(step):
        if step >= stop:
            raise StopIteration
        return step * step

    return produce


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_same_items_as_synchronous(depth):
    assert list(Prefetcher(_squares(10), start=2, depth=depth)) == [s * s for s in range(2, 10)]


def test_runs_ahead_while_loop_works():
    started = []

    def produce(step):
        started.append(step)
        return step

    p = Prefetcher(produce, depth=3)
    assert next(p) == 0
    time.sleep(0.2)  # the "training step"
    assert started == [0, 1, 2, 3, 4]  # 3 queued + 1 blocked on put
    p.close()


def test_error_surfaces_in_loop_after_good_items():
    def produce(step):
        if step == 3:
            raise ValueError("bad example at step 3")
        return step

    p = Prefetcher(produce, depth=2)
    assert [next(p) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="step 3"):
        next(p)
    with pytest.raises(StopIteration):
        next(p)
    p.close()


@pytest.mark.parametrize("consumed", [0, 2, 5])
def test_close_runs_exactly_the_steps_it_may_have_started(consumed):
    started = []

    def produce(step):
        time.sleep(0.002 * (step % 3))  # uneven producer timing must not matter
        started.append(step)
        return step

    p = Prefetcher(produce, start=4, depth=2)
    for _ in range(consumed):
        next(p)
    p.close()
    assert started == list(range(4, 4 + consumed + 2 + 1))
    with pytest.raises(StopIteration):
        next(p)


def test_abandoned_prefetcher_stops_its_thread():
    before = threading.active_count()
    p = Prefetcher(lambda step: step, depth=2, name="abandoned")
    next(p)
    del p
    gc.collect()
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before


def test_negative_depth():
    with pytest.raises(ValueError, match="depth"):
        Prefetcher(lambda s: s, depth=-1)


@pytest.mark.parametrize("depth", [0, 2])
def test_on_close_runs_once_at_the_first_step_no_loop_may_have_started(depth):
    """Where the loop stopped is told at a step every rank that stopped there reaches
    (threaded: consumed + depth + 1; synchronous: consumed), once, also when dropped."""
    calls = []
    p = Prefetcher(lambda s: s, start=3, depth=depth, on_close=lambda *args: calls.append(args))
    assert [next(p), next(p)] == [3, 4]
    p.close()
    p.close()
    first = 5 + depth + 1 if depth else 5
    assert calls == [(first, 5)]
    dropped = Prefetcher(lambda s: s, depth=depth, on_close=lambda *args: calls.append(args))
    next(dropped)
    del dropped
    gc.collect()
    assert calls[1:] == [(1 + depth + 1 if depth else 1, 1)]


@pytest.mark.parametrize("depth", [0, 1])
def test_on_close_is_skipped_at_the_end_and_its_error_surfaces_in_close(depth):
    calls = []
    p = Prefetcher(_squares(3), depth=depth, on_close=lambda *args: calls.append(args))
    assert list(p) == [0, 1, 4]
    p.close()
    assert calls == []  # the producer ended by itself: nothing to tell

    def fail(step, consumed):
        raise RuntimeError(f"loop left after {consumed}")

    p = Prefetcher(lambda s: s, depth=depth, on_close=fail)
    next(p)
    with pytest.raises(RuntimeError, match="loop left after 1"):
        p.close()


# A prefetcher still running when the interpreter shuts down, collected only when its holder's
# module is cleared: there, after the module's own ``os`` is gone (the order in which a script
# that ends on an exception drops a loader it kept).
_AT_SHUTDOWN = textwrap.dedent(
    """
    import time
    import orchmllm.data.prefetch as pf
    pf.zz_kept = pf.Prefetcher(lambda step: time.sleep(0.01) or step, depth=1)
    next(pf.zz_kept)
    raise RuntimeError("the user's error")
    """
)


@pytest.mark.integration
def test_a_prefetcher_collected_at_interpreter_shutdown_prints_only_the_real_error(repo_env):
    proc = subprocess.run(
        [sys.executable, "-c", _AT_SHUTDOWN],
        env=repo_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "RuntimeError: the user's error" in proc.stderr
    assert "Exception ignored" not in proc.stderr and "getpid" not in proc.stderr, proc.stderr
