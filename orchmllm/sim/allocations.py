"""What one trainer step allocates and frees, replayed op by op from the code it runs.

:func:`step_moments` replays ``orchmllm.train``'s step on a :class:`~orchmllm.sim.trace.Trace`
for a model config and a training recipe (:class:`~orchmllm.config.TrainRecipe`): the forward
of every encoder and the LLM (``orchmllm.models``), the chunked loss (``orchmllm.dist.loss``), the
backward (with the recomputation of checkpointed blocks), FSDP2's parameter and gradient
buffers and AdamW's step. Sizes are forms in per-rank features (:data:`FEATURES` names them;
:func:`orchmllm.sim.memory.rank_features` computes them from a batch and its layout), so the
result is every rank's live bytes at every moment that can be a peak.

Each function below mirrors one piece of code and says where each buffer comes from:

- the model code (``orchmllm/models/*.py``, ``orchmllm/dist/loss.py``,
  ``orchmllm/dist/orchestrator.py``, ``orchmllm/dist/comm.py``): which tensors exist, how long
  Python holds them;
- PyTorch autograd (``tools/autograd/derivatives.yaml``): what each op saves for backward and
  which gradients its backward allocates; the engine runs nodes in reverse creation order,
  adds a second gradient into the first in place, and frees a node's saved tensors after it;
- ``torch.utils.checkpoint`` (non-reentrant, early stop): a checkpointed block keeps its
  inputs, and backward recomputes its forward up to the last saved tensor;
- FSDP2 (``torch/distributed/fsdp/_fully_shard``): each unit's parameters are gathered into
  storages of their own (through an all-gather buffer when the group has more than one
  rank; forward frees a unit's buffer at the next unit's copy-out, backward at its own),
  resharded after forward and after backward, the next unit prefetched in backward, the
  gradients reduce-scattered in the reduce dtype (on one rank copied from the input divided
  by the divide factor, a temporary the input's size), and a reduce-scatter's input kept
  until the next one starts; a unit whose forward inputs need no gradient (an encoder's own
  parameters, the token embedding) reduces at the end of backward;
- AdamW (``torch/optim/adamw.py``): the single-tensor step on CPU keeps two parameter-sized
  temporaries, the foreach step on CUDA a whole group's ``sqrt(exp_avg_sq)``;
- attention kernels: the CPU flash kernel (``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``)
  takes per-thread buffers sized by its query and key splits; on CUDA, FlashAttention-2's
  variable-length backward (``flash_api.cpp``, ``mha_varlen_bwd``) an fp32 query-gradient
  accumulator and softmax sum, and the memory-efficient kernel (padded attention with a mask)
  the same two (its ``delta`` and gradient accumulator). The CUDA workspaces are from the
  kernels' sources, not measured here; on CPU the whole replay is checked against the
  allocator (``tests/test_memory_measured.py``).

Left out: the CPU GEMM library's packing buffers for bf16 (oneDNN allocates some per matmul;
CUDA's cuBLAS workspace is allocated once, before any step), the allocator's rounding and
fragmentation, tensors of a few bytes per item or sequence, parameter padding to the shard
group (at most one row per parameter and rank).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from orchmllm.config import EncoderConfig, ModelConfig, TrainRecipe
from orchmllm.schema import LLM
from orchmllm.sim.trace import Form, Moments, Storage, Trace, added, const, scaled

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
        if e.arch == "vit":
            own = e.feature_dim * h + h + 2 * h  # patch_embed, norm
            largest = e.feature_dim * h
        elif e.arch == "whisper":
            own = e.n_mels * h * 3 + h + h * h * 3 + h + 2 * h  # conv1, conv2, norm
            largest = h * h * 3
        else:
            raise ValueError(f"model.encoders.{name}: no memory model for arch {e.arch!r}")
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


# -- FSDP2 --------------------------------------------------------------------------------------


def _gather(env: Env, u: Unit) -> Storage:
    """Copy-out: the unit's parameters into storages of their own, in the compute dtype."""
    tr, s = env.tr, env.s
    if env.setup.shard_group == 1 and env.dt.mixed:
        # one parameter at a time: its bf16 cast, then its storage (FSDPParamGroup
        # .wait_for_unshard, world size 1)
        tr.transient(const(s * u.largest), f"{u.name} cast")
    return tr.new(const(s * u.params), f"{u.name} unsharded")


def unshard(env: Env, u: Unit, *, forward: bool) -> None:
    if not env.setup.fsdp or u.gathered is not None:
        return
    tr, s = env.tr, env.s
    if env.setup.shard_group == 1:
        u.gathered = _gather(env, u)
        return
    if u.buffer is None:
        u.buffer = tr.new(const(s * u.params), f"{u.name} all-gather")
    if forward and env.fwd_buffer is not None:
        tr.drop(env.fwd_buffer)  # the previous unit's buffer, kept for overlap until now
        env.fwd_buffer = None
    u.gathered = _gather(env, u)
    if forward:
        env.fwd_buffer = u.buffer
    else:
        tr.drop(u.buffer)
    u.buffer = None


def reshard(env: Env, u: Unit) -> None:
    if u.gathered is not None:
        env.tr.drop(u.gathered)
        u.gathered = None


def pre_forward(env: Env, u: Unit) -> None:
    unshard(env, u, forward=True)


def post_forward(env: Env, u: Unit) -> None:
    if env.setup.fsdp:
        reshard(env, u)
        env.order.append(u)


def pre_backward(env: Env, u: Unit) -> None:
    """Gather ``u`` (prefetched or not), then prefetch the unit before it in post-forward
    order: its all-gather buffer when the group has other ranks (a single rank copies at
    the wait instead)."""
    if not env.setup.fsdp:
        return
    unshard(env, u, forward=False)
    i = env.order.index(u)
    if i > 0 and env.setup.shard_group > 1:
        nxt = env.order[i - 1]
        if nxt.trained and nxt.gathered is None and nxt.buffer is None:
            nxt.buffer = env.tr.new(const(env.s * nxt.params), f"{nxt.name} prefetch")


def post_backward(env: Env, u: Unit) -> None:
    """Reshard, wait for the previous reduce-scatter (its input is freed), reduce-scatter this
    unit's gradients in the reduce dtype: the output is the sharded gradient (cast to the
    parameters' dtype where the two differ), kept until ``zero_grad``."""
    tr, dt, g = env.tr, env.dt, env.setup.shard_group
    if u.reduced:
        return
    u.reduced = True
    reshard(env, u)
    if not u.trained or not env.setup.fsdp:
        return
    if env.rs_input is not None:
        tr.drop(env.rs_input)
    env.rs_input = tr.new(const(dt.reduce * u.params), f"{u.name} reduce-scatter input")
    out = tr.new(const(dt.reduce * u.params / g), f"{u.name} sharded gradient")
    if g == 1:
        # no collective: the output is copied from the input divided by the gradient divide
        # factor (the trainer's sum reduction sets one), a new tensor the input's size
        # (foreach_reduce, world size 1)
        tr.transient(const(dt.reduce * u.params), f"{u.name} divided reduce-scatter input")
    tr.drop(*u.grads)
    u.grads.clear()
    if dt.reduce != dt.master:
        cast = tr.new(const(dt.master * u.params / g), f"{u.name} sharded gradient")
        tr.drop(out)
        out = cast
    env.sharded.append(out)


def final_callback(env: Env) -> None:
    """FSDP2's root callback at the end of backward: the units not reduced yet (their forward
    inputs needed no gradient) reshard and reduce, in module order; the last reduce-scatter
    is waited for (its input freed)."""
    for u in env.units.values():
        if u.gathered is not None or u.grads:
            post_backward(env, u)
    if env.rs_input is not None:
        env.tr.drop(env.rs_input)
        env.rs_input = None


# -- building blocks ----------------------------------------------------------------------------


def marker(env: Env, label: str, run: Callable[[Trace], None]) -> None:
    """A node that allocates nothing: an FSDP hook placed in the backward order (a unit's
    post-backward is recorded before its operations, its pre-backward after them)."""
    env.tr.node(label, [], run)


def linear(env: Env, x: Act, rows: Form, fan_in: int, fan_out: int, unit: Unit, *, bias: bool,
           label: str, alloc: bool = True) -> Act:  # fmt: skip
    """``nn.Linear``: saves its input when its weight is trained; backward allocates the
    input's gradient and the weight's (and bias's). ``alloc=False``: the node without its
    product (a recomputation stopped before it)."""
    size = scaled(rows, env.s * fan_out)
    tracked = x.tracked or unit.trained
    out = env.new(size, label, tracked=tracked) if alloc else Act(None, size, tracked)

    def run(tr: Trace) -> None:
        env.grad_new(x, f"{label} input grad", scaled(rows, env.s * fan_in))
        env.param_grad(unit, fan_in * fan_out + (fan_out if bias else 0), f"{label} weight grad")
        env.consume(out)

    if tracked:
        env.tr.node(label, [x.storage] if unit.trained else [], run)
    return out


def pointwise(env: Env, x: Act, size: Form, label: str, *, saves: list[Act]) -> Act:
    """A one-input elementwise op (GELU, SiLU, a cast, a product with a constant mask): a new
    output, saving ``saves``; backward allocates the input's gradient."""
    out = env.new(size, label, tracked=x.tracked)

    def run(tr: Trace) -> None:
        env.grad_new(x, f"{label} grad")
        env.consume(out)

    if x.tracked:
        env.tr.node(label, [a.storage for a in saves], run)
    return out


def add(env: Env, a: Act, b: Act, label: str, *, alloc: bool = True) -> Act:
    """``a + b`` (a residual): saves nothing; backward hands the gradient to both."""
    tracked = a.tracked or b.tracked
    out = env.new(a.size, label, tracked=tracked) if alloc else Act(None, a.size, tracked)

    def run(tr: Trace) -> None:
        env.pass_grad(out, a, b)
        env.consume(out)

    if tracked:
        env.tr.node(label, [], run)
    return out


def cast(env: Env, x: Act, size: Form, label: str) -> Act:
    """``x.to(dtype)``: a new tensor unless the size (the dtype) is unchanged."""
    if size == x.size:
        return env.alias(x)
    return pointwise(env, x, size, label, saves=[])


def split(env: Env, whole: Act, sizes: list[Form], label: str) -> list[Act]:
    """``split``/``chunk``/slicing into views; backward concatenates the parts' gradients
    into a new tensor of the whole's size once every part's gradient has arrived."""
    parts = [Act(env.tr.ref(whole.storage), size, whole.tracked) for size in sizes]

    def run(tr: Trace) -> None:
        env.give(whole, tr.new(whole.size, f"{label} grad"))
        for p in parts:
            env.consume(p)

    if whole.tracked:
        env.tr.node(label, [], run)
    return parts


def layer_norm(env: Env, x: Act, rows: Form, h: int, unit: Unit, label: str) -> Act:
    """``nn.LayerNorm`` (``native_layer_norm``): saves its input, mean and rstd."""
    tracked = x.tracked or unit.trained
    y = env.new(scaled(rows, env.s * h), label, tracked=tracked)
    stats = env.new(scaled(rows, 2 * env.stat), f"{label} mean, rstd")

    def run(tr: Trace) -> None:
        env.grad_new(x, f"{label} input grad")
        env.param_grad(unit, 2 * h, f"{label} weight grad")
        env.consume(y)

    if tracked:
        env.tr.node(label, [x.storage, stats.storage], run)
    env.drop(stats)
    return y


def rms_norm(env: Env, x: Act, rows: Form, h: int, unit: Unit, label: str) -> Act:
    """``nn.RMSNorm`` (the composite ``aten::_fused_rms_norm`` runs on CPU): upcast to the
    opmath dtype (a copy for bf16), ``pow(2)``, mean, ``rsqrt``, scale, times the weight in
    opmath, cast back. Saves the upcast input, the rsqrt and the scaled input. Its backward
    (one node here) allocates each of those ops' gradients in opmath in turn."""
    s, a = env.s, env.dt.opmath
    wide = scaled(rows, a * h)
    tracked = x.tracked or unit.trained
    u = (
        env.alias(x, tracked=tracked)
        if a == s
        else env.new(wide, f"{label} upcast", tracked=tracked)
    )
    env.drop(env.new(wide, f"{label} pow"))  # its mean, [rows, 1], replaces it
    r = env.new(scaled(rows, a), f"{label} rsqrt")
    n = env.new(wide, f"{label} scaled", tracked=tracked)
    w = env.new(wide, f"{label} weighted", tracked=tracked)
    y = w if a == s else env.new(scaled(rows, s * h), label, tracked=tracked)
    if a != s:
        env.drop(w)

    def run(tr: Trace) -> None:
        if a != s:  # the cast back
            env.grad_new(w, f"{label} cast grad")
            env.consume(y)
        tr.transient(wide, f"{label} weight grad product")  # (g * scaled).sum(rows)
        env.param_grad(unit, h, f"{label} weight grad")
        env.grad_new(n, f"{label} scaled grad")
        env.consume(w)
        tr.transient(wide, f"{label} rsqrt grad product")  # (g * upcast).sum(-1)
        env.grad_new(u, f"{label} upcast grad")
        env.consume(n)
        mean_grad = tr.new(wide, f"{label} mean grad")  # expanded over the row, / h
        tr.transient(wide, f"{label} pow grad factor")  # 2 * upcast
        env.give(u, tr.new(wide, f"{label} pow grad"))  # added in place
        tr.drop(mean_grad)
        if a != s:
            env.grad_new(x, f"{label} input grad", scaled(rows, s * h))
            env.consume(u)
        else:
            env.give(x, u.grad)
            u.grad = None

    if tracked:
        env.tr.node(label, [u.storage, r.storage, n.storage], run)
    env.drop(u, r, n)
    return y


@dataclass(frozen=True)
class BlockShape:
    """One transformer block of ``orchmllm.models.layers.Block`` as memory sees it."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    qwen2: bool  # RMSNorm + SwiGLU (the LLM); else LayerNorm + GELU MLP (the encoders)
    rope: bool
    padded: bool  # attention over a padded batch (else over packed sequences)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def params(self) -> int:
        return block_parameters(self.hidden, self.ffn, self.heads, self.kv_heads, gated=self.qwen2)


def block_shape(config: ModelConfig, phase: str) -> BlockShape:
    """The block of ``phase`` (an encoder's name or ``llm``)."""
    if phase == LLM:
        m = config.llm
        return BlockShape(m.hidden, m.ffn, m.heads, m.kv_heads, True, True, False)
    e = config.encoders[phase]
    return BlockShape(e.hidden, e.ffn, e.heads, e.kv_heads, False, e.arch == "vit", e.padded)


def rotate(env: Env, x: Act, rows: Form, width: int, d: int, label: str) -> Act:
    """``layers.rotate``: cos and sin built in float64 and cast (each ``[rows, 1, d/2]``,
    saved by the products that use them), four products, a difference, a sum, a
    concatenation. Backward: the concatenation's gradient split into views, the difference's
    second operand negated, four products, and each half's gradient scattered into zeros of
    ``x``'s shape (slice backward)."""
    s = env.s
    half = scaled(rows, s * width // 2)
    table = scaled(rows, 8 * d // 2)
    angles = env.new(table, f"{label} angles")
    tables = [env.new(table, f"{label} table64") for _ in range(2)]
    cos, sin = (
        env.alias(t) if s == 8 else env.new(scaled(rows, s * d // 2), f"{label} table")
        for t in tables
    )
    env.drop(*tables, angles)
    env.drop(*[env.new(half, f"{label} product") for _ in range(2)])
    diff = env.new(half, f"{label} difference")
    env.drop(*[env.new(half, f"{label} product") for _ in range(2)])
    total = env.new(half, f"{label} sum")
    out = env.new(scaled(rows, s * width), label, tracked=x.tracked)
    env.drop(diff, total)

    def run(tr: Trace) -> None:
        halves = [tr.new(half, f"{label} grad") for _ in range(2)]  # x1*sin, x2*cos
        neg = tr.new(half, f"{label} negated grad")
        tr.transient(half, f"{label} grad")  # x2*sin, added into its half in place
        tr.drop(neg)
        tr.transient(half, f"{label} grad")  # x1*cos, added in place
        env.consume(out)
        for h in halves:  # slice backward: zeros of x's shape with the half copied in
            env.give(x, tr.new(scaled(rows, s * width), f"{label} slice grad"))
            tr.drop(h)

    if x.tracked:
        env.tr.node(label, [cos.storage, sin.storage], run)
    env.drop(cos, sin)
    return out


def attention(env: Env, q: Act, k: Act, v: Act, rows: Form, shape: BlockShape, phase: str,
              label: str) -> Act:  # fmt: skip
    """``attention.packed_attention`` / ``padded_attention``: the kernel saves q, k and v (the
    storages they view), its output and its log-sum-exp (opmath, one per head and row); the
    padded one also the key mask converted to the compute dtype. On CPU the packed path runs
    the kernel per sequence and concatenates the outputs (a second copy, the one the output
    projection saves), and its backward concatenates q's, k's and v's per-sequence gradients;
    elsewhere the output is one tensor the projection reads as a view. The kernels'
    workspaces are the ``attn_fwd``/``attn_bwd`` features."""
    s, a, h = env.s, env.dt.opmath, shape.hidden
    tracked = q.tracked
    mask = env.new(scaled(rows, s), f"{label} mask") if shape.padded else None
    env.tr.transient({feature(phase, "attn_fwd"): 1.0}, f"{label} workspace")
    out = env.new(scaled(rows, s * h), label, tracked=tracked)
    lse = env.new(scaled(rows, a * shape.heads), f"{label} lse")
    per_sequence = not shape.padded and env.setup.device == "cpu"
    o = env.new(out.size, f"{label} concatenated", tracked=tracked) if per_sequence else out
    parts = (q, k, v)
    node = None

    def run(tr: Trace) -> None:
        if per_sequence:  # each sequence's kernel frees its output and lse as it goes
            tr.release(node, out.storage)
            tr.release(node, lse.storage)
        grads = [tr.new(p.size, f"{label} grad") for p in parts]
        tr.transient({feature(phase, "attn_bwd"): 1.0}, f"{label} workspace")
        env.consume(o)  # with per-sequence kernels: the views of it, released with them
        for p, g in reversed(list(zip(parts, grads, strict=True))):
            if per_sequence:  # the split into sequences: one concatenation per input
                env.give(p, tr.new(p.size, f"{label} split grad"))
                tr.drop(g)
            else:
                env.give(p, g)

    if tracked:
        saved = [q.storage, k.storage, v.storage, out.storage, lse.storage]
        node = env.tr.node(label, saved + ([mask.storage] if mask else []), run)
    if per_sequence:
        env.drop(out)
    env.drop(lse, mask)
    return o


def block(env: Env, x: Act, rows: Form, shape: BlockShape, unit: Unit, phase: str, *,
          recompute: bool = False) -> Act:  # fmt: skip
    """``layers.Block``: ``x1 = x + attn(norm1(x))``, ``x1 + mlp(norm2(x1))``. With
    ``recompute`` (a checkpointed block's backward) it stops where non-reentrant checkpointing
    stops early: once the down projection has saved its input, before its product and the
    final residual (returned as a tensor without storage)."""
    s, h, f, kv, d = env.s, shape.hidden, shape.ffn, shape.kv, shape.head_dim
    norm = rms_norm if shape.qwen2 else layer_norm
    # a norm's output is the argument of the module it feeds: alive until that returns;
    # SelfAttention's locals (qkv, the rotated q and k) until its output projection ran
    y = norm(env, x, rows, h, unit, f"{phase} norm1")
    qkv = linear(env, y, rows, h, h + 2 * kv, unit, bias=True, label=f"{phase} qkv")
    sizes = [scaled(rows, s * h), scaled(rows, s * kv), scaled(rows, s * kv)]
    q, k, v = split(env, qkv, sizes, f"{phase} qkv split")
    if shape.rope:
        q_in = rotate(env, q, rows, h, d, f"{phase} rope q")
        k_in = rotate(env, k, rows, kv, d, f"{phase} rope k")
    else:  # the kernel reads views of the split's parts
        q_in, k_in = q, k
    o = attention(env, q_in, k_in, v, rows, shape, phase, f"{phase} attention")
    attn = linear(env, o, rows, h, h, unit, bias=False, label=f"{phase} out")
    if shape.rope:
        env.drop(q_in, k_in)
    env.drop(o, q, k, v, qkv, y)
    x1 = add(env, x, attn, f"{phase} residual1")
    env.drop(attn)
    y2 = norm(env, x1, rows, h, unit, f"{phase} norm2")
    if shape.qwen2:  # SwiGLU: gate|up and its halves stay bound until down has run
        gu = linear(env, y2, rows, h, 2 * f, unit, bias=False, label=f"{phase} gate_up")
        gate, up = split(env, gu, [scaled(rows, s * f)] * 2, f"{phase} gate_up chunk")
        act = pointwise(env, gate, scaled(rows, s * f), f"{phase} silu", saves=[gate])
        prod = product(env, act, up, rows, f, f"{phase} swiglu")
        env.drop(act)
        bound = [gate, up, gu]
    else:  # GELU MLP: up's output is a temporary, gone once GELU returns
        u = linear(env, y2, rows, h, f, unit, bias=True, label=f"{phase} up")
        prod = pointwise(env, u, scaled(rows, s * f), f"{phase} gelu", saves=[u])
        env.drop(u)
        bound = []
    down = linear(env, prod, rows, f, h, unit, bias=not shape.qwen2, label=f"{phase} down",
                  alloc=not recompute)  # fmt: skip
    env.drop(prod, *bound, y2)
    out = add(env, x1, down, f"{phase} residual2", alloc=not recompute)
    env.drop(down, x1)
    return out


def product(env: Env, a: Act, b: Act, rows: Form, f: int, label: str) -> Act:
    """``a * b`` of two tracked tensors: saves both; backward: a gradient for each."""
    out = env.new(scaled(rows, env.s * f), label, tracked=True)

    def run(tr: Trace) -> None:
        env.grad_new(a, f"{label} grad")
        env.grad_new(b, f"{label} grad")
        env.consume(out)

    env.tr.node(label, [a.storage, b.storage], run)
    return out


@dataclass(frozen=True)
class Tower:
    """A stack of blocks (an encoder's or the LLM's) as the replay runs it."""

    phase: str
    shape: BlockShape
    layers: int
    trained: bool
    rows: Form


def blocks_forward(env: Env, x: Act, tw: Tower, recipe: TrainRecipe, *, extra: list[Act]) -> Act:
    """A tower's blocks. A checkpointed block (``recipe.checkpointed(i)`` in a trained
    tower) runs without saving; one node keeps its input and ``extra`` (the other arguments
    it was called with, e.g. positions) and recomputes it in backward. Every block's moments
    are recorded: the backward's peak can lie inside the run, not at its ends (MLLM-10B at 64
    ranks: in an inner LLM block, 7.8% above the end blocks' moments; found by torch's
    tracker, :mod:`orchmllm.train.memory_oracle`)."""
    tr = env.tr
    for i in range(tw.layers):
        unit = env.units[f"{tw.phase}.blocks.{i}"]
        backward = tr.saving and tw.trained
        if backward:
            marker(env, f"{unit.name} post-backward", lambda t, u=unit: post_backward(env, u))
        pre_forward(env, unit)
        if backward and recipe.checkpointed(i):
            tr.saving = False
            out = block(env, x, tw.rows, tw.shape, unit, tw.phase)
            tr.saving = True
            out.tracked = True
            _checkpointed(env, x, out, tw, unit, extra)
        else:
            saving = tr.saving
            tr.saving = backward
            out = block(env, x, tw.rows, tw.shape, unit, tw.phase)
            tr.saving = saving
        if backward:
            marker(env, f"{unit.name} pre-backward", lambda t, u=unit: pre_backward(env, u))
        post_forward(env, unit)
        env.drop(x)  # the loop rebinds its variable (the caller holds the first input)
        x = out
    return x


def _checkpointed(env: Env, x: Act, out: Act, tw: Tower, unit: Unit, extra: list[Act]) -> None:
    """The node a checkpointed block leaves: it keeps the block's inputs; its backward
    recomputes the block (saving, up to the early stop), then runs the recomputed nodes."""

    def run(tr: Trace) -> None:
        outer, tr.nodes = tr.nodes, []
        x_in = Act(tr.ref(x.storage), x.size, True)
        again = block(env, x_in, tw.rows, tw.shape, unit, tw.phase, recompute=True)
        again.grad, out.grad = out.grad, None
        inner, tr.nodes = tr.nodes, outer
        tr.backward(inner)
        env.give(x, x_in.grad)
        x_in.grad = None
        tr.drop(x_in.storage)

    env.tr.node(f"{unit.name} checkpoint", [x.storage, *(a.storage for a in extra)], run)


def positions(env: Env, rows: Form, label: str) -> Act:
    """``attention.positions_from_lengths``: ``arange`` minus ``repeat_interleave`` of the
    starts (both int64 per row), the difference kept."""
    parts = [env.new(scaled(rows, ID_BYTES), f"{label} positions work") for _ in range(2)]
    pos = env.new(scaled(rows, ID_BYTES), f"{label} positions")
    env.drop(*parts)
    return pos


# -- the modules -------------------------------------------------------------------------------


def rows_of(phase: str, what: str) -> Form:
    return {feature(phase, what): 1.0}


def vit_forward(env: Env, name: str, e: EncoderConfig, raw: Act, recipe: TrainRecipe) -> Act:
    """``models.vision.VisionEncoder`` called as the trainer calls it (its input cast to the
    compute dtype first): patch embedding, packed blocks with RoPE positions, LayerNorm, the
    connector. The encoder's own unit reduces at the end of backward (its input needs no
    gradient)."""
    own, tr, s, h = env.units[name], env.tr, env.s, e.hidden
    rows, merged = rows_of(name, "rows"), rows_of(name, "merged")
    x = cast(env, raw, scaled(rows_of(name, "raw"), s * e.feature_dim), f"{name} input cast")
    saving = tr.saving
    tr.saving = saving and own.trained
    pre_forward(env, own)
    pos = positions(env, rows, name)
    x0 = linear(env, x, rows, e.feature_dim, h, own, bias=True, label=f"{name} patch_embed")
    tower = Tower(name, block_shape(env.config, name), e.layers, own.trained, rows)
    xl = blocks_forward(env, x0, tower, recipe, extra=[pos])
    y = layer_norm(env, xl, rows, h, own, f"{name} norm")
    tr.saving = saving
    out = connector(env, name, e, y, merged)
    _encoder_done(env, own, out, [y, xl, pos, x])  # `x` is bound until the return
    return out


def whisper_forward(env: Env, name: str, e: EncoderConfig, raw: Act, recipe: TrainRecipe) -> Act:
    """``models.audio.AudioEncoder``: the clips padded to the longest (a zero tensor and a
    bool mask over mel frames), conv1 + GELU, the mask product, conv2 (stride) + GELU, the
    sinusoid table (float64 over the longest clip) added, padded blocks with a key mask, the
    real positions gathered, LayerNorm, the connector."""
    own, tr, s, h = env.units[name], env.tr, env.s, e.hidden
    frames, rows = rows_of(name, "input"), rows_of(name, "rows")
    valid_rows, merged = rows_of(name, "valid"), rows_of(name, "merged")
    x = cast(env, raw, scaled(rows_of(name, "raw"), s * e.n_mels), f"{name} input cast")
    saving = tr.saving
    tr.saving = saving and own.trained
    pre_forward(env, own)
    valid = env.new(scaled(frames, MASK_BYTES), f"{name} frame mask")
    padded = env.new(scaled(frames, s * e.n_mels), f"{name} padded mels")
    tr.transient(scaled(rows_of(name, "raw"), 2 * ID_BYTES), f"{name} mask indices")
    c1 = conv(env, padded, frames, frames, e.n_mels, h, own, f"{name} conv1")
    g1 = pointwise(env, c1, c1.size, f"{name} gelu1", saves=[c1])
    env.drop(c1)
    m1 = pointwise(env, g1, g1.size, f"{name} masked", saves=[valid])
    env.drop(g1)
    c2 = conv(env, m1, frames, rows, h, h, own, f"{name} conv2")
    env.drop(m1)
    g2 = pointwise(env, c2, c2.size, f"{name} gelu2", saves=[c2])
    env.drop(c2)
    longest = rows_of(name, "longest")
    table = env.new(scaled(longest, 8 * h), f"{name} sinusoids")
    table_s = env.new(scaled(longest, s * h), f"{name} sinusoids cast")
    env.drop(table)
    h0 = add(env, g2, Act(None, g2.size, False), f"{name} positions added")
    env.drop(g2, table_s)
    key_mask = env.new(scaled(rows, MASK_BYTES), f"{name} key mask")
    tower = Tower(name, block_shape(env.config, name), e.layers, own.trained, rows)
    hl_ = blocks_forward(env, h0, tower, recipe, extra=[key_mask])
    hv = gather_rows(env, hl_, key_mask, rows, valid_rows, h, f"{name} real positions")
    y = layer_norm(env, hv, valid_rows, h, own, f"{name} norm")
    env.drop(hv)
    tr.saving = saving
    out = connector(env, name, e, y, merged)
    _encoder_done(env, own, out, [y, hl_, key_mask, valid, padded, x])  # `h` is bound
    return out


def _encoder_done(env: Env, own: Unit, out: Act, locals_: list[Act]) -> None:
    """The encoder's forward returns: its unit's pre-backward hook sits on the output (after
    the connector's), the unit reshards, its Python locals go."""
    if env.tr.saving:
        marker(env, f"{own.name} pre-backward", lambda t: pre_backward(env, own))
    post_forward(env, own)
    env.drop(*locals_)


def conv(env: Env, x: Act, rows_in: Form, rows_out: Form, c_in: int, c_out: int, unit: Unit,
         label: str, kernel: int = 3) -> Act:  # fmt: skip
    """``nn.Conv1d``: saves its input (and weight); backward: the input's gradient where the
    input is tracked, the weight's and bias's."""
    tracked = x.tracked or unit.trained
    out = env.new(scaled(rows_out, env.s * c_out), label, tracked=tracked)

    def run(tr: Trace) -> None:
        env.grad_new(x, f"{label} input grad", scaled(rows_in, env.s * c_in))
        env.param_grad(unit, c_in * c_out * kernel + c_out, f"{label} weight grad")
        env.consume(out)

    if tracked:
        env.tr.node(label, [x.storage] if unit.trained else [], run)
    return out


def gather_rows(env: Env, x: Act, mask: Act, rows: Form, kept: Form, h: int, label: str) -> Act:
    """``x[mask]`` with a bool mask: saves the mask; backward scatters the gradient into
    zeros of ``x``'s shape."""
    out = env.new(scaled(kept, env.s * h), label, tracked=x.tracked)

    def run(tr: Trace) -> None:
        env.grad_new(x, f"{label} grad", scaled(rows, env.s * h))
        env.consume(out)

    if x.tracked:
        env.tr.node(label, [mask.storage], run)
    return out


def connector(env: Env, name: str, e: EncoderConfig, y: Act, merged: Form) -> Act:
    """``layers.Connector`` (its own unit): ``downsample`` rows merged (a view), fc1, GELU,
    fc2 to the LLM width. Always trained, so fc1 saves the encoder's normed output (``y``,
    the caller's argument, which the caller releases)."""
    unit, hl = env.units[f"{name}.connector"], env.config.llm.hidden
    marker(env, f"{unit.name} post-backward", lambda t: post_backward(env, unit))
    pre_forward(env, unit)
    a = linear(env, y, merged, e.hidden * e.downsample, hl, unit, bias=True, label=f"{name} fc1")
    g = pointwise(env, a, a.size, f"{name} connector gelu", saves=[a])
    env.drop(a)
    out = linear(env, g, merged, hl, hl, unit, bias=True, label=f"{name} fc2")
    env.drop(g)
    marker(env, f"{unit.name} pre-backward", lambda t: pre_backward(env, unit))
    post_forward(env, unit)
    return out


ENCODER_FORWARD = {"vit": vit_forward, "whisper": whisper_forward}


def llm_forward(env: Env, recipe: TrainRecipe, encoded: list[Act]) -> Act:
    """The LLM phase of ``train.step.step_forward``: the token embedding (its own unit), the
    assembly (``LLMBatch.assemble``: a concatenation, then ``index_select`` into sequence
    order), the blocks with RoPE positions, the final RMSNorm and the chunked loss
    (:func:`chunked_loss`). Returns the loss."""
    s, m, vocab = env.s, env.config.llm, env.config.vocab
    hl = m.hidden
    text, tokens = rows_of(LLM, "text"), rows_of(LLM, "tokens")
    emb, own = env.units["embed_tokens"], env.units[LLM]
    pre_forward(env, emb)
    te = env.new(scaled(text, s * hl), "token embeddings", tracked=True)
    marker(env, "embedding", lambda t: (env.param_grad(emb, vocab * hl, "embedding grad"),
                                        env.consume(te)))  # fmt: skip
    marker(env, "embed_tokens pre-backward", lambda t: pre_backward(env, emb))
    post_forward(env, emb)
    cat = env.new(scaled(tokens, s * hl), "assembly concatenation", tracked=True)
    marker(env, "assembly concatenation", lambda t: (env.pass_grad(cat, te, *encoded),
                                                     env.consume(cat)))  # fmt: skip
    embeds = env.new(scaled(tokens, s * hl), "assembled embeddings", tracked=True)
    marker(env, "assembly index_select", lambda t: (env.grad_new(cat, "index_select grad"),
                                                    env.consume(embeds)))  # fmt: skip
    env.drop(cat, te)
    marker(env, "llm post-backward", lambda t: post_backward(env, own))
    pre_forward(env, own)
    pos = positions(env, tokens, LLM)
    tower = Tower(LLM, block_shape(env.config, LLM), m.layers, True, tokens)
    bound = env.tr.ref(embeds.storage)  # the step's `embeds`, bound until the LLM returns
    x = blocks_forward(env, embeds, tower, recipe, extra=[pos])
    hidden = rms_norm(env, x, tokens, hl, own, "llm norm")
    loss = chunked_loss(env, hidden, own)
    env.drop(hidden, x, pos)  # LLM.forward's locals: the last block's output, positions
    env.tr.drop(bound)
    marker(env, "llm pre-backward", lambda t: pre_backward(env, own))
    post_forward(env, own)
    return loss


def chunked_loss(env: Env, hidden: Act, own: Unit) -> Act:
    """``loss._ChunkedCrossEntropy.forward``: the hidden states' gradient (``empty_like``)
    and an accumulator for the weight's (opmath), then per chunk: the logits (in the compute
    dtype, cast to opmath), their softmax gradient (``exp``), its copy in the compute dtype,
    the hidden rows' gradient and the weight's product (cast and added). A chunk's logits
    and gradient stay bound until the next chunk rebinds them, so the second chunk runs
    beside the first's; later chunks are no larger. Saves the two gradients; its backward
    scales them (two new tensors: the hidden states' gradient and the LM head's)."""
    tr, s, acc = env.tr, env.s, env.dt.opmath
    vocab, hl = env.config.vocab, env.config.llm.hidden
    tokens = rows_of(LLM, "tokens")
    weight_size = const(vocab * hl)
    grad_hidden = env.new(scaled(tokens, s * hl), "loss hidden grad")
    grad_weight = env.new(scaled(weight_size, acc), "loss weight grad accumulator")
    bound: list[Act] = []
    for which in ("chunk", "chunk2"):
        rows = rows_of(LLM, which)
        logits = env.new(scaled(rows, s * vocab), "logits")
        if acc != s:
            wide = env.new(scaled(rows, acc * vocab), "logits (opmath)")
            env.drop(logits)
            logits = wide
        env.drop(*bound[:1])  # the previous chunk's logits are rebound
        grad = env.new(scaled(rows, acc * vocab), "softmax grad")
        env.drop(*bound[1:])  # the previous chunk's gradient is rebound
        if acc != s:
            narrow = env.new(scaled(rows, s * vocab), "softmax grad (compute dtype)")
            env.drop(grad)
            grad = narrow
        tr.transient(scaled(rows, s * hl), "hidden grad rows")
        product = env.new(scaled(weight_size, s), "weight grad product")
        if acc != s:
            tr.transient(scaled(weight_size, acc), "weight grad product (opmath)")
        env.drop(product)
        bound = [logits, grad]
    env.drop(*bound)
    kept = grad_weight
    if acc != s:
        kept = env.new(scaled(weight_size, s), "loss weight grad")
        env.drop(grad_weight)
    loss = env.new({}, "loss", tracked=True)

    def run(t: Trace) -> None:
        env.grad_new(hidden, "loss hidden grad scaled")
        env.param_grad(own, vocab * hl, "lm_head grad")
        env.consume(loss)

    env.tr.node("chunked cross-entropy", [grad_hidden.storage, kept.storage], run)
    env.drop(grad_hidden, kept)
    return loss


def llm_batch(env: Env) -> None:
    """``Orchestrator._llm_batch``: ``targets`` (int64) and ``loss_mask`` (bool) per token,
    kept in the ``LLMBatch`` the trainer holds to the step's end; ``is_start`` (bool) for the
    while. On CUDA the assembly's index and the text positions come to the device too."""
    tokens = rows_of(LLM, "tokens")
    start = env.new(scaled(tokens, MASK_BYTES), "is_start")
    env.held.append(env.tr.new(scaled(tokens, ID_BYTES), "targets"))
    env.drop(start)
    env.held.append(env.tr.new(scaled(tokens, MASK_BYTES), "loss_mask"))
    if env.setup.device == "cuda":
        env.held.append(env.tr.new(scaled(tokens, ID_BYTES), "assembly index"))


def move(
    env: Env,
    x: Act,
    src: Form,
    dst: Form,
    label: str,
    *,
    gathered: Form,
    gathered_back: Form | None = None,
) -> Act:
    """``comm._move_group`` (one native tensor): the send buffer in send order, the receive
    buffer, the result in destination order; backward moves the gradient back the same way.
    Under an ``all_gather`` communicator the receive buffer holds every rank's rows
    (``gathered``, backward ``gathered_back``). Sizes are per row."""
    gather = env.setup.communicator == "all_gather"
    send = env.new(src, f"{label} send")
    recv = env.new(gathered if gather else dst, f"{label} receive")
    out = env.new(dst, label, tracked=x.tracked)
    env.drop(send, recv)

    def run(tr: Trace) -> None:
        received = gathered_back if gather and gathered_back is not None else src
        back = [tr.new(dst, f"{label} grad send"), tr.new(received, f"{label} grad receive")]
        env.grad_new(x, f"{label} grad", src)
        tr.drop(*back)
        env.consume(out)

    if x.tracked:
        env.tr.node(label, [], run)
    return out


def _moved(env: Env, what: str) -> bool:
    return what in env.setup.moves


def step(env: Env, recipe: TrainRecipe) -> None:
    """One ``train.forward_backward`` and optimizer step on one rank. With
    ``previous_batch`` the step starts with the previous step's ``LLMBatch`` alive; it is
    counted as this step's (:func:`held_bytes`)."""
    tr, dev = env.tr, env.setup.device
    previous = held_bytes(env)
    if env.setup.previous_batch:
        tr.grow(previous, "the previous step's LLMBatch")
    raws = {}
    for name, e in env.config.encoders.items():
        size = scaled(rows_of(name, "sampled"), RAW_BYTES * e.feature_dim)
        # on CUDA the batch is copied to the device inside the step (LocalBatch.to)
        raws[name] = env.new(size, f"{name} batch") if dev == "cuda" else Act(None, size, False)
    if dev == "cuda":
        ids_size = scaled(rows_of(LLM, "sampled_text"), 2 * ID_BYTES)
        batch_ids = env.new(ids_size, "token ids and loss mask")
    encoded = []
    for name, e in env.config.encoders.items():
        x = raws[name]
        if _moved(env, f"{name}.raw"):
            dst = scaled(rows_of(name, "raw"), RAW_BYTES * e.feature_dim)
            gathered = scaled(rows_of(name, "gathered_raw"), RAW_BYTES * e.feature_dim)
            x = move(env, x, x.size, dst, f"{name} raw move", gathered=gathered)
        else:  # the sampled tensor itself: the rank's items are the ones it sampled
            x = Act(
                tr.ref(x.storage), scaled(rows_of(name, "raw"), RAW_BYTES * e.feature_dim), False
            )
        if e.arch not in ENCODER_FORWARD:
            raise ValueError(f"model.encoders.{name}: no memory model for arch {e.arch!r}")
        out = ENCODER_FORWARD[e.arch](env, name, e, x, recipe)
        env.drop(x)
        if _moved(env, f"{name}.out"):
            width = env.s * env.config.llm.hidden
            src, dst = (
                scaled(rows_of(name, "merged"), width),
                scaled(rows_of(name, "encoded"), width),
            )
            moved = move(
                env, out, src, dst, f"{name} output move",
                gathered=scaled(rows_of(name, "gathered_merged"), width),
                gathered_back=scaled(rows_of(name, "gathered_encoded"), width),
            )  # fmt: skip
            env.drop(out)
            out = moved
        env.held.append(tr.ref(out.storage))  # LLMBatch.encoded, held by the trainer
        encoded.append(out)
    if _moved(env, "text"):
        text = scaled(rows_of(LLM, "text"), 2 * ID_BYTES)
        sampled = scaled(rows_of(LLM, "sampled_text"), 2 * ID_BYTES)
        wire = env.new(sampled, "text move packed")
        gathered = scaled(rows_of(LLM, "gathered_text"), 2 * ID_BYTES)
        moved = move(
            env, Act(wire.storage, sampled, False), sampled, text, "text move", gathered=gathered
        )
        env.drop(wire)
        env.held.append(tr.new(scaled(rows_of(LLM, "text"), ID_BYTES), "input_ids"))
        env.drop(moved)
    llm_batch(env)
    loss = llm_forward(env, recipe, encoded)
    if env.fwd_buffer is not None:  # the root's post-forward frees the last all-gather buffer
        tr.drop(env.fwd_buffer)
        env.fwd_buffer = None
    for out in encoded:
        env.drop(out)
    if dev == "cuda":
        env.drop(*raws.values(), batch_ids)
    tr.enter("backward")
    loss.grad = tr.new({}, "loss grad")
    nodes, tr.nodes = tr.nodes, []
    tr.backward(nodes)
    final_callback(env)
    env.drop(loss)
    held = added(*(st.nbytes for st in env.held))
    if held != previous:
        raise RuntimeError(f"the replay holds {held}, held_bytes says {previous}")
    if env.setup.previous_batch:  # `loss, out = ...` rebinds: the previous LLMBatch goes
        tr.shrink(previous)
    if env.setup.optimizer:
        tr.enter("optimizer")
        optimizer_step(env)
    tr.enter("end")


def held_bytes(env: Env) -> Form:
    """What the trainer's ``out`` (the step's ``LLMBatch``) keeps to the next step: the
    encoder outputs in the LLM layout, ``targets`` and ``loss_mask`` per token (and, on
    CUDA, the assembly index), the moved token ids."""
    width = env.s * env.config.llm.hidden
    tokens = rows_of(LLM, "tokens")
    forms = [scaled(rows_of(n, "encoded" if _moved(env, f"{n}.out") else "merged"), width)
             for n in env.config.encoders]  # fmt: skip
    forms.append(scaled(tokens, ID_BYTES + MASK_BYTES))
    if env.setup.device == "cuda":
        forms.append(scaled(tokens, ID_BYTES))
    if _moved(env, "text"):
        forms.append(scaled(rows_of(LLM, "text"), ID_BYTES))
    return added(*forms)


def optimizer_step(env: Env) -> None:
    """AdamW (``lr``, no weight decay) over the sharded parameters, then ``zero_grad``
    (gradients set to None). The single-tensor step (CPU) keeps ``sqrt(exp_avg_sq)`` and
    its quotient for one parameter at a time; the foreach step (CUDA) takes the square roots
    of the whole group at once."""
    m, g = env.dt.master, env.setup.shard_group
    trained = [u for u in env.units.values() if u.trained]
    if env.setup.device == "cpu":
        largest = max((u.largest for u in trained), default=0)
        env.tr.transient(const(2 * m * -(-largest // g)), "AdamW denominator")
    else:
        env.tr.transient(const(m * sum(u.params for u in trained) / g), "AdamW square roots")
    env.tr.drop(*env.sharded)
    env.sharded.clear()
    if not env.setup.fsdp:
        for u in trained:
            env.tr.drop(*u.grads)
            u.grads.clear()


def step_moments(config: ModelConfig, recipe: TrainRecipe, setup: StepSetup) -> Moments:
    """The moments of one trainer step (see the module docstring), pruned."""
    env = Env(Trace(), Dtypes.of(recipe.precision), setup, config, units(config))
    step(env, recipe)
    moments = [m for m in env.tr.moments if m.phase != "end"]
    return Moments.of(moments)


def block_saved_bytes(shape: BlockShape, precision: str, *, device: str = "cpu") -> float:
    """Bytes per row one block's forward keeps for its backward in the replay (the storages
    its nodes save, the block's input and parameters excluded)."""
    rows = {"rows": 1.0}
    env = Env(Trace(), Dtypes.of(precision), StepSetup(device=device), ModelConfig(), {})
    unit = Unit("block", shape.params, 0, True)
    x = env.new(scaled(rows, env.s * shape.hidden), "input", tracked=True)
    block(env, x, rows, shape, unit, "block")
    seen = {id(s): s for node in env.tr.nodes for s in node.saved if s is not x.storage}
    return sum(s.nbytes.get("rows", 0.0) for s in seen.values())


def saved_bytes_per_row(shape: BlockShape, precision: str, *, device: str = "cpu") -> int:
    """What one ``layers.Block`` saves for backward per activation row, in closed form (its
    input and parameters excluded). With ``s`` bytes per compute value, ``a = max(4, s)`` the
    opmath bytes, ``t`` LayerNorm's statistic bytes (``s`` on CPU, ``a`` on CUDA), ``h``,
    ``f``, ``kv`` the hidden, FFN and key/value widths, ``d`` the head dim, ``H`` the heads:

    - norm1: LayerNorm its mean and rstd, ``2t`` (and the input); RMSNorm the rsqrt and the
      scaled input, ``a + ah``, and, where ``s < a``, its upcast copy of the input, ``ah``;
    - the q|k|v projection: its input, ``sh``; q, k and v are views of its output,
      ``s(h + 2kv)``;
    - RoPE (ViT, LLM): cos and sin for q and for k, ``2sd``, and the rotated q and k,
      ``s(h + kv)``;
    - attention: the output ``sh`` and its log-sum-exp ``aH``; packed on CPU (one kernel per
      sequence) also their concatenation, ``sh``; padded, the key mask as values, ``s``;
    - the first residual's output, saved by norm2: LayerNorm ``sh``; RMSNorm its upcast
      ``ah`` where ``s < a``, else the output itself ``sh``;
    - norm2 as norm1 without the input, and its output ``sh`` (the MLP's input);
    - the MLP: GELU its up projection and activation, ``2sf``; SwiGLU the gate|up product,
      SiLU and the product, ``4sf``.

    ``tests/test_memory.py`` checks this against ``saved_tensors_hooks`` on real blocks of
    each style and precision, and against the replay (:func:`block_saved_bytes`)."""
    s = PRECISION_BYTES[precision][0]
    a = max(4, s)
    t = s if device == "cpu" else a
    h, f, kv, d, heads = shape.hidden, shape.ffn, shape.kv, shape.head_dim, shape.heads
    if shape.qwen2:
        norm1 = a + a * h + (a * h if s < a else 0)
        x1 = a * h if s < a else s * h
        norm2 = a + a * h
        mlp = 4 * s * f
    else:
        norm1, x1, norm2, mlp = 2 * t, s * h, 2 * t, 2 * s * f
    qkv = s * h + s * (h + 2 * kv)
    rope = 2 * s * d + s * (h + kv) if shape.rope else 0
    attention = s * h + a * heads
    if shape.padded:
        attention += s
    elif device == "cpu":
        attention += s * h
    return norm1 + qkv + rope + attention + x1 + norm2 + s * h + mlp
