"""The training recipe applied from outside the model: activation checkpointing changes no
number and no state-dict name; FSDP2 mixed precision keeps fp32 master weights and
optimizer state while the step computes in bf16."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from orchmllm.config import TrainRecipe, load_config
from orchmllm.models import build_model
from orchmllm.models.parallelize import (
    apply_checkpointing,
    compute_dtype,
    parallelize,
    storage_dtype,
)
from orchmllm.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
TINY = load_config(ROOT / "configs" / "tiny.yaml").model


def _step(model: nn.Module, *, loss_chunk: int) -> torch.Tensor:
    """Every encoder and the LLM, forward and backward, on fixed inputs; returns the loss."""
    g = torch.Generator().manual_seed(5)
    out = []
    for name, enc in TINY.encoders.items():
        lengths = torch.tensor([2, 3]) * enc.rate.divisor * 2
        x = torch.randn(int(lengths.sum()), enc.feature_dim, generator=g, dtype=torch.float64)
        out.append(model.encoders[name](x, lengths))
    ids = torch.randint(0, TINY.vocab, (12,), generator=g)
    embeds = torch.cat([model.llm.embed(ids), *out])
    lengths = torch.tensor([embeds.shape[0] - 5, 5])
    targets = torch.randint(0, TINY.vocab, (embeds.shape[0],), generator=g)
    loss = model.llm(embeds, lengths, targets, denom=7.0, loss_chunk=loss_chunk)
    loss.backward()
    return loss


@pytest.mark.parametrize("every", [1, 2])
def test_checkpointing_changes_no_number_and_no_name(every):
    plain = build_model(TINY, seed=0, dtype=torch.float64)
    ckpt = build_model(TINY, seed=0, dtype=torch.float64)
    recipe = TrainRecipe(checkpointing=every)
    wrapped = apply_checkpointing(ckpt, recipe=recipe)
    layers = [TINY.llm.layers, *(e.layers for e in TINY.encoders.values())]
    assert wrapped == sum(len(range(0, n, every)) for n in layers)
    assert plain.state_dict().keys() == ckpt.state_dict().keys()  # checkpoints load either way
    a, b = _step(plain, loss_chunk=7), _step(ckpt, loss_chunk=7)
    assert a.item() == b.item()
    grads = dict(plain.named_parameters())
    for name, p in ckpt.state_dict(keep_vars=True).items():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=0, atol=0, msg=name)


def test_a_frozen_encoder_is_not_checkpointed():
    vision = dataclasses.replace(TINY.encoders["vision"], frozen=True)
    model = build_model(
        dataclasses.replace(TINY, encoders={**TINY.encoders, "vision": vision}), seed=0
    )
    apply_checkpointing(model, recipe=TrainRecipe(checkpointing=1))
    assert not any("checkpoint" in n for n, _ in model.encoders["vision"].named_modules())
    assert any("checkpoint" in n for n, _ in model.llm.named_modules())


def test_dtypes_of_each_precision():
    for precision, storage, compute in (
        ("float32", torch.float32, torch.float32),
        ("float64", torch.float64, torch.float64),
        ("bf16-mixed", torch.float32, torch.bfloat16),
    ):
        recipe = TrainRecipe(precision=precision)
        assert (storage_dtype(recipe), compute_dtype(recipe)) == (storage, compute)


def _mixed_precision(rank: int, world: int) -> dict:
    """bf16-mixed on 2 ranks: master weights, gradients and optimizer state fp32; the
    computation bf16 (a block's output in forward)."""
    recipe = TrainRecipe(precision="bf16-mixed", checkpointing=1)
    model = parallelize(build_model(TINY, seed=0, dtype=storage_dtype(recipe)), recipe=recipe)
    seen = []
    model.llm.blocks[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(lambda m: _step(m, loss_chunk=5))
    optim.step()
    state = [s for p in optim.state.values() for s in p.values() if s.dim() > 0]
    return {
        "loss": loss.item(),
        "compute": seen,
        "params": {p.dtype for p in model.parameters()},
        "grads": {p.grad.dtype for p in model.parameters() if p.grad is not None},
        "state": {t.dtype for t in state},
    }


@pytest.mark.integration
def test_bf16_mixed_keeps_fp32_masters_and_computes_in_bf16():
    for r in run_distributed(_mixed_precision, 2, timeout=90):
        assert r["params"] == r["grads"] == r["state"] == {torch.float32}
        assert r["compute"] == [torch.bfloat16] and torch.isfinite(torch.tensor(r["loss"]))
