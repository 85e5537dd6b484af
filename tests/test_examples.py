"""The Hugging Face examples: balancing never changes the training of a real transformers model.

Each example's ``main(argv)`` runs on 2 gloo processes (orchmllm.testing, with timeouts),
float64, balanced and with ``--balance none`` (the plain pipeline; for the multimodal model the
HF model's own forward), in one session per example: the per-step losses agree to 1e-5 and the
balanced runs' ranks are closer to equal. Single-process checks pin the two pieces the
multimodal split adds: the packed M-RoPE positions equal the model's ``get_rope_index``, and a
rank without items of a phase still runs that tower's forward and backward.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from orchmllm.testing import run_distributed

pytest.importorskip("transformers", exc_type=ModuleNotFoundError)  # the hf extra

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TOL = 1e-5


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _runs_worker(rank: int, world: int, name: str, runs: dict[str, list[str]]) -> dict:
    """Every run of ``runs`` through the example's main, in order; their records by key."""
    main = _example(name).main
    return {
        key: main([*argv, "--precision", "float64", "--timeout", "60", "--progress", "off"])
        for key, argv in runs.items()
    }


def _max_loss_diff(a: list[dict], b: list[dict]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def causal_lm() -> dict[str, list[dict]]:
    data = ["--examples", "48", "--batch-size", "6"]
    runs = {
        f"{balance}/{loss}": [*data, "--balance", balance, "--loss", loss, "--epochs", epochs]
        for loss, epochs in (("global", "2"), ("local", "1"))
        for balance in ("none", "greedy")
    }
    per_rank = run_distributed(_runs_worker, 2, "hf_causal_lm", runs, timeout=120)
    assert per_rank[0] == per_rank[1]  # the records are all-reduced: equal on every rank
    return per_rank[0]


@pytest.mark.integration
def test_causal_lm_balanced_equals_plain(causal_lm):
    plain, balanced = causal_lm["none/global"], causal_lm["greedy/global"]
    assert len(plain) == 8
    assert _max_loss_diff(plain, balanced) < TOL
    # The same global batch each step, spread differently.
    assert [sum(r["tokens"]) for r in plain] == [sum(r["tokens"]) for r in balanced]
    before = np.mean([r["imbalance"] for r in plain])
    after = np.mean([r["imbalance"] for r in balanced])
    print(f"hf_causal_lm: mean imbalance (max/mean target tokens) {before:.3f} -> {after:.3f}")
    assert before > after and after < 1.05


@pytest.mark.integration
def test_causal_lm_per_rank_mean_breaks_invariance(causal_lm):
    """HF's default loss (mean over the rank's own tokens) trains differently once balanced:
    ten times the tolerance the global normalisation meets."""
    assert _max_loss_diff(causal_lm["none/local"], causal_lm["greedy/local"]) > 10 * TOL


@pytest.fixture(scope="module")
def mllm() -> dict[str, list[dict]]:
    data = ["--examples", "48", "--batch-size", "6"]
    runs = {
        f"{model}/{balance}": [*data, "--model", model, "--balance", balance]
        for model in ("qwen2-vl", "qwen2.5-omni")
        for balance in ("none", "full")
    }
    per_rank = run_distributed(_runs_worker, 2, "hf_mllm", runs, timeout=180)
    assert per_rank[0] == per_rank[1]
    return per_rank[0]


@pytest.mark.integration
@pytest.mark.parametrize("model", ["qwen2-vl", "qwen2.5-omni"])
def test_mllm_orchestrated_equals_hf_forward(mllm, model):
    """The orchestrated split (towers as encoder phases, packed LLM with rebuilt M-RoPE) trains
    exactly as the HF model's own forward on the plain pipeline's padded batches."""
    plain, balanced = mllm[f"{model}/none"], mllm[f"{model}/full"]
    assert len(plain) == 4
    assert _max_loss_diff(plain, balanced) < TOL
    for phase in plain[0]["loads"]:
        assert [sum(r["loads"][phase]) for r in plain] == [sum(r["loads"][phase]) for r in balanced]
        before = np.mean([r["imbalance"][phase] for r in plain])
        after = np.mean([r["imbalance"][phase] for r in balanced])
        print(f"{model} {phase}: mean imbalance {before:.3f} -> {after:.3f}")
        assert before > after


def _rope_columns(mod: ModuleType, example: dict) -> torch.Tensor:
    """The (dt, dh, dw, extent) columns of one example's LLM sequence, as the orchestrated
    step assembles them (-1 for text; the encoders' offsets for their tokens)."""
    images, clips = iter(example["image_patches"]), iter(example["audio_mels"])
    rows = []
    for kind, count in example["segments"]:
        if kind == mod.TEXT:
            rows.append(torch.full((count, mod.ROPE), -1))
        elif kind == mod.IMAGE:
            grid = torch.from_numpy(next(images)[:1, mod.PATCH :]).long()
            rows.append(mod.image_rope(grid))
        else:
            assert len(next(clips)) == count
            rows.append(mod.audio_rope(torch.tensor([count // mod.AUDIO_STRIDE])))
    return torch.cat(rows)


@pytest.mark.parametrize("model", ["qwen2-vl", "qwen2.5-omni"])
def test_mllm_packed_positions_are_hf_rope_index(model):
    """The M-RoPE positions rebuilt from the columns the encoders append, over packed
    sequences, are the model's own ``get_rope_index`` on the padded batch."""
    mod = _example("hf_mllm")
    hf = mod.build_model(model, seed=0, dtype=torch.float32, device=torch.device("cpu"))
    examples = mod.make_dataset(5, audio=model == "qwen2.5-omni", seed=3)
    inputs = mod.hf_inputs(examples)
    mask = inputs["attention_mask"]
    if model == "qwen2-vl":
        expected, _ = hf.model.get_rope_index(
            inputs["input_ids"],
            mm_token_type_ids=(inputs["input_ids"] == mod.IMAGE_TOKEN).int(),
            image_grid_thw=inputs["image_grid_thw"],
            attention_mask=mask,
        )
    else:
        expected, _ = hf.model.get_rope_index(
            inputs["input_ids"],
            image_grid_thw=inputs["image_grid_thw"],
            attention_mask=mask,
            audio_seqlens=inputs["feature_attention_mask"].sum(-1),
        )
    rope = torch.cat([_rope_columns(mod, ex) for ex in examples])
    got = mod.mrope_position_ids(rope, mask.sum(1))
    assert torch.equal(got[1:, 0], expected[:, mask.bool()])
    lengths = mask.sum(1).tolist()
    assert torch.equal(got[0, 0], torch.cat([torch.arange(n) for n in lengths]))


def test_mllm_encoders_run_without_items():
    """A rank with no item of a phase still calls its tower (FSDP2 needs the call) and returns
    no row, connected to the graph: the backward reaches every parameter that a real item's
    backward reaches (Qwen2.5-Omni's audio tower has one its forward never uses)."""
    mod = _example("hf_mllm")
    hf = mod.build_model("qwen2.5-omni", seed=0, dtype=torch.float64, device=torch.device("cpu"))
    loads: dict[str, float] = {}
    encoders = mod.encoders(hf, loads)
    example = mod.make_dataset(1, audio=True, seed=0)[0]
    towers = {"vision": hf.model.visual, "audio": hf.model.audio_tower}
    items = {"vision": example["image_patches"], "audio": example["audio_mels"]}

    def reached(name: str, x: torch.Tensor, lengths: torch.Tensor) -> set[str]:
        hf.zero_grad(set_to_none=True)
        out = encoders[name](x, lengths)
        assert out.shape[1] == mod.HIDDEN + mod.ROPE and out.requires_grad
        out.sum().backward()
        return {n for n, p in towers[name].named_parameters() if p.grad is not None}

    for name, arrays in items.items():
        x = torch.from_numpy(np.concatenate(arrays)).double()
        lengths = torch.tensor([len(a) for a in arrays])
        with_items = reached(name, x, lengths)
        assert loads[name] == float(lengths.sum())
        without = reached(name, x[:0], lengths[:0])
        assert loads[name] == 0.0
        assert without == with_items and len(with_items) > 0
