"""The trainer (``torchrun -m orchmllm.train``) and what only it uses: checkpoints, the launch
checks, preemption, metrics, trackers and reports.

Modules: :mod:`~orchmllm.train.cli` (the command line, :func:`main`), :mod:`~.run` (a run's
parts), :mod:`~.dataset` (the cached synthetic dataset), :mod:`~.step` (one optimizer step),
:mod:`~.loop` (the steps), :mod:`~.metrics` (the records), :mod:`~.resume` (checkpoints of a
run). The names below load on first use, so ``python -m orchmllm.train.report`` or
``orchmllm.train.checkpoint`` does not import the model.
"""

from orchmllm._lazy import lazy_names

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

__getattr__, __dir__ = lazy_names(__name__, _LAZY)
