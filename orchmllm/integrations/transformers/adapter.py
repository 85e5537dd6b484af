"""What an adapter is: how one Hugging Face model family runs as orchmllm phases.

An adapter names a model's phases (its vision tower, audio tower, language model), turns a
processor row into orchmllm's example schema (:meth:`Adapter.to_example`), runs each tower on
packed items (:meth:`Adapter.encode`) and builds the language model's positions exactly as the
model's own code does (:meth:`Adapter.position_ids`). The registry maps HF model classes to
adapters: :func:`register_adapter`, :func:`adapter_for`.

A processor row is one example as the family's processor returns it, without the batch
dimension: ``input_ids`` with every item's placeholder tokens expanded, ``labels`` (the token
or ``-100``), and the item fields (``pixel_values``, ``image_grid_thw``, ``input_features``...).
Each item (an image, a video, a clip) becomes one segment ``[kind, raw rows, tokens]``: its
raw rows (patches, tiles, frames) go to its phase's encoder with a small record
(:class:`orchmllm.ItemField`: grid, seconds per frame, image size), and its tokens are the run
of placeholders it fills, in order, as the model's own ``masked_scatter`` fills them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

import orchmllm
from orchmllm.integrations import hf_compat
from orchmllm.schema import IGNORE_INDEX, MODALITIES, TEXT

# The attention implementations that build the block-diagonal mask of packed sequences from
# restarting position ids (with no attention mask and no cache).
PACKING_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")


@dataclass(frozen=True)
class Source:
    """Items of one kind in a processor row.

    Attributes:
        kind: ``"image"``, ``"video"``, ``"audio"``: what :meth:`Adapter.split` is asked for.
        token_id: the placeholder token its items fill in ``input_ids``.
        phase: the encoder phase (a row of ``orchmllm.schema.MODALITIES``) that encodes it.
    """

    kind: str
    token_id: int
    phase: str


@dataclass(frozen=True)
class Item:
    """One item of a processor row, as its phase's encoder takes it.

    Attributes:
        rows: float32 ``[raw rows, feature_dim]`` (patches, tiles or frames, flattened).
        meta: its phase's record: field name -> value (``width`` numbers).
        tokens: the LLM tokens it becomes: the placeholders it fills (None: the whole next
            run of its kind's placeholders, where the count follows rules of the processor's
            own, e.g. an anyres image's unpadded features and newlines).
    """

    rows: np.ndarray
    meta: Mapping[str, Any]
    tokens: int | None


class Adapter:
    """How one Hugging Face model family runs as orchmllm phases; subclass per family.

    A subclass sets :attr:`fields` (and :attr:`policies` where a tower batches otherwise than
    the modality table says) and implements :meth:`sources`, :meth:`feature_dims`,
    :meth:`split`, :meth:`encode` and :meth:`dummy`; :meth:`position_ids` and
    :meth:`language_kwargs` where the language model needs more than restarting 1-D positions.

    Args:
        model: the model it adapts (its config is read; the modules are passed to each call,
            so wrapping with FSDP2 afterwards is fine).
    """

    #: phase name -> the per-item record its items carry to :meth:`encode`.
    fields: ClassVar[Mapping[str, tuple[orchmllm.ItemField, ...]]] = {}
    #: phase name -> balancing policy, where not the modality table's.
    policies: ClassVar[Mapping[str, str]] = {}

    def __init__(self, model: nn.Module) -> None:
        self.config = model.config

    # -- data side: runs in the loader ----------------------------------------------------

    def sources(self) -> tuple[Source, ...]:
        """The kinds of items a processor row holds, their placeholders and phases."""
        raise NotImplementedError

    def feature_dims(self) -> dict[str, int]:
        """Phase name -> the width of its items' raw rows."""
        raise NotImplementedError

    def split(self, kind: str, row: Mapping[str, Any]) -> list[Item]:
        """The items of ``kind`` in ``row``, in the order their placeholders appear ([] when
        the row has none)."""
        raise NotImplementedError

    def to_example(self, row: Mapping[str, Any]) -> dict:
        """A processor row as orchmllm's example schema (``orchmllm.schema``).

        Text is every token that is no item's placeholder; its loss mask is where ``labels``
        is not ``-100`` (all text when the row has no labels). Each item fills the next run of
        its kind's placeholders.

        Args:
            row: one processor row (``input_ids``, optional ``labels``, the item fields). A
                field held as None is absent (a ``datasets.Dataset`` of rows with different
                fields gives None for the ones a row lacks).

        Returns:
            The schema dict: ``segments`` (items as ``[kind, raw rows, tokens]``),
            ``input_ids``, ``loss_mask``, each phase's raw arrays and ``item_meta``.

        Raises:
            ValueError: placeholders that do not match the items (their count, or an item's
                run broken by other tokens), or labels on a placeholder or that differ from
                the token they label.
        """
        row = {k: v for k, v in row.items() if v is not None}
        ids = np.asarray(row["input_ids"]).reshape(-1)
        labels = np.asarray(row.get("labels", ids)).reshape(-1)
        if labels.shape != ids.shape:
            raise ValueError(f"labels has shape {labels.shape}, input_ids {ids.shape}")
        owner = np.full(ids.size, -1)
        found: list[tuple[int, str, Item]] = []  # (first position, phase, item)
        for source in self.sources():
            items = self.split(source.kind, row)
            at = np.flatnonzero(ids == source.token_id)
            k = 0
            for i, it in enumerate(items):
                n = it.tokens if it.tokens is not None else _run_length(at[k:])
                run = at[k : k + n]
                if run.size != n or n == 0 or run[-1] - run[0] + 1 != n:
                    raise ValueError(
                        f"{source.kind} item {i}'s {n} placeholders (token {source.token_id}) are "
                        f"not one run of input_ids at position {at[k] if k < at.size else 'end'}"
                    )
                owner[run] = len(found)
                found.append((int(run[0]), source.phase, replace(it, tokens=n)))
                k += n
            if k != at.size:
                raise ValueError(
                    f"input_ids has {at.size} {source.kind} placeholders (token "
                    f"{source.token_id}), its {len(items)} {source.kind} items fill {k}"
                )
        text = owner < 0
        if np.any(labels[~text] != IGNORE_INDEX):
            raise ValueError(f"labels must be {IGNORE_INDEX} on placeholder tokens")
        targets = text & (labels != IGNORE_INDEX)
        if np.any(labels[targets] != ids[targets]):
            raise ValueError(f"labels must be the token or {IGNORE_INDEX} (HF shifts them)")
        segments: list[list[int]] = []
        arrays = {p: [] for p in self.feature_dims()}
        meta = {p: {f.name: [] for f in self.fields.get(p, ())} for p in arrays}
        pos = 0
        for start, phase, it in sorted(found, key=lambda f: f[0]):
            if start > pos:
                segments.append([TEXT, start - pos])
            segments.append([MODALITIES[phase].kind, int(it.rows.shape[0]), int(it.tokens)])
            arrays[phase].append(np.asarray(it.rows, dtype=np.float32))
            for name, values in meta[phase].items():
                values.append(it.meta[name])
            pos = start + it.tokens
        if pos < ids.size:
            segments.append([TEXT, ids.size - pos])
        return {
            "segments": segments,
            "input_ids": ids[text].astype(np.int64),
            "loss_mask": targets[text].astype(np.int64),
            **{MODALITIES[p].key: a for p, a in arrays.items()},
            "item_meta": {p: m for p, m in meta.items() if m},
        }

    # -- model side ---------------------------------------------------------------------

    def phases(self) -> tuple[orchmllm.EncoderPhase, ...]:
        """One encoder phase per phase of :meth:`feature_dims`, in the modality table's order:
        items state their tokens, so the divisor is 1."""
        dims = self.feature_dims()
        return tuple(
            orchmllm.EncoderPhase(
                m.name,
                m.kind,
                m.key,
                1,
                dims[m.name],
                self.policies.get(m.name, m.policy),
                fields=self.fields.get(m.name, ()),
            )  # fmt: skip
            for m in MODALITIES.values()
            if m.name in dims
        )

    def encode(
        self,
        model: nn.Module,
        phase: str,
        rows: torch.Tensor,
        lengths: torch.Tensor,
        meta: Mapping[str, torch.Tensor],
    ) -> orchmllm.Encoded:
        """Run ``phase``'s tower on packed items (at least one), with one call of each of its
        sharded modules: ``rows`` ``[sum(lengths), feature_dim]``, ``meta`` the items'
        records. Returns the items' tokens in order, with per-token values the language
        model needs (positions, DeepStack features)."""
        raise NotImplementedError

    def dummy(self, phase: str) -> Item:
        """The smallest valid item of ``phase``: a rank without items encodes it, so every
        rank calls every tower (FSDP2 needs it), and keeps none of its tokens."""
        raise NotImplementedError

    def language_model(self, model: nn.Module) -> nn.Module:
        """The decoder the LLM phase runs (without its head)."""
        return hf_compat.part(model, "language_model")

    def position_ids(self, batch: orchmllm.LLMBatch) -> torch.Tensor:
        """Positions of the packed sequences: restarting at 0 for each, ``[1, tokens]`` (the
        language model derives the block-diagonal mask from them); with pieces of split
        sequences (:attr:`orchmllm.LLMBatch.pieces`), each token's position in its whole
        sequence."""
        if batch.pieces is not None:
            return batch.pieces.positions.to(batch.lengths.device)[None]
        return restart_positions(batch.lengths)[None]

    def language_kwargs(self, batch: orchmllm.LLMBatch) -> dict[str, Any]:
        """More arguments of the language model's forward (none by default)."""
        return {}


def pixel_rows(row: Mapping[str, Any], key: str, width: int, *lead: int) -> np.ndarray:
    """``row[key]`` as rows of ``width`` values, under ``lead`` leading dimensions (e.g. the
    images, each a stack of tiles), where numpy would only say it cannot reshape.

    Raises:
        ValueError: the field does not split into such rows (an image processed at another
            size, or by another model's processor), naming the field, its shape and the
            width this model's tower takes.
    """
    values = np.asarray(row[key])
    if values.size % (width * int(np.prod(lead))):
        within = f" in each of {lead[0]} items" if lead else ""
        raise ValueError(
            f"{key} of shape {tuple(values.shape)} is not rows of {width} values{within}, "
            "what this model's vision tower takes (its config's channels and patch or image "
            "size): was it made by this model's processor, at this model's image size?"
        )
    return values.reshape(*lead, -1, width)


def _run_length(positions: np.ndarray) -> int:
    """How many of ``positions`` (sorted) are consecutive from the first."""
    if not positions.size:
        return 0
    gaps = np.flatnonzero(np.diff(positions) != 1)
    return int(gaps[0]) + 1 if gaps.size else int(positions.size)


def restart_positions(lengths: torch.Tensor) -> torch.Tensor:
    """``[sum(lengths)]`` positions 0, 1, ... restarting at each sequence."""
    starts = torch.cumsum(lengths, 0) - lengths
    total = int(lengths.sum())
    index = torch.arange(total, device=lengths.device)
    return index - torch.repeat_interleave(starts, lengths, output_size=total)


def mrope_positions(rope: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[4, 1, tokens]`` M-RoPE position ids of packed whole sequences, as
    ``get_rope_index`` gives them, with the restarting text positions first (the language
    model reads row 0 for the block-diagonal mask). Each position adds up the steps of the
    tokens before it in its sequence, so split sequences take theirs from the home layout
    (:func:`packed_mrope_positions`).

    Args:
        rope: int64 ``[tokens, 4]`` per token: its (t, h, w) offsets from its item's start and
            how far the position moves after it (an item's last token: the item's extent;
            its other tokens: 0; text: offsets 0 and a step of 1).
        lengths: the packed sequences' lengths.
    """
    step = rope[:, 3]
    before = torch.cumsum(step, 0) - step  # exclusive, over the whole pack
    starts = torch.cumsum(lengths, 0) - lengths
    base = before - torch.repeat_interleave(before[starts], lengths, output_size=rope.shape[0])
    return torch.cat([restart_positions(lengths)[None], (base[:, None] + rope[:, :3]).T])[:, None]


def packed_mrope_positions(batch: orchmllm.LLMBatch, rope: torch.Tensor) -> torch.Tensor:
    """:func:`mrope_positions` of ``batch``'s packed sequences, pieces of split sequences
    included: computed over the whole sequences of the home layout (``rope``: the per-token
    rows there, ``batch.token_values(..., home=True)``) and moved to the pieces (a
    collective with pieces), where row 0 is each token's position in its whole sequence."""
    whole = mrope_positions(rope, batch.home_lengths)
    if batch.pieces is None:
        return whole
    rows = batch.to_pieces(whole[1:, 0].T.contiguous())  # [tokens, 3] in the pieces' layout
    text = batch.pieces.positions.to(rows.device)
    return torch.cat([text[None], rows.T])[:, None]


def item_rope(offsets: torch.Tensor, advance: int) -> torch.Tensor:
    """One item's ``rope`` rows (see :func:`mrope_positions`) from its ``[3, tokens]``
    offsets and the step after it."""
    out = torch.zeros(offsets.shape[1], 4, dtype=torch.long, device=offsets.device)
    out[:, :3] = offsets.T
    out[-1, 3] = advance
    return out


TEXT_ROPE = (0, 0, 0, 1)  # what a text token contributes to mrope_positions


# -- the registry -------------------------------------------------------------------------


ADAPTERS: dict[str, type[Adapter]] = {}
"""HF model class name -> its adapter class. Extend it with :func:`register_adapter`."""


def register_adapter(model_class: type | str, adapter: type[Adapter]) -> type[Adapter]:
    """Balance ``model_class`` (and its subclasses) with ``adapter``.

    Args:
        model_class: the HF model class (or its name), e.g.
            ``Qwen2VLForConditionalGeneration``.
        adapter: an :class:`Adapter` subclass.

    Returns:
        ``adapter``.

    Raises:
        ValueError: ``adapter`` is not an :class:`Adapter` subclass.
    """
    if not (isinstance(adapter, type) and issubclass(adapter, Adapter)):
        raise ValueError(f"adapter must be an Adapter subclass, got {adapter!r}")
    name = model_class if isinstance(model_class, str) else model_class.__name__
    ADAPTERS[name] = adapter
    return adapter


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter registered for ``model``'s class (or the nearest registered base class).

    Raises:
        ValueError: no adapter is registered for it; the error names the registered classes
            and how to register one.
    """
    for cls in type(model).__mro__:
        if cls.__name__ in ADAPTERS:
            return ADAPTERS[cls.__name__](model)
    raise ValueError(
        f"no adapter is registered for {type(model).__name__}; registered: "
        f"{sorted(ADAPTERS)}. Write an orchmllm.integrations.transformers.Adapter subclass "
        f"for it and call register_adapter({type(model).__name__}, YourAdapter), or pass "
        "wrap(model, adapter=YourAdapter(model))"
    )
