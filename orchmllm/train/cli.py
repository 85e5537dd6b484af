"""Train the reference MLLM data-parallel with FSDP2, with or without OrchMLLM balancing.

    torchrun --nproc_per_node=4 -m orchmllm.train --config configs/tiny.yaml --balance full

``--balance none`` trains every rank on the mini-batch it sampled, ``llm`` balances only the
LLM phase (the pre-balancing ablation of the paper), ``full`` balances every phase (OrchMLLM).
The loss is normalised by the global number of target tokens, so the three give the same
gradients: rebalancing changes which rank computes an example, never the result.

Every config key is also an option, ``--section.key=value`` or ``--section.key value``
(``--train.lr=3e-4``, ``--model.llm.layers 4``, ``--model.encoders.audio=null``), read by the
key's type (:func:`orchmllm.overrides.override_value`); :data:`ALIASES` keeps the short flags
(``--steps`` is ``--train.steps``). The other options are the run's own, not the config's.

With ``--grad-accum K`` (``train.grad_accum``) an optimizer step is K micro-steps, each a
balanced step of ``data.examples_per_rank`` examples per rank, and the loss is normalised by
the target tokens of all K micro-steps on all ranks: the update equals one step over the K
micro-batches' examples. Steps, checkpoints, ``--checkpoint-every`` and the metrics count
optimizer steps.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from orchmllm import compat
from orchmllm.config import RunConfig
from orchmllm.dist import watch
from orchmllm.overrides import override_value
from orchmllm.planner.step_options import MODES
from orchmllm.train import host_memory, launch, preempt
from orchmllm.train.loop import train
from orchmllm.train.metrics import RunningSummary
from orchmllm.train.progress import PROGRESS
from orchmllm.train.run import init_distributed, run_config
from orchmllm.train.step import NONFINITE

ALIASES = {
    "--steps": "train.steps",
    "--grad-accum": "train.grad_accum",
    "--seed": "train.seed",
    "--placement": "balance.placement",
    "--cost": "balance.cost",
    "--context-parallel": "balance.context_parallel",
    "--precision": "recipe.precision",
    "--checkpointing": "recipe.checkpointing",
    "--loss-chunk": "recipe.loss_chunk",
}
"""Short flags users type, each the config key it sets (the key's docs: orchmllm/config.py)."""

EPILOG = (
    "Any config key is an option too: --section.key=value or --section.key value (e.g. "
    "--train.lr=3e-4 --model.llm.layers 4 --balance.policies.llm=greedy "
    "--model.encoders.audio=null), read by the key's type; keys and defaults: "
    "orchmllm/config.py. A key may be given once."
)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        required=True,
        help="run config YAML (keys: configs/tiny.yaml, defaults: orchmllm/config.py)",
    )
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE_OR_PATH",
        help="import a module name or a .py file before the config is read (repeatable): "
        "a user's modality, architecture, task or policy registers itself",
    )
    p.add_argument("--balance", choices=MODES, default="full")
    p.add_argument("--data-dir", default=None, help="where rank 0 stores the synthetic dataset")
    p.add_argument(
        "--prefetch", type=int, default=1, help="optimizer steps planned ahead (0: inline)"
    )
    p.add_argument(
        "--on-nonfinite",
        choices=NONFINITE,
        default="stop",
        help="a step whose loss or gradient norm is not finite (nan, inf): stop the run with "
        "an error naming the step and the ranks, before the optimizer step and before any "
        "checkpoint (stop), or skip the step's update and go on (skip; the step's metrics "
        "record says skipped)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long any collective may wait for the other ranks; a step that waits longer "
        "fails on every healthy rank, naming the ranks that did not arrive. It also bounds the "
        "uneven phases: writing the dataset on a first run, writing a checkpoint",
    )
    p.add_argument("--save", default=None, help="write the final full parameters (torch.save)")


def _add_output_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics",
        default=None,
        help="append one JSON line per step to this path as training goes (rank 0; flushed)",
    )
    p.add_argument(
        "--metrics-per-rank",
        action="store_true",
        help="also record every rank's load per phase (world_size numbers per phase and step)",
    )
    p.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="also log each step's metrics to TensorBoard in DIR (rank 0; orchmllm.train.tracking)",
    )
    p.add_argument(
        "--wandb",
        default=None,
        metavar="PROJECT",
        help="also log each step's metrics to this Weights & Biases project (rank 0; needs "
        "wandb installed)",
    )
    memory = p.add_mutually_exclusive_group()
    memory.add_argument(
        "--memory-report",
        default=None,
        metavar="PATH",
        help="write one JSON line per step, rank and phase (forward, backward, optimizer): "
        "measured_bytes (the phase's peak above the step's start: CUDA's allocator on a GPU, "
        "the profiler's allocator events on CPU) beside predicted_bytes (the memory model for "
        "that rank's batch); rank 0 writes every rank's lines",
    )
    memory.add_argument(
        "--memory-trace",
        default=None,
        metavar="PATH",
        help="write one JSON line per step: rank 0's peak CUDA memory in the forward, backward "
        "and optimizer step, and the step's batch (orchmllm.train.phase_memory; read by "
        "benchmarks/train_memory.py); with --grad-accum one line per micro-step",
    )
    p.add_argument(
        "--progress",
        choices=PROGRESS,
        default="auto",
        help="rank 0's per-step report: a tqdm bar, one line per step, or nothing (auto: a "
        "bar on a terminal, else lines)",
    )
    p.add_argument("--quiet", action="store_true", help="same as --progress off")


def _add_checkpoint_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="write sharded checkpoints here (one filesystem all nodes share); rerunning the "
        "same command resumes from the newest complete one",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="N",
        help="checkpoint every N steps (0: only after the last step); needs --checkpoint-dir",
    )
    p.add_argument(
        "--keep-last",
        type=int,
        default=0,
        metavar="N",
        help="keep only the newest N checkpoints, deleting older ones once a newer one has "
        "verified (0: keep all); needs --checkpoint-dir",
    )
    p.add_argument(
        "--preempt-grace",
        type=float,
        default=25.0,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT (a scheduler preempting the job), every rank stops after "
        "the step in progress, writes a checkpoint (with --checkpoint-dir) and exits with "
        f"status {preempt.PREEMPTED}; a job still running SECONDS after the signal is abandoned "
        "there (keep it below the scheduler's kill delay and torchrun's --shutdown-timeout)",
    )
    p.add_argument(
        "--preempt-signal",
        default=None,
        metavar="NAME",
        help="one more signal that preempts like SIGTERM, e.g. USR1 for SLURM's "
        "--signal=USR1@90 warning",
    )


def parser() -> argparse.ArgumentParser:
    """The trainer's command line: the run's own options, and :data:`ALIASES`."""
    p = argparse.ArgumentParser(
        prog="python -m orchmllm.train", description=__doc__.split("\n")[0], epilog=EPILOG
    )
    _add_run_options(p)
    _add_output_options(p)
    _add_checkpoint_options(p)
    for flag, key in ALIASES.items():
        p.add_argument(flag, dest=key, default=None, metavar=key.rsplit(".")[-1].upper(),
                       help=f"= --{key}")  # fmt: skip
    return p


def dotted_options(rest: list[str]) -> list[tuple[str, str]]:
    """``(key, text)`` of each ``--section.key=value`` or ``--section.key value`` in
    ``rest`` (what the parser did not know), in order.

    Raises:
        ValueError: anything else in ``rest``, or a key without its value.
    """
    pairs, tokens = [], iter(rest)
    for token in tokens:
        name, eq, text = token.removeprefix("--").partition("=")
        if not token.startswith("--") or "." not in name:
            raise ValueError(f"unrecognized argument {token!r}")
        if not eq:
            text = next(tokens, None)
            if text is None:
                raise ValueError(f"{token} needs a value")
        pairs.append((name, text))
    return pairs


def overrides(args: argparse.Namespace, rest: list[str]) -> dict[str, Any]:
    """The config overrides of a parsed command line: its aliases' and its dotted options'
    (``rest``), each read by its key's type. A key given twice is an error."""
    given = [(key, text) for key in ALIASES.values() if (text := vars(args)[key]) is not None]
    flags = {key: flag for flag, key in ALIASES.items()}
    out: dict[str, Any] = {}
    for key, text in [*given, *dotted_options(rest)]:
        if key in out:
            alias = f" (--{key} and {flags[key]} are the same key)" if key in flags else ""
            raise ValueError(f"config key {key!r} is given twice{alias}")
        out[key] = override_value(key, text, RunConfig)
    return out


def _check_run_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.preempt_grace > 0:
        p.error(f"--preempt-grace must be > 0 seconds, got {args.preempt_grace}")
    if not args.timeout > 0:
        p.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    for flag in ("checkpoint_every", "keep_last"):
        option, value = f"--{flag.replace('_', '-')}", vars(args)[flag]
        if value < 0:
            p.error(f"{option} must be >= 0, got {value}")
        if value and args.checkpoint_dir is None:
            p.error(f"{option} {value} needs --checkpoint-dir")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The parsed command line; ``overrides`` holds its config keys' values (see
    :func:`overrides`), ``preempt_signals`` the signals that preempt. Exits with status 2
    naming the mistake (an unknown option or config key, a value of the wrong type); a value
    out of its key's range is the config's error, when it is loaded."""
    p = parser()
    args, rest = p.parse_known_args(argv)
    try:
        args.overrides = overrides(args, rest)
    except ValueError as exc:
        p.error(str(exc))
    for key in ALIASES.values():
        delattr(args, key)
    _check_run_options(p, args)
    try:
        args.preempt_signals = [
            preempt.parse_signal(s)
            for s in (*preempt.DEFAULT_SIGNALS, *filter(None, [args.preempt_signal]))
        ]
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> RunningSummary:
    """Entry point; also callable inside an existing process group (tests). Returns the
    run's summary.

    When it created the process group (torchrun), any failure prints the error and ends
    the process at once with status 1: tearing the group down would wait on the peers that
    caused the failure. A launch mistake found before that (no launcher, a config that does
    not load or does not fit the world size: :func:`orchmllm.train.launch.preflight`) ends
    it with status 2, its fix printed once (so does a bad command line).
    """
    with launch.quiet_peers():
        args = parse_args(argv)
    if not dist.is_initialized():
        try:
            launch.preflight(args, sys.argv[1:] if argv is None else argv, run_config)
        except launch.LaunchError as exc:
            launch.exit_with(exc)
    host_memory.bound_native_caches()  # else CPU convolutions cache a kernel per shape
    created, _ = init_distributed(args.timeout)
    try:
        summary, model = train(args)
        if args.save:
            save_parameters(model, args.save)
        if dist.get_rank() == 0:
            print(summary.table(), flush=True)
    except BaseException as exc:
        if created:
            _exit_failed(exc)
        raise
    if created:
        watch.current().close()
        watch.install(None)
        dist.destroy_process_group()
    return summary


def save_parameters(model: torch.nn.Module, path: str) -> None:
    """``--save``: the full parameters, by the model's names (no activation-checkpoint
    wrapper's), in one ``torch.save`` file (collective: every rank gives its shards; rank 0
    writes)."""
    state = {n: t.full_tensor().detach().cpu() for n, t in model.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save(state, path)


def _exit_failed(exc: BaseException) -> NoReturn:
    preempted = isinstance(exc, preempt.Preempted)
    if preempted:
        print(f"{exc} (exit status {preempt.PREEMPTED})", file=sys.stderr)
    else:
        traceback.print_exception(exc)
    progress = watch.current()
    if progress is not None and not isinstance(exc, watch.StepFailed):
        with contextlib.suppress(Exception):
            progress.close("preempted" if preempted else f"failed: {type(exc).__name__}")
    compat.leave_process(preempt.PREEMPTED if preempted else 1)
