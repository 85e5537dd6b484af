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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np

from orchmllm.planner.balance import CLOCKED_PLACEMENTS, balance
from orchmllm.planner.context_parallel import Pieces
from orchmllm.planner.cost import CostModel, imbalance
from orchmllm.planner.placement import place_batches
from orchmllm.planner.plan import Rearrangement
from orchmllm.planner.policies import PADDED_POLICIES, default_cost
from orchmllm.planner.segments import COLUMNS, EX, KIND, RAW, TARGETS, TOKENS, segment_lengths
from orchmllm.planner.step_options import EncoderPhase, StepOptions
from orchmllm.schema import TEXT

__all__ = [
    "PhasePlan",
    "StepPlan",
    "plan_step",
]

# Steps with at least this many segments plan their phases in threads side by side. Below it
# (a few hundred ranks) starting the threads costs about as much as it saves; at 16,384 ranks
# it saves about a tenth of the step plan on 2 cores (placement_bench's whole-step case).
PARALLEL_MIN_SEGMENTS = 8192
# Placement volumes are rounded up to KiB, so the ILP's coefficients stay small.
PLACEMENT_UNIT_BYTES = 1024


# -- planning ----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PhasePlan:
    """Items of one encoder phase in global order, and their two moves.

    ``encoder``: sampled layout -> encoder layout (``Pi_enc``); ``to_llm``: encoder layout ->
    LLM layout (``Pi_llm`` lifted to items, composed with ``Pi_enc^-1``). ``pieces``: with
    context parallelism, the items the phase splits, rows ``(item, rank, start, end)`` in raw
    rows, each range whole LLM tokens (:meth:`StepOptions.splits`); a split item's
    ``encoder`` move takes it whole to its first row's rank, its home, as for the LLM.
    """

    name: str
    kind: int
    example: np.ndarray  # (items,) global example id of each item
    raw: np.ndarray  # raw rows per item
    encoded: np.ndarray  # LLM tokens per item
    encoder: Rearrangement
    to_llm: Rearrangement
    stats: dict = field(repr=False)
    pieces: Pieces = field(default_factory=Pieces.empty)


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
        llm_pieces: with ``StepOptions.context_parallel`` > 1, the examples the LLM phase
            splits: rows ``(example, rank, start, end)`` over the example's interleaved
            sequence (:class:`orchmllm.planner.context_parallel.Pieces`); empty otherwise.
            A split example's ``llm`` move takes it whole to the rank of its first token's
            piece, its home; the orchestrator then sends the pieces' rows on
            (:mod:`orchmllm.planner.piece_layout`); ``llm_stats["loads_after"]`` are the
            pieces' loads.
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
    llm_pieces: Pieces = field(default_factory=Pieces.empty)

    def same_as(self, other: StepPlan) -> bool:
        """Whether ``other`` executes the same step: same rearrangements and layout.

        Args:
            other: another plan, e.g. one computed on another rank or recomputed.

        Returns:
            True when the modes, the LLM move and pieces, the segment lengths and every
            phase's two moves are equal; timings and other statistics are not compared.
        """
        return (
            self.mode == other.mode
            and self.llm == other.llm
            and self.llm_pieces.same_as(other.llm_pieces)
            and np.array_equal(self.seg_len, other.seg_len)
            and self.phases.keys() == other.phases.keys()
            and all(
                p.encoder == other.phases[n].encoder
                and p.to_llm == other.phases[n].to_llm
                and p.pieces.same_as(other.phases[n].pieces)
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
    context_parallel: int = 1,
    max_load: float | None = None,
) -> tuple[np.ndarray, dict, Pieces]:
    """Destination rank per item, the phase's load statistics, and the pieces of split
    items (``context_parallel`` > 1: a split item's destination is its first token's rank).

    Loads are measured with the phase's cost model; a heuristic plan whose slowest rank is no
    faster than the sampled layout's is replaced by the sampled layout (nothing moves).
    """
    t0 = time.perf_counter()
    model = cost or default_cost(policy)
    before = model.loads(lengths, src, num_ranks)
    pieces = Pieces.empty()
    if balanced and lengths.size:
        optimised = _policy_cost(policy, cost)
        split = {}
        if context_parallel > 1:
            split = {"context_parallel": context_parallel, "max_load_per_rank": max_load}
        a = balance(
            lengths, num_ranks, policy, src=src, cost=optimised, ranks_per_node=ranks_per_node,
            **split,
        )  # fmt: skip
        dst = np.asarray(a.dst, dtype=np.int64)
        pieces = a.pieces
        first = pieces.start == 0
        dst[pieces.item[first]] = pieces.rank[first]
        # balance() measured its plan with the cost it optimised: the same loads when that
        # is the phase's model
        # (with pieces always: a split item is on several ranks; StepOptions keeps its cost
        # packed, so that is the phase's model unless a coefficient is negative)
        same = (optimised or default_cost(policy)) == model or pieces.item.size > 0
        after = a.loads if same else model.loads(lengths, dst, num_ranks)
    else:
        dst, after = src.copy(), before
    if after.max() >= before.max():  # never move for a plan that is no better than staying
        dst, after, pieces = src.copy(), before, Pieces.empty()
    stats = {
        "imbalance_before": imbalance(before),
        "imbalance_after": imbalance(after),
        "loads_before": before.tolist(),
        "loads_after": after.tolist(),
        "plan_ms": (time.perf_counter() - t0) * 1e3,
        "items": int(lengths.size),
    }
    if context_parallel > 1:
        stats["items_split"] = int(pieces.items.size)
        stats["pieces"] = int(np.unique(pieces.item * num_ranks + pieces.rank).size)
    return dst, stats, pieces


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
    phase: EncoderPhase, sel: np.ndarray, raw: np.ndarray, encoded: np.ndarray,
    src: np.ndarray, options: StepOptions, *, num_ranks: int,
) -> tuple[np.ndarray, Rearrangement, dict, Pieces]:  # fmt: skip
    """One encoder phase's segments ``sel`` (raw rows ``raw``, LLM tokens ``encoded``,
    sampled on ``src``), their move to the encoder layout, its statistics and its pieces."""
    full = options.mode == "full"
    # A splitting phase plans in LLM tokens, so that every piece is whole tokens: its cost
    # per token is the cost of ``divisor`` rows (the same loads).
    unit = phase.divisor if options.splits(phase) and np.all(raw == encoded * phase.divisor) else 0
    if unit:
        c = phase.cost or default_cost(phase.policy)
        cost = replace(c, alpha=c.alpha * unit, beta=c.beta * unit**2)
        enc_dst, stats, pieces = _balance_phase(
            encoded, src, num_ranks=num_ranks, policy=phase.policy, cost=cost, balanced=full,
            ranks_per_node=options.ranks_per_node, context_parallel=options.context_parallel,
            max_load=phase.max_load,
        )  # fmt: skip
        pieces = Pieces(pieces.item, pieces.rank, pieces.start * unit, pieces.end * unit)
    else:
        enc_dst, stats, pieces = _balance_phase(
            raw // phase.stride, src, num_ranks=num_ranks, policy=phase.policy,
            cost=phase.cost, balanced=full, ranks_per_node=options.ranks_per_node,
        )  # fmt: skip
    enc_dst = _placed(
        enc_dst, volume_bytes=raw * phase.row_bytes, volume_src=src, volume_dst=enc_dst,
        options=options, num_ranks=num_ranks, balanced=full, stats=stats,
    )  # fmt: skip
    move = Rearrangement.from_assignment(src, enc_dst, num_ranks=num_ranks)
    return sel, move, stats, pieces


def _phase_plan(
    phase: EncoderPhase, sel: np.ndarray, encoder: Rearrangement, stats: dict, pieces: Pieces,
    *, seg_raw: np.ndarray, seg_example: np.ndarray, seg_len: np.ndarray, llm_dst: np.ndarray,
) -> PhasePlan:  # fmt: skip
    """A phase's plan once the LLM layout is known: its outputs go where their examples go."""
    item_ex, raw, encoded = seg_example[sel], seg_raw[sel], seg_len[sel]
    lifted = Rearrangement.from_assignment(
        encoder.src_rank, llm_dst[item_ex], num_ranks=encoder.num_ranks
    )
    t0 = time.perf_counter()
    to_llm = lifted.compose(encoder.inverse())
    stats["plan_ms"] += (time.perf_counter() - t0) * 1e3
    return PhasePlan(phase.name, phase.kind, item_ex, raw, encoded, encoder, to_llm, stats, pieces)


def _checked(
    rows: np.ndarray, src: np.ndarray, options: StepOptions, num_ranks: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """:func:`plan_step`'s arguments checked: int64 ``rows`` and ``src``, the rows' kinds,
    and each phase's segment indices."""
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
    kinds = rows[:, KIND].copy()  # contiguous: every phase compares it
    sels = {p.name: np.flatnonzero(kinds == p.kind) for p in options.phases}
    if np.count_nonzero(kinds == TEXT) + sum(sel.size for sel in sels.values()) != kinds.size:
        known = (kinds == TEXT) | np.isin(kinds, [p.kind for p in options.phases])
        unknown = sorted(set(kinds[~known].tolist()))
        raise ValueError(f"rows has segment kinds {unknown} with no phase")
    if np.any(np.diff(src) < 0):
        raise ValueError("src must be non-decreasing (rows in rank order)")
    if src.size and (src[0] < 0 or src[-1] >= num_ranks):
        raise ValueError(f"src must hold ranks in [0, {num_ranks}), got {src.min()}..{src.max()}")
    return rows, src, kinds, sels


def _examples(ex: np.ndarray, src: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Global example ids: each segment's, and each example's sampling rank. A new example
    starts where (rank, local example index ``ex``) changes; each rank must list its examples
    0, 1, ... in order."""
    starts = np.ones(ex.size, dtype=bool)
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
    return seg_example, ex_rank


def _sequences(
    raw: np.ndarray, is_text: np.ndarray, seg_example: np.ndarray, seg_len: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per example its text tokens and whole LLM sequence length; per segment its offset in
    its example's text (0 for an item)."""
    n_ex = int(seg_example[-1]) + 1 if seg_example.size else 0
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
    return text_len, seq_len, seg_text_offset


def _place_llm(
    llm_dst: np.ndarray, llm_stats: dict, items: dict[str, tuple], options: StepOptions, *,
    num_ranks: int, example_src: np.ndarray, text_len: np.ndarray, seg_example: np.ndarray,
    seg_len: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """The LLM plan placed on nodes, weighing the move's pieces: each example's text from its
    sampling rank, each encoded item from its encoder rank (``items``: phase name ->
    segment indices, encoder move, stats)."""
    enc_bytes = options.encoded_token_bytes or options.text_token_bytes
    sels = [sel for sel, *_ in items.values()]
    piece_ex = np.concatenate([np.arange(example_src.size)] + [seg_example[s] for s in sels])
    piece_src = [example_src] + [enc.dst_rank for _, enc, *_ in items.values()]
    piece_bytes = [text_len * options.text_token_bytes] + [seg_len[s] * enc_bytes for s in sels]
    return _placed(
        llm_dst, volume_bytes=np.concatenate(piece_bytes), volume_src=np.concatenate(piece_src),
        volume_dst=llm_dst[piece_ex], options=options, num_ranks=num_ranks, balanced=True,
        stats=llm_stats,
    )  # fmt: skip


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
    rows, src, kinds, sels = _checked(rows, src, options, num_ranks)
    phases = options.phases
    n_seg = rows.shape[0]
    seg_example, example_src = _examples(rows[:, EX], src)
    seg_len = segment_lengths(rows, phases)
    raw = rows[:, RAW].copy()
    text_len, seq_len, seg_text_offset = _sequences(raw, kinds == TEXT, seg_example, seg_len)

    # The encoder phases and the LLM phase's balancing are independent; the LLM placement then
    # weighs where the encoder outputs are.
    jobs = {
        p.name: partial(
            _encoder_phase, p, sels[p.name], raw[sels[p.name]], seg_len[sels[p.name]],
            src[sels[p.name]], options, num_ranks=num_ranks,
        )
        for p in phases
    }  # fmt: skip
    jobs["llm"] = partial(
        _balance_phase, seq_len, example_src, num_ranks=num_ranks, policy=options.llm_policy,
        cost=options.llm_cost, balanced=options.mode != "none",
        ranks_per_node=options.ranks_per_node, context_parallel=options.context_parallel,
        max_load=options.llm_max_load,
    )  # fmt: skip
    # A clocked ILP reads this process's CPU share for its limit: it plans alone.
    parallel = n_seg >= PARALLEL_MIN_SEGMENTS and options.placement not in CLOCKED_PLACEMENTS
    done = _side_by_side(jobs, parallel=parallel)
    llm_dst, llm_stats, llm_pieces = done.pop("llm")
    items = done  # phase name -> (segment indices, encoder move, stats, pieces)
    if options.mode != "none" and _places(options, num_ranks):
        llm_dst = _place_llm(
            llm_dst, llm_stats, items, options, num_ranks=num_ranks, example_src=example_src,
            text_len=text_len, seg_example=seg_example, seg_len=seg_len,
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
    for sel, *_ in items.values():
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
        llm_pieces=llm_pieces,
    )
