"""Training entry point: rebalancing never changes the training (consequence invariance).

Real gloo process groups, real FSDP2, the real orchestrator and synthetic HF dataset, driven
through ``orchmllm.train.main(argv)`` (the torchrun entry point) inside orchmllm.testing
workers; float64, so the only differences between modes are summation orders.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import yaml

from orchmllm.config import load_config
from orchmllm.data.recipe import Task, TaskDraw, register_task, unregister_task
from orchmllm.data.synthetic import save_dataset
from orchmllm.planner.step_options import MODES
from orchmllm.schema import Modality, register_modality, unregister_modality
from orchmllm.testing import launch_ranks, launcher_store, run_distributed, wait_for
from orchmllm.train import (
    RunningSummary,
    checkpoint,
    dataset_location,
    forward_backward,
    main,
    parse_args,
    phase_record,
    run_config,
    setup,
    write_once,
)
from tests.conftest import ROOT

TINY = "configs/tiny.yaml"
PHASES = load_config(TINY).phases
RTOL = 1e-5
SCHEMA = {
    "step", "loss", "step_time_s", "tokens_per_s", "balance", "world_size", "phases",
    "rss_anon_mb", "rss_anon_mb_max", "rss_file_mb", "rss_file_mb_max",
}  # fmt: skip
PHASE_SCHEMA = {
    "imbalance_before", "imbalance_after", "load_max_before", "load_max_after", "bytes_intra",
    "bytes_inter", "plan_ms",
}  # fmt: skip


def _config(
    tmp_path,
    name: str,
    balance: dict | None = None,
    model: dict | None = None,
    train: dict | None = None,
    **data,
) -> str:
    """configs/tiny.yaml with some sections changed: a config of a few lines over a base."""
    raw = {"base": str(ROOT / TINY), "model": model or {}, "data": data, "balance": balance or {}}
    raw["train"] = train or {}
    path = os.path.join(tmp_path, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    return path


def _weights(mix: dict[str, float]) -> dict[str, dict[str, float]]:
    """``data.tasks`` setting these tasks' weights (each laid on the base config's task)."""
    return {task: {"weight": w} for task, w in mix.items()}


def _argv(config: str, tmp_path, mode: str, steps: int, *extra: str) -> list[str]:
    return [
        "--config", config, "--steps", str(steps), "--balance", mode, "--precision", "float64",
        "--data-dir", os.path.join(tmp_path, "data"), "--quiet", *extra,
    ]  # fmt: skip


def _modes_worker(rank: int, world: int, config: str, tmp_path: str, steps: int, extra: tuple):
    """The same run in every balance mode, through main(); metrics and parameters to files."""
    torch.set_num_threads(1)  # several ranks share few cores; OMP spinning would stall gloo
    for mode in MODES:
        out = os.path.join(tmp_path, mode)
        main(
            _argv(config, tmp_path, mode, steps, *extra, "--metrics-per-rank",
                  "--metrics", f"{out}.jsonl", "--save", f"{out}.pt")
        )  # fmt: skip


def _load(tmp_path, mode: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    path = os.path.join(tmp_path, mode)
    with open(f"{path}.jsonl") as f:
        records = [json.loads(line) for line in f]
    return records, torch.load(f"{path}.pt")


def _assert_same_training(
    tmp_path,
    world: int,
    steps: int,
    phases: tuple[str, ...] = PHASES,
    *,
    rtol: float = RTOL,
    compare_params: bool = True,
) -> dict[str, list[dict]]:
    results = {mode: _load(tmp_path, mode) for mode in MODES}
    ref_records, ref_params = results["none"]
    for mode in ("llm", "full"):
        records, params = results[mode]
        np.testing.assert_allclose(
            [r["loss"] for r in records], [r["loss"] for r in ref_records], rtol=rtol
        )
        assert params.keys() == ref_params.keys()
        if not compare_params:
            continue
        for name, p in ref_params.items():
            torch.testing.assert_close(params[name], p, rtol=rtol, atol=1e-9, msg=name)
    for mode, (records, _) in results.items():
        assert [r["step"] for r in records] == list(range(steps))
        for r in records:
            assert set(r) >= SCHEMA and r["world_size"] == world and r["balance"] == mode
            assert np.isfinite(r["loss"]) and r["step_time_s"] > 0 and r["tokens_per_s"] > 0
            assert 0 < r["rss_anon_mb"] <= r["rss_anon_mb_max"]
            assert 0 < r["rss_file_mb"] <= r["rss_file_mb_max"]
            assert tuple(r["phases"]) == phases  # every phase in the metrics, in order
            for name in phases:
                p = r["phases"][name]
                assert set(p) >= PHASE_SCHEMA
                assert len(p["loads_before"]) == len(p["loads_after"]) == world
                assert p["load_max_before"] == max(p["loads_before"])
            for name in set(phases) - {"audio"}:  # packed costs: moving conserves the total
                p = r["phases"][name]
                assert sum(p["loads_after"]) == pytest.approx(sum(p["loads_before"]))
    full = results["full"][0]
    # Balancing did something, so the equalities above are not vacuous.
    before = np.mean([r["phases"]["llm"]["imbalance_before"] for r in full])
    after = np.mean([r["phases"]["llm"]["imbalance_after"] for r in full])
    assert after < before, (before, after)
    assert sum(r["phases"][p]["bytes_intra"] + r["phases"][p]["bytes_inter"]
               for r in full for p in phases) > 0  # fmt: skip
    for r in results["llm"][0]:  # llm mode leaves the encoder phases as sampled
        for p in phases[:-1]:
            assert r["phases"][p]["loads_after"] == r["phases"][p]["loads_before"]
    for r in results["none"][0]:
        for p in phases:
            assert r["phases"][p]["bytes_intra"] == r["phases"][p]["bytes_inter"] == 0
    return {mode: records for mode, (records, _) in results.items()}


@pytest.mark.integration
def test_balance_modes_train_identically_on_4_ranks_as_2_nodes(tmp_path):
    """4 ranks as 2 nodes of 2, node-wise placement by the time-limited ILP (whose plans
    rank 0 computes for all: see orchmllm.data.exchange.agreed_plan)."""
    config = _config(tmp_path, "tiny4", examples_per_rank=4)
    run_distributed(_modes_worker, 4, config, str(tmp_path), 3, ("--placement", "ilp"), timeout=150)
    records = _assert_same_training(tmp_path, 4, 3)
    full = records["full"]
    assert all(r["ranks_per_node"] == 2 and r["placement"] == "ilp" for r in full)
    # Something crossed nodes, and node-wise placement was asked for.
    assert sum(r["phases"][p]["bytes_inter"] for r in full for p in PHASES) > 0


# bf16's unit roundoff. The modes compute the same sums in other orders (other batches, other
# gradient reductions); in bf16-mixed each such sum is exact to within one rounding of its
# result, so a step's loss, a mean of those sums, agrees to that relative precision (float64
# agrees to 1e-5). Weights are not compared: AdamW divides each gradient entry by its own
# running scale, so an entry near zero whose rounding differs moves its weight by up to the
# learning rate either way; the loss is what such moves would change.
BF16_UNIT_ROUNDOFF = 2.0**-8


@pytest.mark.integration
def test_bf16_mixed_with_checkpointing_trains_the_same_in_every_mode(tmp_path):
    """The GPU recipe (bf16 compute over fp32 masters, every block checkpointed, chunked loss)
    on 2 ranks for 10 steps: the three modes agree within bf16's precision."""
    recipe = ("--precision", "bf16-mixed", "--checkpointing", "1", "--loss-chunk", "64")
    run_distributed(_modes_worker, 2, TINY, str(tmp_path), 10, recipe, timeout=240)
    records = _assert_same_training(tmp_path, 2, 10, rtol=BF16_UNIT_ROUNDOFF, compare_params=False)
    assert max(abs(r["loss"] - 6.25) for r in records["none"]) < 0.5  # it trained, not NaN


def _grads_worker(rank: int, world: int, config: str, tmp_path: str, mode: str):
    """Loss and FSDP2-reduced gradients of step 0, as full tensors (rank 0)."""
    torch.set_num_threads(1)
    run = setup(parse_args(_argv(config, tmp_path, mode, 1, "--timeout", "90")))
    with run.loader:
        loss, _ = forward_backward(run, next(iter(run.loader)))
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {n: p.grad.full_tensor() for n, p in run.model.named_parameters()}
    return (float(total), grads) if rank == 0 else None


def _sparse_then_grads_worker(rank, world, sparse, tmp_path, grads_config):
    _modes_worker(rank, world, sparse, tmp_path, 3, ("--seed", "2"))
    return _grads_worker(rank, world, grads_config, tmp_path, "full")


@pytest.mark.integration
def test_two_ranks_idle_encoder_rank_and_global_gradient(tmp_path):
    """Two checks on 2 ranks, one launch.

    1. Two examples per rank, some text-only (seed 2 makes rank 0 hold no image and no audio in
       step 1 while rank 1 holds some): every rank still runs both encoders, nothing hangs,
       and the three modes still train identically.
    2. 2 ranks x B examples and 1 rank x 2B examples see the same global batch
       (distributed-sampler order), so the loss and the FSDP2-reduced gradients must equal
       the single-process ones: loss normalised by the global target count, gradients summed.
    """
    mix = {"caption": 0.4, "vqa": 0.0, "asr": 0.3, "spoken_qa": 0.0, "chat": 0.3}
    sparse = _config(tmp_path, "sparse", examples_per_rank=2, tasks=_weights(mix))
    per_rank = load_config(TINY).data.examples_per_rank
    two = _config(tmp_path, "two", examples_per_rank=per_rank)
    one = _config(tmp_path, "one", examples_per_rank=2 * per_rank)
    loss2, grads2 = run_distributed(
        _sparse_then_grads_worker, 2, sparse, str(tmp_path), two, timeout=150
    )[0]
    records = _assert_same_training(tmp_path, 2, 3)
    idle = [
        (r["step"], rank)
        for r in records["none"]
        for rank in range(2)
        if r["phases"]["vision"]["loads_before"][rank] == 0
        and r["phases"]["audio"]["loads_before"][rank] == 0
        and r["phases"]["vision"]["items"] + r["phases"]["audio"]["items"] > 0
    ]
    assert idle, "no rank was left without encoder items; pick another --seed"

    loss1, grads1 = run_distributed(_grads_worker, 1, one, str(tmp_path), "none", timeout=90)[0]
    assert loss2 == pytest.approx(loss1, rel=1e-9)
    assert grads2.keys() == grads1.keys()
    for name, g in grads1.items():
        assert torch.count_nonzero(g) > 0, name
        torch.testing.assert_close(grads2[name], g, rtol=1e-7, atol=1e-12, msg=name)


def _absent_worker(rank: int, world: int, config: str, tmp_path: str, mode: str, steps: int):
    """The trainer's steps one by one (its forward_backward and optimizer), recording per step
    which phases no rank had an item of and which encoders' parameters got a gradient; at the
    end every parameter and its AdamW state as full tensors (every rank returns both)."""
    torch.set_num_threads(1)
    run = setup(parse_args(_argv(config, tmp_path, mode, steps, "--timeout", "60")))
    steps_seen = []
    with run.loader:
        for _, planned in zip(range(steps), run.loader, strict=False):
            loss, out = forward_backward(run, planned)
            total = loss.detach().clone()
            dist.all_reduce(total)
            with_grad = {
                name: sorted({p.grad is not None for p in enc.parameters()})
                for name, enc in run.model.encoders.items()
            }
            steps_seen.append((float(total), out.absent, with_grad))
            run.optim.step()
            run.optim.zero_grad(set_to_none=True)
    state = {}
    for name, p in run.model.named_parameters():
        state[f"param/{name}"] = p.detach().full_tensor()
        for key, value in run.optim.state.get(p, {}).items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value.clone()
            state[f"{key}/{name}"] = full
    return steps_seen, state


@pytest.mark.integration
def test_a_phase_with_no_item_anywhere_leaves_its_encoder_as_a_plain_run_does(tmp_path):
    """One example per rank, a third of them text-only: some steps have no image (or no audio)
    on any rank, others on one rank only. AdamW with weight decay, float64.

    Where no rank has an item of a phase, no rank runs its encoder and its parameters keep no
    gradient, so AdamW leaves them as a plain run does (no momentum step, no decay, no step
    count); where one rank has items, every rank's encoder parameters get a gradient (zeros on
    the idle one, the plain sum's share). Balanced and unbalanced runs on 2 ranks and one
    process over the same global batch then end with the same parameters and optimizer state,
    to float64 rounding."""
    mix = {"caption": 0.35, "vqa": 0.0, "asr": 0.35, "spoken_qa": 0.0, "chat": 0.3}
    train = {"weight_decay": 0.1, "lr": 1.0e-2}
    two = _config(tmp_path, "two", examples_per_rank=1, tasks=_weights(mix), train=train)
    one = _config(tmp_path, "one", examples_per_rank=2, tasks=_weights(mix), train=train)
    steps = 6
    runs = {
        mode: run_distributed(_absent_worker, 2, two, str(tmp_path), mode, steps, timeout=120)
        for mode in ("none", "full")
    }
    runs["one"] = run_distributed(_absent_worker, 1, one, str(tmp_path), "none", steps, timeout=90)
    seen, _ = runs["full"][0]
    absent = [(step, phase) for step, (_, gone, _) in enumerate(seen) for phase in gone]
    assert {phase for _, phase in absent} == {"vision", "audio"}, f"reseed: absent {absent}"
    for key, per_rank in runs.items():
        for rank, (steps_seen, _) in enumerate(per_rank):
            for step, (_, gone, with_grad) in enumerate(steps_seen):
                assert gone == seen[step][1], (key, rank, step)
                for phase, has in with_grad.items():
                    want = [False] if phase in gone else [True]
                    assert has == want, (key, rank, step, phase, has)
    ref_seen, ref = runs["one"][0]
    for key in ("none", "full"):
        steps_seen, state = runs[key][0]
        np.testing.assert_allclose(
            [s[0] for s in steps_seen], [s[0] for s in ref_seen], rtol=1e-12, err_msg=key
        )
        assert state.keys() == ref.keys()
        for name, value in ref.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-10, msg=(key, name))


# A new encoder modality, added as a user would: one row of the modality table, one task of
# the recipe that holds it, one encoder section of the config (a ViT over depth maps).
DEPTH = Modality("depth", 3, "depth_patches", "greedy", arch="vit", unit="patch")


def _depth_caption(gen: np.random.Generator, n: int, params) -> TaskDraw:
    """A prompt, one depth map of 40-400 patches, a caption."""
    prompt, caption = gen.integers(4, 12, n), gen.lognormal(np.log(20.0), 0.5, n)
    return TaskDraw(np.column_stack([prompt, gen.integers(40, 400, n), caption]))


DEPTH_CAPTION = Task(
    "depth_caption", (("text", False), ("depth", False), ("text", True)), draw=_depth_caption
)


def _depth_worker(rank: int, world: int, config: str, tmp_path: str, steps: int):
    register_modality(DEPTH)  # every process that plans or loads the modality holds the row
    register_task(DEPTH_CAPTION)
    try:
        _modes_worker(rank, world, config, tmp_path, steps, ())
    finally:
        unregister_task(DEPTH_CAPTION.name)
        unregister_modality(DEPTH.name)


@pytest.mark.integration
def test_a_new_modality_in_a_table_row_trains_end_to_end(tmp_path):
    """A temporary "depth" row: synthetic depth maps, its own encoder (a ViT, from the config
    section's architecture), its own balanced phase, moves and metrics; every mode trains
    identically on 2 ranks (float64) and the depth phase is balanced."""
    register_modality(DEPTH)  # the config names the depth encoder: check it loads here too
    try:
        config = _config(
            tmp_path, "depth", examples_per_rank=4,
            model={"encoders": {"depth": {"hidden": 32, "heads": 2, "kv_heads": 2, "patch": 4,
                                          "downsample": 2}}},
            tasks={"depth_caption": {"weight": 0.35}},
        )  # fmt: skip
        with pytest.raises(ValueError, match="data.tasks has no key 'depth_caption'"):
            load_config(config)  # the task is not registered here
        register_task(DEPTH_CAPTION)
        try:
            phases = load_config(config).phases
        finally:
            unregister_task(DEPTH_CAPTION.name)
    finally:
        unregister_modality(DEPTH.name)
    assert phases == ("vision", "audio", "depth", "llm")
    run_distributed(_depth_worker, 2, config, str(tmp_path), 3, timeout=150)
    full = _assert_same_training(tmp_path, 2, 3, phases)["full"]
    depth = [r["phases"]["depth"] for r in full]
    assert sum(p["items"] for p in depth) > 0
    assert np.mean([p["imbalance_after"] for p in depth]) < np.mean(
        [p["imbalance_before"] for p in depth]
    )


SUBSETS = {
    "text-only": ({"vision": None, "audio": None}, {"chat": 1.0}),
    "vision-only": ({"audio": None}, {"caption": 1.0, "vqa": 1.0, "chat": 0.5}),
    "audio-only": ({"vision": None}, {"asr": 1.0, "spoken_qa": 1.0, "chat": 0.5}),
}


def _subsets_worker(rank: int, world: int, tmp_path: str):
    for name in SUBSETS:
        config = os.path.join(tmp_path, f"{name}.yaml")
        sub = os.path.join(tmp_path, name)
        os.makedirs(sub, exist_ok=True)
        _modes_worker(rank, world, config, sub, 2, ())


@pytest.mark.integration
def test_text_vision_and_audio_only_data_train_through_the_defaults(tmp_path):
    """A model without some encoders, on a dataset without their fields: the trainer's data
    (HF datasets), the orchestrated loader's default ``to_example`` and the orchestrator need
    nothing more; every mode trains identically."""
    dropped = dict.fromkeys(load_config(TINY).data.tasks)  # null: the base's task is not drawn
    for name, (encoders, mix) in SUBSETS.items():
        tasks = {t: {"weight": w} for t, w in mix.items()}
        if "vqa" in tasks:
            tasks["vqa"]["p_spoken_question"] = 0.0
        _config(
            tmp_path, name, examples_per_rank=3, model={"encoders": encoders},
            tasks={**dropped, **tasks},
        )  # fmt: skip
    run_distributed(_subsets_worker, 2, str(tmp_path), timeout=240)
    for name, (encoders, _) in SUBSETS.items():
        phases = tuple(p for p in PHASES if p not in encoders)
        _assert_same_training(tmp_path / name, 2, 2, phases)


def _accumulation_worker(
    rank: int, world: int, tmp_path: str, n2: str, n2_late: str, n4: str, steps: int
):
    """K=2 micro-steps of 2 examples per rank (balanced, checkpointed every 2 steps;
    unbalanced; gradients reduce-scattered after the last micro-step only), K=1 with 4; then
    K=1 resumes from the K=2 run's step-2 checkpoint, after a run of another global batch is
    refused it."""
    torch.set_num_threads(1)
    ckpt = os.path.join(tmp_path, "ckpt")

    def run(name: str, config: str, mode: str, *extra: str) -> None:
        out = os.path.join(tmp_path, name)
        main(
            _argv(config, tmp_path, mode, steps, *extra, "--metrics-per-rank", "--timeout",
                  "60", "--metrics", f"{out}.jsonl", "--save", f"{out}.pt")
        )  # fmt: skip

    run("k2", n2, "full", "--grad-accum", "2", "--checkpoint-dir", ckpt, "--checkpoint-every", "2")
    run("k2none", n2, "none", "--grad-accum", "2")
    run("k2late", n2_late, "full", "--grad-accum", "2")
    run("k1", n4, "full")
    dist.barrier()
    if rank == 0:  # back to the middle of the K=2 run
        shutil.rmtree(checkpoint.step_dir(ckpt, steps))
    dist.barrier()
    refusal = (
        r"was written by 2 ranks x 2 examples per rank x 2 micro-steps \(global batch 8\); "
        r"this run has 2 x 4 x 2 = 16\. .*set data.examples_per_rank to 2 \(with grad_accum 2\)"
    )
    with pytest.raises(ValueError, match=refusal):
        run("refused", n4, "full", "--grad-accum", "2", "--checkpoint-dir", ckpt)
    run("resumed", n4, "full", "--checkpoint-dir", ckpt)


@pytest.mark.integration
def test_gradient_accumulation_equals_one_step_over_the_same_examples(tmp_path):
    """2 gloo ranks, float64. The sampler deals the epoch's permutation to the ranks in turn,
    so K=2 micro-steps of n examples per rank cover the same global examples as one step of
    2n: the two train alike (losses and parameters to 1e-5), and balancing each micro-step
    (``full``) trains like ``none``, and so does reducing gradients once a step instead of
    every micro-step. Metrics are per optimizer step: the LLM tokens of a step
    are the K=1 step's. Checkpoints count optimizer steps: a K=2 checkpoint at step 2 resumes
    as K=1 x 2n (the same global batch) at micro-step 2 and ends as the K=1 run."""
    steps = 4
    n2 = _config(tmp_path, "n2", examples_per_rank=2)
    n4 = _config(tmp_path, "n4", examples_per_rank=4)
    n2_late = _config(tmp_path, "n2_late", train={"sync_micro_steps": False}, examples_per_rank=2)
    run_distributed(_accumulation_worker, 2, str(tmp_path), n2, n2_late, n4, steps, timeout=200)
    (k2, k2_params), (none, none_params), (late, late_params), (k1, k1_params) = (
        _load(tmp_path, name) for name in ("k2", "k2none", "k2late", "k1")
    )
    resumed, resumed_params = _load(tmp_path, "resumed")
    assert [r["step"] for r in k2] == [r["step"] for r in k1] == list(range(steps))
    assert [r["step"] for r in resumed] == [2, 3]
    assert {r["micro_steps"] for r in k2 + none} == {2} and {r["micro_steps"] for r in k1} == {1}
    for records, params in ((none, none_params), (late, late_params), (k1, k1_params)):
        np.testing.assert_allclose([r["loss"] for r in k2], [r["loss"] for r in records], rtol=RTOL)
        for name, p in params.items():
            torch.testing.assert_close(k2_params[name], p, rtol=RTOL, atol=1e-9, msg=name)
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in k1[2:]], rtol=RTOL)
    for name, p in k1_params.items():
        torch.testing.assert_close(resumed_params[name], p, rtol=RTOL, atol=1e-9, msg=name)
    for a, b in zip(k2, k1, strict=True):
        llm_a, llm_b = a["phases"]["llm"], b["phases"]["llm"]
        assert sum(llm_a["loads_before"]) == sum(llm_b["loads_before"]) > 0
        assert sum(llm_a["loads_after"]) == pytest.approx(sum(llm_a["loads_before"]))
        assert llm_a["imbalance_after"] <= llm_a["imbalance_before"]
        # A step's slowest load is its micro-steps' slowest summed: >= any rank's total.
        assert llm_a["load_max_before"] >= max(llm_a["loads_before"])
        assert llm_b["load_max_before"] == max(llm_b["loads_before"])
    # Balancing did something, so the equalities above are not vacuous.
    assert np.mean([r["phases"]["llm"]["imbalance_after"] for r in k2]) < np.mean(
        [r["phases"]["llm"]["imbalance_before"] for r in k2]
    )


def _context_parallel_worker(rank: int, world: int, configs: dict, tmp_path: str, steps: int):
    for tag, config in configs.items():
        os.makedirs(os.path.join(tmp_path, tag), exist_ok=True)
        _modes_worker(rank, world, config, os.path.join(tmp_path, tag), steps, ())


@pytest.mark.integration
def test_long_items_split_over_context_parallel_ranks_train_as_whole_ones(tmp_path):
    """4 gloo ranks as 2 nodes of 2, float64, AdamW with weight decay. Documents longer than
    a rank's LLM budget, split over the 2 ranks of a node and over up to 4 ranks (pieces on
    ranks that are no block: the block's other ranks join the gathers), and large images
    split in the vision phase where that lowers its slowest rank, beside steps with no clip on
    any rank: every run trains as the unsplit one does (losses and parameters to 1e-5), and
    the balanced modes split."""
    steps = 3
    # Documents of 2560-3072 tokens (at the tiny scale 0.1), above either LLM budget.
    documents = {"tasks": {"document": {"weight": 0.1, "min_tokens": 25600, "max_tokens": 30720}},
                 "max_text_tokens": 4096, "examples_per_rank": 4}  # fmt: skip
    # Few clips: some steps have none on any rank (the audio tower runs nowhere then).
    images = {"tasks": {"caption": {"weight": 0.85, "max_image_side": 2016},
                        "asr": {"weight": 0.15}, "vqa": {"weight": 0},
                        "spoken_qa": {"weight": 0}, "chat": {"weight": 0}},
              "examples_per_rank": 2}  # fmt: skip
    runs = {  # name -> (context_parallel, max_load, data, the phase that splits)
        "cp2": (2, {"llm": 2400}, documents, "llm"),
        "cp4": (4, {"llm": 2000}, documents, "llm"),
        "vision": (2, {}, images, "vision"),
    }
    train = {"weight_decay": 0.1, "lr": 1.0e-2}
    configs = {
        name: _config(
            tmp_path,
            name,
            train=train,
            balance={"placement": "none", "context_parallel": n, "max_load": budget},
            **data,
        )  # fmt: skip
        for name, (n, budget, data, _) in runs.items()
    }
    run_distributed(_context_parallel_worker, 4, configs, str(tmp_path), steps, timeout=300)
    for name, (_, budget, _, phase) in runs.items():
        records = _assert_same_training(os.path.join(tmp_path, name), 4, steps)
        for mode in ("llm", "full") if phase == "llm" else ("full",):
            stats = [r["phases"][phase] for r in records[mode]]
            assert sum(p["items_split"] for p in stats) >= 1, (name, mode)
            assert all(p["pieces"] >= 2 * p["items_split"] for p in stats)
            if phase in budget:  # every document is over it: a plan within it split each
                assert max(p["load_max_after"] for p in stats) <= budget[phase]
    clips = [sum(r["phases"]["audio"]["loads_before"]) for r in _load(tmp_path, "vision/none")[0]]
    assert min(clips) == 0 < max(clips), clips  # a step without audio anywhere, and one with


def test_every_config_key_is_an_option_and_the_short_flags_alias_keys(capsys):
    args = parse_args(
        ["--config", TINY, "--steps", "3", "--model.llm.layers", "3", "--balance", "llm",
         "--train.sync_micro_steps=false", "--model.encoders.audio=null", "--train.seed", "7"]
    )  # fmt: skip
    assert args.balance == "llm" and not hasattr(args, "steps")  # one home: the config
    cfg = run_config(args)
    assert (cfg.train.steps, cfg.train.seed, cfg.model.llm.layers) == (3, 7, 3)
    assert cfg.train.sync_micro_steps is False and list(cfg.model.encoders) == ["vision"]
    assert cfg.data == load_config(TINY).data  # the rest is the file's
    mistakes = (
        (["--train.step=3"], "config key 'train.step' (given '3') has no such key; did you mean "
         "'train.steps'?"),
        (["--steps", "3", "--train.steps=4"], "'train.steps' is given twice (--train.steps and "
         "--steps are the same key)"),
        (["--model.llm.layers"], "--model.llm.layers needs a value"),
        (["--train.lr", "fast"], "'train.lr' (given 'fast') must be a number"),
        (["stray"], "unrecognized argument 'stray'"),
    )  # fmt: skip
    for argv, message in mistakes:
        with pytest.raises(SystemExit) as end:
            parse_args(["--config", TINY, *argv])
        assert end.value.code == 2 and message in capsys.readouterr().err


def test_bad_arguments_are_rejected(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--config", TINY, "--balance", "everything"])
    with pytest.raises(SystemExit):  # the type: when the command line is parsed
        parse_args(["--config", TINY, "--grad-accum", "2.5"])
    assert "'train.grad_accum' (given '2.5') must be an integer" in capsys.readouterr().err
    for flag, bad in (("--steps", "0"), ("--grad-accum", "0"), ("--grad-accum", "-1")):
        args = parse_args(["--config", TINY, flag, bad])  # the range: when the config loads
        with pytest.raises(ValueError, match=f"must be a positive integer, got {bad}"):
            run_config(args)
    for bad in (0, 2.5, "2"):
        with pytest.raises(
            ValueError, match=f"train.grad_accum must be a positive integer, got {bad!r}"
        ):
            load_config(_config(tmp_path, "bad", train={"grad_accum": bad}))
    for bad in (["--timeout", "0"], ["--checkpoint-every", "2"],
                ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "-1"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(["--config", TINY, *bad])
    preempt_args = (
        (["--preempt-grace", "0"], "--preempt-grace must be > 0 seconds, got 0.0"),
        (["--preempt-signal", "NOPE"], "--preempt-signal must name a signal"),
    )
    for bad, why in preempt_args:
        with pytest.raises(SystemExit):
            parse_args(["--config", TINY, *bad])
        assert why in capsys.readouterr().err
    assert parse_args(["--config", TINY, "--preempt-signal", "usr1"]).preempt_signals == [
        signal.SIGTERM, signal.SIGINT, signal.SIGUSR1
    ]  # fmt: skip
    with pytest.raises(ValueError, match="train.max_skipped_steps must be a positive integer"):
        load_config(_config(tmp_path, "bad", train={"max_skipped_steps": 0}))
    with pytest.raises(ValueError, match="balance.placement 'telepathy' is no placement"):
        load_config(_config(tmp_path, "bad", {"placement": "telepathy"}))
    with pytest.raises(ValueError, match="balance.policies.audio 'fastest' is no policy"):
        load_config(_config(tmp_path, "bad", {"policies": {"audio": "fastest"}}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
def test_two_torchrun_nodes_on_a_shared_empty_data_dir_write_it_once(tmp_path, repo_env):
    """The README's 2-node set-up on one machine: two ``torchrun --nnodes=2`` launches whose
    first ranks both see the same, empty ``--data-dir`` (a shared filesystem). Exactly one
    rank writes the dataset, both nodes train, and nothing temporary is left behind."""
    config = _config(tmp_path, "two_nodes", examples_per_rank=4)
    data = tmp_path / "data"
    port = _free_port()

    def launch(node: int) -> subprocess.Popen:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
            f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}",
            "-m", "orchmllm.train", "--config", config, "--steps", "1", "--quiet",
            "--data-dir", str(data),
        ]  # fmt: skip
        env = {**repo_env, "OMP_NUM_THREADS": "1"}
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    launches = [launch(node) for node in range(2)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in launches]
    finally:
        for p in launches:
            p.kill()
    for node, (p, log) in enumerate(zip(launches, logs, strict=True)):
        assert p.returncode == 0, f"node {node}:\n{log[-3000:]}"
    writers = [line for log in logs for line in log.splitlines() if ": writing " in line]
    assert len(writers) == 1, writers
    assert [p.name for p in data.iterdir()] == [os.path.basename(writers[0].split()[-1])]


def _write_once_worker(rank: int, world: int, tmp_path: str):
    """Ranks 0 and 1 share one directory, rank 2 has its own (node-local)."""
    root = os.path.join(tmp_path, "shared" if rank < 2 else "local")
    path = os.path.join(root, "ds")

    def write(tmp: str) -> None:
        os.makedirs(tmp)
        with open(os.path.join(tmp, "who"), "w") as f:
            f.write(str(rank))

    first = write_once(path, write)
    again = write_once(path, write)  # complete: nobody writes
    with open(os.path.join(path, "who")) as f:
        who = int(f.read())

    def fail(tmp: str) -> None:
        raise OSError(f"disk full on rank {rank}")

    with pytest.raises((OSError, RuntimeError), match="disk full on rank 0"):
        write_once(os.path.join(tmp_path, "shared", "broken"), fail)
    dist.barrier()  # every rank removed its probe
    return first, again, who, sorted(os.listdir(root))


@pytest.mark.integration
def test_write_once_one_writer_per_filesystem(tmp_path):
    results = run_distributed(_write_once_worker, 3, str(tmp_path), timeout=30)
    assert [r[0] for r in results] == [True, False, True]
    assert not any(r[1] for r in results)
    assert [r[2] for r in results] == [0, 0, 2]  # every rank reads its filesystem's writer's copy
    assert results[0][3] == ["ds"] and results[2][3] == ["ds"]  # no probe, no temporary left


def _launch_ranks(logdir, argv: list[str], world: int, env: dict, port: int) -> list:
    """``python -m orchmllm.train`` on ``world`` ranks (see orchmllm.testing.launch_ranks)."""
    return launch_ranks(
        ["-m", "orchmllm.train", *argv], world, port=port, logdir=logdir, env=env, cwd=ROOT
    )


@pytest.mark.integration
def test_a_stopped_rank_is_named_by_every_healthy_rank_within_the_timeout(tmp_path, repo_env):
    """SIGSTOP one of 3 ranks mid-training with ``--timeout 8``: every healthy rank reports
    that rank (and the step) as not arrived and exits with status 1 within the timeout plus
    a few seconds, instead of a generic "Timed out" after 300 s, and does not sit in
    process-group teardown."""
    # The timeout bounds set-up's collectives too, so it must cover the ranks' start-up skew
    # on a loaded CI machine (4 s did not, now and then).
    world, timeout, stopped, slack = 3, 8.0, 1, 5.0
    config = _config(tmp_path, "hang", {"ranks_per_node": None}, examples_per_rank=2)
    cfg, steps, data = load_config(config), 40, str(tmp_path / "data")
    syn, path = dataset_location(
        cfg, num_examples=steps * world * 2, seed=cfg.train.seed, data_dir=data
    )
    save_dataset(syn, cfg.rates, path)  # ahead: writing it is not what the timeout is about
    store = launcher_store()
    argv = ["--config", config, "--steps", str(steps), "--data-dir", data,
            "--timeout", str(timeout), "--balance", "full"]  # fmt: skip
    procs = _launch_ranks(tmp_path, argv, world, repo_env, store.port)
    try:
        wait_for(lambda: "step    2" in (tmp_path / "out0").read_text(), timeout=180, procs=procs)
        os.kill(procs[stopped].pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        elapsed = {}
        for rank, p in enumerate(procs):
            if rank != stopped:
                p.wait(timeout=timeout + slack + 30)
                elapsed[rank] = time.monotonic() - t_stop
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for rank, t in elapsed.items():
        err = (tmp_path / f"err{rank}").read_text()
        assert procs[rank].returncode == 1, err[-3000:]
        assert "ranks that did not arrive at training step" in err or (
            "ranks that did not arrive at loader exchange of step" in err
        ), err[-3000:]
        assert "did not arrive at " in err and f": [{stopped}]" in err, err[-3000:]
        assert f"rank {stopped}: silent for" in err, err[-3000:]
        assert t <= timeout + slack, (rank, t, err[-2000:])


def _reference_then_another_seed(rank: int, world: int, argv: list[str], ckpt: str) -> None:
    """The uninterrupted run (checkpointed at its end), then a run with another seed on the
    same checkpoint directory, which must refuse to resume it."""
    torch.set_num_threads(1)
    main([*argv, "--checkpoint-dir", ckpt])
    with pytest.raises(ValueError, match=r"checkpoint-dir .* another run \(seed 0 there, 1 now"):
        main([*argv, "--checkpoint-dir", ckpt, "--seed", "1"])


@pytest.mark.integration
def test_a_killed_run_resumes_from_its_last_complete_checkpoint(tmp_path, repo_env):
    """Kill both ranks of a checkpointing run (SIGKILL) once a checkpoint is complete, rerun
    the same command: it resumes there (not at a half-written checkpoint) and ends with the
    losses and parameters of an uninterrupted run, in float64 to 1e-6; its metrics file holds
    every step once (streamed by the killed run, cut back to the checkpoint on resume). A
    checkpoint of another run (here: another seed) is refused, not resumed."""
    world, steps = 2, 6
    config = _config(tmp_path, "ckpt", examples_per_rank=2)
    base = _argv(config, tmp_path, "full", steps, "--timeout", "60")
    ref, out, ckpt = tmp_path / "ref", tmp_path / "resumed", tmp_path / "ckpt"
    files = ("--metrics", "{}.jsonl", "--save", "{}.pt")
    ref_argv = [*base, *(f.format(ref) for f in files)]
    run_distributed(
        _reference_then_another_seed, world, ref_argv, str(tmp_path / "ref_ckpt"), timeout=120
    )
    argv = [*base, *(f.format(out) for f in files), "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", "2"]  # fmt: skip
    store = launcher_store()
    procs = _launch_ranks(tmp_path / "killed", argv, world, repo_env, store.port)
    try:
        wait_for(lambda: (ckpt / "step-00000002").is_dir(), timeout=180, procs=procs)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    killed_at = checkpoint.latest_step(str(ckpt))
    assert killed_at is not None and killed_at < steps, "the run ended before the kill"
    # What a job killed while writing the last checkpoint leaves: never loaded.
    partial = ckpt / f"step-{steps:08d}.partial"
    partial.mkdir(exist_ok=True)
    (partial / ".metadata").write_bytes(b"half")

    store = launcher_store()
    # The resumed run draws rank 0's progress bar (to a file: forced on), from the checkpoint.
    bar_argv = [a for a in argv if a != "--quiet"] + ["--progress", "bar"]
    procs = _launch_ranks(tmp_path / "resume", bar_argv, world, repo_env, store.port)
    for rank, p in enumerate(procs):
        assert p.wait(timeout=300) == 0, (tmp_path / "resume" / f"err{rank}").read_text()[-3000:]
    log = (tmp_path / "resume" / "out0").read_text()
    assert f"resumed at step {killed_at} from {ckpt / f'step-{killed_at:08d}'}" in log
    bars = [(tmp_path / "resume" / f"err{rank}").read_text() for rank in range(world)]
    assert f"{steps}/{steps}" in bars[0] and "loss=" in bars[0] and "step/s" in bars[0]
    assert "step/s" not in bars[1] and "  loss " not in log  # no bar on rank 1, no lines
    assert checkpoint.latest_step(str(ckpt)) == steps and not partial.exists()
    ref_records, ref_params = _load(tmp_path, "ref")
    records, params = _load(tmp_path, "resumed")
    # The killed run's lines up to its checkpoint, then the resumed run's: each step once.
    assert [r["step"] for r in records] == list(range(steps))
    np.testing.assert_allclose(
        [r["loss"] for r in records], [r["loss"] for r in ref_records], rtol=1e-6
    )
    for r in records:  # no per-rank arrays unless --metrics-per-rank
        assert all(set(p) >= PHASE_SCHEMA and "loads_before" not in p for p in r["phases"].values())
    assert params.keys() == ref_params.keys()
    for name, p in ref_params.items():
        assert p.dtype == torch.float64
        torch.testing.assert_close(params[name], p, rtol=1e-6, atol=1e-6, msg=name)


def test_latest_checkpoint_is_the_newest_complete_one(tmp_path):
    assert checkpoint.latest_step(str(tmp_path / "none")) is None
    for name in ("step-00000002", "step-00000004", "step-00000010.partial", "step-7"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-00000012").write_text("a file, not a checkpoint")
    assert checkpoint.latest_step(str(tmp_path)) == 4
    assert checkpoint.step_dir("d", 4) == os.path.join("d", "step-00000004")


def _record(step: int, world: int, rng: np.random.Generator) -> dict:
    phases = {
        name: {
            "imbalance_before": float(rng.uniform(1, 2)), "imbalance_after": 1.0,
            "bytes_intra": 10.0, "bytes_inter": 0.0, "plan_ms": 1.0,
            "loads_before": rng.uniform(size=world).tolist(), "loads_after": [1.0] * world,
        } for name in PHASES
    }  # fmt: skip
    return {"step": step, "loss": 1.0 / (step + 1), "step_time_s": 0.1 + step % 2,
            "balance": "full", "placement": "none", "world_size": world, "ranks_per_node": 2,
            "phases": {n: phase_record(p, per_rank=False) for n, p in phases.items()}}  # fmt: skip


def test_running_summary_memory_does_not_grow_with_steps(rng):
    """The loop keeps only running aggregates: the summary of 2000 steps on 1024 ranks
    takes about the bytes of the summary of 2 steps (the records went to the metrics file)."""
    small, big = RunningSummary(), RunningSummary()
    for step in range(2):
        small.add(_record(step, 1024, rng))
    records = [_record(step, 1024, rng) for step in range(2000)]
    for r in records:
        big.add(r)
    assert len(pickle.dumps(big)) < len(pickle.dumps(small)) + 16  # wider ints, nothing more
    assert big.steps == 2000 and big.last_loss == records[-1]["loss"]
    assert big.sums["llm"]["imbalance_before"] == pytest.approx(
        sum(r["phases"]["llm"]["imbalance_before"] for r in records)
    )
    assert "mean step 600.3 ms (after the first)" in big.table()  # steps 1..1999: 1.1 or 0.1
    assert all("loads_before" not in p and p["load_max_after"] == 1.0
               for p in records[0]["phases"].values())  # fmt: skip
