"""The pure step planner: gathered segment rows -> every phase's plan (paper sections 6-7).

One function, :func:`plan_step`, plans a whole multimodal step from the segment table every rank
gathered (:func:`local_metadata`: one int64 row per segment: example, kind, raw count,
prediction targets, the LLM tokens an item states). It is torch-free and a pure function of its
inputs, so the orchestrator (on the critical path or in the loader's background thread) and the
cluster simulator (``orchmllm.sim``) run the same planner; only a time-limited ILP placement is
not pure, and the comm floor computes that plan on one rank and broadcasts it.

Per step:

- each encoder phase balances its own items (images, audio clips) by the length its encoder
  sees, ``raw // stride`` (the raw rows after the encoder's own downsampling, e.g. a
  Whisper-style stride-2 convolution: the unit its cost model is measured in), with its own
  policy;
- the LLM phase balances whole examples by their interleaved sequence length (text tokens plus
  each encoded item's tokens: the count it states, else ``raw // divisor``);
- with a placement method (``placement != "none"`` and ``ranks_per_node`` set) each phase's
  balanced batches are then permuted over the ranks to keep the *bytes that the phase's move
  carries* inside nodes: raw rows for an encoder phase; for the LLM phase each example's text
  from its sampling rank and each encoded item from its encoder rank;
- the encoder outputs' move is composed: ``Pi_llm o Pi_enc^-1`` (the LLM plan lifted to items).

Modes (:data:`MODES`): ``none`` moves nothing; ``llm`` balances only the LLM phase (encoders run
where their items were sampled, the pre-balancing ablation); ``full`` balances every phase.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np

from orchmllm.planner.balance import CLOCKED_PLACEMENTS, PLACEMENTS, balance, plan_is_deterministic
from orchmllm.planner.cost import CostModel, imbalance
from orchmllm.planner.placement import place_batches
from orchmllm.planner.plan import Rearrangement, expand_rows
from orchmllm.planner.policies import PADDED_POLICIES, POLICIES, default_cost
from orchmllm.schema import (
    LLM,
    MODALITIES,
    TEXT,
    EncodingRates,
    check_segments,
    given_tokens,
    is_integer,
)

__all__ = [
    "MODES",
    "Assembly",
    "EncoderPhase",
    "ItemField",
    "PhasePlan",
    "StepOptions",
    "StepPlan",
    "assembly",
    "default_phases",
    "local_metadata",
    "plan_step",
]

MODES = ("none", "llm", "full")
# Columns of the gathered metadata: one row per segment. TOKENS is an item's stated LLM token
# count (-1: ``raw // divisor``); rows of four columns (without it) plan too.
EX, KIND, RAW, TARGETS, TOKENS = range(5)
COLUMNS = 5
ITEM_DTYPES = ("int64", "float64")
# Steps with at least this many segments plan their phases in threads side by side. Below it
# (a few hundred ranks) starting the threads costs about as much as it saves; at 16,384 ranks
# it saves about a tenth of the step plan on 2 cores (placement_bench's whole-step case).
PARALLEL_MIN_SEGMENTS = 8192
# Placement volumes are rounded up to KiB, so the ILP's coefficients stay small.
PLACEMENT_UNIT_BYTES = 1024


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", tuple(self.fields))
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

    Raises:
        ValueError: ``mode`` is not in :data:`MODES`; two phases share a kind or a name;
            ``llm_policy`` is not in ``orchmllm.POLICIES``; ``placement`` is not in
            :data:`orchmllm.planner.balance.PLACEMENTS`; ``ranks_per_node`` is not an integer
            >= 1 or None; a byte count is < 1.
    """

    phases: tuple[EncoderPhase, ...]
    mode: str = "full"
    llm_policy: str = "greedy"
    llm_cost: CostModel | None = None
    placement: str = "none"
    ranks_per_node: int | None = None
    text_token_bytes: int = 16
    encoded_token_bytes: int | None = None

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


# -- metadata ----------------------------------------------------------------------------


def local_metadata(examples: Sequence[Mapping]) -> np.ndarray:
    """This rank's segment table: one int64 row per segment; all the orchestrator gathers.

    Pure: no collective, no torch.

    Args:
        examples: this rank's examples in local order, each with ``segments`` (its
            ``[kind, count]`` pairs, in template order) and ``loss_mask`` (one entry per text
            token).

    Returns:
        An int64 array ``(segments, 5)``, segments in example order: local example index,
        kind, raw count, prediction targets in the segment (text tokens with loss_mask 1,
        except position 0 of the sequence, which nothing predicts; 0 for other kinds), and
        the LLM tokens an item states (``[kind, count, tokens]``; -1 elsewhere).

    Raises:
        ValueError: a bad ``segments`` entry, an example with no segments, or a ``loss_mask``
            whose length is not the example's text token count or that holds a value other
            than 0 and 1.
    """
    rows = []
    for i, ex in enumerate(examples):
        segs = check_segments(ex["segments"])
        if not segs:
            raise ValueError(f"examples[{i}] has no segments")
        mask = np.asarray(ex["loss_mask"]).reshape(-1)
        not_binary = ~np.isin(mask, (0, 1))
        if not_binary.any():
            bad = mask[not_binary][0].item()
            raise ValueError(f"examples[{i}] loss_mask must hold 0 or 1, got {bad!r}")
        mask = mask.astype(np.int64)
        n_text = sum(c for k, c in segs if k == TEXT)
        if mask.size != n_text:
            raise ValueError(
                f"examples[{i}] loss_mask has {mask.size} tokens, segments say {n_text}"
            )
        pos = text = 0
        for (kind, count), tokens in zip(segs, given_tokens(ex["segments"]), strict=True):
            targets = 0
            if kind == TEXT:
                seg_mask = mask[text : text + count]
                targets = int(seg_mask.sum()) - int(pos == 0 and seg_mask[0] != 0)
                text += count
            rows.append((i, kind, count, targets, tokens))
            pos += count
    return np.asarray(rows, dtype=np.int64).reshape(-1, COLUMNS)


def segment_lengths(rows: np.ndarray, phases: Sequence[EncoderPhase]) -> np.ndarray:
    """LLM tokens of every segment of :func:`local_metadata` rows: the text count, an item's
    stated tokens, or its raw count over the phase's divisor.

    Args:
        rows: ``int64 (segments, 5)`` metadata rows (or 4 columns: no item states its
            tokens), of one rank or gathered.
        phases: the encoder phases; a kind with no phase counts like text.

    Returns:
        ``int64 (segments,)``, in row order.
    """
    lengths = rows[:, RAW].copy()
    kinds = rows[:, KIND]
    # Index arrays, not boolean masks: a masked gather and scatter over every segment costs
    # several times the division itself.
    for p in phases:
        if p.divisor > 1:  # integer division only where it changes something
            at = np.flatnonzero(kinds == p.kind)
            lengths[at] //= p.divisor
    if rows.shape[1] > TOKENS:
        tokens = rows[:, TOKENS]
        at = np.flatnonzero(tokens >= 0)
        lengths[at] = tokens[at]
    return lengths


# -- planning ----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PhasePlan:
    """Items of one encoder phase in global order, and their two moves.

    ``encoder``: sampled layout -> encoder layout (``Pi_enc``); ``to_llm``: encoder layout ->
    LLM layout (``Pi_llm`` lifted to items, composed with ``Pi_enc^-1``).
    """

    name: str
    kind: int
    example: np.ndarray  # (items,) global example id of each item
    raw: np.ndarray  # raw rows per item
    encoded: np.ndarray  # LLM tokens per item
    encoder: Rearrangement
    to_llm: Rearrangement
    stats: dict = field(repr=False)


@dataclass(frozen=True, eq=False)
class StepPlan:
    """Everything every rank needs for one step; equal on all ranks (see :meth:`same_as`).

    Examples are numbered globally in gather order (rank 0's in local order, then rank 1's,
    ...); the arrays are int64.

    Attributes:
        num_ranks: the ranks the plan moves data between.
        mode: the :attr:`StepOptions.mode` it was planned in.
        example_src: ``(examples,)`` the rank that sampled each example.
        text_len: ``(examples,)`` text tokens per example.
        seq_len: ``(examples,)`` whole interleaved LLM sequence length per example.
        seg_example: ``(segments,)`` global example id, segments in example order.
        seg_kind: ``(segments,)`` segment kind.
        seg_len: ``(segments,)`` LLM tokens of the segment (text count, an item's stated
            tokens, else ``raw // divisor``).
        seg_item: ``(segments,)`` item id within its phase (-1 for text).
        seg_text_offset: ``(segments,)`` offset of a text segment within its example's text
            (0 for other kinds).
        num_targets: global prediction targets, over all ranks (normalises the loss).
        llm: the LLM phase's move of whole examples (``Pi_llm``).
        phases: phase name -> its :class:`PhasePlan` (items and their two moves).
        llm_stats: the LLM phase's planning statistics (see :meth:`stats`).
    """

    num_ranks: int
    mode: str
    example_src: np.ndarray
    text_len: np.ndarray
    seq_len: np.ndarray
    seg_example: np.ndarray
    seg_kind: np.ndarray
    seg_len: np.ndarray
    seg_item: np.ndarray
    seg_text_offset: np.ndarray
    num_targets: int
    llm: Rearrangement
    phases: dict[str, PhasePlan]
    llm_stats: dict = field(repr=False)

    def same_as(self, other: StepPlan) -> bool:
        """Whether ``other`` executes the same step: same rearrangements and layout.

        Args:
            other: another plan, e.g. one computed on another rank or recomputed.

        Returns:
            True when the modes, the LLM move, the segment lengths and every phase's two moves
            are equal; timings and other statistics are not compared.
        """
        return (
            self.mode == other.mode
            and self.llm == other.llm
            and np.array_equal(self.seg_len, other.seg_len)
            and self.phases.keys() == other.phases.keys()
            and all(
                p.encoder == other.phases[n].encoder and p.to_llm == other.phases[n].to_llm
                for n, p in self.phases.items()
            )
        )

    def stats(self) -> dict[str, dict]:
        """Per-phase metrics known when planning (the orchestrator adds the bytes moved).

        Returns:
            Phase name (and ``"llm"``) -> a copy of its statistics: ``imbalance_before``,
            ``imbalance_after``, ``loads_before``, ``loads_after`` (per rank, in the phase's
            cost), ``plan_ms``, ``items``, and the placement's statistics when it ran.
        """
        out = {name: dict(p.stats) for name, p in self.phases.items()}
        out["llm"] = dict(self.llm_stats)
        return out


def _policy_cost(policy: str, cost: CostModel | None) -> CostModel | None:
    """``cost`` when the policy can optimise it (same kind, non-negative terms), else None."""
    kind = "padded" if policy in PADDED_POLICIES else "packed"
    if cost is not None and cost.kind == kind and cost.alpha >= 0 and cost.beta >= 0:
        return cost
    return None


def _balance_phase(
    lengths: np.ndarray,
    src: np.ndarray,
    *,
    num_ranks: int,
    policy: str,
    cost: CostModel | None,
    balanced: bool,
    ranks_per_node: int | None,
) -> tuple[np.ndarray, dict]:
    """Destination rank per item, and the phase's load statistics.

    Loads are measured with the phase's cost model; a heuristic plan whose slowest rank is no
    faster than the sampled layout's is replaced by the sampled layout (nothing moves).
    """
    t0 = time.perf_counter()
    model = cost or default_cost(policy)
    before = model.loads(lengths, src, num_ranks)
    if balanced and lengths.size:
        optimised = _policy_cost(policy, cost)
        a = balance(
            lengths, num_ranks, policy, src=src, cost=optimised, ranks_per_node=ranks_per_node
        )
        dst = np.asarray(a.dst, dtype=np.int64)
        # balance() measured its plan with the cost it optimised: the same loads when that
        # is the phase's model
        same = (optimised or default_cost(policy)) == model
        after = a.loads if same else model.loads(lengths, dst, num_ranks)
    else:
        dst, after = src.copy(), before
    if after.max() >= before.max():  # never move for a plan that is no better than staying
        dst, after = src.copy(), before
    stats = {
        "imbalance_before": imbalance(before),
        "imbalance_after": imbalance(after),
        "loads_before": before.tolist(),
        "loads_after": after.tolist(),
        "plan_ms": (time.perf_counter() - t0) * 1e3,
        "items": int(lengths.size),
    }
    return dst, stats


def _places(options: StepOptions, num_ranks: int) -> bool:
    """Whether a balanced phase's batches are placed: a method, and more than one node."""
    rpn = options.ranks_per_node
    return options.placement != "none" and rpn is not None and num_ranks > rpn


def _placed(
    dst: np.ndarray,
    *,
    volume_bytes: np.ndarray,
    volume_src: np.ndarray,
    volume_dst: np.ndarray,
    options: StepOptions,
    num_ranks: int,
    balanced: bool,
    stats: dict,
) -> np.ndarray:
    """``dst`` with its batches permuted over the ranks to keep ``volume_bytes`` (pieces
    moving from ``volume_src`` to the batch ``volume_dst``) inside nodes; unchanged when
    placement is off, the cluster is one node, or the phase is not balanced."""
    if not (_places(options, num_ranks) and balanced and volume_bytes.size):
        return dst
    t0 = time.perf_counter()
    units = np.ceil(np.asarray(volume_bytes, dtype=np.float64) / PLACEMENT_UNIT_BYTES)
    p = place_batches(
        units.astype(np.int64), volume_src, volume_dst, num_ranks=num_ranks,
        ranks_per_node=options.ranks_per_node, method=options.placement,
    )  # fmt: skip
    stats.update({k: float(v) for k, v in p.stats.items()})
    stats["plan_ms"] += (time.perf_counter() - t0) * 1e3
    return np.asarray(p.perm, dtype=np.int64)[dst]


def _side_by_side(jobs: dict[str, Callable[[], Any]], *, parallel: bool) -> dict[str, Any]:
    """Every job's result, computed in threads when ``parallel`` (the C++ core and numpy's
    large-array loops release the GIL). Errors surface in the jobs' order either way."""
    if not parallel:
        return {name: job() for name, job in jobs.items()}
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def _encoder_phase(
    phase: EncoderPhase, sel: np.ndarray, raw: np.ndarray, src: np.ndarray,
    options: StepOptions, *, num_ranks: int,
) -> tuple[np.ndarray, Rearrangement, dict]:  # fmt: skip
    """One encoder phase's segments ``sel`` (raw rows ``raw``, sampled on ``src``), their
    move to the encoder layout and its statistics."""
    full = options.mode == "full"
    enc_dst, stats = _balance_phase(
        raw // phase.stride, src, num_ranks=num_ranks, policy=phase.policy,
        cost=phase.cost, balanced=full, ranks_per_node=options.ranks_per_node,
    )  # fmt: skip
    enc_dst = _placed(
        enc_dst, volume_bytes=raw * phase.row_bytes, volume_src=src, volume_dst=enc_dst,
        options=options, num_ranks=num_ranks, balanced=full, stats=stats,
    )  # fmt: skip
    return sel, Rearrangement.from_assignment(src, enc_dst, num_ranks=num_ranks), stats


def _phase_plan(
    phase: EncoderPhase, sel: np.ndarray, encoder: Rearrangement, stats: dict, *,
    seg_raw: np.ndarray, seg_example: np.ndarray, seg_len: np.ndarray, llm_dst: np.ndarray,
) -> PhasePlan:  # fmt: skip
    """A phase's plan once the LLM layout is known: its outputs go where their examples go."""
    item_ex, raw, encoded = seg_example[sel], seg_raw[sel], seg_len[sel]
    lifted = Rearrangement.from_assignment(
        encoder.src_rank, llm_dst[item_ex], num_ranks=encoder.num_ranks
    )
    t0 = time.perf_counter()
    to_llm = lifted.compose(encoder.inverse())
    stats["plan_ms"] += (time.perf_counter() - t0) * 1e3
    return PhasePlan(phase.name, phase.kind, item_ex, raw, encoded, encoder, to_llm, stats)


def plan_step(
    rows: np.ndarray, src: np.ndarray, options: StepOptions, *, num_ranks: int
) -> StepPlan:
    """Plan one step from the gathered segment rows.

    Pure: same inputs, same plan, no collective; with ``placement="ilp"`` the CBC time limit
    can stop the solve elsewhere on a busy machine, so such a plan is computed on one rank
    and broadcast (:meth:`orchmllm.dist.orchestrator.Orchestrator.plan`). A step of at least
    :data:`PARALLEL_MIN_SEGMENTS` segments plans its phases in threads, to the same plan.

    Args:
        rows: every rank's :func:`local_metadata` rows in rank order, int64 ``(n, 5)`` (or
            ``(n, 4)``: no item states its tokens).
        src: the rank of each row, non-decreasing (``rows``/``src`` are what
            ``orchmllm.dist.comm.all_gather_rows`` returns).
        options: how to plan (:class:`StepOptions`).
        num_ranks: the ranks to plan for (the data-parallel group size).

    Returns:
        The :class:`StepPlan` for the step.

    Raises:
        ValueError: ``options`` is not a :class:`StepOptions`; ``num_ranks`` is not an
            integer >= 1; ``src`` and ``rows`` differ in length; a segment kind has no phase;
            ``src`` is decreasing or outside ``[0, num_ranks)``; a rank's rows do not list its
            examples 0, 1, ... with contiguous segments; an example's LLM sequence is empty;
            or a policy or placement rejects its input.
    """
    if not isinstance(options, StepOptions):
        raise ValueError(f"options must be a StepOptions, got {type(options).__name__}")
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be an integer >= 1, got {num_ranks!r}")
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        rows = rows.reshape(0, COLUMNS)
    if rows.ndim != 2 or rows.shape[1] not in (TOKENS, COLUMNS):
        raise ValueError(f"rows must be (n, {TOKENS}) or (n, {COLUMNS}), got shape {rows.shape}")
    src = np.asarray(src, dtype=np.int64).reshape(-1)
    if src.size != rows.shape[0]:
        raise ValueError(f"src has {src.size} entries, rows has {rows.shape[0]}")
    phases = options.phases
    kinds = rows[:, KIND].copy()  # contiguous: every phase compares it
    is_text = kinds == TEXT
    sels = {p.name: np.flatnonzero(kinds == p.kind) for p in phases}
    if np.count_nonzero(is_text) + sum(sel.size for sel in sels.values()) != kinds.size:
        known = is_text | np.isin(kinds, [p.kind for p in phases])
        unknown = sorted(set(kinds[~known].tolist()))
        raise ValueError(f"rows has segment kinds {unknown} with no phase")
    if np.any(np.diff(src) < 0):
        raise ValueError("src must be non-decreasing (rows in rank order)")
    if src.size and (src[0] < 0 or src[-1] >= num_ranks):
        raise ValueError(f"src must hold ranks in [0, {num_ranks}), got {src.min()}..{src.max()}")
    # Global example ids: a new example starts where (rank, local example index) changes.
    n_seg = rows.shape[0]
    ex = rows[:, EX]
    starts = np.ones(n_seg, dtype=bool)
    starts[1:] = (src[1:] != src[:-1]) | (ex[1:] != ex[:-1])
    seg_example = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    ex_rank = src[first]
    # each example's index within its rank: position minus where its rank's run begins
    rank_starts = np.ones(first.size, dtype=bool)
    rank_starts[1:] = ex_rank[1:] != ex_rank[:-1]
    run_begin = np.flatnonzero(rank_starts)
    run_size = np.diff(np.append(run_begin, first.size))
    expected = np.arange(first.size) - np.repeat(run_begin, run_size)
    if not np.array_equal(ex[first], expected):
        raise ValueError(
            "rows must list each rank's examples 0, 1, ... in order, segments contiguous"
        )
    n_ex = first.size
    example_src = src[first]
    seg_len = segment_lengths(rows, phases)
    raw = rows[:, RAW].copy()
    text_rows = np.where(is_text, raw, 0)
    text_len = np.bincount(seg_example, weights=text_rows, minlength=n_ex).astype(np.int64)
    seq_len = np.bincount(seg_example, weights=seg_len, minlength=n_ex).astype(np.int64)
    if np.any(seq_len == 0):
        bad = int(np.flatnonzero(seq_len == 0)[0])
        raise ValueError(f"example {bad} (gather order) has an empty LLM sequence")
    ex_text_start = np.concatenate(([0], np.cumsum(text_len)))[:-1]
    seg_text_offset = np.where(
        is_text, np.cumsum(text_rows) - text_rows - ex_text_start[seg_example], 0
    )

    # The encoder phases and the LLM phase's balancing are independent; the LLM placement then
    # weighs where the encoder outputs are.
    jobs = {
        p.name: partial(
            _encoder_phase, p, sels[p.name], raw[sels[p.name]], src[sels[p.name]], options,
            num_ranks=num_ranks,
        )
        for p in phases
    }  # fmt: skip
    jobs["llm"] = partial(
        _balance_phase, seq_len, example_src, num_ranks=num_ranks, policy=options.llm_policy,
        cost=options.llm_cost, balanced=options.mode != "none",
        ranks_per_node=options.ranks_per_node,
    )  # fmt: skip
    # A clocked ILP reads this process's CPU share for its limit: it plans alone.
    parallel = n_seg >= PARALLEL_MIN_SEGMENTS and options.placement not in CLOCKED_PLACEMENTS
    done = _side_by_side(jobs, parallel=parallel)
    llm_dst, llm_stats = done.pop("llm")
    items = done  # phase name -> (segment indices, encoder move, stats)
    if options.mode != "none" and _places(options, num_ranks):
        # the LLM move's pieces: each example's text from its sampling rank, each encoded
        # item from its encoder rank (built only where a placement weighs them)
        enc_bytes = options.encoded_token_bytes or options.text_token_bytes
        piece_ex = [np.arange(n_ex)] + [seg_example[sel] for sel, _, _ in items.values()]
        piece_src = [example_src] + [enc.dst_rank for _, enc, _ in items.values()]
        piece_bytes = [text_len * options.text_token_bytes] + [
            seg_len[sel] * enc_bytes for sel, _, _ in items.values()
        ]
        piece_ex = np.concatenate(piece_ex)
        llm_dst = _placed(
            llm_dst, volume_bytes=np.concatenate(piece_bytes),
            volume_src=np.concatenate(piece_src), volume_dst=llm_dst[piece_ex], options=options,
            num_ranks=num_ranks, balanced=True, stats=llm_stats,
        )  # fmt: skip

    # The LLM move and each phase's move to the LLM layout, side by side again.
    to_llm = partial(
        _phase_plan, seg_raw=raw, seg_example=seg_example, seg_len=seg_len, llm_dst=llm_dst
    )
    jobs = {p.name: partial(to_llm, p, *items[p.name]) for p in phases}
    jobs["llm"] = partial(Rearrangement.from_assignment, example_src, llm_dst, num_ranks=num_ranks)
    phase_plans = _side_by_side(jobs, parallel=parallel)
    llm = phase_plans.pop("llm")
    seg_item = np.full(n_seg, -1, dtype=np.int64)
    for sel, _, _ in items.values():
        seg_item[sel] = np.arange(sel.size)
    return StepPlan(
        num_ranks=num_ranks,
        mode=options.mode,
        example_src=example_src,
        text_len=text_len,
        seq_len=seq_len,
        seg_example=seg_example,
        seg_kind=kinds,
        seg_len=seg_len,
        seg_item=seg_item,
        seg_text_offset=seg_text_offset,
        num_targets=int(rows[:, TARGETS].sum()),
        llm=llm,
        phases=phase_plans,
        llm_stats=llm_stats,
    )


# -- assembly ----------------------------------------------------------------------------


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(x.size, dtype=np.int64)
    np.cumsum(x[:-1], out=out[1:])
    return out


@dataclass(frozen=True)
class Assembly:
    """Where every position of one rank's LLM sequences comes from (pure, from the plan).

    The LLM input is ``cat([text embeds, phase 0 outputs, phase 1 outputs, ...])[index]``,
    every buffer in the order the moves deliver it; ``text_pos`` is the sequence position of
    each received text token.
    """

    examples: np.ndarray
    lengths: np.ndarray
    index: np.ndarray
    text_pos: np.ndarray
    seq_start: np.ndarray
    rows: dict[str, int]  # rows each buffer must have (text and every phase)


def assembly(plan: StepPlan, rank: int) -> Assembly:
    """How ``rank`` assembles its LLM sequences from the buffers the moves deliver."""
    examples = plan.llm.items_at(rank)
    local_pos = np.full(plan.seq_len.size, -1, dtype=np.int64)
    local_pos[examples] = np.arange(examples.size)
    text_rows = plan.text_len[examples]
    text_start = _exclusive_cumsum(text_rows)
    rows = {"text": int(text_rows.sum())}
    base = rows["text"]
    item_start = {}
    for name, pp in plan.phases.items():
        recv = pp.to_llm.items_at(rank)
        start = np.full(pp.encoded.size, -1, dtype=np.int64)
        start[recv] = base + _exclusive_cumsum(pp.encoded[recv])
        item_start[pp.kind] = start
        rows[name] = int(pp.encoded[recv].sum())
        base += rows[name]
    seg = np.flatnonzero(local_pos[plan.seg_example] >= 0)
    seg = seg[np.argsort(local_pos[plan.seg_example[seg]], kind="stable")]
    kinds, lens = plan.seg_kind[seg], plan.seg_len[seg]
    starts = np.empty(seg.size, dtype=np.int64)
    text = kinds == TEXT
    ex_local = local_pos[plan.seg_example[seg]]
    starts[text] = text_start[ex_local[text]] + plan.seg_text_offset[seg[text]]
    for kind, start in item_start.items():
        m = kinds == kind
        starts[m] = start[plan.seg_item[seg[m]]]
    pos = _exclusive_cumsum(lens)
    text_pos = np.empty(rows["text"], dtype=np.int64)
    text_pos[expand_rows(starts[text], lens[text])] = expand_rows(pos[text], lens[text])
    lengths = plan.seq_len[examples]
    return Assembly(
        examples=examples,
        lengths=lengths,
        index=expand_rows(starts, lens),
        text_pos=text_pos,
        seq_start=_exclusive_cumsum(lengths),
        rows=rows,
    )


def default_phases(
    rates: EncodingRates,
    *,
    feature_dims: Mapping[str, int],
    policies: Mapping[str, str] | None = None,
    costs: Mapping[str, CostModel] | None = None,
) -> tuple[EncoderPhase, ...]:
    """One phase per row of the modality table (:data:`orchmllm.schema.MODALITIES`) named in
    ``feature_dims`` (its raw row width), in table order, with the row's tailored policy
    unless ``policies`` names another; divisor and encoder stride from ``rates``."""
    policies, costs = dict(policies or {}), dict(costs or {})
    unknown = sorted((set(feature_dims) | set(policies) | set(costs)) - set(MODALITIES))
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
        )  # fmt: skip
        for m in MODALITIES.values()
        if m.name in feature_dims
    )
