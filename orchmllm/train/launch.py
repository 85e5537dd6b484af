"""The trainer's launch checks: what can be wrong before any process group exists, said once.

Under ``torchrun`` every worker runs the same command, so a config typo, a missing config
file or a process count the config cannot split fails on every rank at once; raised as
plain exceptions, each rank prints its traceback, ``torchrun`` adds its own, and the cause
sits among a few hundred lines. The trainer checks these first (:func:`preflight`) and ends
with :func:`exit_with`: one block, naming the fix, from the first rank of each node, and
nothing from the others.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import NoReturn

from orchmllm.config import RunConfig
from orchmllm.train.tracking import missing_packages

LAUNCH_ERROR_EXIT = 2  # a usage error, as argparse's
PEER_GRACE_S = 60.0  # how long a rank that is not the node's first waits before it speaks (its
# first rank may start much later on a loaded machine; torchrun ends the others when one fails)


class LaunchError(ValueError):
    """A mistake in how the trainer was started or configured; the message names the fix."""


def under_launcher(env: Mapping[str, str] | None = None) -> bool:
    """Whether a launcher (``torchrun``) started this process: it sets ``RANK`` and
    ``WORLD_SIZE``."""
    env = os.environ if env is None else env
    return "RANK" in env and "WORLD_SIZE" in env


def not_launched(argv: Sequence[str]) -> LaunchError:
    """The error of a trainer started by ``python -m orchmllm.train``: the command to use."""
    args = shlex.join(argv)
    return LaunchError(
        "orchmllm.train runs under torchrun, which starts one process per rank and tells each "
        "its RANK and WORLD_SIZE:\n"
        f"  torchrun --nproc_per_node=N -m orchmllm.train {args}\n"
        f"  torchrun --nproc_per_node=1 -m orchmllm.train {args}    # a single process"
    )


def check_ranks_per_node(rpn: int, world_size: int, *, configured: bool) -> None:
    """Raise a :class:`LaunchError` naming both fixes when ``rpn`` ranks per node does not
    divide ``world_size``: a process count that ``rpn`` divides, or a ``ranks_per_node`` that
    divides the world size (``configured``: the value is the config's, else the launcher's
    ``LOCAL_WORLD_SIZE``)."""
    if world_size % rpn == 0:
        return
    counts = [rpn * k for k in range(1, 4)]
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    source = (
        f"balance.ranks_per_node: {rpn} (the config)"
        if configured
        else f"{rpn} ranks per node (the launcher's LOCAL_WORLD_SIZE)"
    )
    raise LaunchError(
        f"{source} does not divide the world size {world_size} (nodes x --nproc_per_node); "
        f"either launch a multiple of {rpn} processes (--nproc_per_node={counts[0]} or "
        f"{counts[1]} on one node), or set balance.ranks_per_node in the config to a divisor "
        f"of {world_size} ({', '.join(map(str, divisors))}) or null (LOCAL_WORLD_SIZE, the "
        "ranks torchrun starts per node)"
    )


def preflight(
    args: argparse.Namespace,
    argv: Sequence[str],
    load: Callable[[argparse.Namespace], RunConfig],
) -> RunConfig:
    """The checks a launch gets before it joins the process group: started by a launcher,
    the trackers asked for are installed, the config loads (``load(args)``), and its ranks
    per node divide the world size.

    Args:
        args: the parsed command line.
        argv: the command line's arguments, for the command a mistaken start should run.
        load: ``args -> RunConfig`` (the trainer's config with its overrides).

    Returns:
        The run's config.

    Raises:
        LaunchError: a mistake, with its fix.
    """
    if not under_launcher():
        raise not_launched(argv)
    if missing := missing_packages(vars(args)):
        raise LaunchError(
            f"{' and '.join(f'--{p}' for p in missing)} needs the {', '.join(missing)} "
            f"package: pip install {' '.join(missing)}"
        )
    try:
        cfg = load(args)
    except (ValueError, OSError) as exc:
        raise LaunchError(str(exc)) from exc
    world = int(os.environ["WORLD_SIZE"])
    configured = cfg.balance.ranks_per_node is not None
    rpn = cfg.balance.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    check_ranks_per_node(min(rpn, world), world, configured=configured)
    return cfg


@contextlib.contextmanager
def quiet_peers(env: Mapping[str, str] | None = None) -> Iterator[None]:
    """Inside it (the command line's parsing), a rank that is not its node's first holds its
    output: argparse's usage error then prints once per node, as :func:`exit_with` does (a
    held error shows only if the rank still runs :data:`PEER_GRACE_S` later; ``--help``'s
    text not at all)."""
    env = os.environ if env is None else env
    if not under_launcher(env) or env.get("LOCAL_RANK", "0") == "0":
        yield
        return
    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held), contextlib.redirect_stderr(held):
            yield
    except SystemExit as exc:
        if exc.code:
            time.sleep(PEER_GRACE_S)
            sys.stderr.write(held.getvalue())
        raise


def exit_with(error: LaunchError, *, env: Mapping[str, str] | None = None) -> NoReturn:
    """End this process with status 2, the error printed once per node: the node's first
    rank (``LOCAL_RANK`` 0, or a process no launcher started) prints it at once; any other
    rank waits :data:`PEER_GRACE_S` first, so ``torchrun``, which ends the other workers as
    soon as one fails, stops it before it repeats the message, and prints only if it is still
    running then (its first rank did not fail alike: a file missing on one node only)."""
    env = os.environ if env is None else env
    if env.get("LOCAL_RANK", "0") != "0":
        time.sleep(PEER_GRACE_S)
    rank = f" (rank {env['RANK']})" if "RANK" in env else ""
    print(f"orchmllm.train: cannot start{rank}:\n{error}", file=sys.stderr, flush=True)
    sys.exit(LAUNCH_ERROR_EXIT)
