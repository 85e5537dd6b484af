"""Where every item of every phase runs, per balancing mode, from training's own step planner.

The OrchMLLM modes call :func:`orchmllm.plan_step`, the function the orchestrator runs in
training, on the batch's segment table (:func:`segment_rows`), with each phase's calibrated
cost model; only ``disttrain`` (a baseline) is planned here.

Modes:

- ``none``: no balancing; every item runs where its example was sampled.
- ``llm``: OrchMLLM with only the LLM dispatcher (the paper's Figure 10 ablation, its
  stand-in for pre-balancing methods that balance one phase): encoders run where their items
  were sampled, the LLM phase gets a balanced layout of whole examples, text and encoder
  outputs move there (as ``orchmllm.orchestrator`` does in its ``llm`` mode).
- ``disttrain``: DistTrain's intra-microbatch reordering (Zhang et al., section 6.1, Alg. 2)
  of the global batch, read literally: sort the samples by size in *ascending* order, give each
  to the data-parallel group with the smallest summed size so far (ties: fewer samples, then
  the lower index). A sample's size is its modality tokens (image patches plus audio encoder
  frames): DistTrain packs the LLM sequence to a fixed length and balances only the encoder
  input. One layout serves every phase, and it is computed in DistTrain's CPU preprocessing
  before loading, so it moves no data at run time.
- ``full``: OrchMLLM: a separate balanced layout per phase (vision, audio, LLM), each with the
  policy tailored to how its module is batched (``policies``).

``placement="node"`` is the step planner's ``auto`` node-wise rearrangement of every runtime
move, over the bytes the move carries (see :mod:`orchmllm.step_plan`).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from orchmllm.config import ModelConfig
from orchmllm.schema import AUDIO, IMAGE, MODALITIES, TEXT
from orchmllm.sim.batch import Batch
from orchmllm.sim.compute import Submodule
from orchmllm.step_plan import MODES as STEP_MODES
from orchmllm.step_plan import EncoderPhase, StepOptions, plan_step

MODES = (*STEP_MODES, "disttrain")
# The simulator's placement names -> the step planner's placement method.
PLACEMENTS = {"none": "none", "node": "auto"}
# OrchMLLM's tailored policies (paper 8.3): greedy for packed phases, Alg. 2 for padded audio.
TAILORED = {**{m.name: m.policy for m in MODALITIES.values()}, "llm": "greedy"}
TEXT_TOKEN_BYTES = 8  # int64 token ids
ACT_BYTES = 2  # bf16 patches, mel frames, encoder outputs


@dataclass(frozen=True)
class Layout:
    """Destination rank of every item in every phase, and what computing it cost."""

    example: np.ndarray  # int64[n]: LLM-phase rank of each example
    image: np.ndarray  # int64[n_img]: vision-phase rank of each image
    audio: np.ndarray  # int64[n_aud]: audio-phase rank of each clip
    plan_ms: float = 0.0  # wall time of the step planner


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
    example's text, then its images, then its audio clips), and the rank of each row."""
    n = batch.text.size
    has_text = np.flatnonzero(batch.text > 0)
    example = np.concatenate([has_text, batch.image_example, batch.audio_example])
    kind = np.concatenate(
        [
            np.full(has_text.size, TEXT, np.int64),
            np.full(batch.image_example.size, IMAGE, np.int64),
            np.full(batch.audio_example.size, AUDIO, np.int64),
        ]
    )
    raw = np.concatenate([batch.text[has_text], batch.image_patches, batch.audio_frames])
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
) -> StepOptions:
    """Training's step planner options for this model: each phase with its calibrated cost,
    bf16 volumes, and the paper's tailored policies unless ``policies`` overrides them."""
    pol = {**TAILORED, **(policies or {})}
    phases = (
        EncoderPhase(
            "vision", IMAGE, "image_patches", config.vision.downsample, config.vision.patch_dim,
            pol["vision"], modules["vision"].cost, value_bytes=ACT_BYTES,
        ),
        EncoderPhase(
            "audio", AUDIO, "audio_mels", config.audio.frames_per_token, config.audio.n_mels,
            pol["audio"], modules["audio"].cost, stride=config.audio.conv_stride,
            value_bytes=ACT_BYTES,
        ),
    )  # fmt: skip
    return StepOptions(
        phases,
        mode=mode,
        llm_policy=pol["llm"],
        llm_cost=modules["llm"].cost,
        placement=PLACEMENTS[placement],
        ranks_per_node=ranks_per_node,
        text_token_bytes=TEXT_TOKEN_BYTES,
        encoded_token_bytes=encoded_token_bytes(config),
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
) -> Layout:
    """Destination ranks of every phase's items under ``mode`` (see the module docstring)."""
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
        return Layout(ex, ex[batch.image_example], ex[batch.audio_example], plan_ms)
    options = step_options(
        mode, config=config, modules=modules, placement=placement,
        ranks_per_node=ranks_per_node, policies=policies,
    )  # fmt: skip
    rows, row_src = segment_rows(batch)
    step = plan_step(rows, row_src, options, num_ranks=batch.num_ranks)
    plan_ms = (time.perf_counter() - start) * 1e3
    return Layout(
        step.llm.dst_rank,
        step.phases["vision"].encoder.dst_rank,
        step.phases["audio"].encoder.dst_rank,
        plan_ms,
    )


def modality_tokens(batch: Batch, config: ModelConfig) -> np.ndarray:
    """Encoder input tokens per example (image patches plus audio encoder frames)."""
    n = batch.text.size
    size = np.bincount(batch.image_example, weights=batch.vision_lengths(), minlength=n)
    size += np.bincount(batch.audio_example, weights=batch.audio_lengths(config), minlength=n)
    return size.astype(np.int64)


def patch_bytes(config: ModelConfig) -> int:
    return config.vision.patch_dim * ACT_BYTES


def frame_bytes(config: ModelConfig) -> int:
    return config.audio.n_mels * ACT_BYTES


def encoded_token_bytes(config: ModelConfig) -> int:
    return config.llm.hidden * ACT_BYTES


@dataclass(frozen=True)
class Pieces:
    """What the LLM dispatcher moves: each example's text and encoded items, from where they are."""

    example: np.ndarray  # owning example of each piece
    src: np.ndarray  # rank holding the piece before the LLM phase
    bytes: np.ndarray
    kind: np.ndarray  # 0 text, 1 encoded image, 2 encoded audio


def llm_pieces(
    batch: Batch, config: ModelConfig, image_dst: np.ndarray, audio_dst: np.ndarray
) -> Pieces:
    enc = float(encoded_token_bytes(config))
    n = batch.text.size
    return Pieces(
        example=np.concatenate([np.arange(n), batch.image_example, batch.audio_example]),
        src=np.concatenate([batch.example_src, image_dst, audio_dst]),
        bytes=np.concatenate(
            [
                batch.text * float(TEXT_TOKEN_BYTES),
                (batch.image_patches // config.vision.downsample) * enc,
                (batch.audio_frames // config.audio.frames_per_token) * enc,
            ]
        ),
        kind=np.concatenate(
            [
                np.zeros(n, np.int64),
                np.ones(batch.image_example.size, np.int64),
                np.full(batch.audio_example.size, 2, np.int64),
            ]
        ),
    )
