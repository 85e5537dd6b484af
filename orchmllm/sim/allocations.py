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

Forms fitted to torch's tracker (:mod:`orchmllm.train.memory_fit`) can stand for this replay's
modules and step; of it they keep only what the tracker cannot see, each for its reason: the
orchestrator's moves (:func:`move`: the fake process group the oracle runs on delivers
nothing), the previous step's ``LLMBatch`` (:func:`llm_batch`, :func:`held_bytes`: the oracle
measures a step on its own) and the attention kernels' workspaces (inside the kernels, no
tensor holds them). The replay stays the memory model's default source: it needs no tracing,
where the fitted forms trace about twenty steps of the whole model per config and shard
group (minutes per step at a paper config's full depth).
"""

from __future__ import annotations

from collections.abc import Callable

from orchmllm.config import EncoderConfig, ModelConfig, TrainRecipe
from orchmllm.schema import LLM
from orchmllm.sim.replay_env import (
    ID_BYTES,
    MASK_BYTES,
    PRECISION_BYTES,
    RAW_BYTES,
    Act,
    Dtypes,
    Env,
    StepSetup,
    Unit,
    feature,
    units,
)
from orchmllm.sim.replay_ops import (
    BlockShape,
    Tower,
    add,
    block,
    block_shape,
    blocks_forward,
    cast,
    final_callback,
    layer_norm,
    linear,
    marker,
    pointwise,
    positions,
    post_backward,
    post_forward,
    pre_backward,
    pre_forward,
    rms_norm,
)
from orchmllm.sim.trace import Form, Moments, Trace, added, const, scaled

# -- the modules -------------------------------------------------------------------------------


def rows_of(phase: str, what: str) -> Form:
    return {feature(phase, what): 1.0}


def packed_forward(env: Env, name: str, e: EncoderConfig, raw: Act, recipe: TrainRecipe) -> Act:
    """A packed encoder called as the trainer calls it (its input cast to the compute dtype
    first): a linear front end over ``stride`` raw rows merged (a view: the ViT's patch
    embedding at stride 1, or a plugin's windows), packed blocks with RoPE positions,
    LayerNorm, the connector. Every packed architecture is this (the spec says packed, its
    stride and its feature width), so a new one needs no replay of its own. The encoder's own
    unit reduces at the end of backward (its input needs no gradient)."""
    own, tr, s, h = env.units[name], env.tr, env.s, e.hidden
    rows, merged = rows_of(name, "rows"), rows_of(name, "merged")
    x = cast(env, raw, scaled(rows_of(name, "raw"), s * e.feature_dim), f"{name} input cast")
    saving = tr.saving
    tr.saving = saving and own.trained
    pre_forward(env, own)
    pos = positions(env, rows, name)
    fan_in = e.feature_dim * e.stride
    x0 = linear(env, x, rows, fan_in, h, own, bias=True, label=f"{name} front end")
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


#: The padded architectures' replays (their front ends differ); every packed one is
#: :func:`packed_forward`.
PADDED_FORWARD = {"whisper": whisper_forward}


def encoder_forward(name: str, e: EncoderConfig) -> Callable[..., Act]:
    """The replay of modality ``name``'s encoder.

    Raises:
        ValueError: a padded architecture with no replay here (naming it).
    """
    if not e.padded:
        return packed_forward
    if e.arch not in PADDED_FORWARD:
        raise ValueError(
            f"model.encoders.{name}: no memory model for the padded arch {e.arch!r} (the "
            f"padded ones replayed are {sorted(PADDED_FORWARD)}; every packed one is)"
        )
    return PADDED_FORWARD[e.arch]


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
        out = encoder_forward(name, e)(env, name, e, x, recipe)
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
