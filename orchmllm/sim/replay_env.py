"""The memory replay's environment: byte widths, the recipe's dtypes, the model's FSDP units,
and :class:`Env`, the ledger one replayed step writes its allocations to.

Part of the replay of a training step (:mod:`orchmllm.sim.allocations`, whose docstring lists
the sources every allocation is read from); torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchmllm.config import ModelConfig
from orchmllm.schema import LLM
from orchmllm.sim.trace import Form, Storage, Trace, const

DEVICES = ("cpu", "cuda")
RAW_BYTES = 4  # raw rows are float32 (orchmllm.dist.orchestrator.LocalBatch)
ID_BYTES = 8  # token ids, targets, positions: int64
MASK_BYTES = 1  # bool masks

# bytes per value: compute (activations, gathered parameters, their gradients), master
# (sharded parameters, optimizer state, sharded gradients), reduce (reduce-scatter)
PRECISION_BYTES = {"float32": (4, 4, 4), "float64": (8, 8, 8), "bf16-mixed": (2, 4, 4)}


def feature(phase: str, what: str) -> str:
    """The name of a per-rank feature: ``"<phase>.<what>"``."""
    return f"{phase}.{what}"


# What the per-rank features count (rank_features computes them):
FEATURES = {
    "rows": "activation rows of the phase's blocks (packed: summed lengths; padded: items x "
    "the longest)",
    "input": "rows entering the front end (ViT: patches; Whisper: items x the longest clip in "
    "mel frames)",
    "raw": "raw rows of the phase's items on the rank (its encoder layout)",
    "sampled": "raw rows of the items sampled on the rank (before any move)",
    "valid": "real encoder positions (without padding)",
    "merged": "connector rows (real positions / downsample)",
    "encoded": "the phase's encoded tokens in the rank's LLM layout",
    "longest": "the longest item's encoder positions",
    "items": "items (sequences) of the phase",
    "attn_fwd": "the attention kernel's forward workspace (bytes)",
    "attn_bwd": "the attention kernel's backward workspace (bytes)",
    "tokens": "LLM tokens (summed sequence lengths)",
    "text": "text tokens in the rank's LLM layout",
    "sampled_text": "text tokens sampled on the rank",
    "chunk": "tokens of the loss's first chunk, min(tokens, loss_chunk)",
    "chunk2": "tokens of its second chunk (0 with one chunk)",
    "gathered_raw": "an all-gather communicator's raw rows: ranks x the most any rank sampled",
    "gathered_merged": "its connector rows: ranks x the most any rank encoded",
    "gathered_encoded": "its encoded tokens backward: ranks x the most any rank's LLM layout holds",
    "gathered_text": "its text tokens: ranks x the most any rank sampled",
}
COMMUNICATORS = ("all_to_all", "all_gather")


@dataclass(frozen=True)
class Dtypes:
    """Bytes per value under a precision (``TrainRecipe.precision``)."""

    compute: int
    master: int
    reduce: int

    @classmethod
    def of(cls, precision: str) -> Dtypes:
        return cls(*PRECISION_BYTES[precision])

    @property
    def opmath(self) -> int:
        """What a reduced-precision op accumulates in (fp32 for bf16): RMSNorm's upcast,
        attention's log-sum-exp, the loss's logits."""
        return max(4, self.compute)

    @property
    def mixed(self) -> bool:
        return self.compute != self.master


@dataclass(frozen=True)
class StepSetup:
    """How the step runs, beyond the model and the recipe.

    Attributes:
        shard_group: ranks FSDP shards over (1: one rank holds everything).
        device: ``cpu`` or ``cuda``: which attention kernels run, whether the batch is copied
            to the device inside the step, which AdamW implementation runs, LayerNorm's
            statistics dtype (the input's on CPU, fp32 on CUDA).
        moves: the orchestrator's moves that run this step: ``"<encoder>.raw"`` (raw rows to
            the encoder layout), ``"<encoder>.out"`` (outputs to the LLM layout), ``"text"``
            (token ids and loss mask to the LLM layout). A move where every item stays is
            skipped (``Orchestrator._move``).
        fsdp: parameters sharded with FSDP2; False: one plain copy in the compute dtype whose
            gradients accumulate in place (``benchmarks/gpu_step.py``'s emulated ranks).
        optimizer: AdamW steps after the backward.
        previous_batch: the previous step's ``LLMBatch`` is alive when the step starts (the
            trainer rebinds ``loss, out`` only when the backward has returned); taken to be
            the size of this step's.
        communicator: how a move runs: ``all_to_all`` (the dispatcher: a rank receives its
            own items) or ``all_gather`` (the paper's Figure 12 alternative: every rank
            receives every rank's items, padded to the largest, and keeps its own).
    """

    shard_group: int = 1
    device: str = "cuda"
    moves: frozenset[str] = frozenset()
    fsdp: bool = True
    optimizer: bool = True
    previous_batch: bool = True
    communicator: str = "all_to_all"

    def __post_init__(self) -> None:
        if self.communicator not in COMMUNICATORS:
            raise ValueError(
                f"communicator must be one of {COMMUNICATORS}, got {self.communicator!r}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.shard_group < 1:
            raise ValueError(f"shard_group must be >= 1, got {self.shard_group!r}")


# -- parameters -----------------------------------------------------------------------------


def block_parameters(hidden: int, ffn: int, heads: int, kv_heads: int, *, gated: bool) -> int:
    """Parameters of one ``orchmllm.models.layers.Block``: the fused q|k|v projection (with
    bias), the output projection, two norms (RMSNorm: a scale; LayerNorm: scale and bias) and
    the MLP (SwiGLU: gate|up and down, no bias; GELU: up and down with biases)."""
    kv = hidden * kv_heads // heads
    qkv = hidden * (hidden + 2 * kv) + hidden + 2 * kv
    norms = 2 * hidden if gated else 4 * hidden
    mlp = 3 * hidden * ffn if gated else 2 * hidden * ffn + ffn + hidden
    return qkv + hidden * hidden + norms + mlp


def _largest_block_parameter(hidden: int, ffn: int, heads: int, kv_heads: int, gated: bool):
    kv = hidden * kv_heads // heads
    return max(hidden * (hidden + 2 * kv), hidden * hidden, (2 if gated else 1) * hidden * ffn)


@dataclass
class Unit:
    """One FSDP2 unit (``orchmllm.models.parallelize.shard_model``) and its buffers."""

    name: str
    params: int
    largest: int  # its largest parameter (the single-rank gather casts one at a time)
    trained: bool
    gathered: Storage | None = None  # unsharded parameters
    buffer: Storage | None = None  # all-gather output
    grads: list[Storage] = field(default_factory=list)
    reduced: bool = False


def units(config: ModelConfig) -> dict[str, Unit]:
    """Every FSDP unit of the model with its parameter count, in the order the trainer's
    forward first uses them (each encoder's own parameters, its blocks, its connector; the
    token embedding; the LLM's own parameters, its blocks)."""
    out: dict[str, Unit] = {}
    hl = config.llm.hidden
    for name, e in config.encoders.items():
        h = e.hidden
        own = e.front_end_parameters + 2 * h  # the front end (its spec's count) and the norm
        # the largest weight: whisper's conv2; a packed architecture's front-end linear layer
        largest = h * h * 3 if e.arch == "whisper" else e.feature_dim * e.stride * h
        trained = not e.frozen
        out[name] = Unit(name, own, largest, trained)
        p = block_parameters(h, e.ffn, e.heads, e.kv_heads, gated=False)
        big = _largest_block_parameter(h, e.ffn, e.heads, e.kv_heads, False)
        for i in range(e.layers):
            out[f"{name}.blocks.{i}"] = Unit(f"{name}.blocks.{i}", p, big, trained)
        conn = h * e.downsample * hl + hl + hl * hl + hl
        out[f"{name}.connector"] = Unit(
            f"{name}.connector", conn, max(h * e.downsample, hl) * hl, True
        )
    m = config.llm
    out["embed_tokens"] = Unit("embed_tokens", config.vocab * hl, config.vocab * hl, True)
    out[LLM] = Unit(LLM, hl + config.vocab * hl, config.vocab * hl, True)  # norm, lm_head
    p = block_parameters(hl, m.ffn, m.heads, m.kv_heads, gated=True)
    big = _largest_block_parameter(hl, m.ffn, m.heads, m.kv_heads, True)
    for i in range(m.layers):
        out[f"{LLM}.blocks.{i}"] = Unit(f"{LLM}.blocks.{i}", p, big, True)
    return out


# -- the replay's environment -----------------------------------------------------------------


class Act:
    """An activation of the replay: the storage it lives in, its size, whether autograd
    tracks it, and the gradient buffer it receives while backward runs."""

    __slots__ = ("storage", "size", "tracked", "grad")

    def __init__(self, storage: Storage | None, size: Form, tracked: bool) -> None:
        self.storage, self.size, self.tracked, self.grad = storage, size, tracked, None


@dataclass
class Env:
    """One replay: the trace, the dtypes, the set-up and FSDP's state."""

    tr: Trace
    dt: Dtypes
    setup: StepSetup
    config: ModelConfig
    units: dict[str, Unit]
    order: list[Unit] = field(default_factory=list)  # FSDP2's post-forward order
    fwd_buffer: Storage | None = None  # forward all-gather buffer kept for the next copy-out
    rs_input: Storage | None = None  # the last reduce-scatter's input, kept until the next
    sharded: list[Storage] = field(default_factory=list)  # sharded gradients, to zero_grad
    held: list[Storage] = field(default_factory=list)  # what the trainer holds to the step's end

    @property
    def s(self) -> int:
        return self.dt.compute

    @property
    def stat(self) -> int:
        """LayerNorm's mean and rstd: the input's dtype on CPU, fp32 (opmath) on CUDA."""
        return self.dt.compute if self.setup.device == "cpu" else self.dt.opmath

    def new(self, size: Form, label: str, *, tracked: bool = False) -> Act:
        return Act(self.tr.new(size, label), size, tracked)

    def alias(self, a: Act, *, tracked: bool | None = None) -> Act:
        """A view of ``a`` (its storage gains a reference)."""
        return Act(self.tr.ref(a.storage), a.size, a.tracked if tracked is None else tracked)

    def drop(self, *acts: Act | None) -> None:
        self.tr.drop(*(a.storage for a in acts if a is not None))

    # gradients ---------------------------------------------------------------------------

    def give(self, a: Act, grad: Storage | None) -> None:
        """Deliver ``grad`` to ``a``: the first becomes its buffer, a later one is added in
        place (autograd's InputBuffer) and released."""
        if grad is None:
            return
        if not a.tracked or a.grad is not None:
            self.tr.drop(grad)
        else:
            a.grad = grad

    def grad_new(self, a: Act, label: str, size: Form | None = None) -> None:
        """A freshly allocated gradient for ``a`` (of ``size``, default ``a``'s)."""
        if a.tracked:
            self.give(a, self.tr.new(size if size is not None else a.size, label))

    def pass_grad(self, out: Act, *to: Act) -> None:
        """``out``'s gradient handed on unchanged (an addition's, a view's)."""
        for a in to:
            self.give(a, self.tr.ref(out.grad))

    def consume(self, out: Act) -> None:
        """Release ``out``'s gradient buffer after its node ran."""
        self.tr.drop(out.grad)
        out.grad = None

    def param_grad(self, unit: Unit, params: int, label: str) -> None:
        """A weight gradient: the first accumulation keeps the tensor backward produced."""
        if unit.trained:
            unit.grads.append(self.tr.new(const(self.s * params), label))
