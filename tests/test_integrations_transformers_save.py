"""A balanced, FSDP2-sharded HF model saved with ``omt.save_pretrained`` reloads as the plain
model with the trained parameters (2 gloo ranks, one optimizer step first)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", exc_type=ModuleNotFoundError)  # the hf extra

from orchmllm.integrations import transformers as omt  # noqa: E402
from orchmllm.integrations.transformers import tiny  # noqa: E402
from orchmllm.testing import run_distributed  # noqa: E402

FAMILY = "qwen2.5-vl"


def _train_and_save(rank: int, world_size: int, directory: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    hf = tiny.build_model(FAMILY, seed=0)
    rows = tiny.make_rows(FAMILY, hf, 4, seed=rank)
    model = omt.shard(omt.wrap(hf))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    (model(rows).loss * world_size).backward()
    optim.step()
    omt.save_pretrained(model, directory)
    full = {n: p.full_tensor().detach().clone() for n, p in model.model.named_parameters()}
    return full if rank == 0 else {}


@pytest.mark.integration
def test_a_sharded_model_saves_as_the_plain_hf_model(tmp_path):
    trained = run_distributed(_train_and_save, 2, str(tmp_path), timeout=120)[0]
    init = dict(tiny.build_model(FAMILY, seed=0).named_parameters())
    plain = type(tiny.build_model(FAMILY, seed=0)).from_pretrained(tmp_path)
    loaded = dict(plain.named_parameters())
    assert set(loaded) == set(trained)
    for name, value in trained.items():
        torch.testing.assert_close(loaded[name].detach(), value, rtol=0, atol=0)
    # the step changed the weights, so the equality is the trained model's, not the init's
    assert any(not torch.equal(init[n].detach(), trained[n]) for n in trained)
