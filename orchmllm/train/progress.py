"""Per-step progress on rank 0: a tqdm bar on a terminal, one line per step in logs.

Every rank of a data-parallel job runs the same loop, so only rank 0 reports; the others
stay silent whatever the mode. ``auto`` draws a bar when rank 0's stderr is a terminal and
prints one line per step otherwise (a log file or a pipe keeps one readable line per step
instead of a bar redrawn with carriage returns).
"""

from __future__ import annotations

import sys
from typing import IO, Any

from tqdm import tqdm

PROGRESS = ("auto", "bar", "lines", "off")


class StepProgress:
    """Reports each step of a training loop on rank 0 (see the module docstring).

    Args:
        total: Steps in the run (the bar's total).
        initial: Steps already done (a resumed run).
        rank: This process's rank; every rank but 0 reports nothing.
        mode: One of ``PROGRESS``.
        stream: Where the bar or the lines go (default: the bar to stderr, lines to stdout).

    Raises:
        ValueError: ``mode`` is not one of ``PROGRESS``.
    """

    def __init__(
        self,
        *,
        total: int,
        initial: int = 0,
        rank: int,
        mode: str = "auto",
        stream: IO[str] | None = None,
    ) -> None:
        if mode not in PROGRESS:
            raise ValueError(f"progress mode must be one of {PROGRESS}, got {mode!r}")
        if rank != 0:
            mode = "off"
        elif mode == "auto":
            mode = "bar" if (stream or sys.stderr).isatty() else "lines"
        self.mode = mode
        self._stream = stream
        self._bar = None
        if mode == "bar":
            self._bar = tqdm(
                total=total, initial=initial, unit="step", file=stream or sys.stderr, leave=True
            )

    def step(self, line: str, **postfix: Any) -> None:
        """One step done: ``line`` in ``lines`` mode, ``postfix`` beside the bar."""
        if self.mode == "lines":
            print(line, file=self._stream or sys.stdout, flush=True)
        elif self._bar is not None:
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> StepProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
