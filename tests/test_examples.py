"""The Hugging Face examples: balancing never changes the training of a real transformers model.

Each example's ``main(argv)`` runs on 2 gloo processes (orchmllm.testing, with timeouts),
float64, balanced and with ``--balance none`` (the plain pipeline; for the multimodal model the
HF model's own forward), in one session per group of examples: the per-step losses agree (to
1e-10 for the multimodal model, whose loss the example computes in float64; 1e-5 where
transformers computes it in float32) and the balanced runs' ranks are closer to equal.
``hf_mllm.py`` runs every adapted family (``orchmllm.integrations.transformers``);
tests/test_integrations_transformers.py pins its pieces in one process.
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

from orchmllm.integrations import transformers as omt  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TOL = 1e-5
# Float64 end to end (hf_mllm's --loss exact: the loss computed in float64, where transformers'
# own upcasts to float32): the runs differ by float64 rounding alone.
EXACT = 1e-10


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _runs_worker(rank: int, world: int, name: str, runs: dict[str, list[str]]) -> dict:
    """Every run of ``runs`` through the example's main, in order; their records by key."""
    main = _example(name).main
    return {
        key: main([*argv, "--dtype", "float64", "--timeout", "60", "--progress", "off"])
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


def _mllm_runs(models: list[str], extra: dict[str, list[str]] | None = None) -> dict:
    """Every model plain (``none``) and balanced (``full``, ``llm``), 4 steps each, the loss
    computed in float64 (``--loss exact``)."""
    data = ["--examples", "48", "--batch-size", "6", "--loss", "exact"]
    runs = {
        f"{model}/{balance}": [*data, "--model", model, "--balance", balance]
        for model in models
        for balance in ("none", "full", "llm")
    }
    for key, argv in (extra or {}).items():
        runs.update({f"{key}/{b}": [*data, *argv, "--balance", b] for b in ("none", "full")})
    per_rank = run_distributed(_runs_worker, 2, "hf_mllm", runs, timeout=240)
    assert per_rank[0] == per_rank[1]
    return per_rank[0]


QWEN = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen2.5-omni"]
TILES = ["llava", "llava-onevision", "internvl"]
# Omni on datasets holding one modality or none: the adapter's defaults, nothing else.
SUBSETS = {
    f"omni-{m}": ["--model", "qwen2.5-omni", "--modalities", m] for m in ("text", "image", "audio")
}


@pytest.fixture(scope="module")
def qwen_runs() -> dict[str, list[dict]]:
    return _mllm_runs(QWEN)


@pytest.fixture(scope="module")
def tile_runs() -> dict[str, list[dict]]:
    return _mllm_runs(TILES, SUBSETS)


def _imbalance(records: list[dict], phase: str) -> float:
    return float(np.mean([r["imbalance"][phase] for r in records]))


def _check_adapter(runs: dict[str, list[dict]], model: str) -> None:
    plain = runs[f"{model}/none"]
    assert len(plain) == 4
    for balance in ("full", "llm"):
        balanced = runs[f"{model}/{balance}"]
        assert _max_loss_diff(plain, balanced) < EXACT, balance
        for phase in plain[0]["loads"]:  # the same global work, spread differently
            assert [sum(r["loads"][phase]) for r in plain] == [
                sum(r["loads"][phase]) for r in balanced
            ]
    full, llm = runs[f"{model}/full"], runs[f"{model}/llm"]
    diffs = {b: _max_loss_diff(plain, runs[f"{model}/{b}"]) for b in ("full", "llm")}
    print(f"{model}: max |loss - plain| full {diffs['full']:.1e} llm {diffs['llm']:.1e}")
    for phase in plain[0]["loads"]:
        before, after = _imbalance(plain, phase), _imbalance(full, phase)
        print(
            f"  {phase}: mean imbalance {before:.3f} -> {after:.3f} (llm only: "
            f"{_imbalance(llm, phase):.3f})"
        )
        assert after < before, phase
    assert _imbalance(llm, "llm") < _imbalance(plain, "llm")


@pytest.mark.integration
@pytest.mark.parametrize("model", QWEN)
def test_qwen_adapters_train_as_the_models_own_forward(qwen_runs, model):
    """Balanced (towers as phases, packed language model with M-RoPE rebuilt from the tokens'
    offsets) trains exactly as the model's own forward on a plain DataLoader, in float64 over
    4 steps of AdamW, and every phase's ranks come closer to equal. Qwen2.5-Omni's dataset
    mixes images, videos and audio."""
    _check_adapter(qwen_runs, model)


@pytest.mark.integration
@pytest.mark.parametrize("model", TILES)
def test_tile_adapters_train_as_the_models_own_forward(tile_runs, model):
    _check_adapter(tile_runs, model)


@pytest.mark.integration
@pytest.mark.parametrize("subset", list(SUBSETS))
def test_text_image_and_audio_only_datasets_run_through_the_defaults(tile_runs, subset):
    """Qwen2.5-Omni (a vision and an audio phase) on a dataset without images and videos,
    without audio, or with neither: the missing phases' towers run on dummy items, nothing
    else changes, and the losses are the plain run's."""
    plain, full = tile_runs[f"{subset}/none"], tile_runs[f"{subset}/full"]
    assert _max_loss_diff(plain, full) < EXACT
    loads = {p: sum(sum(r["loads"][p]) for r in plain) for p in plain[0]["loads"]}
    assert loads["llm"] > 0
    assert (loads["vision"] > 0) == (subset == "omni-image")
    assert (loads["audio"] > 0) == (subset == "omni-audio")
    assert _imbalance(full, "llm") < _imbalance(plain, "llm")


# Steps where a tower has items on every rank, on some, on one, or on none (the seeds are
# picked for it: the test checks each case occurs). Qwen2.5-Omni with images and audio; LLaVA,
# which never uses its vision tower's last layer, with half the rows text-only. AdamW with
# weight decay, the loss computed here in float64 (--loss exact): what is left between the
# plain run (DDP, the model's own forward on padded batches) and the balanced one is float64
# rounding, so the tolerance is 1e-10.
ABSENT = {
    "qwen2.5-omni": ["--modalities", "image", "audio", "--text-only", "0.3", "--seed", "4"],
    "llava": ["--text-only", "0.5", "--seed", "2"],
}
# Parameters the model's forward never uses: LLaVA reads the output of its vision tower's
# second-to-last layer; Qwen2.5-Omni's audio tower keeps an unused token embedding.
UNUSED = {
    "qwen2.5-omni": ("audio_bos_eos_token",),
    "llava": ("vision_tower.post_layernorm.", "vision_tower.encoder.layers.1."),
}


@pytest.fixture(scope="module")
def absent_runs(tmp_path_factory) -> tuple[dict[str, list[dict]], Path]:
    out = tmp_path_factory.mktemp("absent")
    data = ["--examples", "24", "--batch-size", "1", "--loss", "exact"]
    runs = {
        f"{model}/{b}": [*data, "--model", model, *argv, "--balance", b, "--save", str(out / b)]
        for model, argv in ABSENT.items()
        for b in ("none", "full")
    }
    runs = {k: [*v[:-1], f"{v[-1]}-{k.split('/')[0]}.pt"] for k, v in runs.items()}
    per_rank = run_distributed(_runs_worker, 3, "hf_mllm", runs, timeout=400)
    assert per_rank[0] == per_rank[1] == per_rank[2]
    return per_rank[0], out


@pytest.mark.integration
@pytest.mark.parametrize("model", list(ABSENT))
def test_a_tower_without_items_anywhere_keeps_training_exactly_plain(absent_runs, model):
    """The promise where a step's global batch has no item of a modality: the balanced run
    runs that tower nowhere, so its parameters keep no gradient and AdamW leaves them alone
    (no momentum step, no weight decay, no step count), as in the plain run; where some ranks
    have items, the others' zero gradients are the plain sum's. Parameters the model never
    uses (LLaVA's last vision layer) get no gradient either. Losses, parameters and AdamW's
    state all equal the plain run's."""
    runs, out = absent_runs
    plain, full = runs[f"{model}/none"], runs[f"{model}/full"]
    for phase in plain[0]["loads"]:
        if phase == "llm":
            continue
        idle = {sum(load == 0 for load in r["loads"][phase]) for r in plain}
        assert {1, 2, 3} <= idle, f"{phase}: ranks without items per step {idle}; reseed"
    assert _max_loss_diff(plain, full) < EXACT
    a, b = (torch.load(out / f"{m}-{model}.pt") for m in ("none", "full"))
    assert a.keys() == b.keys()  # the same parameters had a gradient at some step
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=0, atol=EXACT, msg=key)
    params = {k.split("/", 1)[1] for k in a if k.startswith("param/")}
    never = {k for k in params if f"exp_avg/{k}" not in a}
    unused = {k for k in params if any(part in k for part in UNUSED[model])}
    assert unused and never == unused, sorted(never ^ unused)


@pytest.mark.integration
def test_measured_costs_in_a_wrapped_model_are_the_same_on_every_rank():
    """``omt.wrap(model, cost="measured")`` under FSDP2 on 2 ranks: every forward of the first
    steps times each phase (less FSDP's all-gather waits), the ranks gather the times and
    fit the same cost models (the records, all-reduced loads and the calibration alike, are
    equal on both ranks), and the losses stay the plain run's."""
    data = ["--examples", "48", "--batch-size", "3", "--loss", "exact", "--model", "qwen2.5-vl"]
    runs = {b: [*data, "--balance", b, "--cost", "measured" if b == "full" else "default"]
            for b in ("none", "full")}  # fmt: skip
    per_rank = run_distributed(_runs_worker, 2, "hf_mllm", runs, timeout=240)
    assert per_rank[0] == per_rank[1]  # the calibration records too: one fit for all ranks
    plain, full = per_rank[0]["none"], per_rank[0]["full"]
    assert _max_loss_diff(plain, full) < EXACT
    timed = [r["calibration"] for r in full if "calibration" in r]
    assert len(timed) == 8  # the default calibrate_steps, one record per forward
    assert all(set(c) == {"vision", "llm"} for c in timed)
    refits = [c["llm"] for c in timed if "used" in c["llm"]]  # every calibrate_every=2 forwards
    assert len(refits) == 4 and all(np.isfinite(c["measured_imbalance"]) for c in timed[0].values())
    print("qwen2.5-vl calibration:", timed[-1])


@pytest.mark.integration
def test_processor_data_trains_as_plain_with_counts_from_metadata(tmp_path):
    """``hf_processor_data.py``: records with image and audio files, decoded by real HF
    processors in DataLoader workers; the balanced loader plans on token counts computed from
    the files' headers. Every example's planned count equals its processed ``input_ids``
    length (and the planned patches and frames the processed ones), and the losses are the
    plain pipeline's."""
    data = ["--examples", "24", "--batch-size", "4", "--data", str(tmp_path / "records")]
    runs = {b: [*data, "--balance", b] for b in ("none", "greedy")}
    per_rank = run_distributed(_runs_worker, 2, "hf_processor_data", runs, timeout=240)
    assert per_rank[0] == per_rank[1]
    plain, balanced = per_rank[0]["none"], per_rank[0]["greedy"]
    assert len(plain) == len(balanced) == 3
    for run in (plain, balanced):
        assert sum(r["checked"] for r in run) == 24
        assert sum(r["mismatches"] for r in run) == 0
    assert _max_loss_diff(plain, balanced) < TOL
    spread = [max(r["tokens"]) / np.mean(r["tokens"]) for r in balanced]
    before = [max(r["tokens"]) / np.mean(r["tokens"]) for r in plain]
    print(f"hf_processor_data: mean imbalance {np.mean(before):.3f} -> {np.mean(spread):.3f}")
    assert np.mean(spread) < np.mean(before)


def test_processor_data_segments_from_metadata_equal_the_adapters(tmp_path):
    """Qwen2.5-Omni's rows (images and a clip) from ``hf_processor_data.py``'s processor: the
    segments computed from the files' headers equal those the model's adapter makes of the
    decoded, processed row (every item's patches or frames and tokens, in order)."""
    ex = _example("hf_processor_data")
    records = ex.write_records(tmp_path, 12, seed=1)
    processor = ex.Processor([ex.render(r) for r in records])
    model = ex.build_model(
        processor.tokenizer, processor.image_processor, processor.feature_extractor, seed=0
    )
    adapter = omt.adapter_for(model)
    counts = ex.metadata_counts(records, processor)
    assert sum(counts["audio_rows"]) > 0 and sum(counts["vision_rows"]) > 0
    for record, got in zip(records, counts, strict=True):
        row = processor(record)
        assert got["segments"] == adapter.to_example(row)["segments"]
        assert got["num_tokens"] == len(row["input_ids"])
