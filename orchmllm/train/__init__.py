"""The trainer (``torchrun -m orchmllm.train``) and what only it uses: checkpoints, the launch
checks, preemption, metrics, trackers and reports.

Modules: :mod:`~orchmllm.train.cli` (the command line, :func:`main`), :mod:`~.run` (a run's
parts), :mod:`~.dataset` (the cached synthetic dataset), :mod:`~.step` (one optimizer step),
:mod:`~.loop` (the steps), :mod:`~.metrics` (the records), :mod:`~.resume` (checkpoints of a
run). The names below load on first use, so ``python -m orchmllm.train.report`` or
``orchmllm.train.checkpoint`` does not import the model.
"""

from importlib import import_module
from typing import Any

_LAZY = {  # name -> the module of orchmllm.train that defines it, imported on first use
    "main": "cli",
    "parse_args": "cli",
    "run_config": "run",
    "setup": "run",
    "Run": "run",
    "train": "loop",
    "forward_backward": "step",
    "NonFiniteStep": "step",
    "RunningSummary": "metrics",
    "phase_record": "metrics",
    "dataset_location": "dataset",
    "write_once": "dataset",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"orchmllm.train.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'orchmllm.train' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
