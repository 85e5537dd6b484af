"""orchmllm.integrations.trainer: a balanced Trainer trains exactly like the plain one.

examples/hf_trainer.py runs on 2 gloo processes (orchmllm.testing, with timeouts), float64,
gradient accumulation 2, 70 examples over 2 epochs (accelerate's even_batches wraps the last
batches around, and the last step of an epoch has one micro-batch): the plain Trainer and the
BalancedTrainer, TRL's SFTTrainer and its balanced subclass (padded, and padding-free), log the
same per-step losses within 1e-5 (the Trainer logs them in float32) and end with the same
parameters; a balanced run
resumed from its step-3 or step-7 checkpoint (mid-epoch) logs the rest of the uninterrupted run's
losses exactly. The same script under ``accelerate launch``, where ``Accelerator.prepare``
passes the balanced loader through, gives the plain Trainer's losses too. The balanced Trainer
run loads in a DataLoader worker (the Trainer's ``dataloader_num_workers``), the plain one in the
process.

An adapted VLM (``omt.wrap(model)`` in the same BalancedTrainer; tiny Qwen2.5-VL and LLaVA with
random weights, their processors' rows, images and videos mixed) gives the plain Trainer's
per-step losses within 1e-5 too (float64, gradient accumulation 2, 30 examples over 2 epochs,
DDP in both), ends with the same parameters, and resumes exactly, under ``torchrun`` and
``accelerate launch`` too; in TRL's SFTTrainer (its fused LM head served by the balanced
model) it gives the plain SFTTrainer's losses, parameters and metrics. transformers marks Qwen2.5-VL
``accepts_loss_kwargs=False``, so its plain run sets it True: the plain Trainer then takes the
mean over the targets of all ranks and micro-steps, as the balanced one always does. On rows
most of which are text-only (one a rank and step, AdamW with weight decay), steps with no image
on any rank leave the vision tower's parameters without a gradient in both runs: the same
parameters hold optimizer state, with the same step counts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.utils.data import IterableDataset

from orchmllm import BalancedDataLoader, PlannedBatch
from orchmllm.testing import run_distributed

pytest.importorskip("trl", exc_type=ModuleNotFoundError)  # the trainer extra

from datasets import Dataset  # noqa: E402
from transformers import DataCollatorWithFlattening  # noqa: E402  (after the extra's check)
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling  # noqa: E402

from orchmllm.integrations.trainer import (  # noqa: E402
    POLICY_FOR_LAYOUT,
    LossNormalisationWarning,
    collator_layout,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "hf_trainer.py"
TOL = 1e-5
COMMON = ["--dtype", "float64", "--grad-accum", "2", "--examples", "70", "--epochs", "2"]


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hf_trainer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Older Trainers (transformers 4.57 and 5.6 of the tested) restore a checkpoint's optimizer to
# ``args.device``, which on CPU ranks is ``cpu:N``, a location torch.load (2.13) refuses: the
# plain Trainer cannot resume there, balanced or not (on GPUs it is ``cuda:N``, which loads).
CPU_RESUME_ERROR = "don't know how to restore data location"


def _main(main, argv: list[str]) -> dict:
    """The example's record; where this Trainer cannot resume on CPU ranks (above), the run
    without its resume, marked ``resume_skipped``."""
    try:
        return main(argv)
    except RuntimeError as e:
        if CPU_RESUME_ERROR not in str(e) or "--resume-at" not in argv:
            raise
        reason = str(e)
    at = argv.index("--resume-at")
    return {**main(argv[:at] + argv[at + 2 :]), "resume_skipped": reason}


def _resumed(record: dict) -> dict:
    if "resume_skipped" in record:
        pytest.skip(f"this Trainer cannot resume on CPU ranks: {record['resume_skipped']}")
    return record


def _runs_worker(rank: int, world: int, runs: dict[str, list[str]]) -> dict:
    main = _example().main
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Trainer's and DDP's advice, not under test
        return {key: _main(main, argv) for key, argv in runs.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    out, out7 = (str(tmp_path_factory.mktemp("trainer")) for _ in range(2))
    runs = {
        "trainer/none": ["--balance", "none"],
        "trainer/auto": ["--resume-at", "3", "--output-dir", out, "--workers", "1"],
        "trainer/resume-at-7": ["--resume-at", "7", "--output-dir", out7],
        "sft/none": ["--trainer", "sft", "--balance", "none"],
        "sft/auto": ["--trainer", "sft"],
        "sft/auto-padding-free": ["--trainer", "sft", "--padding-free"],
    }
    runs = {key: [*COMMON, *argv] for key, argv in runs.items()}
    return run_distributed(_runs_worker, 2, runs, timeout=150)[0]


VLMS = ("qwen2.5-vl", "llava")
# TRL's fused-LM-head protocol, which an adapted VLM in the SFTTrainer needs (older TRL reads
# the labels before the forward; the mixin refuses it, tested below)
FUSED_HEAD = hasattr(importlib.import_module("trl.trainer"), "add_fused_lm_head")
VLM_COMMON = ["--dtype", "float64", "--grad-accum", "2", "--batch-size", "2"]
VLM_COMMON += ["--examples", "30", "--epochs", "2"]
# One row per rank and step, most of them text-only: some steps have no image on any rank.
ABSENT = ["--dtype", "float64", "--grad-accum", "1", "--batch-size", "1", "--examples", "16"]
ABSENT += ["--epochs", "1", "--text-only", "0.6", "--weight-decay", "0.01"]
# The Trainer's loss is transformers' (TRL's: its own kernel), computed in float32 even for a
# float64 model, so the runs' gradients differ by float32 rounding, and AdamW, which divides
# each entry by its own running scale, turns that into parameter differences of up to 4.6e-6
# after 8 steps at learning rate 1e-3 (measured: Qwen2.5-VL under TRL). A tower stepped where
# the plain run skips it moves its weights by about the learning rate a step.
STATE_TOL = 1e-5
VISION = ("model.visual.", "model.vision_tower.", "model.multi_modal_projector.")


@pytest.fixture(scope="module")
def vlm_runs(tmp_path_factory) -> dict[str, dict]:
    runs = {}
    for model in VLMS:
        runs[f"{model}/none"] = [*VLM_COMMON, "--model", model, "--balance", "none"]
        runs[f"{model}/auto"] = [*VLM_COMMON, "--model", model]
        for balance in ("none", "auto") if FUSED_HEAD else ():
            runs[f"{model}/sft-{balance}"] = [*VLM_COMMON, "--model", model, "--trainer", "sft",
                                              "--balance", balance]  # fmt: skip
        for trainer in ("trainer", "sft") if FUSED_HEAD else ("trainer",):
            for balance in ("none", "auto"):
                runs[f"{model}/absent-{trainer}-{balance}"] = [
                    *ABSENT, "--model", model, "--trainer", trainer, "--balance", balance
                ]  # fmt: skip
    out = str(tmp_path_factory.mktemp("vlm"))
    runs["qwen2.5-vl/auto"] += ["--resume-at", "3", "--output-dir", out]
    return run_distributed(_runs_worker, 2, runs, timeout=240)[0]


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.integration
@pytest.mark.parametrize(
    ("plain", "balanced"),
    [
        ("trainer/none", "trainer/auto"),
        ("sft/none", "sft/auto"),
        ("sft/none", "sft/auto-padding-free"),  # TRL's packed batches: the greedy policy
    ],
)
def test_balanced_trainer_trains_like_the_plain_one(runs, plain, balanced):
    plain, balanced = runs[plain], runs[balanced]
    assert len(plain["losses"]) == 10  # 2 epochs of 5 steps: the epochs' semantics are kept
    assert _max_diff(plain["losses"], balanced["losses"]) < TOL
    assert balanced["param_sum"] == pytest.approx(plain["param_sum"], abs=1e-6)
    assert balanced["balanced"] and not plain["balanced"]
    assert balanced["num_examples"] == plain["num_examples"] == 70
    # the logged mean imbalance of the micro-batches (the policy's padded cost) drops, and
    # the slowest rank's cost, in the same units, never rises
    assert balanced["balance/imbalance_after"] < balanced["balance/imbalance_before"]
    assert balanced["balance/load_max_after"] < balanced["balance/load_max_before"]
    assert plain["balance/imbalance_before"] is None


@pytest.mark.integration
@pytest.mark.parametrize(("run", "at"), [("trainer/auto", 3), ("trainer/resume-at-7", 7)])
def test_a_resumed_balanced_trainer_continues_the_run_exactly(runs, run, at):
    """Step 3 is mid-way through the first epoch (5 steps), step 7 through the second."""
    record = _resumed(runs[run])
    assert record["resumed_losses"] == record["losses"][at:]


@pytest.mark.integration
@pytest.mark.parametrize("model", VLMS)
def test_an_adapted_vlm_trains_like_the_plain_trainer(vlm_runs, model):
    plain, balanced = vlm_runs[f"{model}/none"], vlm_runs[f"{model}/auto"]
    # 30 examples, 2 ranks x 2 micro-batches of 2: 4 steps an epoch (the last wraps around)
    assert len(plain["losses"]) == 8
    assert _max_diff(plain["losses"], balanced["losses"]) < TOL
    _assert_same_state(plain, balanced)
    assert balanced["num_examples"] == plain["num_examples"] == 30
    # FLOPs from the planned sequences' tokens: counted, and no more than the padded batches'
    assert 0 < balanced["total_flos"] <= plain["total_flos"]
    # the language model's logged mean imbalance (its tokens per rank) drops
    assert balanced["balance/imbalance_after"] < balanced["balance/imbalance_before"]


@pytest.mark.integration
@pytest.mark.parametrize("model", VLMS)
def test_an_adapted_vlm_in_trls_sft_trainer_trains_like_the_plain_one(vlm_runs, model):
    """TRL's SFTTrainer asks the model for per-token log-probabilities (its fused LM head):
    the balanced model serves them from its own phases, so the losses, the parameters and
    TRL's own metrics (trained tokens, entropy, token accuracy) are the plain run's."""
    if not FUSED_HEAD:
        pytest.skip("this TRL has no fused-LM-head protocol (trl.trainer.add_fused_lm_head)")
    plain, balanced = vlm_runs[f"{model}/sft-none"], vlm_runs[f"{model}/sft-auto"]
    assert len(plain["losses"]) == 8
    assert _max_diff(plain["losses"], balanced["losses"]) < TOL
    _assert_same_state(plain, balanced)
    assert balanced["num_tokens"] == plain["num_tokens"]  # every rank's tokens, summed
    for metric in ("entropy", "mean_token_accuracy"):
        assert _max_diff(plain[metric], balanced[metric]) < TOL
    assert balanced["balance/imbalance_after"] < balanced["balance/imbalance_before"]


@pytest.mark.integration
@pytest.mark.parametrize("trainer", ["trainer", "sft"])
@pytest.mark.parametrize("model", VLMS)
def test_a_vlm_step_without_images_anywhere_keeps_the_plain_optimizer_state(
    vlm_runs, model, trainer
):
    """Steps whose global batch holds no image: the balanced model runs its vision tower on no
    rank, so AdamW (with weight decay) skips its parameters as in the plain run. Every
    parameter's step count is the plain run's exactly (fewer steps than the run's for the
    tower: the case occurred), and so is the set of parameters with optimizer state (LLaVA's
    unused last vision layer has none); values agree to the float32 loss's rounding."""
    if trainer == "sft" and not FUSED_HEAD:
        pytest.skip("this TRL cannot serve an adapted VLM (no fused LM head; refused below)")
    plain, balanced = (vlm_runs[f"{model}/absent-{trainer}-{b}"] for b in ("none", "auto"))
    a = plain["state"]
    steps = len(plain["losses"])
    tower = [float(a[k]) for k in a if k.startswith("step/") and k[5:].startswith(VISION)]
    assert tower and min(tower) < steps, "every step had an image somewhere; reseed"
    _assert_same_state(plain, balanced)
    assert _max_diff(plain["losses"], balanced["losses"]) < TOL


def _assert_same_state(plain: dict, balanced: dict) -> None:
    """The same parameters with optimizer state, the same step counts, values within
    STATE_TOL."""
    a, b = plain["state"], balanced["state"]
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for key, value in a.items():
        if key.startswith("step/"):
            assert float(b[key]) == float(value), key
        else:
            torch.testing.assert_close(b[key], value, rtol=0, atol=STATE_TOL, msg=key)


LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                 "--nproc_per_node=2"],
    "accelerate": ["accelerate", "launch", "--multi_gpu", "--num_processes", "2"],
}  # fmt: skip


@pytest.mark.integration
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_an_adapted_vlm_under_a_launcher(vlm_runs, launcher):
    """The launcher starts the ranks, and ``TrainingArguments`` starts ``torch.distributed``
    after the example wrapped the model: the Trainer rebuilds the orchestrator's groups
    (``accelerate launch``: gloo on CPU, and ``Accelerator.prepare`` keeps the loader)."""
    if shutil.which(LAUNCHERS[launcher][0]) is None:
        pytest.skip(f"no {launcher} launcher")
    argv = [*VLM_COMMON, "--model", "qwen2.5-vl"]
    out = subprocess.run(
        [*LAUNCHERS[launcher], str(EXAMPLE), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert record["prepare_keeps_loader"]
    assert _max_diff(record["losses"], vlm_runs["qwen2.5-vl/none"]["losses"]) < TOL


@pytest.mark.integration
def test_a_resumed_vlm_trainer_continues_the_run_exactly(vlm_runs):
    record = _resumed(vlm_runs["qwen2.5-vl/auto"])
    assert record["resumed_losses"] == record["losses"][3:]


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="no accelerate launcher")
def test_under_accelerate_launch(runs):
    """``accelerate launch`` starts the ranks (gloo on CPU); ``Accelerator.prepare`` returns the
    balanced loader itself."""
    out = subprocess.run(
        ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", str(EXAMPLE), *COMMON],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert record["prepare_keeps_loader"]
    assert _max_diff(record["losses"], runs["trainer/none"]["losses"]) < TOL


def test_policy_follows_the_collator_layout():
    assert collator_layout(DataCollatorForLanguageModeling(pad_token_id=0)) == "padded"
    packed = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    assert collator_layout(packed) == "packed"
    assert collator_layout(DataCollatorWithFlattening()) == "packed"
    assert POLICY_FOR_LAYOUT["padded"] == "padded_cost"
    assert POLICY_FOR_LAYOUT[collator_layout(sorted)] == "greedy"  # unknown: packed cost


class _Stream(IterableDataset):
    def __iter__(self):
        return ({"input_ids": list(range(1, 5 + i)), "id": i} for i in range(8))


def test_an_iterable_dataset_needs_each_rank_to_read_its_shard(tmp_path):
    """accelerate dispatches an iterable dataset's batches from rank 0 by default; the
    balanced loader reads on every rank, so it asks for per-rank shards instead."""
    ex = _example()
    trainer = ex.make_trainer(ex.parse_args(["--examples", "8"]), str(tmp_path), max_steps=1)
    trainer.train_dataset = _Stream()
    with pytest.raises(ValueError, match="dispatch_batches"):
        trainer.get_train_dataloader()
    trainer.accelerator.dataloader_config.dispatch_batches = False  # as accelerator_config sets
    assert isinstance(trainer.get_train_dataloader(), BalancedDataLoader)


def test_a_per_rank_loss_warns(tmp_path):
    ex = _example()
    args = ex.parse_args(["--examples", "8", "--max-len", "16", "--batch-size", "2"])
    trainer = ex.make_trainer(args, str(tmp_path), max_steps=1)
    trainer.args.average_tokens_across_devices = False
    with pytest.warns(LossNormalisationWarning, match="average_tokens_across_devices=False"):
        trainer.get_train_dataloader()


def _vlm_trainer(tmp_path, model="qwen2.5-vl", *argv, **args):
    ex = _example()
    argv = ["--model", model, "--examples", "4", "--batch-size", "2", *argv]
    trainer = ex.make_trainer(ex.parse_args(argv), str(tmp_path), max_steps=1)
    vars(trainer.args).update(args)
    return trainer


def test_an_adapted_vlm_keeps_its_models_columns_and_the_plain_count(tmp_path):
    """Column removal keeps what the HF model takes (not the wrapper's ``batch``), and a
    step's micro-batches come planned, their target count the plain Trainer's (LLaVA: every
    row has the same fields, as a ``datasets.Dataset``'s rows do)."""
    trainers = [_vlm_trainer(tmp_path, "llava", *argv) for argv in ([], ["--balance", "none"])]
    rows = [{**r, "id": i} for i, r in enumerate(trainers[0].train_dataset)]
    steps = []
    for trainer in trainers:
        trainer.train_dataset = Dataset.from_list(rows).with_format("torch")
        loader = trainer.get_train_dataloader()
        steps.append(trainer.get_batch_samples(iter(loader), 2, "cpu"))
    (balanced, balanced_count), (plain, plain_count) = steps
    assert len(balanced) == len(plain) == 2
    assert all(isinstance(b["batch"], PlannedBatch) for b in balanced)
    assert int(balanced_count) == int(plain_count) > 0
    kept = trainers[0]._balanced.source.dataset.column_names
    assert "id" not in kept and {"input_ids", "labels", "pixel_values"} <= set(kept)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_trls_fused_head_patch_comes_off_an_adapted_vlm(tmp_path):
    """TRL patches the model's forward with a fused LM head that would run the HF backbone
    unbalanced: on an adapted VLM the mixin takes the patch off (the model's own forward
    serves the protocol); the plain run's HF model keeps it."""
    if not FUSED_HEAD:  # the balanced model cannot serve this TRL: the mixin says so
        with pytest.raises(ValueError, match="add_fused_lm_head"):
            _vlm_trainer(tmp_path, "llava", "--trainer", "sft")
        return
    balanced = _vlm_trainer(tmp_path, "llava", "--trainer", "sft").model
    plain = _vlm_trainer(tmp_path, "llava", "--trainer", "sft", "--balance", "none").model
    assert "forward" not in vars(balanced) and "forward" in vars(plain)


def test_an_adapted_vlm_needs_the_global_token_count(tmp_path):
    trainer = _vlm_trainer(tmp_path, average_tokens_across_devices=False)
    with pytest.raises(ValueError, match="average_tokens_across_devices=True"):
        trainer.get_train_dataloader()
    trainer = _vlm_trainer(tmp_path)
    trainer.model.model.accepts_loss_kwargs = False  # as transformers marks Qwen2.5-VL
    with pytest.warns(LossNormalisationWarning, match="accepts_loss_kwargs=False"):
        trainer.get_train_dataloader()
