"""Memory proxy: activation bytes held on the worst rank against a per-GPU budget.

With FSDP and activation checkpointing a rank keeps, at the peak (end of the LLM forward), the
checkpointed input of every block of every phase for every token it processed in that phase,
plus the LLM's logits for the loss, so activation memory is
``sum_phase tokens_on_rank * (layers * hidden * act_bytes + vocab * logit_bytes)`` (vocab only
for the LLM). ``act_bytes`` is bytes per hidden unit per layer and token: 2 for the bf16 block
input alone, default 4 to cover the recompute working set and connector outputs;
``logit_bytes`` default 4 is the bf16 logits and their gradient. The two defaults were picked
from the grid {2, 3, 4} x {0, 4, 6, 10} (MLLM-10B/18B/84B at 2560 GPUs, one sampled step) as
the point whose largest safe mini-batches come closest to the paper's six settings: it gives
82/64/30 balanced (paper 80/60/30) and 66/51/20 without balancing (paper 65/40/15). No
per-model constant.
Static memory is the ZeRO-3 shard of bf16 parameters and gradients plus fp32 Adam state (16
bytes per parameter over the shard group) and two unsharded blocks of the largest module (the
one computing and the one prefetched).

The paper sets each run's mini-batch to the largest that does not run out of memory (section
8.1): without balancing that is set by the heaviest of all mini-batches, with balancing by the
mean. ``max_examples_per_rank`` in ``orchmllm.sim.sweep`` searches for it with this proxy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from orchmllm.sim.compute import Submodule


@dataclass(frozen=True)
class MemoryModel:
    """Per-GPU memory budget and the bytes an activation token costs."""

    gpu_bytes: float = 80e9
    reserve_bytes: float = 6e9  # CUDA context, NCCL buffers, allocator fragmentation
    act_bytes: float = 4.0
    logit_bytes: float = 4.0  # per vocabulary entry per LLM token (bf16 logits and gradient)
    shard_group: int = 256  # hybrid-shard group size (paper section 8.1)

    def __post_init__(self) -> None:
        for name in ("gpu_bytes", "act_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("reserve_bytes", "logit_bytes"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.shard_group < 1:
            raise ValueError(f"shard_group must be >= 1, got {self.shard_group!r}")

    def static_bytes(self, modules: Mapping[str, Submodule], num_ranks: int) -> float:
        """Sharded parameters, gradients and optimizer state plus two gathered blocks."""
        group = min(self.shard_group, num_ranks)
        trainable = sum(m.parameters for m in modules.values() if not m.frozen)
        frozen = sum(m.parameters for m in modules.values() if m.frozen)
        largest_block = max(m.block.shape.weights for m in modules.values())
        return (16.0 * trainable + 2.0 * frozen) / group + 2 * 2.0 * largest_block

    def activation_bytes(
        self, modules: Mapping[str, Submodule], tokens: Mapping[str, np.ndarray]
    ) -> np.ndarray:
        """Activation bytes per rank from each phase's tokens per rank."""
        total = None
        for phase, per_rank in tokens.items():
            m = modules[phase]
            per_token = (
                m.layers * m.block.shape.hidden * self.act_bytes + m.vocab * self.logit_bytes
            )
            part = np.asarray(per_rank, dtype=np.float64) * per_token
            total = part if total is None else total + part
        if total is None:
            raise ValueError("tokens must name at least one phase")
        return total

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
