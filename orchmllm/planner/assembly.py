"""How one rank assembles its LLM sequences from the buffers a step's moves deliver.

Pure and torch-free: from the :class:`~orchmllm.planner.step_plan.StepPlan` alone, every
position of the rank's interleaved sequences is mapped to a row of the text embeddings or of a
phase's encoder outputs, in the order the moves deliver them. The orchestrator gathers with
the index; the loader computes it in its background thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from orchmllm.planner.plan import expand_rows
from orchmllm.planner.step_plan import StepPlan
from orchmllm.schema import TEXT

__all__ = ["Assembly", "assembly"]


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
