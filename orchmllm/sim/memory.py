"""Memory model: the bytes the worst rank holds at its peak, from the model's shapes alone.

Nothing here is fitted to a paper result. Every per-token figure follows from the block shapes
(bf16 activations, 2 bytes per value) under the training recipe of ``benchmarks/gpu_step.py``:
FSDP (ZeRO-3), activation checkpointing per Transformer block, memory-efficient attention
(FlashAttention: no ``l x l`` score matrix is kept) and a chunked LM-head loss.

Per token of a phase on a rank (``h`` hidden, ``f`` FFN, ``kv`` the key/value width):

- kept under checkpointing: every block's input, ``2 h`` bytes per layer; the LLM also keeps
  the final norm's input and output and the loss's hidden gradient, ``3 * 2 h``;
- the one block being recomputed in backward (``block_activation_bytes``): what autograd saves
  for it, counted as in Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", section 4.1) without dropout and without the ``l^2`` softmax terms
  (FlashAttention): the two norms' inputs and the attention input (``3 h``), ``q``, ``k`` and
  ``v`` (``h + 2 kv``), the attention output (``h``), the MLP input (``h``) and its
  intermediates (``4 f`` for SwiGLU: gate, up, ``silu(gate)``, their product; ``2 f`` for a GELU
  MLP), plus the block's output and input gradients (``2 h``);
- the LM-head loss works ``logit_chunk_tokens`` tokens at a time: fp32 logits, their fp32
  softmax gradient and its bf16 copy, 10 bytes per vocabulary entry per chunk token.

The peak is the largest of the backward moments: the LLM's (all three phases' kept inputs plus
the larger of its recomputed block and its loss chunk), the audio encoder's (vision and audio
kept plus an audio block), the vision encoder's. A frozen module runs forward without autograd
and keeps nothing; without checkpointing a module keeps every block's activations. The padded
audio phase holds ``items x longest item`` tokens per rank.

Static memory is the ZeRO-3 shard of bf16 parameters and gradients plus fp32 Adam state (16
bytes per trained parameter, 2 per frozen one, over the shard group) and, unsharded, the
parameters of two FSDP units (the one computing and the one prefetched) and one unit's
gradient before its reduce-scatter; the largest unit is the LM head or a block. A set-up
without an optimizer or without FSDP sets ``trained_param_bytes`` and ``fsdp_units`` (gpu_step's
emulated ranks: bf16 parameters and gradients, 4 bytes, and no unit gathered; see
:mod:`orchmllm.sim.emulated`).

What agrees with the paper by construction: nothing in this module; the GPU's memory and the
shard group are the paper's hardware and setting (section 8.1). Left out (so the model is a
lower bound and its largest mini-batch an upper bound): allocator fragmentation, the
intermediate gradients inside a block's backward, connector and embedding activations,
communication buffers beyond ``reserve_bytes``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from orchmllm.sim.compute import BlockShape, Submodule
from orchmllm.sim.layout import ACT_BYTES  # bf16 activations and gradients

# Chunked loss (benchmarks/gpu_step.py, chunked_head_loss): fp32 logits + fp32 softmax
# gradient + its bf16 copy, per vocabulary entry of a chunk token.
LOGIT_ENTRY_BYTES = 4 + 4 + 2


def block_activation_bytes(shape: BlockShape) -> float:
    """Bytes per token one block holds while it is recomputed and run backward (docstring)."""
    h = shape.hidden
    kv = h * shape.kv_heads // shape.heads
    mlp = (4 if shape.gated else 2) * shape.ffn
    saved = 3 * h + (h + 2 * kv) + h + h + mlp
    return ACT_BYTES * (saved + 2 * h)


def phase_tokens(kind: str, lengths: np.ndarray, dst: np.ndarray, num_ranks: int) -> np.ndarray:
    """Activation rows per rank of one phase: summed lengths when packed, ``items x longest``
    when padded, ``float64[num_ranks]``."""
    lengths = np.asarray(lengths, dtype=np.float64)
    if kind != "padded":
        return np.bincount(dst, weights=lengths, minlength=num_ranks).astype(np.float64)
    count = np.bincount(dst, minlength=num_ranks).astype(np.float64)
    longest = np.zeros(num_ranks)
    np.maximum.at(longest, dst, lengths)
    return count * longest


@dataclass(frozen=True)
class MemoryModel:
    """Per-GPU memory budget and the shapes' activation bytes."""

    # H100 SXM: 80 GB HBM3 (NVIDIA H100 Tensor Core GPU datasheet), the paper's GPUs (section 8).
    gpu_bytes: float = 80e9
    # Assumed, not measured: CUDA context, NCCL buffers, allocator slack.
    reserve_bytes: float = 6e9
    # Hybrid-shard group size of ZeRO-3: the paper's setting (section 8.1).
    shard_group: int = 256
    # Tokens per LM-head loss chunk, as benchmarks/gpu_step.py's chunked_head_loss.
    logit_chunk_tokens: int = 4096
    # Bytes per trained parameter, sharded: bf16 parameter and gradient, fp32 Adam master copy
    # and two moments (2 + 2 + 12).
    trained_param_bytes: float = 16.0
    # Unsharded FSDP units held at once: two units' parameters (computing, prefetched) and one
    # unit's gradient before its reduce-scatter.
    fsdp_units: int = 3

    def __post_init__(self) -> None:
        if not self.gpu_bytes > 0:
            raise ValueError(f"gpu_bytes must be > 0, got {self.gpu_bytes!r}")
        if not self.reserve_bytes >= 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {self.reserve_bytes!r}")
        for name in ("shard_group", "logit_chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.trained_param_bytes >= 0:
            raise ValueError(f"trained_param_bytes must be >= 0, got {self.trained_param_bytes!r}")
        if self.fsdp_units < 0:
            raise ValueError(f"fsdp_units must be >= 0, got {self.fsdp_units!r}")

    def static_bytes(self, modules: Mapping[str, Submodule], num_ranks: int) -> float:
        """Sharded parameters, gradients and optimizer state plus the unsharded FSDP units."""
        group = min(self.shard_group, num_ranks)
        trainable = sum(m.parameters for m in modules.values() if not m.frozen)
        frozen = sum(m.parameters for m in modules.values() if m.frozen)
        unit = max(
            max(m.block.shape.weights, m.block.shape.hidden * m.vocab) for m in modules.values()
        )
        sharded = self.trained_param_bytes * trainable + ACT_BYTES * frozen
        return sharded / group + self.fsdp_units * ACT_BYTES * unit

    def kept_bytes(self, module: Submodule, tokens: np.ndarray) -> np.ndarray:
        """What ``module`` keeps for its backward from its forward until its backward starts."""
        if module.frozen:
            return np.zeros_like(tokens)
        h = module.block.shape.hidden
        per_layer = (
            ACT_BYTES * h if module.checkpointing else block_activation_bytes(module.block.shape)
        )
        head = 3 * ACT_BYTES * h if module.vocab else 0
        return tokens * (module.layers * per_layer + head)

    def working_bytes(self, module: Submodule, tokens: np.ndarray) -> np.ndarray:
        """The largest transient of ``module``'s backward: a recomputed block (its input and
        output gradients alone when not checkpointing) or the loss chunk."""
        if module.frozen:
            return np.zeros_like(tokens)
        shape = module.block.shape
        block = (
            block_activation_bytes(shape) if module.checkpointing else 2 * ACT_BYTES * shape.hidden
        )
        work = tokens * block
        if module.vocab:
            chunk = np.minimum(tokens, self.logit_chunk_tokens)
            work = np.maximum(work, chunk * module.vocab * LOGIT_ENTRY_BYTES)
        return work

    def activation_bytes(
        self, modules: Mapping[str, Submodule], tokens: Mapping[str, np.ndarray]
    ) -> np.ndarray:
        """Peak activation bytes per rank from each phase's activation rows per rank (the
        phases in forward order, the LLM last; see the module docstring)."""
        if not tokens:
            raise ValueError("tokens must name at least one phase")
        peak, kept = None, None
        for phase, per_rank in tokens.items():
            rows = np.asarray(per_rank, dtype=np.float64)
            kept = self.kept_bytes(modules[phase], rows) + (0.0 if kept is None else kept)
            # the backward of this phase runs with every earlier phase's inputs still kept
            moment = kept + self.working_bytes(modules[phase], rows)
            peak = moment if peak is None else np.maximum(peak, moment)
        return peak

    def peak_bytes(
        self,
        modules: Mapping[str, Submodule],
        tokens: Mapping[str, np.ndarray],
        num_ranks: int,
    ) -> np.ndarray:
        """Peak memory per rank (static plus activations), ``float64[num_ranks]``."""
        return self.static_bytes(modules, num_ranks) + self.activation_bytes(modules, tokens)

    @property
    def budget_bytes(self) -> float:
        """What a rank may use before it runs out of memory."""
        return self.gpu_bytes - self.reserve_bytes
