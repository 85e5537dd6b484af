"""Test distributed code on one machine: run a function on several processes, with a timeout.

Public helper for users and for this project's own tests and benchmarks: a bug in a
collective (a rank that never joins, a size mismatch) fails within ``timeout`` seconds
instead of hanging CI, and each rank's traceback is reported.

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
Processes the code under test starts (DataLoader workers) use the platform's default start
method, as under ``torchrun``, not the ``spawn`` used to start the ranks.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
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
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{getattr(fn, '__name__', fn)} did not finish on {world_size} "
                        f"processes within {timeout:.0f}s (+{startup_s:.0f}s start-up)"
                    )
        except mp.ProcessRaisedException as exc:
            errors = []
            for rank in range(world_size):
                path = os.path.join(workdir, f"error_{rank}.txt")
                if os.path.exists(path):
                    with open(path) as f:
                        errors.append(f"--- rank {rank} ---\n{f.read()}")
            raise RuntimeError("worker failed:\n" + ("\n".join(errors) or str(exc))) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        results = []
        for rank in range(world_size):
            with open(os.path.join(workdir, f"result_{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


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
