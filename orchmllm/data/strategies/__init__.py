"""How the ranks exchange a step: one strategy per exchange mode of the balanced loader.

- ``"index"`` (:class:`~orchmllm.data.strategies.index.IndexExchange`): lengths known before
  loading; the ranks exchange dataset indices and lengths only, and each loads its balanced
  share.
- ``"move"`` (:class:`~orchmllm.data.strategies.move.MoveExchange`): each rank loads what it
  sampled; the examples then move to their destination ranks as bytes.
- ``"local"`` (:class:`~orchmllm.data.strategies.local.LocalExchange`): nothing moves; the
  batch as sampled is yielded with its plan (for the dispatcher or the orchestrator, which
  move data on the device).

Each implements :class:`~orchmllm.data.strategies.base.ExchangeStrategy` over a shared
:class:`~orchmllm.data.strategies.base.Setup`; the loader picks one in
:func:`strategy_for`, once, when it is built.
"""

from __future__ import annotations

from orchmllm.data.strategies.base import EpochState, ExchangeStrategy, Setup, Step
from orchmllm.data.strategies.index import IndexExchange
from orchmllm.data.strategies.local import LocalExchange, PlannedBatch
from orchmllm.data.strategies.move import MoveExchange

__all__ = [
    "STRATEGIES",
    "EpochState",
    "ExchangeStrategy",
    "IndexExchange",
    "LocalExchange",
    "MoveExchange",
    "PlannedBatch",
    "Setup",
    "Step",
    "strategy_for",
]

STRATEGIES: dict[str, type[ExchangeStrategy]] = {
    s.mode: s for s in (IndexExchange, MoveExchange, LocalExchange)
}


def strategy_for(mode: str) -> type[ExchangeStrategy]:
    """The strategy of a resolved exchange mode (``"auto"`` is resolved by the loader).

    Args:
        mode: ``"index"``, ``"move"`` or ``"local"``.

    Returns:
        The strategy's class (built with the loader's :class:`Setup`).

    Raises:
        ValueError: another mode.
    """
    if mode not in STRATEGIES:
        raise ValueError(f"mode must be one of {tuple(STRATEGIES)}, got {mode!r}")
    return STRATEGIES[mode]
