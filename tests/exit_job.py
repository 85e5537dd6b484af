"""A finished job, run many times: how often does a process that simply ends exit 0?

    python -m tests.exit_job --runs 30                 # with the library's exit hook
    python -m tests.exit_job --runs 30 --without-hook  # the hook unregistered: the old failure

Each run is a pair of processes forked from this one (torch and the library are imported
once, so a run costs a rendezvous, not an interpreter start): every rank opens a gloo group,
builds a ``BalancedDataLoader`` with a DataLoader worker, runs one epoch to its end and breaks
out of the next after two steps, keeping the loader and the iterator alive in module globals
as a script's top level would, and then ends by returning: the interpreter finalises as after
any script (no ``os._exit``, no call of ours). Prints one JSON line: the exit codes counted
over all processes (-6: SIGABRT) and the seconds taken.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import orchmllm
from orchmllm.dist import topology

WORLD = 2
KEEP: list = []  # what a script's top level holds when it ends


def job(rank: int, rendezvous: str) -> None:
    """One rank of the finished job; returns with its objects still alive."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    gen = torch.Generator().manual_seed(0)
    data = [{"x": torch.arange(int(n))} for n in torch.randint(1, 64, (48,), generator=gen)]
    loader = orchmllm.BalancedDataLoader(
        data,
        batch_size=4,
        lengths=[len(e["x"]) for e in data],
        collate_fn=list,
        options=orchmllm.LoaderOptions(num_workers=1, prefetch=2),
        topology=orchmllm.Topology.build(timeout=60),
    )
    for _ in loader:  # one whole epoch
        pass
    loader.set_epoch(1)
    it = iter(loader)
    for _ in range(2):  # then leave the next one early, as a run with max_steps does
        next(it)
    KEEP.extend([loader, it])


def run_once(index: int, workdir: str, deadline_s: float) -> list[tuple[int, float]]:
    """Fork the ranks of one run; each one's exit code (negative: the signal that ended it)
    and the seconds it ran."""
    rendezvous = f"file://{os.path.join(workdir, f'rendezvous_{index}')}"
    pids, start = [], time.monotonic()
    for rank in range(WORLD):
        pid = os.fork()
        if pid == 0:
            # An error propagates to the top like a script's; so does the exit after success,
            # and the child finalises like a script's end.
            job(rank, rendezvous)
            sys.exit(0)
        pids.append(pid)
    ended = {}
    while len(ended) < len(pids):
        for pid in pids:
            if pid in ended:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                ended[pid] = (os.waitstatus_to_exitcode(status), time.monotonic() - start)
            elif time.monotonic() > start + deadline_s:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                ended[pid] = (124, deadline_s)  # hung
        time.sleep(0.01)
    return [ended[pid] for pid in pids]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--deadline", type=float, default=60.0, help="seconds one run may take")
    p.add_argument("--without-hook", action="store_true", help="unregister the exit hook")
    args = p.parse_args(argv)
    if args.without_hook:
        atexit.unregister(topology._close_live_topologies)
    counts: collections.Counter[int] = collections.Counter()
    slowest = 0.0
    t0 = time.perf_counter()
    # No context manager or finally on the children's way out: they unwind through here.
    workdir = tempfile.mkdtemp(prefix="orchmllm_exit_")
    for i in range(args.runs):
        ended = run_once(i, workdir, args.deadline)
        counts.update(code for code, _ in ended)
        slowest = max([slowest] + [seconds for _, seconds in ended])
    shutil.rmtree(workdir)
    result = {
        "runs": args.runs,
        "processes": args.runs * WORLD,
        "exit_codes": {str(k): v for k, v in sorted(counts.items())},
        "hook": not args.without_hook,
        "slowest_run_seconds": round(slowest, 1),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
