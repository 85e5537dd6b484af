"""Memory model: what each rank of ``orchmllm.train`` holds at its peak, per phase of a step.

The model takes the run's training recipe (:class:`~orchmllm.config.TrainRecipe`: precision,
activation checkpointing, loss chunk) and the model config, and predicts each rank's bytes:

- **static** (:meth:`MemoryModel.static_bytes`), live when a step starts: the FSDP2 shards of
  the master parameters (fp32 for ``bf16-mixed``) and AdamW's two moments of every trained
  parameter, over the shard group;
- **per phase above static** (:meth:`MemoryModel.phase_peaks`): the forward, the backward and
  the optimizer step, replayed op by op from the code the trainer runs
  (:mod:`orchmllm.sim.allocations`: gathered FSDP units and their all-gather buffers,
  checkpointed block inputs, the recomputed block's saved tensors and gradients, the
  connectors' and front ends' parameters and activations, the loss's chunks, unsharded and
  reduce-scatter gradient buffers, AdamW's temporaries) as linear forms in per-rank features
  (:meth:`MemoryModel.rank_features`: the rank's rows per phase, its longest item, ...).

Every term names its source in :mod:`orchmllm.sim.allocations`; nothing is fitted to a
measurement. What a block saves for backward is checked byte for byte against
``torch.autograd.graph.saved_tensors_hooks`` for every block style and precision, and a
trainer step's allocator peak on CPU against the whole prediction
(``tests/test_memory_measured.py``). Left out: the allocator's fragmentation and rounding,
CPU bf16 GEMM packing buffers, buffers of a few bytes per item; ``reserve_bytes`` stands for
the CUDA context, NCCL's buffers and fragmentation (assumed, not measured).

The per-phase peaks can come from torch instead (``MemoryModel(forms=...)``): forms fitted to
the memory oracle's trace of a few rank shapes (:mod:`orchmllm.train.memory_fit`, cached by
the config's hash, :mod:`orchmllm.sim.memory_forms`), which need no memory code for a new
architecture. The replay then gives only what the oracle cannot see: the attention kernels'
workspaces (:func:`cpu_attention_workspace`, :func:`cuda_attention_workspace`), the
orchestrator's moves and the previous step's batch (see :meth:`MemoryModel.phase_peaks`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from orchmllm.config import ModelConfig, TrainRecipe
from orchmllm.data.recipe import ItemLengths
from orchmllm.planner.step_plan import StepPlan
from orchmllm.schema import LLM
from orchmllm.sim.allocations import step_moments
from orchmllm.sim.batch import Batch
from orchmllm.sim.context_parallel import llm_sequences
from orchmllm.sim.layout import Layout
from orchmllm.sim.memory_forms import MemoryForms
from orchmllm.sim.replay_env import DEVICES, Dtypes, StepSetup, units
from orchmllm.sim.trace import Moments

PHASES = ("forward", "backward", "optimizer")

_MOMENTS: dict[tuple, Moments] = {}


def moves_of_layout(batch: Batch, layout: Layout, config: ModelConfig) -> frozenset[str]:
    """The orchestrator's moves a step runs (``Orchestrator.run``): raw rows to an encoder's
    layout, its outputs to the LLM's, text to the LLM's; a move where no item changes rank
    is skipped (``Orchestrator._move``)."""
    src = batch.example_src
    out = set()
    for name in config.encoders:
        it = batch.of(name)
        if np.any(layout.items[name] != src[it.example]):
            out.add(f"{name}.raw")
        if np.any(layout.items[name] != layout.example[it.example]):
            out.add(f"{name}.out")
    if np.any(layout.example != src):
        out.add("text")
    return frozenset(out)


def _split(length: np.ndarray) -> np.ndarray:
    """The CPU flash kernel's query split for a sequence of ``length`` rows (it switches
    at 192 and 768 rows), capped at the length."""
    q = np.where(length >= 768, 256, np.where(length >= 192, 64, 32))
    return np.minimum(q, length)


def cpu_attention_workspace(
    longest: np.ndarray, *, head_dim: int, dtypes: Dtypes, threads: int
) -> tuple[np.ndarray, np.ndarray]:
    """Bytes the CPU flash kernel (``FlashAttentionKernel.cpp``) allocates per call, forward
    and backward, for the longest sequence (its buffers grow with the length): per thread, in
    opmath, the score block ``q_split x kv_split`` (kv_split = min(512, length)), its max and
    sum and an output block (forward), the score and its gradient plus a row sum (backward);
    for bf16 also the blocks in bf16."""
    longest = np.asarray(longest, dtype=np.float64)
    q = _split(longest)
    kv = np.minimum(512, longest)
    a, s = dtypes.opmath, dtypes.compute
    reduced = s < 4
    fwd = (q * kv + 2 * q + q * head_dim) * a + (q * kv * s if reduced else 0)
    bwd = 2 * q * kv * a + q * a + (2 * q * kv * s if reduced else 0)
    return threads * fwd, threads * bwd


def cuda_attention_workspace(
    rows: np.ndarray, items: np.ndarray, *, hidden: int, heads: int, padded: bool
) -> tuple[np.ndarray, np.ndarray]:
    """fp32 workspaces of the CUDA kernels' backward (forward: none): FlashAttention-2's
    variable-length backward (``mha_varlen_bwd``) a query-gradient accumulator and a softmax
    sum over ``rows + 128 * sequences``; the memory-efficient kernel (padded, masked) the
    same two per padded row. From the kernels' sources, not measured here."""
    rows = np.asarray(rows, dtype=np.float64)
    extent = rows if padded else rows + 128 * np.asarray(items, dtype=np.float64)
    return np.zeros_like(rows), 4.0 * (hidden + heads) * extent


def _per_rank(values: np.ndarray, dst: np.ndarray, num_ranks: int, how: str) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    if how == "sum":
        return np.bincount(dst, weights=values, minlength=num_ranks).astype(np.float64)
    if how == "count":
        return np.bincount(dst, minlength=num_ranks).astype(np.float64)
    out = np.zeros(num_ranks)
    np.maximum.at(out, dst, values)
    return out


def _gathered(per_rank: np.ndarray) -> np.ndarray:
    """What an all-gather of per-rank rows delivers to every rank: all ranks' rows, each
    padded to the largest (NCCL gathers equal sizes)."""
    return np.full(per_rank.size, per_rank.size * per_rank.max(initial=0.0))


@dataclass(frozen=True)
class MemoryModel:
    """A GPU's memory and the set-up around the trainer's step.

    Attributes:
        gpu_bytes: the device's memory.
        reserve_bytes: what the step may not use (CUDA context, NCCL, fragmentation).
        shard_group: ranks FSDP shards over (the paper's hybrid-shard group).
        device: ``cuda`` or ``cpu`` (which kernels run, see :mod:`orchmllm.sim.allocations`).
        threads: the CPU kernels' threads (``torch.get_num_threads()``); ignored on CUDA.
        fsdp: parameters sharded by FSDP2 with fp32 masters; False: one plain copy in the
            compute dtype (gpu_step's emulated ranks).
        optimizer: AdamW runs (its state is static, its step a phase).
        previous_batch: the previous step's ``LLMBatch`` is alive until the backward ends
            (the trainer's loop); False for a step measured on its own.
        forms: where the per-phase peaks come from: None, the hand replay
            (:mod:`orchmllm.sim.allocations`); else a source of forms fitted to torch's own
            accounting of the step, called with the config, the recipe, the shard group and the
            device
            (``orchmllm.train.memory_fit.OracleForms``), to which the replay adds only what
            the oracle cannot see (see :meth:`phase_peaks`).
    """

    # H100 SXM: 80 GB HBM3 (NVIDIA H100 Tensor Core GPU datasheet), the paper's GPUs (section 8).
    gpu_bytes: float = 80e9
    # Assumed, not measured: CUDA context, NCCL buffers, allocator slack.
    reserve_bytes: float = 6e9
    # Hybrid-shard group size of ZeRO-3: the paper's setting (section 8.1).
    shard_group: int = 256
    device: str = "cuda"
    threads: int = 1
    fsdp: bool = True
    optimizer: bool = True
    previous_batch: bool = True
    forms: Callable[[ModelConfig, TrainRecipe, int, str], MemoryForms] | None = None

    def __post_init__(self) -> None:
        if not self.gpu_bytes > 0:
            raise ValueError(f"gpu_bytes must be > 0, got {self.gpu_bytes!r}")
        if not self.reserve_bytes >= 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {self.reserve_bytes!r}")
        for name in ("shard_group", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.forms is not None and not (self.fsdp and self.optimizer):
            raise ValueError(
                "forms: fitted forms are of the trainer's step (FSDP and AdamW), got "
                f"fsdp={self.fsdp!r}, optimizer={self.optimizer!r}"
            )

    @property
    def budget_bytes(self) -> float:
        """What a rank may use before it runs out of memory."""
        return self.gpu_bytes - self.reserve_bytes

    def group(self, num_ranks: int) -> int:
        return min(self.shard_group, num_ranks) if self.fsdp else 1

    # -- static ------------------------------------------------------------------------------

    def parameters(self, config: ModelConfig) -> tuple[int, int]:
        """The model's parameters: all of them and the trained ones (every FSDP unit of
        :func:`orchmllm.sim.replay_env.units`, embeddings and connectors included)."""
        us = units(config).values()
        return sum(u.params for u in us), sum(u.params for u in us if u.trained)

    def static_bytes(self, config: ModelConfig, recipe: TrainRecipe, num_ranks: int) -> float:
        """Live when a step starts: the sharded master parameters and AdamW's two moments of
        the trained ones (FSDP2 shards over the group); without FSDP one copy of the
        parameters in the compute dtype."""
        dt = Dtypes.of(recipe.precision)
        total, trained = self.parameters(config)
        if not self.fsdp:
            return float(dt.compute * total)
        state = 2 * dt.master * trained if self.optimizer else 0
        return (dt.master * total + state) / self.group(num_ranks)

    def held_gradient_bytes(
        self, config: ModelConfig, recipe: TrainRecipe, num_ranks: int
    ) -> float:
        """What gradient accumulation adds to every phase after its first micro-step (sync
        every micro-step, the trainer's default): the sharded gradients of the trained
        parameters, reduce-scattered in the master dtype, live until the optimizer step. The
        step's replay does not hold them (it is one micro-step)."""
        _, trained = self.parameters(config)
        return float(Dtypes.of(recipe.precision).master * trained / self.group(num_ranks))

    # -- per phase ----------------------------------------------------------------------------

    def moments(
        self,
        config: ModelConfig,
        recipe: TrainRecipe,
        *,
        num_ranks: int,
        moves=frozenset(),
        communicator: str = "all_to_all",
    ) -> Moments:
        """The step's replay for this set-up (cached per config, recipe, group, moves and
        communicator)."""
        setup = StepSetup(
            shard_group=self.group(num_ranks), device=self.device, moves=frozenset(moves),
            fsdp=self.fsdp, optimizer=self.optimizer, previous_batch=self.previous_batch,
            communicator=communicator,
        )  # fmt: skip
        key = (repr(config), recipe, setup)
        if key not in _MOMENTS:
            _MOMENTS[key] = step_moments(config, recipe, setup)
        return _MOMENTS[key]

    def phase_peaks(
        self,
        config: ModelConfig,
        recipe: TrainRecipe,
        features: Mapping[str, np.ndarray],
        *,
        num_ranks: int,
        moves=frozenset(),
        communicator: str = "all_to_all",
    ) -> dict[str, np.ndarray]:
        """Each rank's peak above :meth:`static_bytes` in each phase (forward, backward and,
        with an optimizer, optimizer).

        With :attr:`forms` the step's peaks are the fitted forms' (one rank's step from its
        own items on, as the oracle runs it), plus what the oracle cannot see: the largest
        attention workspace of the phase (a kernel's buffer lives inside its call, so adding
        it to the whole peak bounds it from above) and what the moves and the previous batch
        add to the replay's peaks (the replay with them less the replay without). An
        architecture the replay does not know gets the fitted forms and the workspaces alone,
        and an error if moves or the previous batch are asked for."""
        if self.forms is None:
            m = self.moments(
                config, recipe, num_ranks=num_ranks, moves=moves, communicator=communicator
            )
            return m.peaks(features)
        fitted = self.forms(config, recipe, self.group(num_ranks), self.device).peaks(features)
        out = {ph: v + self._workspace_peak(features, ph) for ph, v in fitted.items()}
        if moves or self.previous_batch:
            extra = self._replay_extras(config, recipe, features, num_ranks, moves, communicator)
            out = {ph: v + extra[ph] for ph, v in out.items()}
        return out

    def _replay_extras(self, config, recipe, features, num_ranks, moves, communicator):
        """What the moves and the previous batch add to the replay's peaks (the attention
        workspaces set aside: they are added apart)."""
        bare = {k: 0 * v if k.endswith((".attn_fwd", ".attn_bwd")) else v
                for k, v in features.items()}  # fmt: skip
        plain = replace(self, forms=None)
        try:
            full = plain.moments(
                config, recipe, num_ranks=num_ranks, moves=moves, communicator=communicator
            )
            alone = replace(plain, previous_batch=False).moments(
                config, recipe, num_ranks=num_ranks
            )
        except ValueError as e:
            raise ValueError(
                "forms: the moves and the previous batch come from the replay, which cannot "
                f"replay this config ({e}); plan without them (previous_batch=False, a layout "
                "that moves nothing)"
            ) from e
        with_extras, without = full.peaks(bare), alone.peaks(bare)
        return {ph: with_extras[ph] - without[ph] for ph in with_extras}

    @staticmethod
    def _workspace_peak(features: Mapping[str, np.ndarray], phase: str) -> np.ndarray:
        what = {"forward": ".attn_fwd", "backward": ".attn_bwd"}.get(phase)
        spaces = [np.asarray(v, dtype=np.float64) for k, v in features.items()
                  if what and k.endswith(what)]  # fmt: skip
        return np.max(np.stack(spaces), 0) if spaces else np.float64(0.0)

    def peak_bytes(
        self,
        config: ModelConfig,
        recipe: TrainRecipe,
        features: Mapping[str, np.ndarray],
        *,
        num_ranks: int,
        moves=frozenset(),
        communicator: str = "all_to_all",
    ) -> np.ndarray:
        """Each rank's peak over the step: static plus the largest phase peak."""
        peaks = self.phase_peaks(
            config, recipe, features, num_ranks=num_ranks, moves=moves, communicator=communicator
        )
        top = np.max(np.stack(list(peaks.values())), axis=0)
        return self.static_bytes(config, recipe, num_ranks) + top

    # -- features -----------------------------------------------------------------------------

    def rank_features(
        self, config: ModelConfig, recipe: TrainRecipe, batch: Batch, layout: Layout
    ) -> dict[str, np.ndarray]:
        """What the replay's forms are evaluated on, per rank, for ``batch`` laid out as
        ``layout`` (see :data:`orchmllm.sim.replay_env.FEATURES`)."""
        d = batch.num_ranks
        dt = Dtypes.of(recipe.precision)
        src = batch.example_src
        out: dict[str, np.ndarray] = {}
        for name, e in config.encoders.items():
            it = batch.of(name)
            dst = layout.items[name]
            pos = it.raw // e.stride
            n = _per_rank(pos, dst, d, "count")
            longest = _per_rank(pos, dst, d, "max")
            valid = _per_rank(pos, dst, d, "sum")
            rows = n * longest if e.padded else valid
            sampled = _per_rank(it.raw, src[it.example], d, "sum")
            merged = _per_rank(it.raw // e.rate.divisor, dst, d, "sum")
            encoded = _per_rank(it.raw // e.rate.divisor, layout.example[it.example], d, "sum")
            f = {
                "rows": rows,
                "input": n * _per_rank(it.raw, dst, d, "max") if e.padded else valid,
                "raw": _per_rank(it.raw, dst, d, "sum"),
                "sampled": sampled,
                "valid": valid,
                "merged": merged,
                "encoded": encoded,
                "longest": longest,
                "items": n,
                "gathered_raw": _gathered(sampled),
                "gathered_merged": _gathered(merged),
                "gathered_encoded": _gathered(encoded),
            }
            f["attn_fwd"], f["attn_bwd"] = self._workspace(
                e.hidden, e.heads, e.padded, rows, longest, n, dt
            )
            out.update({f"{name}.{k}": v for k, v in f.items()})
        # a split example's pieces are sequences of their ranks (orchmllm.sim.context_parallel)
        seq, at = llm_sequences(batch.llm_lengths(config), layout, d)
        tokens = _per_rank(seq, at, d, "sum")
        c = recipe.loss_chunk
        m = config.llm
        n = _per_rank(seq, at, d, "count")
        longest = _per_rank(seq, at, d, "max")
        sampled_text = _per_rank(batch.text, src, d, "sum")
        f = {
            "tokens": tokens,
            "text": _per_rank(batch.text, layout.example, d, "sum"),
            "sampled_text": sampled_text,
            "gathered_text": _gathered(sampled_text),
            "items": n,
            "chunk": np.minimum(tokens, c),
            "chunk2": np.clip(tokens - c, 0, c),
        }
        f["attn_fwd"], f["attn_bwd"] = self._workspace(
            m.hidden, m.heads, False, tokens, longest, n, dt
        )
        out.update({f"{LLM}.{k}": v for k, v in f.items()})
        return out

    def _workspace(self, hidden, heads, padded, rows, longest, items, dt):
        if self.device == "cpu":
            return cpu_attention_workspace(
                longest, head_dim=hidden // heads, dtypes=dt, threads=self.threads
            )
        return cuda_attention_workspace(rows, items, hidden=hidden, heads=heads, padded=padded)


def _moves(r) -> bool:
    return not (np.array_equal(r.src_rank, r.dst_rank) and np.array_equal(r.src_slot, r.dst_slot))


def step_of_plan(plan: StepPlan) -> tuple[Batch, Layout, frozenset[str]]:
    """A trainer step's plan (:class:`~orchmllm.planner.step_plan.StepPlan`) as the memory model
    reads it: the global batch, where each phase runs it (the LLM phase's pieces too; an
    encoder phase's split items count whole on their home rank: not modelled yet), and which
    moves run (a move where every item stays is skipped, as ``Orchestrator._move`` skips it)."""
    items = {n: ItemLengths(p.example, p.raw) for n, p in plan.phases.items()}
    batch = Batch(plan.num_ranks, plan.text_len, items)
    encoders = {n: p.encoder.dst_rank for n, p in plan.phases.items()}
    layout = Layout(plan.llm.dst_rank, encoders, pieces=plan.llm_pieces)
    moves = {f"{n}.raw" for n, p in plan.phases.items() if _moves(p.encoder)}
    moves |= {f"{n}.out" for n, p in plan.phases.items() if _moves(p.to_llm)}
    if _moves(plan.llm):
        moves.add("text")
    return batch, layout, frozenset(moves)
