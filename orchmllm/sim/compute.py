"""Compute-time model of one submodule: FLOPs per batch and H100 time calibrated per shape.

A Transformer block's forward+backward time is ``alpha*sum(l) + beta*sum(l^2) + const`` for a
packed batch and ``alpha*b*max(l) + beta*b*max(l)^2 + const`` for a padded one (paper eq. 2,
``orchmllm.planner.cost``). Both coefficients are FLOPs divided by an achieved rate:

- ``alpha = 6 * P_block / R_lin``: every token passes the block's ``P_block`` weights once
  forward (2 FLOPs per weight) and twice backward;
- ``beta = 3 * 4 * h * causal / R_attn``: ``Q K^T`` and ``A V`` cost ``4 l^2 h`` forward per
  sequence (halved when causal), backward twice that.

Calibration fits ``alpha, beta, const`` per measured shape on
``data/h100_table1_blocks.json`` with ``orchmllm.planner.cost.fit_packed``/``fit_padded``, which
also yields the achieved rates ``R_lin`` and ``R_attn`` of that shape. A shape that was not measured
takes ``R_lin`` from the measured shape with the nearest hidden size of any attention kind (the
per-token GEMMs do not care how attention is batched), ``R_attn`` and ``const`` from the nearest
hidden size with the same attention kind, so ``alpha`` scales with its weights and ``beta`` with
its hidden size. A module of ``L`` layers costs ``L`` blocks; the LLM adds its output projection
(``6 * hidden * vocab`` FLOPs per token at the LLM's ``R_lin``). A frozen module runs forward only
(``CostModel.forward_only``). Connectors, the audio conv front end and embeddings are left out:
each is under 2% of its module's FLOPs for the paper's shapes.

Activation checkpointing (``Submodule.checkpointing``, set from the run's training recipe by
``orchmllm.sim.sweep.load_model``) keeps only each block's input and recomputes the block in
backward, so a trained module's blocks cost one extra forward: ``1 + FORWARD_FRACTION`` (4/3) of
their measured forward+backward time. The LM head is not recomputed (the chunked loss computes
its logits and their gradients in one pass) and a frozen module has no backward to recompute
for. MFU counts useful FLOPs only, so recompute lowers it.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np

from orchmllm.config import ModelConfig
from orchmllm.planner.cost import FORWARD_FRACTION, CostModel, fit_packed, fit_padded
from orchmllm.schema import LLM

ATTENTION_KINDS = ("causal", "bidir", "padded")
# Dense bf16 peak of an H100 SXM (NVIDIA H100 Tensor Core GPU datasheet: 1,979 TFLOPS with
# sparsity, half that dense), the denominator of MFU; the paper's GPUs (section 8).
H100_PEAK_FLOPS = 989.4e12


@dataclass(frozen=True)
class BlockShape:
    """One Transformer block: what its FLOPs and its achieved speed depend on."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    attention: str  # causal (packed), bidir (packed), padded (dense with key mask)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")

    @property
    def gated(self) -> bool:
        """Qwen2 decoders use SwiGLU (three FFN matrices); ViT and Whisper a plain GELU MLP."""
        return self.attention == "causal"

    @property
    def weights(self) -> int:
        """Weights every token multiplies by: q, k, v, o projections and the FFN."""
        kv = self.hidden * self.kv_heads // self.heads
        return (
            2 * self.hidden * self.hidden
            + 2 * self.hidden * kv
            + (3 if self.gated else 2) * self.hidden * self.ffn
        )

    @property
    def linear_flops(self) -> float:
        """Forward+backward FLOPs per token outside attention."""
        return 6.0 * self.weights

    @property
    def attention_flops(self) -> float:
        """Forward+backward attention FLOPs per unit of ``l^2`` (sum_l2 or b*max^2)."""
        return 12.0 * self.hidden * (0.5 if self.attention == "causal" else 1.0)


@dataclass(frozen=True)
class BlockFit:
    """A calibrated block: its cost in ms and the rates (FLOP/s) it achieved."""

    shape: BlockShape
    cost: CostModel
    linear_rate: float
    attention_rate: float
    source: str  # measured shape name, or "scaled from <name>/<name>"
    stats: Mapping[str, float]


def _kind(attention: str) -> str:
    return "padded" if attention == "padded" else "packed"


def load_block_records() -> list[dict[str, Any]]:
    """The measured H100 forward+backward times of one block of every Table 1 shape."""
    text = resources.files("orchmllm.sim").joinpath("data/h100_table1_blocks.json").read_text()
    return json.loads(text)


@functools.cache
def measured_fits() -> dict[str, BlockFit]:
    """Least-squares fit of every measured shape, with its achieved rates."""
    records = load_block_records()
    fits = {}
    for name in sorted({r["shape"] for r in records}):
        rows = [r for r in records if r["shape"] == name]
        r0 = rows[0]
        shape = BlockShape(r0["hidden"], r0["ffn"], r0["heads"], r0["kv_heads"], r0["attention"])
        fitter = fit_padded if shape.attention == "padded" else fit_packed
        fit = fitter(rows)
        if fit.model.alpha <= 0 or fit.model.beta <= 0:
            raise ValueError(f"records: shape {name} fits non-positive coefficients {fit.model}")
        fits[name] = BlockFit(
            shape=shape,
            cost=fit.model,
            linear_rate=shape.linear_flops / (fit.model.alpha * 1e-3),
            attention_rate=shape.attention_flops / (fit.model.beta * 1e-3),
            source=name,
            stats=fit.stats,
        )
    return fits


def _nearest(fits: Mapping[str, BlockFit], hidden: int, attention: str | None) -> str:
    """Measured shape with the nearest hidden size (log scale); ties break by name."""
    names = [n for n, f in fits.items() if attention is None or f.shape.attention == attention]
    return min(names, key=lambda n: (abs(math.log(fits[n].shape.hidden / hidden)), n))


def block_fit(shape: BlockShape) -> BlockFit:
    """Calibrated cost of ``shape``: its own fit if measured, else scaled (module docstring)."""
    fits = measured_fits()
    for fit in fits.values():
        if fit.shape == shape:
            return fit
    lin = fits[_nearest(fits, shape.hidden, None)]
    att = fits[_nearest(fits, shape.hidden, shape.attention)]
    alpha = shape.linear_flops / lin.linear_rate * 1e3
    beta = shape.attention_flops / att.attention_rate * 1e3
    cost = CostModel(_kind(shape.attention), alpha=alpha, beta=beta, const=att.cost.const)
    return BlockFit(
        shape=shape,
        cost=cost,
        linear_rate=lin.linear_rate,
        attention_rate=att.attention_rate,
        source=f"scaled from {lin.source}/{att.source}",
        stats={},
    )


@dataclass(frozen=True)
class Submodule:
    """One phase's module (an encoder or the LLM): calibrated time and useful FLOPs."""

    name: str
    block: BlockFit
    layers: int
    frozen: bool = False
    vocab: int = 0  # output projection after the blocks (LLM only)
    checkpointing: bool = True  # blocks recomputed in backward (only their inputs are kept)

    @property
    def kind(self) -> str:
        return self.block.cost.kind

    @property
    def recomputes(self) -> bool:
        """Whether backward recomputes the blocks' forward (a checkpointed, trained module)."""
        return self.checkpointing and not self.frozen

    @property
    def _pass_fraction(self) -> float:
        return 1.0 / 3.0 if self.frozen else 1.0

    @property
    def head_flops(self) -> float:
        """Forward+backward FLOPs per token of the output projection."""
        return 6.0 * self.block.shape.hidden * self.vocab

    @property
    def cost(self) -> CostModel:
        """Forward+backward (forward only if frozen) time in ms of a batch on one GPU, the
        blocks' recomputed forward included when checkpointing."""
        b = self.block.cost
        blocks = self.layers * (1.0 + FORWARD_FRACTION if self.recomputes else 1.0)
        head_ms = self.head_flops / self.block.linear_rate * 1e3
        whole = CostModel(
            b.kind,
            alpha=blocks * b.alpha + head_ms,
            beta=blocks * b.beta,
            const=blocks * b.const,
        )
        return whole.forward_only() if self.frozen else whole

    def times_ms(self, lengths: np.ndarray, dst: np.ndarray, num_ranks: int) -> np.ndarray:
        """Time of every rank's batch (items with ``dst == rank``), ``float64[num_ranks]``."""
        return np.maximum(self.cost.loads(lengths, dst, num_ranks), 0.0)

    def useful_flops(self, lengths: Sequence[int] | np.ndarray) -> float:
        """Model FLOPs of these items without padding (the numerator of MFU)."""
        l = np.asarray(lengths, dtype=np.float64)
        shape = self.block.shape
        per_block = shape.linear_flops * l.sum() + shape.attention_flops * (l * l).sum()
        return self._pass_fraction * (self.layers * per_block + self.head_flops * l.sum())

    @property
    def parameters(self) -> int:
        """Weights held by the module (blocks plus output projection)."""
        return self.layers * self.block.shape.weights + self.block.shape.hidden * self.vocab


def submodules(config: ModelConfig, *, checkpointing: bool = True) -> dict[str, Submodule]:
    """Every phase of a paper-shaped MLLM, calibrated on the H100 block data: each encoder
    (bidirectional packed attention, or padded where its architecture pads), then the LLM
    (causal)."""
    out = {
        name: Submodule(
            name,
            block_fit(
                BlockShape(e.hidden, e.ffn, e.heads, e.kv_heads, "padded" if e.padded else "bidir")
            ),
            e.layers,
            frozen=e.frozen,
            checkpointing=checkpointing,
        )
        for name, e in config.encoders.items()
    }
    m = config.llm
    out[LLM] = Submodule(
        LLM,
        block_fit(BlockShape(m.hidden, m.ffn, m.heads, m.kv_heads, "causal")),
        m.layers,
        vocab=config.vocab,
        checkpointing=checkpointing,
    )
    return out
