"""Reference MLLM: attention kernels, encoders, LLM, one encoder per config section."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import pytest
import torch

from orchmllm.config import ARCHS, ModelConfig, load_config
from orchmllm.models import MLLM, build_model, packed_attention, padded_attention
from orchmllm.models.layers import rotate
from orchmllm.models.spec import (
    EncoderConfig,
    architecture,
    register_architecture,
    unregister_architecture,
)
from orchmllm.models.vit import VitConfig

TINY = "configs/tiny.yaml"


def _model_cfg(path: str) -> ModelConfig:
    return load_config(path).model


def _reference_attention(q, k, v, *, causal):
    """Textbook softmax(q k^T / sqrt(d)) v for one sequence; q [L, H, D], k/v [L, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        length = q.shape[0]
        scores = scores.masked_fill(torch.ones(length, length).triu(1).bool(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_packed_attention_equals_per_sequence(causal, kv_heads):
    torch.manual_seed(0)
    lengths = torch.tensor([5, 1, 17, 9])
    total = int(lengths.sum())
    q = torch.randn(total, 4, 8, dtype=torch.float64)
    k = torch.randn(total, kv_heads, 8, dtype=torch.float64)
    v = torch.randn(total, kv_heads, 8, dtype=torch.float64)
    out = packed_attention(q, k, v, lengths, causal=causal)
    assert out.shape == q.shape
    chunks = [t.split(lengths.tolist()) for t in (q, k, v)]
    expected = torch.cat(
        [_reference_attention(*c, causal=causal) for c in zip(*chunks, strict=True)]
    )
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_padded_attention_ignores_padding():
    torch.manual_seed(0)
    lengths = [6, 3]
    q = torch.randn(2, 6, 4, 8, dtype=torch.float64)
    k, v = torch.randn_like(q), torch.randn_like(q)
    mask = torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]
    out = padded_attention(q, k, v, mask)
    for b, n in enumerate(lengths):
        expected = _reference_attention(q[b, :n], k[b, :n], v[b, :n], causal=False)
        torch.testing.assert_close(out[b, :n], expected, rtol=1e-10, atol=1e-10)


def test_packed_attention_rejects_wrong_lengths():
    q = torch.randn(10, 2, 4)
    with pytest.raises(ValueError, match="lengths"):
        packed_attention(q, q, q, torch.tensor([3, 4]), causal=True)


def test_rope_keeps_norm_and_depends_on_relative_position():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 16, dtype=torch.float64), torch.randn(1, 2, 16, dtype=torch.float64)
    rq = rotate(q, torch.tensor([7]), 1e4)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))

    def score(pq, pk):
        a, b = rotate(q, torch.tensor([pq]), 1e4), rotate(k, torch.tensor([pk]), 1e4)
        return (a * b).sum(-1)

    torch.testing.assert_close(score(3, 1), score(12, 10))
    assert not torch.allclose(score(3, 1), score(3, 2))


@pytest.fixture(scope="module")
def tiny_model() -> MLLM:
    return build_model(_model_cfg(TINY), seed=0, dtype=torch.float64)


def test_builds_from_tiny_yaml_with_gqa_shapes(tiny_model):
    cfg = tiny_model.cfg
    assert cfg.llm.kv_heads < cfg.llm.heads  # the tiny LLM exercises grouped-query attention
    attn = tiny_model.llm.blocks[0].attn
    head_dim = cfg.llm.hidden // cfg.llm.heads
    assert attn.qkv.out_features == (cfg.llm.heads + 2 * cfg.llm.kv_heads) * head_dim
    assert len(tiny_model.llm.blocks) == cfg.llm.layers
    for name, enc in cfg.encoders.items():
        assert len(tiny_model.encoders[name].blocks) == enc.layers
    again = build_model(cfg, seed=0, dtype=torch.float64)
    for a, b in zip(tiny_model.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)  # weights depend only on the seed: identical on every rank


def _batch_equals_each_alone(run, inputs: torch.Tensor, lengths: torch.Tensor, shape: tuple):
    """``run(inputs, lengths)`` has ``shape`` and equals ``run`` on each item alone,
    concatenated (a batch never mixes its items); returns the batch output."""
    out = run(inputs, lengths)
    assert out.shape == shape
    alone = [run(x, torch.tensor([len(x)])) for x in inputs.split(lengths.tolist())]
    torch.testing.assert_close(out, torch.cat(alone), rtol=1e-9, atol=1e-9)
    return out


def test_vision_packed_equals_each_image_alone(tiny_model):
    torch.manual_seed(1)
    cfg = tiny_model.cfg.encoders["vision"]
    lengths = torch.tensor([8, 20, 4]) * cfg.downsample
    patches = torch.randn(int(lengths.sum()), cfg.feature_dim, dtype=torch.float64)
    shape = (int(lengths.sum()) // cfg.downsample, tiny_model.cfg.llm.hidden)
    _batch_equals_each_alone(tiny_model.encoders["vision"], patches, lengths, shape)


def test_audio_padded_batch_equals_each_clip_alone(tiny_model):
    torch.manual_seed(2)
    cfg = tiny_model.cfg.encoders["audio"]
    lengths = torch.tensor([30, 4, 12]) * cfg.rate.divisor
    mels = torch.randn(int(lengths.sum()), cfg.n_mels, dtype=torch.float64)
    shape = (int(lengths.sum()) // cfg.rate.divisor, tiny_model.cfg.llm.hidden)
    _batch_equals_each_alone(tiny_model.encoders["audio"], mels, lengths, shape)


@pytest.mark.parametrize("bucket", [3, 64])
def test_audio_buckets_change_the_shape_not_the_output(tiny_model, bucket):
    """Padding a batch to a bucket of frames gives the same outputs and gradients as padding it
    to its longest clip (the padded frames are zeroed and masked)."""
    torch.manual_seed(4)
    plain = tiny_model.encoders["audio"]
    cfg = dataclasses.replace(plain.cfg, bucket=bucket)
    bucketed = type(plain)(cfg, tiny_model.cfg.llm.hidden).double()
    bucketed.load_state_dict(plain.state_dict())
    lengths = torch.tensor([30, 4, 13]) * cfg.rate.divisor
    mels = torch.randn(int(lengths.sum()), cfg.n_mels, dtype=torch.float64)
    runs = []
    for encoder in (plain, bucketed):
        encoder.zero_grad()
        x = mels.clone().requires_grad_(True)
        out = encoder(x, lengths)
        out.square().sum().backward()
        grads = [p.grad.clone() for p in encoder.parameters()]
        runs.append((out.detach(), x.grad, *grads))
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=1e-12)


def test_llm_packed_is_causal_and_equals_each_sequence_alone(tiny_model):
    torch.manual_seed(3)
    lengths = torch.tensor([7, 1, 12])
    ids = torch.randint(0, tiny_model.cfg.vocab, (int(lengths.sum()),))

    def llm(x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        return tiny_model.llm(tiny_model.llm.embed(x), lens)

    logits = _batch_equals_each_alone(llm, ids, lengths, (int(lengths.sum()), tiny_model.cfg.vocab))
    changed = ids.clone()
    changed[-1] = (changed[-1] + 1) % tiny_model.cfg.vocab  # future token of the last sequence
    logits2 = llm(changed, lengths)
    torch.testing.assert_close(logits2[:-1], logits[:-1], rtol=0, atol=0)


def test_empty_inputs_run_every_submodule_with_zero_grads():
    model = build_model(_model_cfg(TINY), seed=0, dtype=torch.float64)
    cfg = model.cfg
    empty = torch.zeros(0, dtype=torch.int64)
    outs = [
        model.encoders[name](torch.zeros(0, enc.feature_dim, dtype=torch.float64), empty)
        for name, enc in cfg.encoders.items()
    ]
    assert all(out.shape == (0, cfg.llm.hidden) for out in outs)
    sum(out.sum() for out in outs).backward()
    for name, p in [p for enc in model.encoders.values() for p in enc.named_parameters()]:
        assert p.grad is not None, name  # FSDP2 needs every rank to reduce every gradient
        assert torch.count_nonzero(p.grad) == 0, name


def test_encoders_reject_lengths_off_the_downsample_grid(tiny_model):
    for name, enc in tiny_model.cfg.encoders.items():
        bad = enc.rate.divisor + 1
        with pytest.raises(ValueError, match="lengths"):
            tiny_model.encoders[name](
                torch.zeros(bad, enc.feature_dim, dtype=torch.float64), torch.tensor([bad])
            )


@pytest.mark.parametrize(
    "name, total_b, vision_b, audio_b, llm_b",
    [("10b", 10, 2, 0.6, 7), ("18b", 18, 3, 0.6, 14), ("84b", 84, 6, 6, 72)],
)
def test_paper_configs_match_table1_parameter_counts(name, total_b, vision_b, audio_b, llm_b):
    with torch.device("meta"):  # shapes only, no memory
        model = MLLM(_model_cfg(f"configs/mllm-{name}.yaml"))

    def billions(module):
        return sum(p.numel() for p in module.parameters()) / 1e9

    # Table 1 rounds to whole billions; our encoders also hold their connector to the LLM.
    assert billions(model) == pytest.approx(total_b, rel=0.05)
    assert billions(model.encoders["vision"]) == pytest.approx(vision_b, rel=0.1, abs=0.2)
    assert billions(model.encoders["audio"]) == pytest.approx(audio_b, rel=0.15)
    assert billions(model.llm) == pytest.approx(llm_b, rel=0.1)


def test_every_architecture_has_a_module_and_counts_its_parameters():
    """Each registered architecture builds its module, and its spec's parameter count (what
    the simulator reads, torch-free) is the module's."""
    for name in ARCHS:
        cfg = ARCHS[name](downsample=2)
        module = architecture(name).module(cfg, 48)
        assert cfg.parameters(48) == sum(p.numel() for p in module.parameters()), name


def test_frozen_encoders_train_only_their_connectors():
    base = load_config(TINY).model
    frozen = {n: dataclasses.replace(e, frozen=True) for n, e in base.encoders.items()}
    model = build_model(dataclasses.replace(base, encoders=frozen), seed=0)
    for encoder in model.encoders.values():
        trainable = {n for n, p in encoder.named_parameters() if p.requires_grad}
        assert trainable and all(n.startswith("connector.") for n in trainable)
    assert all(p.requires_grad for p in model.llm.parameters())


def test_an_encoder_per_section_of_the_config_built_by_its_architecture():
    """A vision-only model has one encoder; a second ViT section (any modality of the table)
    is built as a ViT without an entry of its own."""
    only = ModelConfig.from_dict({"encoders": {"audio": None}})
    assert list(MLLM(only).encoders) == ["vision"]
    vit_audio = ModelConfig.from_dict({"encoders": {"audio": {"arch": "vit", "patch": 2}}})
    model = MLLM(vit_audio)
    assert type(model.encoders["audio"]) is type(model.encoders["vision"])
    assert model.encoders["audio"].patch_embed.in_features == 12


def test_register_architecture_refuses_what_it_cannot_build():
    @dataclasses.dataclass(frozen=True)
    class NoName(EncoderConfig):
        padded: ClassVar[bool] = False

    @dataclasses.dataclass(frozen=True)
    class Twin(VitConfig):  # a second class under vit's name
        pass

    @dataclasses.dataclass(frozen=True)
    class Bare(VitConfig):
        arch: ClassVar[str] = "bare_vit"

    with pytest.raises(ValueError, match="EncoderConfig subclass"):
        register_architecture(dict)
    with pytest.raises(ValueError, match="NoName must set the class attribute 'arch'"):
        register_architecture(NoName)
    with pytest.raises(ValueError, match="'vit' is taken by VitConfig"):
        register_architecture(Twin)
    with pytest.raises(ValueError, match="no encoder architecture 'nope'; registered: .*'vit'"):
        architecture("nope")
    register_architecture(Bare)  # the spec alone: the config reads it, no module to build
    try:
        model = ModelConfig(encoders={"vision": Bare()})
        with pytest.raises(ValueError, match="'bare_vit' has no module"):
            MLLM(model)
    finally:
        unregister_architecture("bare_vit")
    assert "bare_vit" not in ARCHS
