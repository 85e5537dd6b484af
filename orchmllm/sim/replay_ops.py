"""The memory replay's operations: FSDP2's hooks (all-gather, reshard, reduce-scatter) and the
building blocks (linear, norms, attention, a transformer block, a tower of blocks with or without
activation checkpointing), each allocating and freeing what the real op does.

Part of the replay of a training step (:mod:`orchmllm.sim.allocations`, whose docstring lists
the sources every allocation is read from); torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchmllm.config import ModelConfig, TrainRecipe
from orchmllm.schema import LLM
from orchmllm.sim.replay_env import (
    ID_BYTES,
    Act,
    Env,
    Unit,
    block_parameters,
    feature,
)
from orchmllm.sim.trace import Form, Storage, Trace, const, scaled

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
