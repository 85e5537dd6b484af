"""The segment table: the one int64 row per segment that every rank gathers for a step.

A rank's examples become rows (:func:`local_metadata`: local example index, kind, raw count,
prediction targets, the LLM tokens an item states); the step planner (:mod:`step_plan`) and
the simulator read only these rows, so they are the whole contract between the data and the
plan. :func:`segment_lengths` turns rows into the LLM tokens each segment becomes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from orchmllm.schema import TEXT, check_segments, given_tokens

__all__ = ["COLUMNS", "EX", "KIND", "RAW", "TARGETS", "TOKENS", "local_metadata", "segment_lengths"]

# Columns of the gathered metadata: one row per segment. TOKENS is an item's stated LLM token
# count (-1: ``raw // divisor``); rows of four columns (without it) plan too.
EX, KIND, RAW, TARGETS, TOKENS = range(5)
COLUMNS = 5


class Divides(Protocol):
    """What :func:`segment_lengths` reads of a phase (an ``EncoderPhase``)."""

    kind: int
    divisor: int


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


def segment_lengths(rows: np.ndarray, phases: Sequence[Divides]) -> np.ndarray:
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
