"""The memory model's forms fitted to the oracle (:mod:`orchmllm.train.memory_fit`).

One process each: the oracle runs on fake tensors and a fake process group of the shard
group's size. The model is tiny.yaml's widths with one block per module and a 32k vocabulary
(the chunked loss's logits then dominate the forward, as at paper scale), in bf16-mixed.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from orchmllm.config import ModelConfig, TrainRecipe, load_config
from orchmllm.models.attention import padded_attention
from orchmllm.models.layers import Block, Connector, check_lengths
from orchmllm.models.spec import EncoderConfig, register_architecture, unregister_architecture
from orchmllm.sim.memory import MemoryModel
from orchmllm.sim.memory_forms import MemoryForms, load_forms
from orchmllm.train.memory_fit import (
    DesignRange,
    OracleForms,
    design,
    fit_forms,
    forms_key,
    held_out_table,
    shape_features,
)
from orchmllm.train.memory_oracle import (
    PHASES,
    RankBatch,
    step_peaks,
    step_peaks_many,
    with_layers,
)
from tests.conftest import ROOT


def _model() -> ModelConfig:
    m = load_config(str(ROOT / "configs" / "tiny.yaml")).model
    return with_layers(dataclasses.replace(m, vocab=32768), 1)


def _recipe(checkpointing: int) -> TrainRecipe:
    return TrainRecipe(precision="bf16-mixed", checkpointing=checkpointing, loss_chunk=256)


def test_many_batches_on_one_model_measure_what_each_alone_measures() -> None:
    """``step_peaks_many`` builds the model once; each batch's figures are its own."""
    model, recipe = _model(), _recipe(1)
    batches = [
        RankBatch({"vision": (64, 128), "audio": (200,)}, (138, 135, 60)),
        RankBatch({"vision": (), "audio": (400, 100)}, (300,)),
    ]
    many = step_peaks_many(model, recipe, 8, batches)
    for batch, got in zip(batches, many, strict=True):
        alone = step_peaks(model, recipe, 8, batch)
        assert (got.static, got.peaks, got.by_kind) == (alone.static, alone.peaks, alone.by_kind)


# Every tested world size, with and without checkpointing (alternating: a fit traces 18 steps).
@pytest.mark.parametrize("world, ckpt", [(1, 0), (2, 1), (8, 1), (64, 0)])
def test_fitted_forms_meet_the_oracle_on_held_out_shapes(world, ckpt) -> None:
    """Two encoders (packed ViT, padded Whisper) and the LLM: every phase of every held-out
    rank shape within 10% of the oracle; the forward needs more than one form (the chunked
    loss)."""
    fit = fit_forms(_model(), _recipe(ckpt), world, ranges=DesignRange(design=12, held_out=6))
    print(f"\n{world} ranks, checkpointing {ckpt}:\n{held_out_table(fit)}")
    assert len(fit.held_out) == 6
    for traced, predicted in fit.held_out:
        for ph in PHASES:
            assert 0.9 <= predicted[ph] / traced.peaks[ph] <= 1.1, (ph, traced.peaks, predicted)
    assert max(fit.forms.held_out.values()) <= 0.1
    assert len(fit.forms.phases["forward"]) > 1


def test_the_cache_traces_a_key_once(tmp_path) -> None:
    model, recipe = _model(), _recipe(1)
    ranges = DesignRange(design=8, held_out=0)
    source = OracleForms(cache=tmp_path, ranges=ranges)
    first = source(model, recipe, 4, "cpu")
    key = forms_key(model, recipe, 4, "cpu")
    assert source.traced == [key] and first.key == key
    assert source(model, recipe, 4, "cpu") is first and source.traced == [key]
    again = OracleForms(cache=tmp_path, ranges=ranges)  # a new process: from the file
    assert again(model, recipe, 4, "cpu") == first and again.traced == []
    assert load_forms(key, tmp_path) == MemoryForms.from_json(first.to_json()) == first
    # another config, recipe, group or device is another key
    other = dataclasses.replace(model, vocab=32000)
    keys = {key, forms_key(other, recipe, 4, "cpu"), forms_key(model, _recipe(0), 4, "cpu"),
            forms_key(model, recipe, 8, "cpu"), forms_key(model, recipe, 4, "cuda")}  # fmt: skip
    assert len(keys) == 5
    # the memory model evaluates them: the fitted peak plus the attention workspace
    memory = MemoryModel(device="cpu", shard_group=4, previous_batch=False, forms=again)
    _, feats = shape_features(model, recipe, design(model, recipe, ranges, seed=2, count=3))
    peaks = memory.phase_peaks(model, recipe, feats, num_ranks=4)
    fitted = first.peaks(feats)
    assert np.all(peaks["forward"] > fitted["forward"])
    assert np.array_equal(peaks["optimizer"], fitted["optimizer"])


@dataclass(frozen=True)
class PooledMelConfig(EncoderConfig):
    """A padded encoder with a front end of its own: ``pool`` consecutive mel frames
    concatenated and projected (no convolution), padded attention, the connector."""

    arch: ClassVar[str] = "pooled_mel_test"
    padded: ClassVar[bool] = True

    n_mels: int = 16
    pool: int = 4
    downsample: int = 2

    @property
    def stride(self) -> int:
        return self.pool

    @property
    def feature_dim(self) -> int:
        return self.n_mels

    @property
    def front_end_parameters(self) -> int:
        return (self.pool * self.n_mels + 1) * self.hidden


class PooledMel(nn.Module):
    def __init__(self, cfg: PooledMelConfig, llm_hidden: int):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Linear(cfg.pool * cfg.n_mels, cfg.hidden)
        self.blocks = nn.ModuleList(
            Block(cfg.hidden, cfg.ffn, cfg.heads, cfg.kv_heads, style="encoder")
            for _ in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(cfg.hidden)
        self.connector = Connector(cfg.hidden, cfg.downsample, llm_hidden)

    def forward(self, mels: Tensor, lengths: Tensor) -> Tensor:
        cfg = self.cfg
        check_lengths(lengths, cfg.rate.divisor, "lengths")
        longest = int(lengths.max()) if lengths.numel() else cfg.rate.divisor  # a width
        frame = torch.arange(longest)
        padded = mels.new_zeros(lengths.numel(), longest, cfg.n_mels)
        padded[frame[None, :] < lengths[:, None]] = mels
        windows = padded.reshape(lengths.numel(), longest // cfg.pool, cfg.pool * cfg.n_mels)
        h = F.gelu(self.embed(windows))
        key_mask = frame[None, : h.shape[1]] < (lengths // cfg.pool)[:, None]
        attend = functools.partial(padded_attention, key_mask=key_mask)
        for block in self.blocks:
            h = block(h, attend)
        return self.connector(self.norm(h[key_mask]))


@pytest.fixture
def pooled_mel():
    register_architecture(PooledMelConfig, module=PooledMel)
    try:
        yield
    finally:
        unregister_architecture(PooledMelConfig.arch)


def test_a_new_padded_architecture_needs_no_memory_code(pooled_mel, tmp_path) -> None:
    """The hand replay has no replay of this front end and refuses the config; the memory
    model with the oracle's forms predicts its step within 10% of the oracle, per phase."""
    base = _model()
    audio = PooledMelConfig(hidden=64, ffn=128, layers=1, heads=4, kv_heads=4)
    # tiny.yaml's vocabulary: the encoders' share of the peaks is not lost under the loss's
    model = dataclasses.replace(
        base, vocab=512, encoders={"vision": base.encoders["vision"], "audio": audio}
    )
    recipe, world = _recipe(1), 8
    held = design(model, recipe, DesignRange(), seed=9, count=6)  # shapes no fit draws
    batches, feats = shape_features(model, recipe, held)
    with pytest.raises(ValueError, match="pooled_mel_test"):
        MemoryModel(device="cpu", previous_batch=False).phase_peaks(
            model, recipe, feats, num_ranks=world
        )
    source = OracleForms(cache=tmp_path, ranges=DesignRange(design=12))
    memory = MemoryModel(device="cpu", shard_group=world, previous_batch=False, forms=source)
    bare = {k: 0 * v if k.endswith((".attn_fwd", ".attn_bwd")) else v for k, v in feats.items()}
    predicted = memory.phase_peaks(model, recipe, bare, num_ranks=world)
    oracle = step_peaks_many(model, recipe, world, batches)
    print("\nshape phase oracle MB predicted MB ratio")
    for i, traced in enumerate(oracle):
        for ph in PHASES:
            r = predicted[ph][i] / traced.peaks[ph]
            print(
                f"{i} {ph:<10} {traced.peaks[ph] / 1e6:9.2f} {predicted[ph][i] / 1e6:9.2f} {r:.3f}"
            )
            assert 0.9 <= r <= 1.1, (i, ph, traced.peaks[ph], predicted[ph][i])
    # the new encoder's shapes are in its forms
    forms = source(model, recipe, world, "cpu")
    for ph in ("forward", "backward"):
        assert any(k.startswith("audio.") for f in forms.phases[ph] for k in f.coef), ph
    # the previous batch and the moves are the replay's: asked for, the model says so
    with pytest.raises(ValueError, match="the moves and the previous batch come from the replay"):
        MemoryModel(device="cpu", shard_group=world, forms=source).phase_peaks(
            model, recipe, feats, num_ranks=world
        )
    with pytest.raises(ValueError, match="fsdp=False"):
        MemoryModel(fsdp=False, forms=source)
