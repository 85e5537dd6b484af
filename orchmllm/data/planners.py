"""Planners: gathered per-item metadata -> plan.

The loader calls a planner in its background thread on the metadata every rank gathered
(see :data:`orchmllm.data.exchange.Planner`). Single-phase balancing returns a
:class:`~orchmllm.planner.plan.Rearrangement` the loader executes itself; any other planner
(e.g. the multimodal orchestrator's per-phase plans) is handed to the training loop.

Most plans are a pure function of the gathered metadata, so every rank computes the same
plan itself. A plan that is not (see :func:`plan_is_deterministic`) is computed on one rank
and broadcast by :func:`orchmllm.data.exchange.agreed_plan`; a planner says which it is
with its ``deterministic`` attribute.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from orchmllm.planner.balance import balance, plan_is_deterministic
from orchmllm.planner.plan import Rearrangement
from orchmllm.planner.policies import PADDED_POLICIES

LAYOUTS = ("padded", "packed")
# Collate classes whose batch layout is known, by (module, class); matched by name so that
# transformers stays an optional dependency.
_HF_COLLATORS = "transformers.data.data_collator"
KNOWN_COLLATE_LAYOUTS = {
    (_HF_COLLATORS, "DataCollatorWithPadding"): "padded",
    (_HF_COLLATORS, "DataCollatorForLanguageModeling"): "padded",
    (_HF_COLLATORS, "DataCollatorForSeq2Seq"): "padded",
    (_HF_COLLATORS, "DataCollatorForTokenClassification"): "padded",
    (_HF_COLLATORS, "DataCollatorWithFlattening"): "packed",
}


class LayoutMismatchWarning(UserWarning):
    """The collate function pads its batches and the policy balances packed ones, or the
    reverse: the plan then balances a cost the step does not pay."""


@dataclass(frozen=True)
class BalancePlanner:
    """Single-phase plan: ``orchmllm.balance`` on column 0 of the metadata (the length).

    The loader's default planner (``BalancePlanner(policy, cost)``); build one yourself to
    pass ``ranks_per_node`` or ``placement``. Called as ``planner(meta, src, num_ranks)``
    (:data:`~orchmllm.data.exchange.Planner`), it returns a
    :class:`~orchmllm.planner.plan.Rearrangement`; arguments are checked by :func:`orchmllm.balance`
    when it plans.

    Attributes:
        policy: the balancing policy, a name in ``orchmllm.POLICIES``.
        cost: an ``orchmllm.planner.cost.CostModel``, or None for the policy's default.
        ranks_per_node: ranks per node, for ``greedy_stay`` and ``placement``.
        placement: ``none``, or how batches are permuted over ranks to keep traffic inside
            nodes (``orchmllm.planner.placement``).
    """

    policy: str = "greedy"
    cost: Any = None
    ranks_per_node: int | None = None
    placement: str = "none"

    @property
    def deterministic(self) -> bool:
        """Whether every rank computes the same plan itself (False: rank 0 plans for all)."""
        return plan_is_deterministic(placement=self.placement, policies=(self.policy,))

    def __call__(self, meta: np.ndarray, src: np.ndarray, num_ranks: int) -> Rearrangement:
        meta = np.asarray(meta, dtype=np.int64)
        src = np.asarray(src, dtype=np.int64)
        if meta.shape[0] == 0:
            return Rearrangement.from_assignment(src, src, num_ranks=num_ranks)
        result = balance(
            meta[:, 0],
            num_ranks,
            self.policy,
            src=src,
            cost=self.cost,
            ranks_per_node=self.ranks_per_node,
            placement=self.placement,
        )
        return Rearrangement.from_assignment(src, result.dst, num_ranks=num_ranks)


@dataclass(frozen=True)
class WithinBudget:
    """A planner whose plans keep every rank within ``max_tokens`` (column 0 of the
    metadata): a plan that would not is replaced by the sampled layout, which is.

    Attributes:
        planner: the planner whose plans are kept when within the budget.
        max_tokens: the budget of every rank, in length units.
    """

    planner: Callable[[np.ndarray, np.ndarray, int], Any]
    max_tokens: int

    @property
    def deterministic(self) -> bool:
        """Whether every rank computes the same plan itself (as the wrapped planner)."""
        return getattr(self.planner, "deterministic", True)

    def __call__(self, meta: np.ndarray, src: np.ndarray, num_ranks: int) -> Rearrangement:
        plan = self.planner(meta, src, num_ranks)
        if not isinstance(plan, Rearrangement):
            raise ValueError(
                f"max_tokens_per_rank needs a planner returning a Rearrangement, got "
                f"{type(plan).__name__}"
            )
        loads = np.bincount(plan.dst_rank, weights=meta[:, 0], minlength=num_ranks)
        if loads.size and loads.max() > self.max_tokens:
            return Rearrangement.from_assignment(src, src, num_ranks=num_ranks)
        return plan


def collate_layout(collate_fn: Callable[[list], Any]) -> str | None:
    """``"padded"``, ``"packed"`` or None (cannot tell) for a collate function.

    A collate function declares its layout with an ``orchmllm_layout`` attribute (e.g.
    ``my_collate.orchmllm_layout = "padded"``); Hugging Face's collators are known by class
    (``KNOWN_COLLATE_LAYOUTS``). Anything else is not guessed: a batch's tensors alone do not
    say whether the zeros in them are padding.

    Args:
        collate_fn: the collate function (or collator object) that builds the batches.

    Returns:
        ``"padded"``, ``"packed"``, or None when the layout is not known.

    Raises:
        ValueError: ``collate_fn.orchmllm_layout`` is not one of :data:`LAYOUTS`.
    """
    declared = getattr(collate_fn, "orchmllm_layout", None)
    if declared is not None:
        if declared not in LAYOUTS:
            raise ValueError(
                f"collate_fn.orchmllm_layout must be one of {LAYOUTS}, got {declared!r}"
            )
        return declared
    kind = type(collate_fn)
    return KNOWN_COLLATE_LAYOUTS.get((kind.__module__, kind.__qualname__))


def warn_on_layout_mismatch(collate_fn: Callable[[list], Any], planner: Any) -> None:
    """Warn (:class:`LayoutMismatchWarning`) when a :class:`BalancePlanner`'s policy assumes
    the other batch layout than ``collate_fn`` makes. Python shows each such warning once per
    process; a custom planner is trusted to know its cost."""
    layout = collate_layout(collate_fn)
    if layout is None or not isinstance(planner, BalancePlanner):
        return
    if layout == "padded" and planner.policy not in PADDED_POLICIES:
        advice = (
            f"a padded batch costs count x its longest example, which policy="
            f"{planner.policy!r} does not balance: use policy='padded_cost' (or "
            f"'binary_search')"
        )
    elif layout == "packed" and planner.policy in PADDED_POLICIES:
        advice = (
            f"a packed batch costs the sum of its lengths, which policy={planner.policy!r} "
            f"(a padded policy) does not balance: use policy='greedy'"
        )
    else:
        return
    warnings.warn(
        f"collate_fn {collate_fn!r} makes {layout} batches; {advice}",
        LayoutMismatchWarning,
        stacklevel=3,
    )
