"""How a step is planned: the encoder phases, the mode, the LLM policy, the placement.

:class:`StepOptions` is everything :func:`~orchmllm.planner.step_plan.plan_step` needs besides
the gathered rows: one :class:`EncoderPhase` per encoder (its segment kind, the divisor and
stride from raw rows to tokens, its policy and cost), the LLM phase's policy and cost, and the
node placement. :func:`default_phases` builds the phases from the modality table.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, replace

from orchmllm.planner.balance import PLACEMENTS, plan_is_deterministic
from orchmllm.planner.context_parallel import SPLIT_POLICIES
from orchmllm.planner.cost import CostModel
from orchmllm.planner.policies import POLICIES
from orchmllm.schema import LLM, MODALITIES, TEXT, EncodingRates, is_integer

__all__ = ["ITEM_DTYPES", "MODES", "EncoderPhase", "ItemField", "StepOptions", "default_phases"]

MODES = ("none", "llm", "full")
ITEM_DTYPES = ("int64", "float64")


@dataclass(frozen=True)
class ItemField:
    """One field of the small per-item record an encoder phase's items carry to its encoder.

    The record travels with its item to the encoder layout (``Orchestrator.run`` moves it with
    the raw rows and passes it to the encoder), so what an encoder needs besides the rows (an
    image's patch grid, a video's seconds per frame, a clip's sample rate) never becomes
    padding columns on the rows. The plan does not read it.

    Attributes:
        name: the field's key in an example's ``item_meta[phase]`` and in the encoder's
            ``meta`` argument.
        width: numbers per item (an image grid ``(t, h, w)``: 3).
        dtype: ``"int64"`` or ``"float64"``.

    Raises:
        ValueError: an empty name, a width that is not an integer >= 1, or another dtype.
    """

    name: str
    width: int = 1
    dtype: str = "int64"

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        if not is_integer(self.width) or self.width < 1:
            raise ValueError(f"width must be an integer >= 1, got {self.width!r}")
        if self.dtype not in ITEM_DTYPES:
            raise ValueError(f"dtype must be one of {ITEM_DTYPES}, got {self.dtype!r}")


@dataclass(frozen=True)
class EncoderPhase:
    """One encoder phase: which segments it consumes and how it is balanced.

    Attributes:
        name: the phase's name: the key of its plan (``StepPlan.phases``), its raw tensor
            (``LocalBatch.raw``), its encoder and its statistics; ``"llm"`` is reserved.
        kind: the non-text segment kind (``orchmllm.schema``) whose segments it consumes.
        key: the example field holding the raw arrays (``image_patches``), one
            ``(raw, feature_dim)`` array per segment of this kind.
        divisor: raw rows per LLM token (a multiple of ``stride``), for items that state no
            token count of their own (``[kind, count, tokens]`` segments do).
        feature_dim: raw row width.
        policy: the balancing policy, a name from ``orchmllm.POLICIES``.
        cost: the phase's cost model; the policy optimises it when it is of the policy's kind
            (packed or padded) with non-negative coefficients, else the policy's default;
            loads and statistics always use it (None: padded for padded policies, else packed
            linear).
        stride: raw rows per encoder position (the encoder's own sequence is
            ``raw // stride``: what the policy balances and ``cost`` is measured over).
        value_bytes: the bytes of one raw value; the move's volume per raw row is
            :attr:`row_bytes` (it weighs placement only).
        fields: the per-item record its items carry to the encoder (:class:`ItemField`;
            none: the encoder is called as ``encoder(rows, lengths)``, else as
            ``encoder(rows, lengths, meta)``, see ``Orchestrator.run``).
        max_load: with :attr:`StepOptions.context_parallel` > 1, a rank's budget in the
            phase's cost, which an item over it is split to meet (None: split only where it
            lowers the slowest rank). Only for a phase that splits
            (:meth:`StepOptions.splits`).

    Raises:
        ValueError: ``kind`` is the text kind or not a non-negative integer; ``divisor``,
            ``feature_dim``, ``stride`` or ``value_bytes`` is not an integer >= 1;
            ``divisor`` is not a multiple of ``stride``; ``policy`` is not in
            ``orchmllm.POLICIES``; ``name`` is ``"llm"``; ``fields`` holds another type or
            two fields of one name.
    """

    name: str
    kind: int
    key: str
    divisor: int
    feature_dim: int
    policy: str = "greedy"
    cost: CostModel | None = None
    stride: int = 1
    value_bytes: int = 4
    fields: tuple[ItemField, ...] = ()
    max_load: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", tuple(self.fields))
        _check_budget("max_load", self.max_load)
        if not all(isinstance(f, ItemField) for f in self.fields):
            raise ValueError(f"fields must hold ItemField entries, got {self.fields!r}")
        if len({f.name for f in self.fields}) != len(self.fields):
            raise ValueError(f"fields must have distinct names, got {self.fields!r}")
        if self.kind == TEXT or not is_integer(self.kind) or self.kind < 0:
            raise ValueError(f"kind must be a non-text segment kind, got {self.kind!r}")
        for name in ("divisor", "feature_dim", "stride", "value_bytes"):
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.divisor % self.stride:
            raise ValueError(
                f"divisor ({self.divisor}) must be a multiple of stride ({self.stride})"
            )
        if self.name == "llm":
            raise ValueError("name 'llm' is reserved for the LLM phase")

    @property
    def row_bytes(self) -> int:
        """Bytes one raw row carries in the encoder move: ``feature_dim * value_bytes``."""
        return self.feature_dim * self.value_bytes


@dataclass(frozen=True)
class StepOptions:
    """How a step is planned: the encoder phases, the mode, the LLM policy, the placement.

    Attributes:
        phases: the encoder phases (distinct kinds and names), kept as a tuple.
        mode: one of :data:`MODES`: ``none`` moves nothing, ``llm`` balances only the LLM
            phase (encoders run where their items were sampled), ``full`` every phase.
        llm_policy: the LLM phase's balancing policy, a name from ``orchmllm.POLICIES``.
        llm_cost: the LLM phase's cost model, used as :attr:`EncoderPhase.cost` is (None:
            the policy's default).
        placement: ``none``, or how each phase's balanced batches are permuted over the ranks
            to keep the moved bytes inside nodes (``orchmllm.planner.placement``: ``assign``,
            ``ilp``, ``auto``); in effect only with ``ranks_per_node`` set and more than one
            node.
        ranks_per_node: consecutive ranks per node (None: unknown, placement off).
        text_token_bytes: what the LLM move carries per text token (default: an int64 id and
            an int64 loss-mask entry, as :class:`orchmllm.dist.orchestrator.LocalBatch` holds
            them).
        encoded_token_bytes: what it carries per encoder output row (the LLM hidden size
            times the activation dtype's bytes; None counts an encoded token like a text
            token). Both byte counts only weigh the LLM phase's placement volumes.
        context_parallel: ``N`` > 1 lets the LLM phase cut an example into up to ``N``
            pieces on ranks of one group (``balance(context_parallel=)``), under
            ``llm_max_load`` or where it lowers the slowest rank; the plan records the pieces
            (:attr:`orchmllm.planner.step_plan.StepPlan.llm_pieces`). It must divide the
            number of ranks (checked when planning). 1: whole examples only. An encoder phase
            that :meth:`splits` cuts its items likewise (``PhasePlan.pieces``), under its
            ``max_load``.
        llm_max_load: the LLM phase's per-rank budget in its cost (``max_load_per_rank``),
            or None; only with ``context_parallel`` > 1.

    Raises:
        ValueError: ``mode`` is not in :data:`MODES`; two phases share a kind or a name;
            ``llm_policy`` is not in ``orchmllm.POLICIES``; ``placement`` is not in
            :data:`orchmllm.planner.balance.PLACEMENTS`; ``ranks_per_node`` is not an integer
            >= 1 or None; a byte count is < 1; ``context_parallel`` is not an integer >= 1,
            or > 1 with an LLM policy other than ``greedy``/``greedy_cost``, a placement or
            a padded ``llm_cost``; ``llm_max_load`` is not a number > 0, or set without
            ``context_parallel``.
    """

    phases: tuple[EncoderPhase, ...]
    mode: str = "full"
    llm_policy: str = "greedy"
    llm_cost: CostModel | None = None
    placement: str = "none"
    ranks_per_node: int | None = None
    text_token_bytes: int = 16
    encoded_token_bytes: int | None = None
    context_parallel: int = 1
    llm_max_load: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "phases", tuple(self.phases))
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        kinds = {p.kind for p in self.phases}
        names = {p.name for p in self.phases}
        if len(kinds) != len(self.phases) or len(names) != len(self.phases):
            raise ValueError(f"phases must have distinct kinds and names, got {self.phases}")
        if self.llm_policy not in POLICIES:
            raise ValueError(f"llm_policy must be one of {POLICIES}, got {self.llm_policy!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        rpn = self.ranks_per_node
        if rpn is not None and (not is_integer(rpn) or rpn < 1):
            raise ValueError(f"ranks_per_node must be an integer >= 1, got {rpn!r}")
        if self.text_token_bytes < 1:
            raise ValueError(f"text_token_bytes must be >= 1, got {self.text_token_bytes!r}")
        if self.encoded_token_bytes is not None and self.encoded_token_bytes < 1:
            raise ValueError(
                f"encoded_token_bytes must be >= 1 or None, got {self.encoded_token_bytes!r}"
            )
        self._check_context_parallel()

    def _check_context_parallel(self) -> None:
        cp, budget = self.context_parallel, self.llm_max_load
        if not is_integer(cp) or cp < 1:
            raise ValueError(f"context_parallel must be an integer >= 1, got {cp!r}")
        _check_budget("llm_max_load", budget)
        for p in self.phases:
            if p.max_load is not None and not self.splits(p):
                raise ValueError(
                    f"phases[{p.name!r}].max_load={p.max_load!r} needs a phase that splits: "
                    f"context_parallel > 1 (got {cp}), a policy in {SPLIT_POLICIES}, stride 1 "
                    "and no fields"
                )
        if cp == 1:
            if budget is not None:
                raise ValueError(f"llm_max_load={budget!r} needs context_parallel > 1")
            return
        if self.llm_policy not in SPLIT_POLICIES:
            raise ValueError(
                f"context_parallel={cp} needs llm_policy in {SPLIT_POLICIES} (a packed LPT), "
                f"got {self.llm_policy!r}"
            )
        if self.placement != "none":
            raise ValueError(
                f"context_parallel={cp} needs placement='none', got {self.placement!r}"
            )
        if self.llm_cost is not None and not self.llm_cost.packed:
            raise ValueError(
                f"context_parallel={cp} needs a packed llm_cost (pieces of a padded batch have "
                f"no cost), got {self.llm_cost!r}"
            )

    def splits(self, phase: EncoderPhase) -> bool:
        """Whether ``phase`` cuts items into pieces: ``context_parallel`` > 1 and a phase
        planned by LPT on a packed cost (a policy in ``SPLIT_POLICIES``, a packed or no
        cost), whose encoder sees its raw rows one to one (stride 1) and whose items carry no
        record (``fields``: a piece would need its item's). Its pieces are whole LLM tokens
        (multiples of ``divisor`` rows), so a connector that merges ``divisor`` consecutive
        rows merges inside a piece. Other phases keep their items whole.

        Args:
            phase: one of these options' phases.

        Returns:
            True when the phase splits.
        """
        return (
            self.context_parallel > 1
            and phase.policy in SPLIT_POLICIES
            and (phase.cost is None or phase.cost.packed)
            and phase.stride == 1
            and not phase.fields
        )

    @property
    def balanced_policies(self) -> tuple[str, ...]:
        """The policies a step runs in this mode."""
        if self.mode == "none":
            return ()
        if self.mode == "llm":
            return (self.llm_policy,)
        return (self.llm_policy, *(p.policy for p in self.phases))

    @property
    def deterministic(self) -> bool:
        """Whether the plan is a pure function of the gathered rows (else one rank computes
        it and broadcasts it: a time-limited ILP placement can stop at another point)."""
        policies = self.balanced_policies
        return not policies or plan_is_deterministic(placement=self.placement, policies=policies)

    def with_costs(self, costs: Mapping[str, CostModel | None]) -> StepOptions:
        """These options with other cost models; phases not named keep theirs.

        Args:
            costs: phase name (or ``"llm"``) -> its cost model (None: the policy's default).

        Returns:
            New options; these are unchanged.

        Raises:
            ValueError: a name that is no phase of these options.
        """
        names = {p.name for p in self.phases} | {LLM}
        unknown = sorted(set(costs) - names)
        if unknown:
            raise ValueError(f"costs names phases {unknown}; the options have {sorted(names)}")
        phases = tuple(
            replace(p, cost=costs[p.name]) if p.name in costs else p for p in self.phases
        )
        return replace(self, phases=phases, llm_cost=costs.get(LLM, self.llm_cost))


def _check_budget(name: str, budget: object) -> None:
    if budget is not None and (
        not isinstance(budget, numbers.Real) or isinstance(budget, bool) or not budget > 0
    ):
        raise ValueError(f"{name} must be a number > 0 or None, got {budget!r}")


def default_phases(
    rates: EncodingRates,
    *,
    feature_dims: Mapping[str, int],
    policies: Mapping[str, str] | None = None,
    costs: Mapping[str, CostModel] | None = None,
    max_loads: Mapping[str, float] | None = None,
) -> tuple[EncoderPhase, ...]:
    """One phase per row of the modality table (:data:`orchmllm.schema.MODALITIES`) named in
    ``feature_dims`` (its raw row width), in table order, with the row's tailored policy
    unless ``policies`` names another; divisor and encoder stride from ``rates``; a
    context-parallel budget from ``max_loads``."""
    policies, costs, loads = dict(policies or {}), dict(costs or {}), dict(max_loads or {})
    unknown = sorted(
        (set(feature_dims) | set(policies) | set(costs) | set(loads)) - set(MODALITIES)
    )
    if unknown:
        raise ValueError(f"no modality named {unknown}; the table has {list(MODALITIES)}")
    return tuple(
        EncoderPhase(
            m.name,
            m.kind,
            m.key,
            rates.divisor(m.kind),
            int(feature_dims[m.name]),
            policies.get(m.name, m.policy),
            costs.get(m.name),
            stride=rates.stride(m.kind),
            max_load=loads.get(m.name),
        )  # fmt: skip
        for m in MODALITIES.values()
        if m.name in feature_dims
    )
