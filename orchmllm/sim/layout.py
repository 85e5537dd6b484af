"""Where every item of every phase runs, per balancing mode, from the real planner.

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

``placement="node"`` applies the node-wise rearrangement (``orchmllm.placement.place_batches``)
to every runtime move, with the bytes the move really carries as volumes: raw inputs for the
encoder dispatchers and, for the LLM dispatcher, each example's pieces from where they are (text
from the sampling rank, encoded images and clips from the encoder layouts).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

import orchmllm
from orchmllm.balance import PADDED_POLICIES
from orchmllm.config import ModelConfig
from orchmllm.cost import CostModel
from orchmllm.sim.batch import Batch
from orchmllm.sim.compute import Submodule

MODES = ("none", "llm", "disttrain", "full")
PLACEMENTS = ("none", "node")
# OrchMLLM's tailored policies (paper 8.3): greedy for packed phases, Alg. 2 for padded audio.
TAILORED = {"vision": "greedy", "audio": "binary_search", "llm": "greedy"}
TEXT_TOKEN_BYTES = 8  # int64 token ids
ACT_BYTES = 2  # bf16 patches, mel frames, encoder outputs
# Volumes are handed to the placement solver in KiB so that ILP coefficients stay small.
_PLACEMENT_UNIT = 1024


@dataclass(frozen=True)
class Layout:
    """Destination rank of every item in every phase, and what computing it cost."""

    example: np.ndarray  # int64[n]: LLM-phase rank of each example
    image: np.ndarray  # int64[n_img]: vision-phase rank of each image
    audio: np.ndarray  # int64[n_aud]: audio-phase rank of each clip
    plan_ms: float = 0.0  # wall time of the balancing and placement calls
    stats: dict[str, float] = field(default_factory=dict)


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


def _balance(
    lengths: np.ndarray, src: np.ndarray, num_ranks: int, policy: str, cost: CostModel
) -> np.ndarray:
    """The real planner, with the module's calibrated cost when the policy's kind fits.

    As ``orchmllm.orchestrator`` does, a plan whose slowest rank (under the calibrated cost) is
    no faster than the sampled layout's is dropped and nothing moves.
    """
    if lengths.size == 0:
        return src.copy()
    kind = "padded" if policy in PADDED_POLICIES else "packed"
    use = cost if cost.kind == kind and cost.alpha >= 0 and cost.beta >= 0 else None
    dst = np.asarray(orchmllm.balance(lengths, num_ranks, policy, src=src, cost=use).dst)
    if cost.loads(lengths, dst, num_ranks).max() >= cost.loads(lengths, src, num_ranks).max():
        return src.copy()
    return dst


def _place(
    volume: np.ndarray, src: np.ndarray, dst: np.ndarray, num_ranks: int, ranks_per_node: int
) -> tuple[np.ndarray, dict[str, float]]:
    """Permute the destination batches ``dst`` to keep ``volume`` inside nodes."""
    if volume.size == 0 or num_ranks <= ranks_per_node:
        return np.arange(num_ranks, dtype=np.int64), {}
    from orchmllm.placement import place_batches  # lazy: pulls in cvxpy

    units = np.ceil(np.asarray(volume, dtype=np.float64) / _PLACEMENT_UNIT).astype(np.int64)
    p = place_batches(units, src, dst, num_ranks=num_ranks, ranks_per_node=ranks_per_node)
    return np.asarray(p.perm, dtype=np.int64), dict(p.stats)


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
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    pol = {**TAILORED, **(policies or {})}
    d = batch.num_ranks
    src = batch.example_src
    img_src, aud_src = src[batch.image_example], src[batch.audio_example]
    stats: dict[str, float] = {}
    start = time.perf_counter()
    if mode in ("none", "disttrain"):
        ex = src if mode == "none" else disttrain_reorder(modality_tokens(batch, config), d)
        plan_ms = (time.perf_counter() - start) * 1e3
        return Layout(ex, ex[batch.image_example], ex[batch.audio_example], plan_ms, stats)

    def placed(volume: np.ndarray, from_rank: np.ndarray, to: np.ndarray, name: str):
        """The batch permutation that keeps ``volume`` inside nodes (identity if off)."""
        if placement == "none":
            return np.arange(d, dtype=np.int64)
        perm, pstats = _place(volume, from_rank, to, d, ranks_per_node)
        stats.update({f"{name}_{k}": float(v) for k, v in pstats.items()})
        return perm

    img, aud = img_src, aud_src  # llm: encoders run where their items were sampled
    if mode == "full":
        img = _balance(batch.vision_lengths(), img_src, d, pol["vision"], modules["vision"].cost)
        img = placed(batch.image_patches * patch_bytes(config), img_src, img, "vision")[img]
        aud = _balance(batch.audio_lengths(config), aud_src, d, pol["audio"], modules["audio"].cost)
        aud = placed(batch.audio_frames * frame_bytes(config), aud_src, aud, "audio")[aud]
    ex = _balance(batch.llm_lengths(config), src, d, pol["llm"], modules["llm"].cost)
    pieces = llm_pieces(batch, config, img, aud)
    ex = placed(pieces.bytes, pieces.src, ex[pieces.example], "llm")[ex]
    plan_ms = (time.perf_counter() - start) * 1e3
    return Layout(ex, img, aud, plan_ms, stats)


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
