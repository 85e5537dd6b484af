"""orchmllm.integrations.transformers: every adapter, in one process, against the model's own code.

The distributed checks (balanced losses equal the plain run's on 2 gloo ranks, every dataset
shape through the defaults) run the example, in tests/test_examples.py. Here: packed sequences
give the per-sequence outputs of the model's own forward (positions, cache off and the merge of
the towers' outputs all matter, and a wrong one is caught), the packed M-RoPE positions are
``get_rope_index``'s, a rank without items still reaches every tower parameter, a processor row
becomes the schema, and the registry and ``wrap`` refuse what they cannot run.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", exc_type=ModuleNotFoundError)  # the hf extra

import orchmllm  # noqa: E402
from orchmllm.integrations import hf_compat  # noqa: E402
from orchmllm.integrations import transformers as omt  # noqa: E402
from orchmllm.integrations.transformers import tiny  # noqa: E402
from orchmllm.planner.segments import KIND, RAW  # noqa: E402
from orchmllm.schema import IMAGE, TEXT  # noqa: E402

FAMILIES = list(tiny.FAMILIES)
QWEN = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen2.5-omni"]


@pytest.fixture(scope="module")
def families() -> dict[str, tuple[torch.nn.Module, list[dict]]]:
    """Each family's tiny model in float64, and 5 processor rows holding its modalities."""
    out = {}
    for name in FAMILIES:
        model = tiny.build_model(name, seed=0, dtype=torch.float64)
        out[name] = (model, tiny.make_rows(name, model, 5, seed=3))
    return out


def _per_sequence(out: omt.BalancedOutput) -> dict[int, torch.Tensor]:
    """The packed logits of each example (by its index in the rows)."""
    pieces = torch.split(out.logits[0], out.batch.lengths.tolist())
    return dict(zip(out.batch.example_ids.tolist(), pieces, strict=True))


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_sequences_give_the_models_own_outputs(families, name):
    """The adapter's packed step (towers on packed items, outputs merged by position, the
    language model over several sequences at once) gives each sequence the logits of the
    model's own forward on that example alone, and the loss of its forward on the batch."""
    model, rows = families[name]
    kinds = {k for r in rows for k in r if k.startswith(("pixel_values", "input_features"))}
    assert len(kinds) == len(tiny.FAMILIES[name].modalities)  # every modality is exercised
    out = omt.wrap(model)(rows)
    assert out.batch.lengths.numel() == len(rows)
    for i, logits in _per_sequence(out).items():
        alone = model(**tiny.collate([rows[i]])).logits[0]
        torch.testing.assert_close(logits, alone, rtol=0, atol=1e-10)
    batch = tiny.collate(rows)
    n = int((batch["labels"][:, 1:] != -100).sum())
    plain = model(**batch, num_items_in_batch=n).loss  # HF computes it in float32
    torch.testing.assert_close(out.loss, plain, rtol=0, atol=1e-5)


def test_packing_needs_the_cache_off_and_the_models_positions(families):
    """What the adapter's language model call guards against, measured: with a cache (the
    config's default) transformers does not derive the block-diagonal mask, and Qwen's packed
    sequences with 1-D positions instead of M-RoPE give other outputs."""
    model, rows = families["qwen2-vl"]
    balanced = omt.wrap(model)
    out = balanced(rows)
    embeds = out.batch.assemble(model.get_input_embeddings()(out.batch.input_ids))[None]
    lm = balanced.adapter.language_model(model)
    kwargs = {"inputs_embeds": embeds, "position_ids": balanced.adapter.position_ids(out.batch)}
    right = lm(**kwargs, use_cache=False).last_hidden_state
    cached = lm(**kwargs, use_cache=True).last_hidden_state
    flat = omt.restart_positions(out.batch.lengths)[None]
    one_d = lm(inputs_embeds=embeds, position_ids=flat, use_cache=False).last_hidden_state
    first = int(out.batch.lengths[0])  # the first sequence sees no other: equal either way
    torch.testing.assert_close(cached[:, :first], right[:, :first], rtol=0, atol=1e-10)
    assert (cached - right).abs().max() > 1e-3
    assert (one_d - right).abs().max() > 1e-3


def _rope_index(name: str, model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The model's own ``get_rope_index`` on a padded processor batch."""
    common = {
        "image_grid_thw": batch.get("image_grid_thw"),
        "video_grid_thw": batch.get("video_grid_thw"),
        "attention_mask": batch["attention_mask"],
    }
    if name == "qwen2.5-omni":
        seqlens = batch["feature_attention_mask"].sum(-1) if "input_features" in batch else None
        common.update(audio_seqlens=seqlens, second_per_grids=batch.get("video_second_per_grid"))
    elif name == "qwen2.5-vl":
        common["second_per_grid_ts"] = batch["second_per_grid_ts"]
    types = batch.get("mm_token_type_ids")
    return hf_compat.rope_index(model, batch["input_ids"], types, **common)


@pytest.mark.parametrize("name", QWEN)
def test_packed_mrope_positions_are_get_rope_index(families, name):
    """The positions rebuilt from the offsets each token brought from its tower are, sequence
    by sequence, the model's ``get_rope_index`` on the padded batch; row 0 restarts at 0."""
    model, rows = families[name]
    balanced = omt.wrap(model)
    out = balanced(rows)
    positions = balanced.adapter.position_ids(out.batch)
    assert positions.shape == (4, 1, int(out.batch.lengths.sum()))
    batch = tiny.collate(rows)
    expected = _rope_index(name, model, batch)
    pieces = torch.split(positions[:, 0], out.batch.lengths.tolist(), dim=1)
    for i, got in zip(out.batch.example_ids.tolist(), pieces, strict=True):
        mask = batch["attention_mask"][i].bool()
        assert torch.equal(got[1:], expected[:, i, mask])
        assert torch.equal(got[0], torch.arange(got.shape[1]))


def _tower_params(model: torch.nn.Module, phase: str) -> dict[str, torch.nn.Parameter]:
    """The parameters a phase's tower owns (what its encoder must reach)."""
    tower = {"vision": ("visual", "vision_tower"), "audio": ("audio_tower",)}[phase]
    module = next(
        hf_compat.part(model, n) for n in tower if hasattr(model, n) or hasattr(model.model, n)
    )
    return dict(module.named_parameters())


@pytest.mark.parametrize("name", FAMILIES)
def test_a_rank_without_items_runs_every_tower_and_keeps_no_token(families, name):
    """A rank that holds no item of a phase encodes the adapter's dummy item (FSDP2 needs every
    rank to call every tower): no token comes out, yet the backward reaches every parameter a
    real item's backward reaches, with zero gradients."""
    model, rows = families[name]
    balanced = omt.wrap(model)
    examples = [balanced.adapter.to_example(r) for r in rows]
    local = orchmllm.LocalBatch.from_examples(examples, balanced.orchestrator.phases)
    for phase in balanced.orchestrator.phases:
        encode = balanced._encoder(phase)
        params = _tower_params(model, phase.name)
        raw, meta = local.raw[phase.name], local.item_meta.get(phase.name, {})
        lengths = torch.as_tensor(local.metadata[local.metadata[:, KIND] == phase.kind, RAW])
        reached = {}
        for label, args in (
            ("items", (raw, lengths, meta)),
            ("none", (raw[:0], lengths[:0], {k: v[:0] for k, v in meta.items()})),
        ):
            model.zero_grad(set_to_none=True)
            out = encode(*args)
            assert out.embeds.requires_grad
            assert (out.embeds.shape[0] == 0) == (label == "none")
            (out.embeds.sum() + sum(v.float().sum() for v in out.values.values())).backward()
            reached[label] = {n for n, p in params.items() if p.grad is not None}
            if label == "none":
                assert all(float(params[n].grad.abs().max()) == 0 for n in reached[label])
        assert reached["none"] == reached["items"] and reached["items"], phase.name


def _own_loss(logits: torch.Tensor, targets: torch.Tensor, n: int) -> torch.Tensor:
    """The summed next-token cross-entropy over ``n`` targets in the logits' dtype (HF's
    upcasts to float32)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, targets.reshape(-1), ignore_index=-100, reduction="sum") / n


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_a_step_without_items_runs_no_tower_as_the_models_own_forward(families, name):
    """Text-only rows: the balanced step runs no tower (no rank has an item), so exactly the
    parameters the model's own forward reaches get a gradient, and the same one (float64,
    the loss computed here); the towers' stay None, as AdamW needs to leave them alone.
    M-RoPE positions and Qwen3-VL's DeepStack take the no-image path."""
    model, _ = families[name]
    rows = tiny.make_rows(name, model, 4, modalities=(), seed=5)
    model.zero_grad(set_to_none=True)
    batch = tiny.collate(rows)
    n = int((batch["labels"][:, 1:] != -100).sum())
    _own_loss(model(**batch).logits[:, :-1], batch["labels"][:, 1:], n).backward()
    plain = _grads(model)
    balanced = omt.wrap(model)
    out = balanced(rows)
    phases = [p.name for p in balanced.orchestrator.phases]
    assert out.batch.absent == tuple(phases) and out.batch.num_targets == n
    _own_loss(out.logits[0], out.batch.targets, n).backward()
    for phase in phases:
        assert all(p.grad is None for p in _tower_params(model, phase).values()), phase
    got = _grads(model)
    assert got.keys() == plain.keys()
    for key, grad in plain.items():
        torch.testing.assert_close(got[key], grad, rtol=0, atol=1e-10, msg=key)


@pytest.mark.parametrize("name", ["qwen2.5-vl", "llava"])
def test_the_fused_lm_head_serves_per_token_log_probs_of_the_plain_logits(families, name):
    """TRL's protocol (``fused_lm_head=True``): per target of the packed sequences, the
    log-probability, entropy and top-1 flag of the plain forward's logits, in chunks smaller
    than the tokens; the loss their mean over the targets, the plain loss; the mask counts
    the targets; rows of a ``datasets.Dataset`` hold None for fields they lack."""
    model, rows = families[name]
    balanced = omt.wrap(model, loss_chunk=7)
    plain = balanced(rows)
    holes = [{**r, "video_grid_thw": r.get("video_grid_thw")} for r in rows]
    tokens = int(plain.batch.lengths.sum())
    fused = balanced(holes, fused_lm_head=True, attention_mask=torch.ones(1, tokens))
    assert fused.logits is None and tokens > 7
    targets = plain.batch.targets
    mask = targets != -100
    log_softmax = torch.log_softmax(plain.logits[0].double(), dim=-1)
    picked = log_softmax.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    torch.testing.assert_close(fused.log_probs[0], torch.where(mask, picked, 0.0))
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    torch.testing.assert_close(fused.entropy[0], torch.where(mask, entropy, 0.0))
    assert torch.equal(fused.is_top1[0], mask & (log_softmax.argmax(-1) == targets))
    assert torch.equal(fused.label_mask[0], mask) and int(mask.sum()) == plain.batch.num_targets
    torch.testing.assert_close(fused.loss, plain.loss.double(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen2.5-vl", "llava"])
def test_without_logits_the_loss_and_gradients_are_the_logits_ones(families, name):
    """``keep_logits=False``: the loss in chunks smaller than the tokens, no logits kept; the
    same loss and the same gradients as the plain head's, within float32's precision (HF's
    loss upcasts the logits to float32, so the plain gradients pass through float32)."""
    model, rows = families[name]
    grads = {}
    for keep in (True, False):
        model.zero_grad()
        out = omt.wrap(model, loss_chunk=7, keep_logits=keep)(rows)
        out.loss.backward()
        grads[keep] = (out, [p.grad.clone() for p in model.parameters() if p.grad is not None])
    (plain, plain_grads), (chunked, chunked_grads) = grads[True], grads[False]
    assert chunked.logits is None and int(plain.batch.lengths.sum()) > 7
    torch.testing.assert_close(chunked.loss, plain.loss.double(), rtol=0, atol=1e-5)
    assert len(chunked_grads) == len(plain_grads)
    for a, b in zip(chunked_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_balanced_model_refuses_what_a_training_step_cannot_take(families):
    model, rows = families["llava"]
    balanced = omt.wrap(model)
    with pytest.raises(ValueError, match="use_cache must be None or False"):
        balanced(rows, use_cache=True)
    with pytest.raises(ValueError, match="attention_mask must count this rank's"):
        balanced(rows, attention_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="loss_chunk must be a positive integer, got 0"):
        omt.wrap(model, loss_chunk=0)
    assert balanced.config is model.config  # trainers read the HF model's settings


def test_what_a_hand_written_loop_gets_wrong_is_named(families):
    """A plain DataLoader's collated dict, a step without targets, an image of another size,
    each refused with what to do instead of numpy's or Python's own error."""
    model, rows = families["llava"]
    balanced = omt.wrap(model)
    with pytest.raises(TypeError, match=r"got a dict with keys \[.*'input_ids'.*model.loader"):
        balanced(tiny.collate(rows))
    unlabelled = [{**r, "labels": torch.full_like(r["labels"], -100)} for r in rows]
    with pytest.raises(ValueError, match="the step has 0 prediction targets over all ranks"):
        balanced(unlabelled)
    row = next(r for r in rows if "pixel_values" in r)
    small = {**row, "pixel_values": row["pixel_values"][..., :-1, :-1]}  # one pixel less a side
    with pytest.raises(
        ValueError, match=r"pixel_values of shape \(\d+, 3, \d+, \d+\) is not .* by "
    ):
        omt.adapter_for(model).to_example(small)
    qwen, qrows = families["qwen2.5-vl"]
    row = next(r for r in qrows if "image_grid_thw" in r)
    cut = {**row, "pixel_values": row["pixel_values"][:, :-1]}  # another patch size
    with pytest.raises(ValueError, match="pixel_values of shape .* by this model's processor"):
        omt.adapter_for(qwen).to_example(cut)


def test_accumulated_micro_batches_normalised_by_their_total_targets_are_one_step(families):
    """The README's accumulation lines: each micro-batch's loss divided by the targets of the
    whole group (``sum(b.plan.num_targets ...)``, here each forward's own count) sums to the
    loss, and the gradient, of one step over all the group's rows."""
    model, rows = families["llava"]
    balanced = omt.wrap(model, keep_logits=False)  # float64 throughout
    group = [rows[:2], rows[2:]]
    n = sum(balanced(b).batch.num_targets for b in group)
    model.zero_grad()
    total = sum(balanced(b, num_items_in_batch=n).loss for b in group)
    total.backward()
    accumulated = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    whole = balanced(rows).loss
    whole.backward()
    torch.testing.assert_close(total, whole, rtol=0, atol=1e-10)
    for a, p in zip(
        accumulated, [p for p in model.parameters() if p.grad is not None], strict=True
    ):
        torch.testing.assert_close(a, p.grad, rtol=0, atol=1e-10)


def test_qwen_rows_without_mm_token_type_ids_warn_that_plain_hf_loses_mrope(families):
    """Where this release's plain model reads the tokens' types, a row without them loses
    M-RoPE there (its logits differ) and the adapter warns; older releases find the items from
    the placeholders, lose nothing, and get no warning."""
    model, rows = families["qwen2.5-vl"]
    adapter = omt.adapter_for(model)
    row = next(r for r in rows if "image_grid_thw" in r)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with_types = adapter.to_example(row)  # the processor's row: no warning
    bare = {k: v for k, v in row.items() if k != "mm_token_type_ids"}
    reads_types = hf_compat.rope_reads_token_types(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        without = adapter.to_example(bare)
    warned = [w for w in caught if issubclass(w.category, omt.qwen.MRopeWarning)]
    assert len(warned) == reads_types
    assert all("falls back to 1-D text positions" in str(w.message) for w in warned)
    assert np.array_equal(without["input_ids"], with_types["input_ids"])  # only a warning
    batch = tiny.collate([row])
    plain = model(**batch).logits
    lost = model(**{k: v for k, v in batch.items() if k != "mm_token_type_ids"}).logits
    assert torch.allclose(plain, lost) != reads_types


def test_a_processor_row_becomes_the_schema(families):
    """Qwen2.5-VL: text is every token but the placeholders, each item a segment stating its
    tokens, with its patch rows and its record (grid, video, seconds per temporal patch); the
    loss mask is where labels are set."""
    model, rows = families["qwen2.5-vl"]
    adapter = omt.adapter_for(model)
    row = next(r for r in rows if "image_grid_thw" in r and "video_grid_thw" in r)
    ex = adapter.to_example(row)
    ids, labels = row["input_ids"].numpy(), row["labels"].numpy()
    placeholder = np.isin(ids, [tiny.IMAGE_TOKEN, tiny.VIDEO_TOKEN])
    assert np.array_equal(ex["input_ids"], ids[~placeholder])
    assert np.array_equal(ex["loss_mask"], labels[~placeholder] != -100)
    items = [s for s in ex["segments"] if s[0] != TEXT]
    grids = np.concatenate([row[k] for k in ("image_grid_thw", "video_grid_thw") if k in row])
    meta = ex["item_meta"]["vision"]
    assert sorted(map(tuple, meta["grid_thw"])) == sorted(map(tuple, grids.tolist()))
    for (kind, raw, tokens), grid, patches in zip(
        items, meta["grid_thw"], ex["image_patches"], strict=True
    ):
        assert kind == IMAGE and raw == np.prod(grid) == len(patches) and tokens == raw // 4
    assert sum(s[1] for s in ex["segments"] if s[0] == TEXT) == ex["input_ids"].size
    assert sum(tokens for _, _, tokens in items) == placeholder.sum()
    videos = [s for v, s in zip(meta["video"], meta["seconds"], strict=True) if v]
    assert videos == row["second_per_grid_ts"].tolist() and len(videos) < len(items)


def test_qwen3_vl_videos_become_one_item_per_frame(families):
    """Qwen3-VL separates a video's frames by timestamps: each frame is an item, grid (1, h, w)."""
    model, rows = families["qwen3-vl"]
    adapter = omt.adapter_for(model)
    row = next(r for r in rows if "video_grid_thw" in r)
    meta = adapter.to_example(row)["item_meta"]["vision"]
    frames = [g for g, v in zip(meta["grid_thw"], meta["video"], strict=True) if v]
    expected = [[1, h, w] for t, h, w in row["video_grid_thw"].tolist() for _ in range(t)]
    assert frames == expected


def test_rows_that_do_not_match_their_items_are_refused(families):
    model, rows = families["qwen2-vl"]
    adapter = omt.adapter_for(model)
    row = next(r for r in rows if "image_grid_thw" in r)
    ids = row["input_ids"]
    first = int(torch.nonzero(ids == tiny.IMAGE_TOKEN)[0])
    short = {**row, "input_ids": torch.cat([ids[:first], ids[first + 1 :]])}
    short["labels"] = torch.cat([row["labels"][:first], row["labels"][first + 1 :]])
    with pytest.raises(ValueError, match=r"image item 0's \d+ placeholders .* are not one run"):
        adapter.to_example(short)
    labelled = {**row, "labels": torch.where(ids == tiny.IMAGE_TOKEN, ids, row["labels"])}
    with pytest.raises(ValueError, match="placeholder tokens"):
        adapter.to_example(labelled)
    shifted = {**row, "labels": torch.roll(torch.where(row["labels"] >= 0, ids, -100), 1)}
    with pytest.raises(ValueError, match="labels must be the token"):
        adapter.to_example(shifted)


def test_the_registry_names_what_it_has_and_how_to_add_one(families):
    model, _ = families["llava"]

    class MyLlava(type(model)):
        """A user's subclass: the base class's adapter serves it."""

    mine = MyLlava(model.config)
    assert isinstance(omt.adapter_for(mine), omt.tiles.LlavaAdapter)
    with pytest.raises(ValueError) as err:
        omt.adapter_for(torch.nn.Linear(2, 2))
    message = str(err.value)
    assert "no adapter is registered for Linear" in message and "register_adapter" in message
    assert all(name in message for name in omt.ADAPTERS) and len(omt.ADAPTERS) == 7
    with pytest.raises(ValueError, match="Adapter subclass"):
        omt.register_adapter("Linear", object)


def test_wrap_refuses_an_attention_that_cannot_pack(families):
    model, _ = families["internvl"]
    text = model.config.get_text_config()
    saved = text._attn_implementation
    try:
        text._attn_implementation = "paged|sdpa"
        with pytest.raises(ValueError, match="cannot attend within packed sequences"):
            omt.wrap(model)
    finally:
        text._attn_implementation = saved
    with pytest.raises(
        ValueError, match="cost must be one of .'default', 'measured'., got 'timed'"
    ):
        omt.wrap(model, cost="timed")


def test_nothing_below_the_integrations_imports_transformers():
    """``import orchmllm`` (and every floor below the integrations) never loads transformers:
    it stays an optional extra."""
    package = Path(omt.__file__).resolve().parents[2]
    found = []
    for path in sorted(package.rglob("*.py")):
        if "integrations" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "transformers"]
    assert not found


def test_a_family_the_installed_transformers_lacks_names_itself():
    """A family's classes missing from the installed transformers (every adapted one exists
    from 4.57, the extras' minimum): the error names the class and the release that has it."""
    with pytest.raises(hf_compat.MissingFamily, match=r"no NoSuchVLModel: .* >= 4\.57"):
        hf_compat.model_class("NoSuchVLModel")
