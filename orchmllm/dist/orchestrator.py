"""MLLM Global Orchestrator: executes a step's per-phase plans (paper section 6).

Each rank samples its own mini-batch of interleaved multimodal examples. Per step the
orchestrator

1. all-gathers the examples' segment tables once
   (:func:`orchmllm.planner.segments.local_metadata`: one int64 row per segment), a few KB;
2. plans with the pure step planner (:func:`orchmllm.planner.step_plan.plan_step`; a loader
   runs it in a background thread instead): each encoder phase balances its own items, the
   LLM phase whole examples; a time-limited ILP placement is solved on one rank and
   broadcast;
3. executes (:meth:`Orchestrator.run`): raw encoder inputs move to the encoder layout, every
   encoder runs on every rank (FSDP2 needs the calls even with no items) unless no rank has
   an item of its phase, in which case it runs nowhere (see below), encoder outputs go
   straight to the LLM layout with ``Pi_llm o Pi_enc^-1`` (the LLM plan lifted to items: an
   item goes where its example goes), one all-to-all per encoder forward and one backward,
   text moves with ``Pi_llm``, and each example's sequence is assembled in template order.

The orchestrator knows phases (a segment kind, a divisor from raw units to LLM tokens, a
policy), not a model: encoders and the token embedding are callables of the caller.

Per-item metadata: a phase that declares ``fields``
(:class:`~orchmllm.planner.step_options.ItemField`: an image's grid, a video's seconds per
frame) has each item carry a small record from the
example (``item_meta``) to its encoder, moved with its rows; an encoder may return per-token
values beside its embeddings (:class:`Encoded`: M-RoPE offsets, DeepStack features), which
move with its tokens to the LLM layout (:meth:`LLMBatch.token_values`). Nothing is padded onto
the data rows.

Context parallelism (``StepOptions.context_parallel`` > 1): an example the LLM plan splits
(``StepPlan.llm_pieces``) moves whole to its home rank like any example and is assembled there;
its pieces' rows then go on to the ranks that compute them
(:func:`orchmllm.planner.piece_layout.llm_piece_layout`: one more all-to-all, autograd-aware, in
:meth:`LLMBatch.assemble`, and its targets in :meth:`Orchestrator.run`), and
:attr:`LLMBatch.pieces` gives the LLM the pieces' positions and attention
(:class:`~orchmllm.dist.context_parallel.PackedPieces`).

A phase with no item on any rank is skipped on every rank: every rank holds the same plan, so
all skip it together and FSDP's collectives stay matched. This is what keeps training
unchanged: a plain run never calls a tower without items, so its parameters get no gradient
(``None``) and AdamW leaves them alone (no update from momentum, no weight decay, no step
count). Running the tower on a dummy input would give them zero gradients instead, which
AdamW does not skip. Where some ranks have items, the others still run the encoder on no
item (zero gradients), which is what the plain run's sum over ranks gives them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.distributed as dist

from orchmllm.dist import comm
from orchmllm.dist.agreement import agreed_plan
from orchmllm.dist.context_parallel import PackedPieces, SplitSequence
from orchmllm.dist.topology import Topology
from orchmllm.planner.assembly import Assembly
from orchmllm.planner.assembly import assembly as rank_assembly
from orchmllm.planner.piece_layout import PieceLayout, llm_piece_layout, piece_layout, scaled
from orchmllm.planner.placement import prepare_ilp
from orchmllm.planner.plan import Rearrangement
from orchmllm.planner.segments import EX, KIND, RAW, local_metadata, segment_lengths
from orchmllm.planner.step_options import EncoderPhase, ItemField, StepOptions
from orchmllm.planner.step_plan import PhasePlan, StepPlan, plan_step
from orchmllm.schema import IGNORE_INDEX, TEXT

__all__ = ["Encoded", "LLMBatch", "LocalBatch", "Orchestrator"]


@dataclass
class LocalBatch:
    """One rank's sampled examples as flat tensors (items and tokens in local order).

    Build it with :meth:`from_examples` and pass it to :meth:`Orchestrator.run`.

    Attributes:
        metadata: this rank's :func:`~orchmllm.planner.segments.local_metadata` rows, int64
            ``(segments, 4)``, a NumPy array (what :meth:`Orchestrator.gather` gathers).
        raw: phase name -> float32 ``[raw rows, feature_dim]``, the phase's items' rows
            concatenated.
        input_ids: int64 ``[text tokens]``, every example's text tokens concatenated.
        loss_mask: int64 ``[text tokens]``, aligned with ``input_ids``.
        item_meta: phase name -> field name -> ``[items, width]`` (int64 or float64), the
            per-item records of a phase that declares ``fields``, items in the order of
            ``raw`` (empty for phases without fields).
    """

    metadata: np.ndarray
    raw: dict[str, torch.Tensor]
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    item_meta: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def from_examples(
        cls, examples: Sequence[Mapping], phases: Sequence[EncoderPhase]
    ) -> LocalBatch:
        """Flatten this rank's examples into tensors on the CPU.

        Args:
            examples: this rank's examples in local order (schema fields ``segments``,
                ``input_ids``, ``loss_mask``, and each phase's ``key``: one
                ``(raw count, feature_dim)`` array per segment of the phase's kind; an
                example without items of a phase needs no field for it), and for a phase
                with ``fields``, ``item_meta[phase][field]``: one row of ``width`` numbers per
                item of the phase, in segment order.
            phases: the encoder phases, as the orchestrator has them.

        Returns:
            The :class:`LocalBatch`; raw arrays become float32.

        Raises:
            ValueError: a bad segment table or ``loss_mask`` (:func:`local_metadata`), an
                example whose ``input_ids`` count differs from its text segments, a phase
                whose number of arrays differs from its segments, an array whose shape is
                not ``(raw count, feature_dim)``, or a missing or misshapen ``item_meta``
                field.
        """
        metadata = local_metadata(examples)
        raw, item_meta = {}, {}
        for p in phases:
            arrays = [
                np.asarray(a, dtype=np.float32) for ex in examples for a in ex.get(p.key) or ()
            ]
            counts = metadata[metadata[:, KIND] == p.kind, RAW]
            if len(arrays) != counts.size:
                raise ValueError(f"{p.key}: {len(arrays)} arrays but {counts.size} segments")
            for a, c in zip(arrays, counts, strict=True):
                if a.shape != (c, p.feature_dim):
                    raise ValueError(
                        f"{p.key} item shape {a.shape}, expected ({c}, {p.feature_dim})"
                    )
            flat = np.concatenate(arrays) if arrays else np.zeros((0, p.feature_dim), np.float32)
            raw[p.name] = torch.from_numpy(flat)
            if p.fields:
                items = np.bincount(
                    metadata[metadata[:, KIND] == p.kind, EX], minlength=len(examples)
                )
                item_meta[p.name] = {
                    f.name: _item_field(examples, items, p.name, f) for f in p.fields
                }

        text = metadata[metadata[:, KIND] == TEXT]
        text_tokens = np.bincount(text[:, EX], weights=text[:, RAW], minlength=len(examples))

        def tokens(key: str) -> torch.Tensor:
            parts = [np.asarray(ex[key], dtype=np.int64).reshape(-1) for ex in examples]
            for i, (part, n) in enumerate(zip(parts, text_tokens, strict=True)):
                if part.size != n:
                    raise ValueError(
                        f"examples[{i}] {key} has {part.size} tokens, segments say {int(n)}"
                    )
            return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))

        return cls(metadata, raw, tokens("input_ids"), tokens("loss_mask"), item_meta)

    def to(self, device: torch.device | str) -> LocalBatch:
        """The batch with its tensors on ``device`` (``metadata`` stays on the host).

        Args:
            device: where the moves run, e.g. the rank's CUDA device for NCCL.

        Returns:
            A new :class:`LocalBatch`; this one is unchanged.
        """
        raw = {k: v.to(device) for k, v in self.raw.items()}
        meta = {
            k: {f: v.to(device) for f, v in fields.items()} for k, fields in self.item_meta.items()
        }
        return LocalBatch(
            self.metadata, raw, self.input_ids.to(device), self.loss_mask.to(device), meta
        )


def _item_field(
    examples: Sequence[Mapping], items: np.ndarray, phase: str, spec: ItemField
) -> torch.Tensor:
    """One field of a phase's per-item records, every example's rows concatenated."""
    parts = [np.zeros((0, spec.width), dtype=spec.dtype)]
    for i, (ex, n) in enumerate(zip(examples, items.tolist(), strict=True)):
        value = ((ex.get("item_meta") or {}).get(phase) or {}).get(spec.name)
        if value is None and n:
            raise ValueError(
                f"examples[{i}] has {n} {phase} items but no item_meta[{phase!r}][{spec.name!r}]"
            )
        arr = np.asarray([] if value is None else value, dtype=spec.dtype)
        if (
            arr.size != n * spec.width
            or arr.ndim > 2
            or (arr.ndim == 2 and arr.shape[1] != spec.width)
        ):
            raise ValueError(
                f"examples[{i}] item_meta[{phase!r}][{spec.name!r}] has shape {arr.shape}, "
                f"expected ({n}, {spec.width}): one row per {phase} item"
            )
        parts.append(arr.reshape(n, spec.width))
    return torch.from_numpy(np.concatenate(parts))


@dataclass
class LLMBatch:
    """What the LLM needs on this rank after the orchestrator ran the encoders.

    Embed ``input_ids`` with the LLM's token embedding, then :meth:`assemble` gives the packed
    sequences ``[sum(lengths), hidden]``. Normalise the summed loss by ``num_targets``
    (global), so the gradient does not depend on the layout.

    Attributes:
        input_ids: int64 ``[text tokens]``, the text of this rank's sequences, in sequence
            order.
        lengths: int64 ``[sequences]``, the length of each packed sequence.
        targets: int64 ``[sum(lengths)]``, the next token at each position (``IGNORE_INDEX``
            where nothing is predicted).
        loss_mask: bool ``[sum(lengths)]``, the positions with a target
            (``targets != IGNORE_INDEX``; not the per-token mask of :class:`LocalBatch`).
        num_targets: the prediction targets over all ranks (normalises the loss).
        example_ids: global ids (gather order) of this rank's sequences.
        stats: per-phase statistics (:meth:`~orchmllm.planner.step_plan.StepPlan.stats` plus the
            bytes moved, see :meth:`Orchestrator.run`).
        encoded: encoder outputs in the LLM layout, one ``[rows, hidden]`` per phase, in phase
            order.
        index: int64 ``[sum(lengths)]``, the row of ``cat([text_embeds, *encoded])`` each
            position takes.
        phases: the phase names of ``encoded``, in its order.
        values: phase name -> the per-token values its encoder returned beside its embeddings
            (:class:`Encoded`), name -> ``[rows, ...]`` aligned with its ``encoded`` rows; read
            them in sequence layout with :meth:`token_values`.
        absent: the phases no rank had an item of in this step: their encoders ran nowhere
            (their parameters keep no gradient, as in a plain run), and ``encoded`` and
            ``phases`` leave them out (they contribute no row).
        pieces: with split examples in the step (context parallelism), the positions and the
            attention of this rank's packed sequences, pieces included (pass it to the LLM);
            None otherwise. Then ``lengths``, ``targets`` and ``loss_mask`` are of the pieces'
            layout, and :meth:`assemble`, :meth:`token_values` and :meth:`mask` send the
            pieces' rows on: collectives, which every rank calls in the same order.
        scatter: (with ``pieces``) the move of the pieces' rows, with its group and timeout.
        home_lengths: int64 ``[sequences]``, the lengths of this rank's assembled sequences,
            every example whole (the home layout, before the pieces' rows leave); ``lengths``
            when nothing is split. What is computed over whole sequences (M-RoPE positions,
            which add up per-token steps from the sequence's start) is computed in this
            layout (``token_values(..., home=True)``) and then moved with :meth:`to_pieces`.
    """

    input_ids: torch.Tensor
    lengths: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    num_targets: int
    example_ids: np.ndarray
    stats: dict[str, dict]
    encoded: list[torch.Tensor]
    index: torch.Tensor
    phases: tuple[str, ...] = ()
    values: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    absent: tuple[str, ...] = ()
    pieces: PackedPieces | None = None
    scatter: _Scatter | None = None
    home_lengths: torch.Tensor | None = None

    def to_pieces(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` of the home layout in the pieces' layout: with :attr:`pieces` a
        collective (every rank calls it in the same order), differentiable.

        Args:
            rows: one row per position of the assembled sequences (:attr:`home_lengths`).

        Returns:
            One row per position of :attr:`lengths`; ``rows`` itself when nothing is split.
        """
        if self.scatter is None:
            return rows
        return self.scatter(rows)

    def assemble(self, text_embeds: torch.Tensor) -> torch.Tensor:
        """Interleave text embeddings and encoder outputs into the packed sequences.

        Differentiable: gradients flow back to ``text_embeds`` and to the encoder outputs.

        Args:
            text_embeds: ``[text tokens, hidden]``, the token embeddings of ``input_ids``;
                the encoder outputs are cast to its dtype.

        Returns:
            ``[sum(lengths), hidden]`` on ``text_embeds``' device, sequences one after
            another, each in template order.

        Raises:
            ValueError: ``text_embeds`` has another number of rows than ``input_ids``.
        """
        if text_embeds.shape[0] != self.input_ids.shape[0]:
            raise ValueError(
                f"text_embeds has {text_embeds.shape[0]} rows, input_ids {self.input_ids.shape[0]}"
            )
        rows = [text_embeds, *(e.to(text_embeds.dtype) for e in self.encoded)]
        return self.to_pieces(torch.cat(rows).index_select(0, self.index.to(text_embeds.device)))

    def token_values(
        self, name: str, fill: float | Sequence[float] | torch.Tensor, *, home: bool = False
    ) -> torch.Tensor:
        """The per-token values ``name`` at every position of the packed sequences.

        Tokens of a phase whose encoder returned ``name`` take theirs; every other position
        (text, other phases) takes ``fill``. Differentiable like :meth:`assemble`.

        Args:
            name: a key of the :class:`Encoded` values some encoder returned.
            fill: the value of the other positions, broadcast to one token's value shape.
            home: the values in the home layout (:attr:`home_lengths`; no collective), not
                the pieces'.

        Returns:
            ``[sum(lengths), ...]`` (``home``: ``[sum(home_lengths), ...]``), in the dtype and
            on the device of the encoders' values; where no encoder ran that could have
            returned ``name`` (every phase that ran returned other values, and some phase is
            :attr:`absent`), ``fill`` at every position, as ``torch.as_tensor(fill)`` gives
            it.

        Raises:
            ValueError: no phase returned ``name`` and none is absent.
        """
        like = next((v[name] for v in self.values.values() if name in v), None)
        if like is None and self.absent:
            filler = torch.as_tensor(fill, device=self.input_ids.device)
            lengths = self.home_lengths if home else self.lengths
            return filler.expand(int(lengths.sum()), *filler.shape).clone()
        if like is None:
            known = sorted({k for v in self.values.values() for k in v})
            raise ValueError(f"no encoder returned token values {name!r}; they returned {known}")
        shape = like.shape[1:]
        filler = torch.as_tensor(fill, dtype=like.dtype, device=like.device).expand(shape)
        rows = [filler.expand(self.input_ids.shape[0], *shape)]
        for phase, enc in zip(self.phases, self.encoded, strict=True):
            mine = self.values.get(phase, {}).get(name)
            rows.append(filler.expand(enc.shape[0], *shape) if mine is None else mine)
        rows = torch.cat(rows).index_select(0, self.index.to(like.device))
        return rows if home else self.to_pieces(rows)

    def mask(self, *sources: str) -> torch.Tensor:
        """Which positions of the packed sequences hold a token of ``sources``.

        Args:
            sources: phase names (an :attr:`absent` one holds no position), or ``"text"`` for
                the text tokens.

        Returns:
            bool ``[sum(lengths)]``.

        Raises:
            ValueError: a source that is neither ``"text"`` nor a phase.
        """
        rows = {"text": self.input_ids.shape[0]}
        rows.update((p, e.shape[0]) for p, e in zip(self.phases, self.encoded, strict=True))
        rows.update((p, 0) for p in self.absent)
        unknown = [s for s in sources if s not in rows]
        if unknown:
            raise ValueError(f"sources {unknown} are not among {list(rows)}")
        bounds = np.cumsum([0, *rows.values()])
        keep = torch.zeros(int(bounds[-1]), dtype=torch.bool, device=self.index.device)
        for k, source in enumerate(rows):
            if source in sources:
                keep[int(bounds[k]) : int(bounds[k + 1])] = True
        return self.to_pieces(keep[self.index].to(torch.uint8)).bool()


@dataclass(frozen=True)
class _Scatter:
    """The move of the pieces' rows from their home ranks (:class:`PieceLayout`), on the
    data-parallel group: the backward sends the gradients home."""

    layout: PieceLayout
    group: dist.ProcessGroup | None
    timeout: float

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        m = self.layout
        return comm.move(m.move, rows, sizes=m.sizes, group=self.group, timeout=self.timeout)


def _packed_pieces(layout: PieceLayout, topology: Topology, *, causal: bool) -> PackedPieces:
    """This rank's batch of ``layout``'s piece layout as the attention sees it: its segments,
    its pieces' records, and every split item's (the blocks it joins)."""
    rank = topology.rank
    records = {s.example: SplitSequence(s.example, s.ranks, s.chunks) for s in layout.splits}
    mine = {i: records[e] for e, i in layout.segments[rank].items()}
    return PackedPieces(
        layout.lengths[rank], mine, topology=topology, others=list(records.values()),
        causal=causal,
    )  # fmt: skip


@dataclass(frozen=True)
class _SplitPhase:
    """An encoder phase with split items: its raw rows go from their home ranks to the
    pieces, the encoder attends over each item's gathered keys, and its outputs go home."""

    raw: PieceLayout  # raw rows, home -> pieces
    tokens: PieceLayout  # the tokens they become, home -> pieces (run inverted)
    topology: Topology

    @classmethod
    def of(cls, pp: PhasePlan, divisor: int, topology: Topology) -> _SplitPhase | None:
        """The phase's split (None: every item is whole)."""
        raw = piece_layout(pp.encoder, pp.raw, pp.pieces)
        if raw is None:
            return None
        tokens = piece_layout(pp.encoder, pp.encoded, scaled(pp.pieces, divisor))
        return cls(raw, tokens, topology)

    def encode(self, encoder: Encoder, x: torch.Tensor) -> Encoded:
        """``encoder(rows, lengths, pieces=...)`` on this rank's pieces' layout, its outputs
        (and their values) moved back to the home layout."""
        t, rank = self.topology, self.topology.rank
        lengths = self.raw.lengths[rank]
        pieces = _packed_pieces(self.raw, t, causal=False)
        rows = _Scatter(self.raw, t.group, t.timeout)(x)
        out = encoder(rows, torch.as_tensor(lengths, device=x.device), pieces=pieces)
        out = out if isinstance(out, Encoded) else Encoded(out)
        expected = int(self.tokens.lengths[rank].sum())
        _check_encoded("(split phase)", out, expected, lengths)
        home = _Scatter(replace(self.tokens, move=self.tokens.move.inverse()), t.group, t.timeout)
        return Encoded(home(out.embeds), {k: home(v) for k, v in out.values.items()})


@dataclass
class Encoded:
    """What an encoder returns when its tokens carry per-token values besides embeddings.

    The values move with the tokens to the LLM layout (one all-to-all per dtype with the
    embeddings) and are read there with :meth:`LLMBatch.token_values`: positions the LLM needs
    (M-RoPE offsets), features it adds at later layers (DeepStack). Every rank's encoder must
    return the same names, dtypes and trailing shapes, also with no items.

    Attributes:
        embeds: ``[tokens, hidden]``, as a plain encoder returns.
        values: name -> ``[tokens, ...]``, one row per token of ``embeds``.
    """

    embeds: torch.Tensor
    values: dict[str, torch.Tensor] = field(default_factory=dict)


Encoder = Callable[..., "torch.Tensor | Encoded"]


class Orchestrator:
    """Gathers, plans and executes the per-phase rearrangements of an MLLM step.

    A plan that is not a pure function of the gathered metadata (``placement="ilp"``: CBC is
    stopped by a clock) is computed on rank 0 of the topology's gloo metadata group and
    broadcast there (:func:`orchmllm.dist.agreement.agreed_plan`); such an orchestrator also pays
    the ILP's one-time setup here (:func:`orchmllm.planner.placement.prepare_ilp` on the rank that
    solves), not in the first step.

    Args:
        options: how every step is planned (:class:`~orchmllm.planner.step_options.StepOptions`: the
            encoder phases, mode, policies, placement, ranks per node, byte counts).
        topology: the job's process groups (:class:`orchmllm.dist.topology.Topology`: the
            data-parallel group the moves use, the gloo group metadata is gathered on, ranks
            per node, the timeout), e.g. shared with the loader. None builds one over the
            default group that this orchestrator owns (a collective: construct it on every
            rank together; dropping the orchestrator destroys its group). ``ranks_per_node``
            is one fact: the options take the topology's when they have none.

    Attributes:
        options: the :class:`~orchmllm.planner.step_options.StepOptions` every step is planned with.
        topology: the :class:`~orchmllm.dist.topology.Topology` it gathers and moves on.

    Raises:
        TypeError: ``options`` is not a :class:`~orchmllm.planner.step_options.StepOptions`.
        ValueError: the options and the topology name different ``ranks_per_node``, or the
            topology opened no context-parallel groups for ``options.context_parallel``.
    """

    def __init__(self, options: StepOptions, *, topology: Topology | None = None) -> None:
        if not isinstance(options, StepOptions):
            raise TypeError(f"options must be a StepOptions, got {type(options).__name__}")
        if topology is None:
            topology = Topology.build(
                ranks_per_node=options.ranks_per_node, context_parallel=options.context_parallel
            )
        if topology.context_parallel % options.context_parallel:
            raise ValueError(
                f"options.context_parallel={options.context_parallel} needs a topology built "
                f"with it (Topology.build(context_parallel={options.context_parallel})), got "
                f"one with context_parallel={topology.context_parallel}"
            )
        self.options = _with_ranks_per_node(options, topology.ranks_per_node)
        self.topology = topology
        deterministic = self.options.deterministic
        if not deterministic and topology.distributed and dist.get_rank(topology.meta_group) == 0:
            prepare_ilp()

    @property
    def phases(self) -> tuple[EncoderPhase, ...]:
        """The encoder phases, in the order :meth:`run` executes them."""
        return self.options.phases

    @property
    def ranks_per_node(self) -> int | None:
        """Consecutive ranks per node (None: unknown; placement off, all bytes intra-node)."""
        return self.options.ranks_per_node

    def gather(self, metadata: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """All-gather every rank's :func:`local_metadata` rows (the step's only metadata).

        A collective on the topology's metadata group: every rank calls this together.

        Args:
            metadata: this rank's :func:`local_metadata` rows, int64 ``(segments, 4)``.

        Returns:
            ``(rows, src)``: every rank's rows in rank order and the rank of each row, as
            :meth:`plan` takes them.

        Raises:
            ValueError: ``metadata`` is not a 2-D integer array with the same number of
                columns on every rank.
            RuntimeError: a rank did not join the gather within the topology's timeout.
        """
        t = self.topology
        return comm.all_gather_rows(metadata, group=t.meta_group, timeout=t.timeout)

    def plan(self, rows: np.ndarray, src: np.ndarray) -> StepPlan:
        """:func:`plan_step` with this orchestrator's options, the same plan on every rank.

        Pure and computed on each rank when the options make it a function of ``rows`` and
        ``src`` alone; otherwise (``placement="ilp"``) computed on rank 0 of the topology's
        metadata group and broadcast, a collective: every rank calls this together. Safe in a
        thread either way.

        Args:
            rows: every rank's :func:`local_metadata` rows in rank order (from :meth:`gather`).
            src: the rank of each row.

        Returns:
            The :class:`~orchmllm.planner.step_plan.StepPlan`, the same on every rank.

        Raises:
            ValueError: rows the planner rejects (:func:`plan_step`).
            PeerFailed: on the other ranks, when rank 0 failed to compute a broadcast plan
                (its own error is raised there).
            RuntimeError: a broadcast that did not complete within the topology's timeout.
        """
        t = self.topology
        return agreed_plan(
            lambda: plan_step(rows, src, self.options, num_ranks=t.size),
            deterministic=self.options.deterministic,
            group=t.meta_group,
            timeout=t.timeout,
        )

    def plan_batch(self, batch: LocalBatch) -> StepPlan:
        """Gather ``batch``'s metadata and plan the step (:meth:`gather`, then :meth:`plan`).

        A collective: every rank calls this together.

        Args:
            batch: this rank's :class:`LocalBatch`.

        Returns:
            The :class:`~orchmllm.planner.step_plan.StepPlan`, the same on every rank.

        Raises:
            ValueError: as :meth:`gather` and :meth:`plan`.
            PeerFailed: as :meth:`plan`.
            RuntimeError: as :meth:`gather` and :meth:`plan` (a collective timed out).
        """
        return self.plan(*self.gather(batch.metadata))

    def _move(
        self, plan: Rearrangement, tensors: list[torch.Tensor], sizes: list[np.ndarray]
    ) -> list[torch.Tensor]:
        # Every rank holds the whole plan, so all skip a no-op move together.
        if np.array_equal(plan.src_rank, plan.dst_rank) and np.array_equal(
            plan.src_slot, plan.dst_slot
        ):
            return tensors
        t = self.topology
        return comm.move_many(plan, tensors, sizes, group=t.group, timeout=t.timeout)

    def _bytes(self, plan: Rearrangement, sizes: np.ndarray, row_bytes: int) -> tuple[int, int]:
        t = plan.traffic(sizes=sizes, ranks_per_node=self.ranks_per_node)
        return t["intra"] * row_bytes, t["inter"] * row_bytes

    def run(
        self,
        batch: LocalBatch,
        encoders: Mapping[str, Encoder],
        *,
        plan: StepPlan | None = None,
        assembly: Assembly | None = None,
    ) -> LLMBatch:
        """Move, encode and assemble one step; ``plan`` from a prefetcher, or computed now.

        ``encoders[name](raw_rows, lengths)`` gets the phase's items in its balanced layout and
        must return ``[tokens, hidden]``: each item's tokens (its stated count, else
        ``length // divisor``), items in order. A phase with ``fields`` calls
        ``encoders[name](raw_rows, lengths, meta)``, ``meta`` the items' records (field name ->
        ``[items, width]``). An encoder may return an :class:`Encoded` instead, whose per-token
        values move with its tokens (:meth:`LLMBatch.token_values`). It is called on every
        rank, with empty tensors where a rank has no items, unless no rank has an item of its
        phase: then it is called nowhere (:attr:`LLMBatch.absent`). In a step where the plan
        splits items of the phase (``PhasePlan.pieces``: context parallelism) it is called as
        ``encoders[name](rows, lengths, pieces=...)`` on the pieces' layout (whole items, then
        this rank's pieces), ``pieces`` a bidirectional
        :class:`~orchmllm.dist.context_parallel.PackedPieces` to attend and position with
        (a collective per call of its ``attend``); its outputs go back to the items' homes.
        ``stats[phase]["bytes_intra"/"bytes_inter"]`` are the forward bytes that leave their
        rank, summed over all ranks (raw inputs, item records and encoder outputs with their
        values for an encoder phase, token ids and loss mask for ``llm``).

        A collective on the topology's data-parallel group (and, without ``plan``, on its
        metadata group): every rank calls this together. The moves are autograd-aware: the
        encoder outputs' backward is an all-to-all too, so every rank must backpropagate if
        any does.

        Args:
            batch: this rank's :class:`LocalBatch`, on the device the moves use.
            encoders: phase name -> its encoder, ``encoder(raw_rows, lengths)`` with
                ``raw_rows`` ``[sum(lengths), feature_dim]`` and ``lengths`` int64 raw rows
                per item (``encoder(raw_rows, lengths, meta)`` for a phase with ``fields``).
            plan: the step's plan made ahead for exactly this batch (e.g.
                ``PlannedBatch.plan`` from :func:`~orchmllm.data.orchestrated.orchestrated_loader`);
                None plans now (:meth:`plan_batch`).
            assembly: this rank's :func:`~orchmllm.planner.assembly.assembly` of ``plan``, computed
                ahead with it (``PlannedBatch.assembly``), so that nothing but the moves and
                the encoders runs here; None computes it now.

        Returns:
            This rank's :class:`LLMBatch`.

        Raises:
            ValueError: ``encoders`` lacks a phase, ``plan`` is not this step's (another
                group size, other phases, or other segments on this rank than ``batch``
                holds), an ``assembly`` without its ``plan`` or of another rank or step, an
                encoder returned another shape, or a tensor does not match the plan (or,
                without ``plan``, as :meth:`plan_batch`).
            PeerFailed: without ``plan``, as :meth:`plan`.
            RuntimeError: a move or gather did not complete within the topology's timeout.
        """
        rank = self.topology.rank
        missing = [p.name for p in self.phases if p.name not in encoders]
        if missing:
            raise ValueError(f"encoders has no callable for phases {missing}")
        if assembly is not None and plan is None:
            raise ValueError("assembly was given without plan: pass the plan it was made from")
        if plan is None:
            plan = self.plan_batch(batch)
        if plan.num_ranks != self.topology.size:
            raise ValueError(f"plan.num_ranks = {plan.num_ranks}, group has another size")
        _check_plan_fits(plan, batch, self.phases, rank)
        if assembly is None:
            assembly = rank_assembly(plan, rank)
        else:
            _check_assembly_fits(assembly, plan, rank)
        stats = plan.stats()
        encoded, values, absent = [], {}, []
        for p in self.phases:
            pp = plan.phases[p.name]
            meta = batch.item_meta.get(p.name, {})
            if sorted(meta) != sorted(f.name for f in p.fields):
                raise ValueError(
                    f"batch.item_meta[{p.name!r}] has fields {sorted(meta)}, the phase declares "
                    f"{[f.name for f in p.fields]}: build the batch with these phases"
                )
            if pp.raw.size == 0:  # no item on any rank: all skip it (module docstring)
                absent.append(p.name)
                stats[p.name]["bytes_intra"] = stats[p.name]["bytes_inter"] = 0
                continue
            ones = np.ones(pp.raw.size, dtype=np.int64)
            x, *moved = self._move(
                pp.encoder, [batch.raw[p.name], *meta.values()], [pp.raw] + [ones] * len(meta)
            )
            mine = pp.encoder.items_at(rank)
            lengths = torch.as_tensor(pp.raw[mine], dtype=torch.long, device=x.device)
            args = (x, lengths, dict(zip(meta, moved, strict=True))) if p.fields else (x, lengths)
            split = _SplitPhase.of(pp, p.divisor, self.topology)
            out = encoders[p.name](*args) if split is None else split.encode(encoders[p.name], x)
            out = out if isinstance(out, Encoded) else Encoded(out)
            _check_encoded(p.name, out, int(pp.encoded[mine].sum()), pp.raw[mine])
            names = list(out.values)
            y, *token_values = self._move(
                pp.to_llm, [out.embeds, *out.values.values()], [pp.encoded] * (1 + len(names))
            )
            encoded.append(y)
            values[p.name] = dict(zip(names, token_values, strict=True))
            moves = [
                self._bytes(pp.encoder, pp.raw, _row_bytes([x])),
                self._bytes(pp.encoder, ones, _row_bytes(moved)),
                self._bytes(pp.to_llm, pp.encoded, _row_bytes([out.embeds, *token_values])),
            ]
            if split is not None:  # to the pieces and back
                moves.append(self._bytes(split.raw.move, split.raw.sizes, _row_bytes([x])))
                row = _row_bytes([out.embeds, *token_values])
                moves.append(self._bytes(split.tokens.move, split.tokens.sizes, row))
            stats[p.name]["bytes_intra"] = sum(m[0] for m in moves)
            stats[p.name]["bytes_inter"] = sum(m[1] for m in moves)
        ids, mask = self._move(plan.llm, [batch.input_ids, batch.loss_mask], [plan.text_len] * 2)
        intra, inter = self._bytes(plan.llm, plan.text_len, _row_bytes([ids, mask]))
        stats["llm"]["bytes_intra"], stats["llm"]["bytes_inter"] = intra, inter
        out = self._llm_batch(plan, assembly, ids, mask, encoded, stats, values, tuple(absent))
        layout = llm_piece_layout(plan)
        return out if layout is None else self._split(out, layout)

    def _split(self, out: LLMBatch, layout: PieceLayout) -> LLMBatch:
        """``out`` in the pieces' layout: its targets moved now, its rows when assembled,
        and the pieces' attention (whose records' check is a collective of each block)."""
        t = self.topology
        scatter = _Scatter(layout, t.group, t.timeout)
        targets = scatter(out.targets)
        lengths = layout.lengths[t.rank]
        pieces = _packed_pieces(layout, t, causal=True)
        bytes_ = self.options.encoded_token_bytes or 0  # the hidden rows the pieces carry
        intra, inter = self._bytes(layout.move, layout.sizes, bytes_)
        out.stats["llm"]["bytes_intra"] += intra
        out.stats["llm"]["bytes_inter"] += inter
        return replace(
            out,
            lengths=torch.from_numpy(lengths).to(targets.device),
            targets=targets,
            loss_mask=targets != IGNORE_INDEX,
            pieces=pieces,
            scatter=scatter,
        )

    @staticmethod
    def _llm_batch(
        plan: StepPlan,
        layout: Assembly,
        ids: torch.Tensor,
        mask: torch.Tensor,
        encoded: list[torch.Tensor],
        stats: dict,
        values: dict[str, dict[str, torch.Tensor]],
        absent: tuple[str, ...],
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
            phases=tuple(values),
            values={k: v for k, v in values.items() if v},
            absent=absent,
            home_lengths=torch.from_numpy(layout.lengths).to(device),
        )


def _row_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of one row of each tensor, together (what one item or token carries)."""
    return sum(int(np.prod(t.shape[1:], dtype=np.int64)) * t.element_size() for t in tensors)


def _check_encoded(name: str, out: Encoded, expected: int, raw: np.ndarray) -> None:
    """An encoder's output must have one row per token its items become, values too."""
    if out.embeds.dim() != 2 or out.embeds.shape[0] != expected:
        raise ValueError(
            f"encoders[{name!r}] returned shape {tuple(out.embeds.shape)}, expected "
            f"({expected}, hidden) for raw lengths {raw.tolist()}"
        )
    for key, value in out.values.items():
        if value.dim() < 1 or value.shape[0] != expected:
            raise ValueError(
                f"encoders[{name!r}] returned values {key!r} of shape {tuple(value.shape)}, "
                f"expected {expected} rows (one per token)"
            )


def _with_ranks_per_node(options: StepOptions, ranks_per_node: int | None) -> StepOptions:
    """``options`` with the topology's ``ranks_per_node`` where they have none; two different
    values are an error (placement and the byte counts would disagree)."""
    if ranks_per_node is None or ranks_per_node == options.ranks_per_node:
        return options
    if options.ranks_per_node is None:
        return replace(options, ranks_per_node=ranks_per_node)
    raise ValueError(
        f"options.ranks_per_node={options.ranks_per_node} but the topology's "
        f"ranks_per_node={ranks_per_node}: set it in one place"
    )


def _check_plan_fits(
    plan: StepPlan, batch: LocalBatch, phases: Sequence[EncoderPhase], rank: int
) -> None:
    """A plan given to :meth:`Orchestrator.run` must be this step's: the same phases, and this
    rank's segments as the batch holds them (a plan of another step would move wrong rows)."""
    names = [p.name for p in phases]
    if sorted(plan.phases) != sorted(names):
        raise ValueError(f"plan has phases {sorted(plan.phases)}, the orchestrator {names}")
    # This rank's examples, and so its segments, are one run of the gather order.
    first, end = np.searchsorted(
        plan.seg_example, np.searchsorted(plan.example_src, [rank, rank + 1])
    )
    mine = slice(first, end)
    if not np.array_equal(plan.seg_kind[mine], batch.metadata[:, KIND]) or not np.array_equal(
        plan.seg_len[mine], segment_lengths(batch.metadata, phases)
    ):
        raise ValueError(
            f"plan does not match rank {rank}'s batch: its segments (kinds and lengths) differ; "
            "pass the plan computed for this batch"
        )


def _check_assembly_fits(layout: Assembly, plan: StepPlan, rank: int) -> None:
    """An assembly given to :meth:`Orchestrator.run` must be ``rank``'s of ``plan``: the same
    examples and, for the text and every phase, the rows the moves deliver (an assembly of
    another rank or step would index the wrong rows)."""
    examples = plan.llm.items_at(rank)
    rows = {"text": int(plan.text_len[examples].sum())}
    for name, pp in plan.phases.items():
        rows[name] = int(pp.encoded[pp.to_llm.items_at(rank)].sum())
    if not np.array_equal(layout.examples, examples) or layout.rows != rows:
        raise ValueError(
            f"assembly is not rank {rank}'s of this plan (examples {layout.examples.tolist()}, "
            f"rows {layout.rows}; the plan gives {examples.tolist()}, {rows}): pass the "
            "assembly computed with the plan"
        )
