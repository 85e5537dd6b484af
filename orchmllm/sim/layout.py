"""Where every item of every phase runs, per balancing mode, from training's own step planner.

The OrchMLLM modes call :func:`orchmllm.plan_step`, the function the orchestrator runs in
training, on the batch's segment table (:func:`segment_rows`), with each phase's calibrated
cost model; only ``disttrain`` (a baseline) is planned here.

Modes:

- ``none``: no balancing; every item runs where its example was sampled.
- ``llm``: OrchMLLM with only the LLM dispatcher (the paper's Figure 10 ablation, its
  stand-in for pre-balancing methods that balance one phase): encoders run where their items
  were sampled, the LLM phase gets a balanced layout of whole examples, text and encoder
  outputs move there (as ``orchmllm.dist.orchestrator`` does in its ``llm`` mode).
- ``disttrain``: DistTrain's intra-microbatch reordering (Zhang et al., section 6.1, Alg. 2)
  of the global batch, read literally: sort the samples by size in *ascending* order, give each
  to the data-parallel group with the smallest summed size so far (ties: fewer samples, then
  the lower index). A sample's size is its modality tokens (image patches plus audio encoder
  frames): DistTrain packs the LLM sequence to a fixed length and balances only the encoder
  input. One layout serves every phase, and it is computed in DistTrain's CPU preprocessing
  before loading, so it moves no data at run time.
- ``full``: OrchMLLM: a separate balanced layout per phase (each encoder's, the LLM's), each
  with the policy tailored to how its module is batched (``policies``).

``placement="node"`` is the step planner's ``auto`` node-wise rearrangement of every runtime
move, over the bytes the move carries (see :mod:`orchmllm.planner.step_plan`).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from orchmllm.config import ModelConfig
from orchmllm.planner.context_parallel import Pieces as SplitPieces
from orchmllm.planner.step_options import MODES as STEP_MODES
from orchmllm.planner.step_options import EncoderPhase, StepOptions
from orchmllm.planner.step_plan import plan_step
from orchmllm.schema import LLM, MODALITIES, TEXT
from orchmllm.sim.batch import Batch
from orchmllm.sim.compute import Submodule

MODES = (*STEP_MODES, "disttrain")
# The simulator's placement names -> the step planner's placement method.
PLACEMENTS = {"none": "none", "node": "auto"}
TEXT_TOKEN_BYTES = 8  # int64 token ids
ACT_BYTES = 2  # bf16 raw rows (patches, mel frames) and encoder outputs


def tailored() -> dict[str, str]:
    """OrchMLLM's tailored policies (paper 8.3): each modality row's (greedy for packed phases,
    Alg. 2 for padded audio) and greedy for the LLM; read from the table when called, so a
    modality registered after this module's import has its row's policy."""
    return {**{m.name: m.policy for m in MODALITIES.values()}, LLM: "greedy"}


@dataclass(frozen=True)
class Layout:
    """Destination rank of every item in every phase, and what computing it cost.

    Attributes:
        example: int64 ``[n]``, the LLM-phase rank of each example (a split example's: its
            home, the rank of its first token).
        items: encoder name -> int64 ``[items]``, its phase's rank of each of its items.
        plan_ms: wall time of the step planner.
        pieces: the LLM phase's split examples (``StepPlan.llm_pieces``; empty: none split;
            see :mod:`orchmllm.sim.context_parallel`).
    """

    example: np.ndarray
    items: dict[str, np.ndarray]
    plan_ms: float = 0.0
    pieces: SplitPieces = field(default_factory=SplitPieces.empty)


def disttrain_reorder(sizes: np.ndarray, num_ranks: int) -> np.ndarray:
    """DistTrain Alg. 2: ascending sort, each sample to the group with the least summed size.

    Ties in size go to the group holding fewer samples, then the lower index: DistTrain's data
    has no sample without images, ours has text-only ones, which would otherwise all land on
    group 0.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    dst = np.empty(sizes.size, dtype=np.int64)
    heap = [(0, 0, r) for r in range(num_ranks)]
    for i in np.argsort(sizes, kind="stable"):
        load, count, r = heapq.heappop(heap)
        dst[i] = r
        heapq.heappush(heap, (load + int(sizes[i]), count + 1, r))
    return dst


def segment_rows(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    """The batch as the segment table every rank gathers in training (rank order; each
    example's text, then its items of each modality in table order), and the rank of each
    row."""
    n = batch.text.size
    has_text = np.flatnonzero(batch.text > 0)
    items = [(MODALITIES[name].kind, it) for name, it in batch.items.items()]
    items.sort(key=lambda pair: pair[0])
    example = np.concatenate([has_text, *(it.example for _, it in items)])
    kind = np.concatenate(
        [np.full(has_text.size, TEXT, np.int64)]
        + [np.full(it.example.size, k, np.int64) for k, it in items]
    )
    raw = np.concatenate([batch.text[has_text], *(it.raw for _, it in items)])
    order = np.lexsort((kind, example))  # stable within a kind: items keep their order
    example, kind, raw = example[order], kind[order], raw[order]
    if example.size and (example[0] != 0 or np.any(np.diff(example) > 1) or example[-1] != n - 1):
        raise ValueError("every example needs a text token or an item to be planned")
    b = batch.examples_per_rank
    rows = np.stack([example % b, kind, raw, np.zeros_like(raw)], axis=1)
    return rows, example // b


def step_options(
    mode: str,
    *,
    config: ModelConfig,
    modules: Mapping[str, Submodule],
    placement: str,
    ranks_per_node: int,
    policies: Mapping[str, str] | None,
    context_parallel: int = 1,
    llm_max_load: float | None = None,
) -> StepOptions:
    """Training's step planner options for this model: each phase with its calibrated cost,
    bf16 volumes, and the paper's tailored policies unless ``policies`` overrides them; the
    LLM phase may split examples over ``context_parallel`` ranks under ``llm_max_load``."""
    pol = {**tailored(), **(policies or {})}
    phases = tuple(
        EncoderPhase(
            name, MODALITIES[name].kind, MODALITIES[name].key, enc.rate.divisor,
            enc.feature_dim, pol[name], modules[name].cost, stride=enc.stride,
            value_bytes=ACT_BYTES,
        )
        for name, enc in config.encoders.items()
    )  # fmt: skip
    return StepOptions(
        phases,
        mode=mode,
        llm_policy=pol[LLM],
        llm_cost=modules[LLM].cost,
        placement=PLACEMENTS[placement],
        ranks_per_node=ranks_per_node,
        text_token_bytes=TEXT_TOKEN_BYTES,
        encoded_token_bytes=encoded_token_bytes(config),
        context_parallel=context_parallel,
        llm_max_load=llm_max_load,
    )


def plan(
    batch: Batch,
    mode: str,
    *,
    config: ModelConfig,
    modules: Mapping[str, Submodule],
    placement: str = "none",
    ranks_per_node: int = 8,
    policies: Mapping[str, str] | None = None,
    context_parallel: int = 1,
    llm_max_load: float | None = None,
) -> Layout:
    """Destination ranks of every phase's items under ``mode`` (see the module docstring);
    with ``context_parallel`` > 1 the LLM phase may split examples (``StepOptions``), its
    pieces in :attr:`Layout.pieces`."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {tuple(PLACEMENTS)}, got {placement!r}")
    src = batch.example_src
    start = time.perf_counter()
    if mode in ("none", "disttrain"):
        d = batch.num_ranks
        ex = src if mode == "none" else disttrain_reorder(modality_tokens(batch, config), d)
        plan_ms = (time.perf_counter() - start) * 1e3
        return Layout(ex, {n: ex[batch.of(n).example] for n in config.encoders}, plan_ms)
    options = step_options(
        mode, config=config, modules=modules, placement=placement,
        ranks_per_node=ranks_per_node, policies=policies, context_parallel=context_parallel,
        llm_max_load=llm_max_load,
    )  # fmt: skip
    rows, row_src = segment_rows(batch)
    step = plan_step(rows, row_src, options, num_ranks=batch.num_ranks)
    plan_ms = (time.perf_counter() - start) * 1e3
    return Layout(
        step.llm.dst_rank,
        {name: p.encoder.dst_rank for name, p in step.phases.items()},
        plan_ms,
        step.llm_pieces,
    )


def modality_tokens(batch: Batch, config: ModelConfig) -> np.ndarray:
    """Encoder input tokens per example (every encoder's sequence lengths summed)."""
    n = batch.text.size
    size = np.zeros(n)
    for name in config.encoders:
        size += np.bincount(
            batch.of(name).example, weights=batch.encoder_lengths(name, config), minlength=n
        )
    return size.astype(np.int64)


def raw_row_bytes(config: ModelConfig, name: str) -> int:
    """Bytes of one raw row of encoder ``name``'s input (bf16)."""
    return config.encoders[name].feature_dim * ACT_BYTES


def encoded_token_bytes(config: ModelConfig) -> int:
    return config.llm.hidden * ACT_BYTES


@dataclass(frozen=True)
class Pieces:
    """What the LLM dispatcher moves: each example's text and encoded items, from where they are.

    Attributes:
        example: owning example of each piece.
        src: rank holding the piece before the LLM phase.
        bytes: its bytes.
        phase: the phase that made it: :data:`orchmllm.schema.LLM` for text, else the encoder.
    """

    example: np.ndarray
    src: np.ndarray
    bytes: np.ndarray
    phase: np.ndarray


def llm_pieces(batch: Batch, config: ModelConfig, layout: Layout) -> Pieces:
    enc = float(encoded_token_bytes(config))
    n = batch.text.size
    names = list(config.encoders)
    of = [batch.of(name) for name in names]
    return Pieces(
        example=np.concatenate([np.arange(n), *(it.example for it in of)]),
        src=np.concatenate([batch.example_src, *(layout.items[name] for name in names)]),
        bytes=np.concatenate(
            [batch.text * float(TEXT_TOKEN_BYTES)]
            + [
                (it.raw // config.encoders[name].rate.divisor) * enc
                for name, it in zip(names, of, strict=True)
            ]
        ),
        phase=np.concatenate(
            [np.full(n, LLM)]
            + [np.full(it.example.size, name) for name, it in zip(names, of, strict=True)]
        ),
    )
