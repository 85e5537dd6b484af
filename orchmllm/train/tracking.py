"""The trainer's step records in experiment trackers: TensorBoard (``--tensorboard DIR``) and
Weights & Biases (``--wandb PROJECT``, when ``wandb`` is installed); rank 0 writes.

Each step's record (the ``--metrics`` line) becomes scalars under the step's index:
``loss``, ``grad_norm``, ``step_time_s`` and ``tokens_per_s`` (measured), ``plan_s`` and
``prep_s`` (the step's planning and batch preparation, done ahead in the loader's thread),
memory (``rss_*_mb``: rank 0's and the largest rank's resident MB), and per phase
``<phase>/imbalance_before`` and ``_after`` (max/mean cost over ranks), ``<phase>/load_max_*``
(the slowest rank's cost in the phase's cost units: what the step waits for; under padding
max/mean can rise while it falls), ``<phase>/bytes_intra`` and ``_inter`` (moved inside and
across nodes) and ``<phase>/plan_ms``. A phase's planned cost is in length units (tokens,
patches, frames), not seconds, so its time is the measured step's only.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # option -> the package it needs
PHASE_SCALARS = (
    "imbalance_before", "imbalance_after", "load_max_before", "load_max_after",
    "bytes_intra", "bytes_inter", "plan_ms",
)  # fmt: skip
STEP_SCALARS = (
    "loss", "grad_norm", "step_time_s", "tokens_per_s", "plan_s", "prep_s",
    "rss_anon_mb", "rss_anon_mb_max", "rss_file_mb", "rss_file_mb_max",
)  # fmt: skip


def missing_packages(options: Mapping[str, Any]) -> list[str]:
    """The tracker packages that the options ask for and this Python lacks: a launch checks
    them before any work (``pip install`` each)."""
    return [
        package
        for option, package in PACKAGES.items()
        if options.get(option) and importlib.util.find_spec(package) is None
    ]


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """A step record's trackable numbers, ``<phase>/<metric>`` for the per-phase ones.

    Args:
        record: one step's record, as ``--metrics`` writes it.

    Returns:
        Name -> value, for the keys the record has.
    """
    out = {k: float(record[k]) for k in STEP_SCALARS if k in record}
    for phase, stats in record["phases"].items():
        out.update({f"{phase}/{k}": float(stats[k]) for k in PHASE_SCALARS if k in stats})
    return out


class Trackers:
    """The trackers of one run; :meth:`log` each step's record, :meth:`close` at the end.

    Args:
        tensorboard: a TensorBoard log directory (None: none). A resumed run starting at
            step ``start`` drops the events it logged from ``start`` on before it logs them
            anew, so a curve has each step once.
        wandb: a W&B project (None: none); the run is named by W&B and its config is
            ``config``.
        config: the run's settings, for W&B's run config.
        start: the first step this process runs.
    """

    def __init__(
        self,
        *,
        tensorboard: str | None = None,
        wandb: str | None = None,
        config: Mapping[str, Any] | None = None,
        start: int = 0,
    ) -> None:
        # optional packages, imported only when asked for (missing_packages checks first)
        self.writer = self.run = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(tensorboard, purge_step=start or None)
        if wandb:
            import wandb as wandb_module

            self.run = wandb_module.init(project=wandb, config=dict(config or {}))

    def log(self, record: Mapping[str, Any]) -> None:
        """Write one step's scalars (flushed: a crash keeps the steps before it)."""
        values, step = scalars(record), int(record["step"])
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)
            self.writer.flush()
        if self.run is not None:
            self.run.log(values, step=step)

    def close(self) -> None:
        """Flush and close every tracker."""
        if self.writer is not None:
            self.writer.close()
        if self.run is not None:
            self.run.finish()
