"""MLLM Global Orchestrator: one balanced layout per phase, glued by composed rearrangements.

Paper section 6. Each rank samples its own mini-batch of interleaved multimodal examples. Per
step the orchestrator

1. all-gathers the examples' segment tables once (:func:`local_metadata`: one int64 row per
   segment: example, kind, raw count, prediction targets), a few KB;
2. plans, as a pure function of the gathered rows (:func:`plan_step`, so a loader can run it
   in a background thread and every rank gets the same plan; a time-limited ILP placement is
   not one, so :meth:`Orchestrator.plan` solves it on one rank and broadcasts it): each
   encoder phase balances its own items (images, audio clips) by their raw lengths with its
   own policy, and the LLM phase balances whole examples by their interleaved sequence
   lengths;
3. executes (:meth:`Orchestrator.run`): raw encoder inputs move to the encoder layout, every
   encoder runs on every rank (FSDP2 needs the calls even with no items), encoder outputs go
   straight to the LLM layout with ``Pi_llm o Pi_enc^-1`` (the LLM plan lifted to items: an
   item goes where its example goes), one all-to-all per encoder forward and one backward,
   text moves with ``Pi_llm``, and each example's sequence is assembled in template order.

The orchestrator knows phases (a segment kind, a divisor from raw units to LLM tokens, a
policy), not a model: encoders and the token embedding are callables of the caller.

Modes: ``none`` moves nothing; ``llm`` balances only the LLM phase (encoders run where their
items were sampled, the pre-balancing ablation); ``full`` balances every phase.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from orchmllm import comm
from orchmllm.balance import PADDED_POLICIES
from orchmllm.cost import CostModel
from orchmllm.plan import Rearrangement, expand_rows
from orchmllm.schema import AUDIO, IMAGE, TEXT, EncodingRates, check_segments

__all__ = [
    "MODES",
    "EncoderPhase",
    "LLMBatch",
    "LocalBatch",
    "Orchestrator",
    "PhasePlan",
    "StepPlan",
    "default_phases",
    "local_metadata",
    "plan_step",
]

MODES = ("none", "llm", "full")
IGNORE_INDEX = -100
# Columns of the gathered metadata: one row per segment.
_EX, _KIND, _RAW, _TARGETS = range(4)


@dataclass(frozen=True)
class EncoderPhase:
    """One encoder phase: which segments it consumes and how it is balanced.

    ``key``: the example field holding the raw arrays (``image_patches``); ``divisor``: raw
    rows per LLM token; ``feature_dim``: raw row width; ``cost``: the phase's cost model over
    raw lengths (None: padded for padded policies, else packed linear, i.e. raw units).
    """

    name: str
    kind: int
    key: str
    divisor: int
    feature_dim: int
    policy: str = "greedy"
    cost: CostModel | None = None

    def __post_init__(self) -> None:
        if self.kind == TEXT or not isinstance(self.kind, int) or self.kind < 0:
            raise ValueError(f"kind must be a non-text segment kind, got {self.kind!r}")
        if self.divisor < 1:
            raise ValueError(f"divisor must be >= 1, got {self.divisor!r}")
        if self.feature_dim < 1:
            raise ValueError(f"feature_dim must be >= 1, got {self.feature_dim!r}")
        if self.name == "llm":
            raise ValueError("name 'llm' is reserved for the LLM phase")


def default_phases(
    rates: EncodingRates,
    *,
    patch_dim: int,
    n_mels: int,
    vision_policy: str = "greedy",
    audio_policy: str = "binary_search",
    vision_cost: CostModel | None = None,
    audio_cost: CostModel | None = None,
) -> tuple[EncoderPhase, EncoderPhase]:
    """The vision and audio phases of the schema in :mod:`orchmllm.schema`."""
    return (
        EncoderPhase(
            "vision", IMAGE, "image_patches", rates.divisor(IMAGE), patch_dim, vision_policy,
            vision_cost,
        ),
        EncoderPhase(
            "audio", AUDIO, "audio_mels", rates.divisor(AUDIO), n_mels, audio_policy, audio_cost
        ),
    )  # fmt: skip


def _default_cost(policy: str, cost: CostModel | None) -> CostModel:
    if cost is not None:
        return cost
    return CostModel("padded" if policy in PADDED_POLICIES else "packed")


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


# -- metadata ----------------------------------------------------------------------------


def local_metadata(examples: Sequence[Mapping]) -> np.ndarray:
    """This rank's segment table, ``int64 (segments, 4)``: example index, kind, raw count,
    prediction targets in the segment (text tokens with loss_mask 1, except position 0 of the
    sequence, which nothing predicts). Pure; this is all the orchestrator gathers."""
    rows = []
    for i, ex in enumerate(examples):
        segs = check_segments(ex["segments"])
        if not segs:
            raise ValueError(f"examples[{i}] has no segments")
        mask = np.asarray(ex["loss_mask"], dtype=np.int64).reshape(-1)
        n_text = sum(c for k, c in segs if k == TEXT)
        if mask.size != n_text:
            raise ValueError(
                f"examples[{i}] loss_mask has {mask.size} tokens, segments say {n_text}"
            )
        pos = text = 0
        for kind, count in segs:
            targets = 0
            if kind == TEXT:
                seg_mask = mask[text : text + count]
                targets = int(seg_mask.sum()) - int(pos == 0 and seg_mask[0] != 0)
                text += count
            rows.append((i, kind, count, targets))
            pos += count
    return np.asarray(rows, dtype=np.int64).reshape(-1, 4)


# -- planning (pure) ---------------------------------------------------------------------


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
    """Everything every rank needs for one step; equal on all ranks (see :meth:`same_as`)."""

    num_ranks: int
    mode: str
    example_src: np.ndarray  # (examples,) sampling rank
    text_len: np.ndarray
    seq_len: np.ndarray  # whole interleaved sequence length
    seg_example: np.ndarray  # (segments,) global example id, segments in example order
    seg_kind: np.ndarray
    seg_len: np.ndarray  # LLM tokens of the segment (text count or encoded length)
    seg_item: np.ndarray  # item id within its phase (-1 for text)
    seg_text_offset: np.ndarray  # offset of a text segment within its example's text
    num_targets: int  # global prediction targets (normalises the loss)
    llm: Rearrangement
    phases: dict[str, PhasePlan]
    llm_stats: dict = field(repr=False)

    def same_as(self, other: StepPlan) -> bool:
        """Same rearrangements and layout (timings aside)."""
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
        """Per-phase metrics known when planning (``run`` adds the bytes moved)."""
        out = {name: dict(p.stats) for name, p in self.phases.items()}
        out["llm"] = dict(self.llm_stats)
        return out


def _imbalance(loads: np.ndarray) -> float:
    mean = float(loads.mean()) if loads.size else 0.0
    return float(loads.max() / mean) if mean > 0 else 1.0


def _balance_phase(
    lengths: np.ndarray,
    src: np.ndarray,
    *,
    num_ranks: int,
    policy: str,
    cost: CostModel | None,
    balanced: bool,
    placement: str,
    ranks_per_node: int | None,
) -> tuple[np.ndarray, dict]:
    """Destination rank per item, and the phase's load statistics.

    Loads are measured with the phase's cost model; a heuristic plan whose slowest rank is no
    faster than the sampled layout's is replaced by the sampled layout (nothing moves).
    """
    from orchmllm.balance import balance

    t0 = time.perf_counter()
    if balanced and lengths.size:
        a = balance(
            lengths, num_ranks, policy, src=src, cost=cost, ranks_per_node=ranks_per_node,
            placement=placement,
        )  # fmt: skip
        dst = np.asarray(a.dst, dtype=np.int64)
    else:
        dst = src.copy()
    model = _default_cost(policy, cost)
    before = model.loads(lengths, src, num_ranks)
    after = model.loads(lengths, dst, num_ranks)
    if after.max() >= before.max():  # never move for a plan that is no better than staying
        dst, after = src.copy(), before
    plan_ms = (time.perf_counter() - t0) * 1e3
    stats = {
        "imbalance_before": _imbalance(before),
        "imbalance_after": _imbalance(after),
        "loads_before": before.tolist(),
        "loads_after": after.tolist(),
        "plan_ms": plan_ms,
        "items": int(lengths.size),
    }
    return dst, stats


def plan_step(
    rows: np.ndarray,
    src: np.ndarray,
    *,
    num_ranks: int,
    phases: Sequence[EncoderPhase],
    mode: str = "full",
    llm_policy: str = "greedy",
    llm_cost: CostModel | None = None,
    placement: str = "none",
    ranks_per_node: int | None = None,
) -> StepPlan:
    """Plan one step from the gathered segment rows (pure: same inputs, same plan).

    ``rows``/``src``: the output of ``comm.all_gather_rows(local_metadata(examples))``.
    """
    _check_choice("mode", mode, MODES)
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
    src = np.asarray(src, dtype=np.int64).reshape(-1)
    if src.size != rows.shape[0]:
        raise ValueError(f"src has {src.size} entries, rows has {rows.shape[0]}")
    by_kind = {p.kind: p for p in phases}
    if len(by_kind) != len(phases) or len({p.name for p in phases}) != len(phases):
        raise ValueError(f"phases must have distinct kinds and names, got {list(phases)}")
    unknown = set(np.unique(rows[:, _KIND]).tolist()) - set(by_kind) - {TEXT}
    if unknown:
        raise ValueError(f"rows has segment kinds {sorted(unknown)} with no phase")
    # Global example ids: a new example starts where (rank, local example index) changes.
    n_seg = rows.shape[0]
    key = np.stack([src, rows[:, _EX]], axis=1)
    starts = np.ones(n_seg, dtype=bool)
    starts[1:] = np.any(key[1:] != key[:-1], axis=1)
    seg_example = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    if np.any(np.diff(src) < 0):
        raise ValueError("src must be non-decreasing (rows in rank order)")
    ex_rank = src[first]
    expected = np.arange(first.size) - np.searchsorted(ex_rank, ex_rank, side="left")
    if not np.array_equal(rows[first, _EX], expected):
        raise ValueError(
            "rows must list each rank's examples 0, 1, ... in order, segments contiguous"
        )
    n_ex = first.size
    example_src = src[first]
    kinds = rows[:, _KIND]
    divisor = np.ones(n_seg, dtype=np.int64)
    for p in phases:
        divisor[kinds == p.kind] = p.divisor
    seg_len = rows[:, _RAW] // divisor
    is_text = kinds == TEXT
    text_len = np.bincount(seg_example, weights=np.where(is_text, rows[:, _RAW], 0), minlength=n_ex)
    text_len = text_len.astype(np.int64)
    seq_len = np.bincount(seg_example, weights=seg_len, minlength=n_ex).astype(np.int64)
    if np.any(seq_len == 0):
        bad = int(np.flatnonzero(seq_len == 0)[0])
        raise ValueError(f"example {bad} (gather order) has an empty LLM sequence")
    text_cum = np.cumsum(np.where(is_text, rows[:, _RAW], 0))
    ex_text_start = np.concatenate(([0], np.cumsum(text_len)))[:-1]
    seg_text_offset = np.where(is_text, text_cum - rows[:, _RAW] - ex_text_start[seg_example], 0)

    common = {"num_ranks": num_ranks, "placement": placement, "ranks_per_node": ranks_per_node}
    llm_dst, llm_stats = _balance_phase(
        seq_len, example_src, policy=llm_policy, cost=llm_cost, balanced=mode != "none", **common
    )
    llm = Rearrangement.from_assignment(example_src, llm_dst, num_ranks=num_ranks)

    seg_item = np.full(n_seg, -1, dtype=np.int64)
    phase_plans = {}
    for p in phases:
        sel = np.flatnonzero(kinds == p.kind)
        seg_item[sel] = np.arange(sel.size)
        item_src, item_ex, raw = src[sel], seg_example[sel], rows[sel, _RAW]
        enc_dst, stats = _balance_phase(
            raw, item_src, policy=p.policy, cost=p.cost, balanced=mode == "full", **common
        )
        encoder = Rearrangement.from_assignment(item_src, enc_dst, num_ranks=num_ranks)
        lifted = Rearrangement.from_assignment(item_src, llm_dst[item_ex], num_ranks=num_ranks)
        t0 = time.perf_counter()
        to_llm = lifted.compose(encoder.inverse())
        stats["plan_ms"] += (time.perf_counter() - t0) * 1e3
        phase_plans[p.name] = PhasePlan(
            p.name, p.kind, item_ex, raw, raw // p.divisor, encoder, to_llm, stats
        )
    return StepPlan(
        num_ranks=num_ranks,
        mode=mode,
        example_src=example_src,
        text_len=text_len,
        seq_len=seq_len,
        seg_example=seg_example,
        seg_kind=kinds.copy(),
        seg_len=seg_len,
        seg_item=seg_item,
        seg_text_offset=seg_text_offset,
        num_targets=int(rows[:, _TARGETS].sum()),
        llm=llm,
        phases=phase_plans,
        llm_stats=llm_stats,
    )


# -- execution ---------------------------------------------------------------------------


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(x.size, dtype=np.int64)
    np.cumsum(x[:-1], out=out[1:])
    return out


@dataclass(frozen=True)
class _Assembly:
    """Where every position of this rank's LLM sequences comes from (pure, from the plan).

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


def _assembly(plan: StepPlan, rank: int) -> _Assembly:
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
    return _Assembly(
        examples=examples,
        lengths=lengths,
        index=expand_rows(starts, lens),
        text_pos=text_pos,
        seq_start=_exclusive_cumsum(lengths),
        rows=rows,
    )


@dataclass
class LocalBatch:
    """One rank's sampled examples as flat tensors (items and tokens in local order)."""

    metadata: np.ndarray  # local_metadata rows
    raw: dict[str, torch.Tensor]  # phase name -> [raw rows, feature_dim]
    input_ids: torch.Tensor  # int64 [text tokens]
    loss_mask: torch.Tensor  # int64 [text tokens]

    @classmethod
    def from_examples(
        cls, examples: Sequence[Mapping], phases: Sequence[EncoderPhase]
    ) -> LocalBatch:
        metadata = local_metadata(examples)
        raw = {}
        for p in phases:
            arrays = [np.asarray(a, dtype=np.float32) for ex in examples for a in ex[p.key]]
            counts = metadata[metadata[:, _KIND] == p.kind, _RAW]
            if len(arrays) != counts.size:
                raise ValueError(f"{p.key}: {len(arrays)} arrays but {counts.size} segments")
            for a, c in zip(arrays, counts, strict=True):
                if a.shape != (c, p.feature_dim):
                    raise ValueError(
                        f"{p.key} item shape {a.shape}, expected ({c}, {p.feature_dim})"
                    )
            flat = np.concatenate(arrays) if arrays else np.zeros((0, p.feature_dim), np.float32)
            raw[p.name] = torch.from_numpy(flat)

        def tokens(key: str) -> torch.Tensor:
            parts = [np.asarray(ex[key], dtype=np.int64).reshape(-1) for ex in examples]
            return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))

        return cls(metadata, raw, tokens("input_ids"), tokens("loss_mask"))

    def to(self, device: torch.device | str) -> LocalBatch:
        raw = {k: v.to(device) for k, v in self.raw.items()}
        return LocalBatch(self.metadata, raw, self.input_ids.to(device), self.loss_mask.to(device))


@dataclass
class LLMBatch:
    """What the LLM needs on this rank after the orchestrator ran the encoders.

    Embed ``input_ids`` with the LLM's token embedding, then :meth:`assemble` gives the packed
    sequences ``[sum(lengths), hidden]``; ``targets`` holds the next token at each position
    (``IGNORE_INDEX`` where nothing is predicted). Normalise the summed loss by
    ``num_targets`` (global), so the gradient does not depend on the layout.
    """

    input_ids: torch.Tensor
    lengths: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    num_targets: int
    example_ids: np.ndarray  # global ids (gather order) of this rank's sequences
    stats: dict[str, dict]
    encoded: list[torch.Tensor]  # encoder outputs in the LLM layout, one per phase
    index: torch.Tensor

    def assemble(self, text_embeds: torch.Tensor) -> torch.Tensor:
        if text_embeds.shape[0] != self.input_ids.shape[0]:
            raise ValueError(
                f"text_embeds has {text_embeds.shape[0]} rows, input_ids {self.input_ids.shape[0]}"
            )
        pieces = [text_embeds, *(e.to(text_embeds.dtype) for e in self.encoded)]
        return torch.cat(pieces).index_select(0, self.index.to(text_embeds.device))


Encoder = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Orchestrator:
    """Gathers, plans and executes the per-phase rearrangements of an MLLM step.

    ``group``: the data-parallel group the moves use; ``meta_group``: where metadata is
    gathered (a separate gloo group lets a loader gather in a background thread; default
    ``group``). ``ranks_per_node``/``placement`` are passed to :func:`orchmllm.balance` and
    split the reported bytes into intra- and inter-node.

    A plan that is not a pure function of the gathered metadata (``placement="ilp"``: CBC is
    stopped by a clock) is computed on rank 0 of ``meta_group`` and broadcast there
    (:func:`orchmllm.data.exchange.agreed_plan`), which needs a CPU (gloo) group: when
    ``meta_group`` is None and ``group`` is not gloo, a gloo group over the same ranks is
    created here, a collective, so construct the orchestrator on every rank together. Such an
    orchestrator also pays the ILP's one-time setup here (:func:`orchmllm.placement.prepare_ilp`
    on the rank that solves), not in the first step.
    """

    def __init__(
        self,
        phases: Sequence[EncoderPhase],
        *,
        mode: str = "full",
        llm_policy: str = "greedy",
        llm_cost: CostModel | None = None,
        placement: str = "none",
        ranks_per_node: int | None = None,
        group: dist.ProcessGroup | None = None,
        meta_group: dist.ProcessGroup | None = None,
        timeout: float | None = None,
    ) -> None:
        _check_choice("mode", mode, MODES)
        if ranks_per_node is not None and ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node!r}")
        self.phases = tuple(phases)
        self.mode = mode
        self.llm_policy = llm_policy
        self.llm_cost = llm_cost
        self.placement = placement
        self.ranks_per_node = ranks_per_node
        self.group = group
        self.meta_group = meta_group if meta_group is not None else group
        self.timeout = timeout
        if self._deterministic() or not (dist.is_available() and dist.is_initialized()):
            return
        if meta_group is None and dist.get_backend(group) != "gloo":
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            self.meta_group = dist.new_group(ranks, backend="gloo", timeout=self._agree_timeout())
        self._check_meta_group()
        if dist.get_rank(self.meta_group) == 0:
            from orchmllm.placement import prepare_ilp

            prepare_ilp()

    def _deterministic(self) -> bool:
        from orchmllm.data.orchestrated import OrchestratorPlanner  # it imports this module

        return OrchestratorPlanner(self).deterministic

    def _agree_timeout(self) -> timedelta:
        return dist.default_pg_timeout if self.timeout is None else timedelta(seconds=self.timeout)

    def _check_meta_group(self) -> None:
        backend = dist.get_backend(self.meta_group)
        if backend != "gloo":
            raise ValueError(
                f"placement={self.placement!r} plans on rank 0 and broadcasts the plan on "
                f"meta_group, which must be a gloo group, got backend {backend!r}"
            )

    def gather(self, metadata: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """All-gather every rank's :func:`local_metadata` rows (the step's only metadata)."""
        return comm.all_gather_rows(metadata, group=self.meta_group, timeout=self.timeout)

    def plan(self, rows: np.ndarray, src: np.ndarray) -> StepPlan:
        """:func:`plan_step` with this orchestrator's options, the same plan on every rank.

        Pure and computed on each rank when the options make it a function of ``rows`` and
        ``src`` alone; otherwise (``placement="ilp"``) computed on rank 0 of ``meta_group`` and
        broadcast, a collective: every rank calls this together. Safe in a thread either way.
        """
        from orchmllm.data.exchange import agreed_plan
        from orchmllm.data.orchestrated import OrchestratorPlanner  # it imports this module

        planner = OrchestratorPlanner(self)
        deterministic = planner.deterministic
        if not deterministic and dist.is_available() and dist.is_initialized():
            self._check_meta_group()
        num_ranks = dist.get_world_size(self.group)
        return agreed_plan(
            lambda: planner(rows, src, num_ranks),
            deterministic=deterministic,
            group=self.meta_group,
            timeout=self._agree_timeout().total_seconds(),
        )

    def plan_batch(self, batch: LocalBatch) -> StepPlan:
        return self.plan(*self.gather(batch.metadata))

    def _move(
        self, plan: Rearrangement, tensors: list[torch.Tensor], sizes: np.ndarray
    ) -> list[torch.Tensor]:
        # Every rank holds the whole plan, so all skip a no-op move together.
        if np.array_equal(plan.src_rank, plan.dst_rank) and np.array_equal(
            plan.src_slot, plan.dst_slot
        ):
            return tensors
        return comm.move_many(
            plan, tensors, [sizes] * len(tensors), group=self.group, timeout=self.timeout
        )

    def _bytes(self, plan: Rearrangement, sizes: np.ndarray, row_bytes: int) -> tuple[int, int]:
        t = plan.traffic(sizes=sizes, ranks_per_node=self.ranks_per_node)
        return t["intra"] * row_bytes, t["inter"] * row_bytes

    def run(
        self,
        batch: LocalBatch,
        encoders: Mapping[str, Encoder],
        *,
        plan: StepPlan | None = None,
    ) -> LLMBatch:
        """Move, encode and assemble one step; ``plan`` from a prefetcher, or computed now.

        ``encoders[name](raw_rows, lengths)`` gets the phase's items in its balanced layout and
        must return ``[sum(lengths // divisor), hidden]``. It is called on every rank, with
        empty tensors where a rank has no items. ``stats[phase]["bytes_intra"/"bytes_inter"]``
        are the forward bytes that leave their rank, summed over all ranks (raw inputs plus
        encoder outputs for an encoder phase, token ids and loss mask for ``llm``).
        """
        rank = dist.get_rank(self.group)
        missing = [p.name for p in self.phases if p.name not in encoders]
        if missing:
            raise ValueError(f"encoders has no callable for phases {missing}")
        if plan is None:
            plan = self.plan_batch(batch)
        if plan.num_ranks != dist.get_world_size(self.group):
            raise ValueError(f"plan.num_ranks = {plan.num_ranks}, group has another size")
        stats = plan.stats()
        layout = _assembly(plan, rank)
        encoded = []
        for p in self.phases:
            pp = plan.phases[p.name]
            (x,) = self._move(pp.encoder, [batch.raw[p.name]], pp.raw)
            mine = pp.encoder.items_at(rank)
            lengths = torch.as_tensor(pp.raw[mine], dtype=torch.long, device=x.device)
            out = encoders[p.name](x, lengths)
            expected = int(pp.encoded[mine].sum())
            if out.dim() != 2 or out.shape[0] != expected:
                raise ValueError(
                    f"encoders[{p.name!r}] returned shape {tuple(out.shape)}, expected "
                    f"({expected}, hidden) for raw lengths {pp.raw[mine].tolist()}"
                )
            (y,) = self._move(pp.to_llm, [out], pp.encoded)
            encoded.append(y)
            raw_b = self._bytes(pp.encoder, pp.raw, x.shape[1] * x.element_size())
            out_b = self._bytes(pp.to_llm, pp.encoded, out.shape[1] * out.element_size())
            stats[p.name]["bytes_intra"] = raw_b[0] + out_b[0]
            stats[p.name]["bytes_inter"] = raw_b[1] + out_b[1]
        ids, mask = self._move(plan.llm, [batch.input_ids, batch.loss_mask], plan.text_len)
        intra, inter = self._bytes(
            plan.llm, plan.text_len, ids.element_size() + mask.element_size()
        )
        stats["llm"]["bytes_intra"], stats["llm"]["bytes_inter"] = intra, inter
        return self._llm_batch(plan, layout, ids, mask, encoded, stats)

    @staticmethod
    def _llm_batch(
        plan: StepPlan,
        layout: _Assembly,
        ids: torch.Tensor,
        mask: torch.Tensor,
        encoded: list[torch.Tensor],
        stats: dict,
    ) -> LLMBatch:
        device = ids.device
        total = int(layout.lengths.sum())
        text_pos = torch.from_numpy(layout.text_pos).to(device)
        is_start = torch.zeros(total, dtype=torch.bool, device=device)
        is_start[torch.from_numpy(layout.seq_start).to(device)] = True
        targets = torch.full((total,), IGNORE_INDEX, dtype=torch.long, device=device)
        predicted = (mask != 0) & ~is_start[text_pos]
        targets[text_pos[predicted] - 1] = ids[predicted]
        return LLMBatch(
            input_ids=ids,
            lengths=torch.from_numpy(layout.lengths).to(device),
            targets=targets,
            loss_mask=targets != IGNORE_INDEX,
            num_targets=plan.num_targets,
            example_ids=layout.examples,
            stats=stats,
            encoded=encoded,
            index=torch.from_numpy(layout.index).to(device),
        )
