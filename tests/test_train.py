"""Training entry point: rebalancing never changes the training (consequence invariance).

Real gloo process groups, real FSDP2, the real orchestrator and synthetic HF dataset, driven
through ``orchmllm.train.main(argv)`` (the torchrun entry point) inside orchmllm.testing
workers; float64, so the only differences between modes are summation orders.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import yaml

from orchmllm.testing import run_distributed
from orchmllm.train import PHASES, forward_backward, load_config, main, parse_args, setup

TINY = "configs/tiny.yaml"
MODES = ("none", "llm", "full")
RTOL = 1e-5
SCHEMA = {"step", "loss", "step_time_s", "tokens_per_s", "balance", "world_size", "phases"}
PHASE_SCHEMA = {
    "imbalance_before", "imbalance_after", "loads_before", "loads_after", "bytes_intra",
    "bytes_inter", "plan_ms",
}  # fmt: skip


def _config(tmp_path, name: str, **data_overrides) -> str:
    with open(TINY) as f:
        raw = yaml.safe_load(f)
    raw["data"].update(data_overrides)
    path = os.path.join(tmp_path, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    return path


def _argv(config: str, tmp_path, mode: str, steps: int, *extra: str) -> list[str]:
    return [
        "--config", config, "--steps", str(steps), "--balance", mode, "--dtype", "float64",
        "--data-dir", os.path.join(tmp_path, "data"), "--quiet", *extra,
    ]  # fmt: skip


def _modes_worker(rank: int, world: int, config: str, tmp_path: str, steps: int, extra: tuple):
    """The same run in every balance mode, through main(); metrics and parameters to files."""
    torch.set_num_threads(1)  # several ranks share few cores; OMP spinning would stall gloo
    for mode in MODES:
        out = os.path.join(tmp_path, mode)
        main(
            _argv(config, tmp_path, mode, steps, *extra,
                  "--metrics", f"{out}.jsonl", "--save", f"{out}.pt")
        )  # fmt: skip


def _load(tmp_path, mode: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    path = os.path.join(tmp_path, mode)
    with open(f"{path}.jsonl") as f:
        records = [json.loads(line) for line in f]
    return records, torch.load(f"{path}.pt")


def _assert_same_training(tmp_path, world: int, steps: int) -> dict[str, list[dict]]:
    results = {mode: _load(tmp_path, mode) for mode in MODES}
    ref_records, ref_params = results["none"]
    for mode in ("llm", "full"):
        records, params = results[mode]
        np.testing.assert_allclose(
            [r["loss"] for r in records], [r["loss"] for r in ref_records], rtol=RTOL
        )
        assert params.keys() == ref_params.keys()
        for name, p in ref_params.items():
            torch.testing.assert_close(params[name], p, rtol=RTOL, atol=1e-9, msg=name)
    for mode, (records, _) in results.items():
        assert [r["step"] for r in records] == list(range(steps))
        for r in records:
            assert set(r) >= SCHEMA and r["world_size"] == world and r["balance"] == mode
            assert np.isfinite(r["loss"]) and r["step_time_s"] > 0 and r["tokens_per_s"] > 0
            for name in PHASES:
                p = r["phases"][name]
                assert set(p) >= PHASE_SCHEMA
                assert len(p["loads_before"]) == len(p["loads_after"]) == world
            for name in ("vision", "llm"):  # packed costs: moving items conserves the total
                p = r["phases"][name]
                assert sum(p["loads_after"]) == pytest.approx(sum(p["loads_before"]))
    full = results["full"][0]
    # Balancing did something, so the equalities above are not vacuous.
    before = np.mean([r["phases"]["llm"]["imbalance_before"] for r in full])
    after = np.mean([r["phases"]["llm"]["imbalance_after"] for r in full])
    assert after < before, (before, after)
    assert sum(r["phases"][p]["bytes_intra"] + r["phases"][p]["bytes_inter"]
               for r in full for p in PHASES) > 0  # fmt: skip
    for r in results["llm"][0]:  # llm mode leaves the encoder phases as sampled
        for p in ("vision", "audio"):
            assert r["phases"][p]["loads_after"] == r["phases"][p]["loads_before"]
    for r in results["none"][0]:
        for p in PHASES:
            assert r["phases"][p]["bytes_intra"] == r["phases"][p]["bytes_inter"] == 0
    return {mode: records for mode, (records, _) in results.items()}


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


def _grads_worker(rank: int, world: int, config: str, tmp_path: str, mode: str):
    """Loss and FSDP2-reduced gradients of step 0, as full tensors (rank 0)."""
    torch.set_num_threads(1)
    run = setup(parse_args(_argv(config, tmp_path, mode, 1)), timeout=90)
    with run.loader:
        loss, _ = forward_backward(run, next(iter(run.loader)))
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {n: p.grad.full_tensor() for n, p in run.model.named_parameters()}
    return (float(total), grads) if rank == 0 else None


def _sparse_then_grads_worker(rank, world, sparse, tmp_path, grads_config):
    _modes_worker(rank, world, sparse, tmp_path, 3, ("--seed", "2"))
    return _grads_worker(rank, world, grads_config, tmp_path, "full")


def test_two_ranks_idle_encoder_rank_and_global_gradient(tmp_path):
    """Two checks on 2 ranks, one launch.

    1. Two examples per rank, some text-only (seed 2 makes rank 0 hold no image and no audio in
       step 1 while rank 1 holds some): every rank still runs both encoders, nothing hangs,
       and the three modes still train identically.
    2. 2 ranks x B examples and 1 rank x 2B examples see the same global batch
       (distributed-sampler order), so the loss and the FSDP2-reduced gradients must equal
       the single-process ones: loss normalised by the global target count, gradients summed.
    """
    sparse = _config(
        tmp_path, "sparse", examples_per_rank=2, mix={"caption": 0.4, "asr": 0.3, "chat": 0.3}
    )
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


@pytest.mark.parametrize("name", ["tiny", "mllm-10b", "mllm-18b", "mllm-84b"])
def test_every_shipped_config_loads(name):
    cfg = load_config(f"configs/{name}.yaml")
    assert cfg.rates.divisor(1) == cfg.model.vision.downsample
    assert cfg.rates.divisor(2) == cfg.model.audio.conv_stride * cfg.model.audio.downsample
    assert cfg.balance.vision_policy == "greedy" and cfg.balance.audio_policy == "binary_search"


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(SystemExit):
        parse_args(["--config", TINY, "--balance", "everything"])
    with pytest.raises(SystemExit):
        parse_args(["--config", TINY, "--steps", "0"])
    with open(TINY) as f:
        raw = yaml.safe_load(f)
    raw["balance"]["placement"] = "telepathy"
    bad = os.path.join(tmp_path, "bad.yaml")
    with open(bad, "w") as f:
        yaml.safe_dump(raw, f)
    with pytest.raises(ValueError, match="placement"):
        load_config(bad)
    raw["balance"]["placement"] = "auto"
    raw["balance"]["audio_policy"] = "fastest"
    with open(bad, "w") as f:
        yaml.safe_dump(raw, f)
    with pytest.raises(ValueError, match="audio_policy"):
        load_config(bad)
