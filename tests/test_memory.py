"""The memory model (orchmllm.sim.memory, .allocations, .trace): its terms against the code
they mirror. The whole prediction against a measured trainer step: test_memory_measured.py."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from orchmllm.config import TrainRecipe, load_config
from orchmllm.data.recipe import ItemLengths
from orchmllm.models import MLLM
from orchmllm.models.attention import packed_attention, padded_attention, positions_from_lengths
from orchmllm.models.layers import Block
from orchmllm.sim.allocations import block_saved_bytes, held_bytes, saved_bytes_per_row, step
from orchmllm.sim.batch import Batch
from orchmllm.sim.layout import Layout
from orchmllm.sim.memory import (
    MemoryModel,
    cpu_attention_workspace,
    moves_of_layout,
    step_of_plan,
)
from orchmllm.sim.replay_env import FEATURES, Dtypes, Env, StepSetup, units
from orchmllm.sim.replay_ops import BlockShape
from orchmllm.sim.trace import Moment, Moments, Trace

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
GPU_RECIPE = load_config(CONFIGS / "mllm-10b.yaml").recipe  # bf16 mixed, checkpointed, chunked
DTYPES = {"bf16-mixed": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
STYLES = {  # block style -> (qwen2, padded): the LLM's, the ViT's, the Whisper encoder's
    "llm": (True, False),
    "vit": (False, False),
    "whisper": (False, True),
}


def _hooked_saved_bytes(style: str, dtype: torch.dtype, shape: BlockShape, lengths) -> tuple:
    """Bytes of the storages a real block's autograd saves (its input and parameters
    excluded), as ``saved_tensors_hooks`` sees them, and the block's activation rows."""
    torch.manual_seed(0)
    block = Block(
        shape.hidden, shape.ffn, shape.heads, shape.kv_heads,
        style="qwen2" if shape.qwen2 else "encoder", rope_theta=1e4 if shape.rope else None,
    ).to(dtype)  # fmt: skip
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()}
    lengths = torch.tensor(lengths)
    if shape.padded:
        b, t = lengths.numel(), int(lengths.max())
        x = torch.randn(b, t, shape.hidden, dtype=dtype, requires_grad=True)
        mask = torch.arange(t)[None] < lengths[:, None]
        attend, positions = functools.partial(padded_attention, key_mask=mask), None
    else:
        x = torch.randn(int(lengths.sum()), shape.hidden, dtype=dtype, requires_grad=True)
        attend = functools.partial(packed_attention, lengths=lengths, causal=shape.qwen2)
        positions = positions_from_lengths(lengths)
    skip.add(x.untyped_storage().data_ptr())
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, attend, positions)
    return sum(seen.values()), x.shape[:-1].numel()


@pytest.mark.parametrize("precision", sorted(DTYPES))
@pytest.mark.parametrize("style", sorted(STYLES))
def test_block_saves_exactly_what_autograd_saves(style, precision) -> None:
    """The closed-form saved bytes per row of one block (what a checkpointed block recomputes
    and a plain one keeps) equal the bytes autograd saves for a real block, exactly, for every
    block style of orchmllm/models and every precision, at two shapes (grouped-query or not);
    the replay the memory model runs saves the same."""
    qwen2, padded = STYLES[style]
    for hidden, ffn, heads, kv_heads in ((64, 160, 4, 2), (96, 256, 6, 6)):
        shape = BlockShape(hidden, ffn, heads, kv_heads, qwen2, not padded, padded)
        measured, rows = _hooked_saved_bytes(style, DTYPES[precision], shape, (30, 50, 17))
        assert saved_bytes_per_row(shape, precision) * rows == measured, (hidden, kv_heads)
        assert block_saved_bytes(shape, precision) == saved_bytes_per_row(shape, precision)
    for device in ("cpu", "cuda"):  # on CUDA too, replay and formula agree
        assert block_saved_bytes(shape, precision, device=device) == saved_bytes_per_row(
            shape, precision, device=device
        )


@pytest.mark.parametrize("name", ["tiny", "mllm-10b", "mllm-84b"])
def test_fsdp_units_hold_every_parameter_of_the_model(name) -> None:
    """The units' parameter counts are the model's (meta device: no memory), unit by unit:
    blocks, connectors, each encoder's own parameters, the embedding, the LLM's own."""
    cfg = load_config(CONFIGS / f"{name}.yaml").model
    with torch.device("meta"):
        model = MLLM(cfg)
    us = units(cfg)
    assert sum(u.params for u in us.values()) == sum(p.numel() for p in model.parameters())
    for enc_name, enc in model.encoders.items():
        assert us[f"{enc_name}.connector"].params == sum(
            p.numel() for p in enc.connector.parameters()
        )
        assert us[f"{enc_name}.blocks.0"].params == sum(
            p.numel() for p in enc.blocks[0].parameters()
        )
    assert us["embed_tokens"].params == model.llm.embed_tokens.weight.numel()
    assert us["llm.blocks.0"].params == sum(p.numel() for p in model.llm.blocks[0].parameters())


def _tiny_step(*, precision: str, checkpointing: int, device: str, group: int, moves=frozenset()):
    cfg = load_config(CONFIGS / "tiny.yaml").model
    recipe = TrainRecipe(precision=precision, checkpointing=checkpointing, loss_chunk=64)
    setup = StepSetup(shard_group=group, device=device, moves=moves)
    env = Env(Trace(), Dtypes.of(precision), setup, cfg, units(cfg))
    step(env, recipe)
    return env


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("checkpointing", [0, 1, 2])
def test_the_replay_frees_everything_the_step_does_not_keep(device, group, checkpointing):
    """Conservation: after a whole replayed step (every activation, gathered parameter,
    gradient buffer, saved tensor and recomputation) the only bytes left are the ones the
    trainer keeps to the next step, its LLMBatch; no node is left unrun."""
    moves = (
        frozenset({"vision.raw", "vision.out", "audio.out", "text"}) if group > 1 else frozenset()
    )
    for precision in ("bf16-mixed", "float32"):
        env = _tiny_step(
            precision=precision, checkpointing=checkpointing, device=device, group=group,
            moves=moves,
        )  # fmt: skip
        left = {k: v for k, v in env.tr.level.items() if abs(v) > 1e-6}
        assert left == pytest.approx(held_bytes(env)), precision
        assert not env.tr.nodes and not env.sharded


def _batch(num_ranks: int, per_rank: int, rng: np.random.Generator) -> Batch:
    n = num_ranks * per_rank
    img = np.flatnonzero(rng.random(n) < 0.6)
    aud = np.flatnonzero(rng.random(n) < 0.4)
    return Batch(
        num_ranks,
        text=rng.integers(20, 400, n),
        items={
            "vision": ItemLengths(img, rng.integers(16, 256, img.size) // 4 * 4),
            "audio": ItemLengths(aud, rng.integers(40, 800, aud.size) // 4 * 4),
        },
    )


def _at_home(batch: Batch) -> Layout:
    src = batch.example_src
    return Layout(src, {n: src[it.example] for n, it in batch.items.items()})


def test_rank_features_count_what_each_rank_holds() -> None:
    """Packed phases count summed lengths, the padded one items x the longest; the LLM its
    sequences (text plus encoded items) and the loss's first two chunks."""
    cfg = load_config(CONFIGS / "tiny.yaml").model
    batch = Batch(
        2,
        text=np.array([10, 20, 30, 40]),
        items={
            "vision": ItemLengths(np.array([0, 2]), np.array([16, 32])),
            "audio": ItemLengths(np.array([0, 1, 3]), np.array([40, 80, 120])),
        },
    )
    recipe = dataclasses.replace(TrainRecipe(), loss_chunk=64)
    f = MemoryModel(device="cpu").rank_features(cfg, recipe, batch, _at_home(batch))
    np.testing.assert_array_equal(f["vision.rows"], [16, 32])
    np.testing.assert_array_equal(f["vision.merged"], [4, 8])
    np.testing.assert_array_equal(f["audio.rows"], [2 * 40, 60])  # 2 clips x 40 positions
    np.testing.assert_array_equal(f["audio.input"], [2 * 80, 120])  # mel frames, padded
    np.testing.assert_array_equal(f["audio.valid"], [60, 60])
    tokens = np.array([10 + 20 + 4 + 10 + 20, 30 + 8 + 40 + 30])
    np.testing.assert_array_equal(f["llm.tokens"], tokens)
    np.testing.assert_array_equal(f["llm.chunk"], np.minimum(tokens, 64))
    np.testing.assert_array_equal(f["llm.chunk2"], np.clip(tokens - 64, 0, 64))
    # nothing moves when every item stays where it was sampled
    assert moves_of_layout(batch, _at_home(batch), cfg) == frozenset()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_feature_the_replay_reads_is_computed_and_documented(device, rng) -> None:
    cfg = load_config(CONFIGS / "mllm-10b.yaml").model
    mem = MemoryModel(device=device)
    batch = _batch(4, 3, rng)
    features = mem.rank_features(cfg, GPU_RECIPE, batch, _at_home(batch))
    assert {k.split(".", 1)[1] for k in features} <= set(FEATURES)
    every = frozenset({"vision.raw", "vision.out", "audio.raw", "audio.out", "text"})
    for moves in (frozenset(), every):
        used = mem.moments(cfg, GPU_RECIPE, num_ranks=4, moves=moves).features
        assert set(used) - {"1"} <= set(features), moves


def test_cpu_attention_workspace_follows_the_kernels_splits() -> None:
    """The CPU flash kernel's buffers: query splits of 32, 64, 256 rows (at 192 and 768),
    key splits of up to 512, per thread; bf16 adds reduced copies."""
    bf16, fp32 = Dtypes.of("bf16-mixed"), Dtypes.of("float32")
    fwd, bwd = cpu_attention_workspace(np.array([100, 191, 192, 1000]), head_dim=16,
                                       dtypes=fp32, threads=1)  # fmt: skip
    q, kv = np.array([32, 32, 64, 256]), np.array([100, 191, 192, 512])
    np.testing.assert_array_equal(fwd, (q * kv + 2 * q + q * 16) * 4)
    np.testing.assert_array_equal(bwd, (2 * q * kv + q) * 4)
    f2, b2 = cpu_attention_workspace(np.array([100]), head_dim=16, dtypes=bf16, threads=2)
    assert f2[0] == 2 * (fwd[0] + 32 * 100 * 2) and b2[0] == 2 * (bwd[0] + 2 * 32 * 100 * 2)


def test_the_recipe_moves_memory_the_way_it_should(rng) -> None:
    """Checkpointing keeps less than keeping every block; bf16 mixed keeps less than fp32;
    more examples per rank need more; a larger shard group holds less static memory;
    the optimizer's phase is the sharded gradients plus AdamW's temporaries."""
    cfg, gpu = load_config(CONFIGS / "mllm-10b.yaml").model, GPU_RECIPE
    mem = MemoryModel()
    small, big = _batch(8, 4, rng), None
    big = _batch(8, 8, np.random.default_rng(1))

    def peak(recipe, batch, model=mem):
        f = model.rank_features(cfg, recipe, batch, _at_home(batch))
        return model.peak_bytes(cfg, recipe, f, num_ranks=8)

    plain = dataclasses.replace(gpu, checkpointing=0)
    fp32 = dataclasses.replace(gpu, precision="float32")
    assert np.all(peak(gpu, small) < peak(plain, small))
    assert np.all(peak(gpu, small) < peak(fp32, small))
    assert peak(gpu, big).max() > peak(gpu, small).max()
    assert mem.static_bytes(cfg, gpu, 256) < mem.static_bytes(cfg, gpu, 8)
    total, trained = mem.parameters(cfg)
    assert mem.static_bytes(cfg, gpu, 8) == pytest.approx((4 * total + 8 * trained) / 8)
    emulated = MemoryModel(shard_group=1, fsdp=False, optimizer=False)
    assert emulated.static_bytes(cfg, gpu, 8) == 2 * total  # one bf16 copy, no state
    f = mem.rank_features(cfg, gpu, small, _at_home(small))
    phases = mem.phase_peaks(cfg, gpu, f, num_ranks=8)
    assert set(phases) == {"forward", "backward", "optimizer"}
    # the optimizer's step: the sharded fp32 gradients and the foreach AdamW's square roots of
    # every moment at once (CUDA), beside what the trainer holds of the step (its LLMBatch)
    held = f["llm.tokens"] * (8 + 1 + 8) + 2 * cfg.llm.hidden * sum(
        f[f"{n}.merged"] for n in cfg.encoders
    )
    np.testing.assert_allclose(phases["optimizer"], 2 * 4 * trained / 8 + held)


def test_moments_keep_only_what_can_be_a_peak() -> None:
    """A moment bounded coefficient-wise by another of its phase is dropped; a rank's peak
    is its largest moment."""
    moments = Moments.of(
        [
            Moment("forward", "a", {"x": 2.0, "1": 1.0}),
            Moment("forward", "b", {"x": 1.0, "1": 1.0}),  # below a for every x >= 0
            Moment("forward", "c", {"x": 0.5, "1": 10.0}),
            Moment("backward", "d", {"x": 1.0}),  # another phase: kept
        ]
    )
    assert moments.labels == ("a", "c", "d")
    peaks = moments.peaks({"x": np.array([0.0, 4.0, 20.0])})
    np.testing.assert_allclose(peaks["forward"], [10.0, 12.0, 41.0])
    np.testing.assert_allclose(peaks["backward"], [0.0, 4.0, 20.0])
    with pytest.raises(ValueError, match="'x'"):
        moments.peaks({})


def test_bad_settings_are_named() -> None:
    for kwargs, name in (
        ({"shard_group": 0}, "shard_group"),
        ({"threads": 0}, "threads"),
        ({"device": "tpu"}, "device"),
        ({"gpu_bytes": 0}, "gpu_bytes"),
        ({"reserve_bytes": -1}, "reserve_bytes"),
    ):
        with pytest.raises(ValueError, match=name):
            MemoryModel(**kwargs)
    with pytest.raises(ValueError, match="device"):
        StepSetup(device="tpu")


def test_a_plans_moves_are_the_ones_the_orchestrator_runs(rng) -> None:
    """A real step plan as the model reads it: the batch, each phase's layout, and a move
    wherever some item changes rank or slot."""
    from orchmllm.planner.step_options import StepOptions, default_phases
    from orchmllm.planner.step_plan import plan_step
    from orchmllm.sim.layout import segment_rows

    run = load_config(CONFIGS / "tiny.yaml")
    batch = _batch(4, 6, rng)
    rows, src = segment_rows(batch)
    phases = default_phases(run.rates, feature_dims=run.model.feature_dims)
    for mode in ("none", "full"):
        plan = plan_step(rows, src, StepOptions(phases, mode=mode), num_ranks=4)
        again, layout, moves = step_of_plan(plan)
        np.testing.assert_array_equal(again.text, batch.text)
        np.testing.assert_array_equal(layout.example, plan.llm.dst_rank)
        if mode == "none":
            assert moves == frozenset()
        else:
            assert "text" in moves and moves >= moves_of_layout(again, layout, run.model)
