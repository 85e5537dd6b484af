"""Test distributed code on one machine: run a function on several processes, with a timeout.

Public helper for users and for this project's own tests and benchmarks: a bug in a
collective (a rank that never joins, a size mismatch) fails within ``timeout`` seconds
instead of hanging CI, and each rank's traceback is reported: a failing rank's exception, and
the stacks of every thread of every rank still running when the run is stopped (a hang at
``timeout``, or the peers of a rank that failed), and of the processes those ranks started
(DataLoader workers): where a peer was stuck is what explains most distributed failures.

Example (a test module; the worker must be defined at module level, because the
processes are started with ``spawn`` and import it)::

    import torch, torch.distributed as dist
    from orchmllm.testing import run_distributed

    def _sum_of_ranks(rank, world_size):
        t = torch.tensor([rank])
        dist.all_reduce(t)
        return int(t)

    def test_all_reduce():
        assert run_distributed(_sum_of_ranks, 3, timeout=30) == [3, 3, 3]

:func:`run_distributed` calls ``fn(rank, world_size, *args)`` inside an initialised gloo
process group (or NCCL, one GPU per rank) and returns each rank's (picklable) result.
:func:`run_checks` runs several such checks in one set of processes (start-up dominates
the cost of small checks) and :func:`assert_check_passed` reports each one separately.

Fault tests start the ranks as the launcher does, one process each, and inject faults from
outside (signals, files): :func:`launcher_store` and :func:`launch_ranks` start them on an
env:// rendezvous without ``torchrun`` (whose habit of killing every worker when one fails
would hide each rank's own exit), :func:`torchrun` starts a real ``torchrun`` (restarts),
:func:`worker_ranks` finds its workers, and :func:`wait_for` polls for a condition while
checking that no rank ended early.
Processes the code under test starts (DataLoader workers) use the platform's default start
method, as under ``torchrun``, not the ``spawn`` used to start the ranks.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from orchmllm.compat import leave_process


def _worker(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    workdir: str,
    timeout: float,
    env: dict[str, str],
    backend: str,
) -> None:
    os.environ.update(env)
    # As under torchrun: the platform's default start method for processes the code under
    # test starts (DataLoader workers), not the spawn method this harness started us with.
    multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)
    # torch is already imported here, so OMP_NUM_THREADS alone would not take effect.
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    # A rank still running when the run is stopped is asked (SIGUSR1) where each of its
    # threads is (the rendezvous included); the processes it forks inherit the handler and the file.
    stacks = open(os.path.join(workdir, f"stacks_{rank}.txt"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{os.path.join(workdir, 'rendezvous')}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(workdir, f"result_{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(os.path.join(workdir, f"error_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        faulthandler.unregister(signal.SIGUSR1)
        stacks.close()
        dist.destroy_process_group()
    # Done and recorded: leave before interpreter finalisation can abort a check that passed.
    leave_process(0)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    backend: str = "gloo",
    startup_s: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes.

    Returns the per-rank return values in rank order. Raises ``RuntimeError`` with
    the failing ranks' tracebacks if any worker fails, and ``TimeoutError`` (after
    killing every worker) if they do not all finish within ``timeout`` seconds, plus
    ``startup_s`` for spawning and imports. Collectives inside the workers also use
    ``timeout``. ``backend="nccl"`` puts rank ``r`` on GPU ``r``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="orchmllm_mp_") as workdir:
        ctx = mp.start_processes(
            _worker,
            args=(fn, world_size, args, workdir, timeout, env, backend),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        # Startup (spawn + imports) is not the code under test: allow extra time for it.
        deadline = time.monotonic() + timeout + startup_s
        procs, stuck = ctx.processes, ""
        try:
            while any(p.exitcode != 0 for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs):
                    # Where the peers are stuck, asked before join() terminates them.
                    stuck = _running_stacks(procs, workdir)
                    _kill(procs)  # at once: join() would give each 30 s to stop
                    ctx.join()  # raises the failing rank's exception
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{getattr(fn, '__name__', fn)} did not finish on {world_size} "
                        f"processes within {timeout:.0f}s (+{startup_s:.0f}s start-up)"
                        + _running_stacks(procs, workdir)
                    )
                multiprocessing.connection.wait(
                    [p.sentinel for p in procs if p.exitcode is None], timeout=0.5
                )
            ctx.join()
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            errors = []
            for rank in range(world_size):
                path = os.path.join(workdir, f"error_{rank}.txt")
                if os.path.exists(path):
                    with open(path) as f:
                        errors.append(f"--- rank {rank} ---\n{f.read()}")
            report = "\n".join(errors) or str(exc)
            raise RuntimeError("worker failed:\n" + report + stuck) from None
        finally:
            _kill(procs)
        results = []
        for rank in range(world_size):
            with open(os.path.join(workdir, f"result_{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def _kill(processes: Sequence[Any]) -> None:
    """Kill every rank still running, and the processes it started (not left orphaned)."""
    for proc in processes:
        if proc.is_alive():
            children = _descendants(proc.pid)
            proc.kill()
            proc.join()
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _running_stacks(processes: Sequence[Any], workdir: str) -> str:
    """The thread stacks of every rank still running, and of each process it started, asked
    for one process at a time (SIGUSR1, see ``_worker``) so each dump can be labelled."""
    report = []
    for rank, proc in enumerate(processes):
        if not proc.is_alive() or os.path.exists(os.path.join(workdir, f"error_{rank}.txt")):
            continue  # finished, or failed and already reported
        path = os.path.join(workdir, f"stacks_{rank}.txt")
        for pid in [proc.pid, *_descendants(proc.pid)]:
            who = "its threads" if pid == proc.pid else f"its child process {pid}, its threads"
            dump = _ask_for_stacks(pid, path)
            if dump:
                report.append(f"--- rank {rank}, {who} when the run was stopped ---\n{dump}")
    return "".join(f"\n{part}" for part in report)


def _ask_for_stacks(pid: int, path: str, *, wait_s: float = 3.0) -> str:
    """Signal ``pid`` to dump its stacks into ``path`` and return what it wrote (empty if
    it wrote nothing within ``wait_s``: gone, or a process that does not dump)."""
    before = os.path.getsize(path) if os.path.exists(path) else 0
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return ""
    deadline, size = time.monotonic() + wait_s, before
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = os.path.getsize(path)
        if now > before and now == size:  # written, and no longer growing
            break
        size = now
    with open(path) as f:
        f.seek(before)
        return f.read()


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` now, read from /proc (Linux; none elsewhere)."""
    out = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rpartition(")")[2].split()[1]) == pid:
                    out.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return sorted(out)


def _descendants(pid: int) -> list[int]:
    out = []
    for child in _children(pid):
        out += [child, *_descendants(child)]
    return out


def _run_checks_worker(
    rank: int, world_size: int, checks: dict[str, Callable[[int, int], Any]]
) -> dict[str, str | None]:
    """Run every check in order; after a failure the rest are skipped (ranks may be out of step)."""
    results: dict[str, str | None] = {}
    failed = None
    for name, check in checks.items():
        if failed:
            results[name] = f"not run: {failed} failed first"
            continue
        try:
            check(rank, world_size)
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
            failed = name
    return results


def run_checks(
    checks: dict[str, Callable[[int, int], Any]], world_size: int, *, timeout: float
) -> list[dict[str, str | None]]:
    """Run ``check(rank, world_size)`` for every entry of ``checks``, in order, in one session.

    The checks must be importable (module level). Returns per rank ``{name: None}`` for a
    check that passed and ``{name: traceback or reason}`` for one that failed or was not run;
    pass it to :func:`assert_check_passed` to report one check per test.
    """
    return run_distributed(_run_checks_worker, world_size, checks, timeout=timeout)


def assert_check_passed(results: list[dict[str, str | None]], name: str) -> None:
    """Fail with every rank's traceback if check ``name`` did not pass on every rank."""
    errors = {rank: res[name] for rank, res in enumerate(results) if res[name] is not None}
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{e}" for r, e in errors.items()))


# -- launching ranks as the launcher does (fault tests) ----------------------------------------


def launcher_store() -> dist.TCPStore:
    """A key-value store as ``torchrun``'s agent holds one (one per launch): the ranks of
    :func:`launch_ranks` meet on it (``port``)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def launch_ranks(
    argv: Sequence[str],
    world_size: int,
    *,
    port: int,
    logdir: Path,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> list[subprocess.Popen]:
    """``python *argv`` on ``world_size`` local processes as ``torchrun`` starts its workers
    (env:// rendezvous on the store at ``port``, the agent's store), without torchrun's
    habit of killing every worker when the first one fails: each rank's own exit is
    observed. Rank r's stdout and stderr go to ``logdir/out{r}`` and ``logdir/err{r}``."""
    logdir.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world_size):
        rank_env = {
            **(env if env is not None else os.environ), "OMP_NUM_THREADS": "1",
            "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
        }  # fmt: skip
        with open(logdir / f"out{rank}", "w") as out, open(logdir / f"err{rank}", "w") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, *argv], cwd=cwd, env=rank_env, stdout=out, stderr=err
                )
            )
    return procs


def torchrun(
    argv: Sequence[str],
    nproc: int,
    *,
    log: Path,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> subprocess.Popen:
    """``torchrun --standalone --nproc_per_node=nproc --max-restarts=max_restarts *argv``
    (stdout and stderr, every worker's included, to ``log``)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}", "--monitor-interval=0.2",
        *argv,
    ]  # fmt: skip
    with open(log, "w") as out:
        return subprocess.Popen(
            cmd, cwd=cwd, env={**(env if env is not None else os.environ), "OMP_NUM_THREADS": "1"},
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


def worker_ranks(parent: int) -> dict[int, int]:
    """The worker processes a launcher (``torchrun``'s agent, pid ``parent``) runs now, as
    {RANK: pid}, read from /proc (Linux)."""
    out = {}
    for pid in _children(parent):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env:
            out[int(env[b"RANK"])] = pid
    return out


def wait_for(
    predicate: Callable[[], bool], *, timeout: float, procs: Sequence[subprocess.Popen] = ()
) -> None:
    """Poll ``predicate`` every 10 ms until it holds; fail (AssertionError) after ``timeout``
    seconds or as soon as one of ``procs`` ended."""
    deadline = time.monotonic() + timeout
    while not predicate():
        dead = [p.args for p in procs if p.poll() is not None]
        assert not dead, f"a process ended early: {dead}"
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting"
        time.sleep(0.01)


def stop_all(procs: Sequence[subprocess.Popen]) -> None:
    """Kill and reap every process of ``procs`` that still runs (also stopped ones)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.wait()
