"""The cluster simulator: calibration, communication, memory and step aggregation."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from orchmllm.config import ModelConfig, load_config
from orchmllm.data.recipe import ItemLengths
from orchmllm.sim import comm
from orchmllm.sim.batch import Batch
from orchmllm.sim.compute import (
    BlockShape,
    block_fit,
    load_block_records,
    submodules,
)
from orchmllm.sim.emulated import EmulatedSetup, emulated_memory
from orchmllm.sim.layout import MODES, disttrain_reorder, llm_pieces, plan
from orchmllm.sim.step import dispatch_collectives, simulate_step

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPE = load_config(CONFIGS / "mllm-10b.yaml").recipe  # the GPU recipe


def _config(name: str) -> ModelConfig:
    return load_config(CONFIGS / f"{name}.yaml").model


@pytest.fixture(scope="module")
def mllm10b() -> tuple[ModelConfig, dict]:
    cfg = _config("mllm-10b")
    return cfg, submodules(cfg)


def _random_batch(rng: np.random.Generator, num_ranks: int, per_rank: int) -> Batch:
    """Heavy-tailed lengths: about 60% of examples hold an image, 30% a clip, some both."""
    n = num_ranks * per_rank
    has_img = rng.random(n) < 0.6
    has_aud = rng.random(n) < 0.3
    img_ex = np.flatnonzero(has_img)
    aud_ex = np.flatnonzero(has_aud)
    return Batch(
        num_ranks,
        text=np.minimum(rng.lognormal(5.0, 1.0, n).astype(np.int64) + 1, 4096),
        items={
            "vision": ItemLengths(img_ex, rng.integers(64, 1025, img_ex.size)),
            "audio": ItemLengths(
                aud_ex, (rng.uniform(1.0, 30.0, aud_ex.size) * 100).astype(np.int64) // 8 * 8
            ),
        },
    )


# -- calibration ---------------------------------------------------------------------------


def test_calibration_reproduces_measured_blocks_within_15_percent() -> None:
    for r in load_block_records():
        shape = BlockShape(r["hidden"], r["ffn"], r["heads"], r["kv_heads"], r["attention"])
        fit = block_fit(shape)
        assert fit.source == r["shape"]
        c = fit.cost
        if r["attention"] == "padded":  # the padded cost sees count and longest item only
            predicted = c.batch_cost([r["max_len"]] * r["n"])
        else:
            predicted = c.alpha * r["tokens"] + c.beta * r["sum_l2"] + c.const
        assert abs(predicted / r["ms"] - 1) < 0.15, (r["shape"], r["tokens"], predicted, r["ms"])


def test_calibrated_rates_are_physical() -> None:
    """Achieved rates sit below the H100 dense bf16 peak and above a tenth of it."""
    for r in load_block_records():
        fit = block_fit(
            BlockShape(r["hidden"], r["ffn"], r["heads"], r["kv_heads"], r["attention"])
        )
        assert 100e12 < fit.linear_rate < 989.4e12
        assert 100e12 < fit.attention_rate < 989.4e12


def test_unmeasured_shape_scales_with_flops() -> None:
    """Doubling the FFN of a measured shape raises alpha by its share of the weights."""
    base = block_fit(BlockShape(3584, 18944, 28, 4, "causal"))
    wider = block_fit(BlockShape(3584, 2 * 18944, 28, 4, "causal"))
    assert wider.source.startswith("scaled from")
    ratio = wider.shape.weights / base.shape.weights
    assert wider.cost.alpha == pytest.approx(base.cost.alpha * ratio)
    assert wider.cost.beta == pytest.approx(base.cost.beta)


def test_module_parameters_match_table1(mllm10b) -> None:
    _, mods = mllm10b
    billions = {k: m.parameters / 1e9 for k, m in mods.items()}
    assert billions["vision"] == pytest.approx(2.0, rel=0.15)
    assert billions["audio"] == pytest.approx(0.6, rel=0.1)
    assert billions["llm"] == pytest.approx(7.0, rel=0.1)


def test_frozen_module_costs_a_third() -> None:
    cfg = _config("mllm-10b")
    vision = dataclasses.replace(cfg.encoders["vision"], frozen=True)
    frozen = dataclasses.replace(cfg, encoders={**cfg.encoders, "vision": vision})
    a = submodules(cfg, checkpointing=False)["vision"]
    b = submodules(frozen)["vision"]  # nothing to recompute without a backward
    lengths = np.array([256, 1024, 700])
    dst = np.array([0, 0, 1])
    np.testing.assert_allclose(b.times_ms(lengths, dst, 2), a.times_ms(lengths, dst, 2) / 3)
    assert b.useful_flops(lengths) == pytest.approx(a.useful_flops(lengths) / 3)


def test_checkpointing_charges_one_extra_forward_of_the_blocks(mllm10b) -> None:
    """Recompute adds a forward (a third of forward+backward) to every block, not to the LM
    head, and adds no useful FLOPs (MFU counts the model's FLOPs once)."""
    cfg, mods = mllm10b
    plain = submodules(cfg, checkpointing=False)
    for phase in ("vision", "audio"):
        assert mods[phase].cost.alpha == pytest.approx(plain[phase].cost.alpha * 4 / 3)
        assert mods[phase].cost.beta == pytest.approx(plain[phase].cost.beta * 4 / 3)
    llm, base = mods["llm"], plain["llm"]
    head_ms = base.cost.alpha - base.layers * base.block.cost.alpha
    assert head_ms > 0
    assert llm.cost.alpha == pytest.approx(base.layers * base.block.cost.alpha * 4 / 3 + head_ms)
    lengths = np.array([300, 2000])
    assert llm.useful_flops(lengths) == base.useful_flops(lengths)


# -- communication -------------------------------------------------------------------------


def test_comm_volumes_conserve_bytes(rng) -> None:
    d, c = 32, 8
    n = 500
    src, dst = rng.integers(0, d, n), rng.integers(0, d, n)
    nbytes = rng.integers(0, 10_000, n).astype(np.float64)
    v = comm.volumes(src, dst, nbytes, num_ranks=d, ranks_per_node=c)
    assert v.sent_intra.sum() + v.sent_inter.sum() + v.kept.sum() == pytest.approx(nbytes.sum())
    assert v.sent_inter.sum() == pytest.approx(v.recv_inter.sum())
    assert v.sent_intra.sum() == pytest.approx(v.recv_intra.sum())
    origin = np.bincount(src, weights=nbytes, minlength=d)
    np.testing.assert_allclose(v.sent_intra + v.sent_inter + v.kept, origin)
    arrive = np.bincount(dst, weights=nbytes, minlength=d)
    np.testing.assert_allclose(v.recv_intra + v.recv_inter + v.kept, arrive)
    inter = (src // c) != (dst // c)
    assert v.inter_total == pytest.approx(nbytes[inter].sum())


def test_all_to_all_time_is_the_busiest_rank() -> None:
    net = comm.Network(ranks_per_node=2, bw_intra=100.0, bw_inter=10.0, peer_latency_s=0.0)
    # rank 0 -> 2 (inter, 50 B) and rank 1 -> 0 (intra, 300 B): 5 s vs 3 s.
    v = comm.volumes(
        np.array([0, 1]), np.array([2, 0]), np.array([50.0, 300.0]), num_ranks=4, ranks_per_node=2
    )
    assert comm.all_to_all_seconds(v, net) == pytest.approx(5.0)
    assert comm.all_to_all_seconds(v, comm.Network(2, 100.0, 10.0, 1e-3)) == pytest.approx(5.003)


def test_all_gather_time_is_every_rank_padded_to_the_largest() -> None:
    """Each rank receives num_ranks - 1 buffers of the largest rank's size over the slowest
    link of the ring: the network beyond one node, NVLink within one."""
    net = comm.Network(ranks_per_node=2, bw_intra=100.0, bw_inter=10.0, peer_latency_s=0.0)
    held = np.array([50.0, 0.0, 20.0, 10.0])
    assert comm.all_gather_seconds(held, net) == pytest.approx(3 * 50.0 / 10.0)
    assert comm.all_gather_seconds(held[:2], net) == pytest.approx(50.0 / 100.0)
    assert comm.all_gather_seconds(held[:1], net) == 0.0
    v = comm.volumes(
        np.array([0, 0, 2]), np.array([0, 3, 2]), np.array([5.0, 7.0, 11.0]), num_ranks=4,
        ranks_per_node=2,
    )  # fmt: skip
    np.testing.assert_array_equal(v.held, [12.0, 0.0, 11.0, 0.0])  # kept bytes count too


def test_all_gather_communicator_costs_time_and_memory() -> None:
    """The same batch and plan: the all-gather communicator's dispatch takes longer and its
    gathered receive buffers raise the peak at 128 ranks (they hold the global batch); the
    compute is the same; an unknown communicator is refused."""
    from orchmllm.sim.step import Cluster
    from orchmllm.sim.sweep import load_model, run_case

    model = load_model("mllm-10b")
    runs = {
        c: run_case(
            model,
            128,
            "full",
            examples_per_rank=75,
            placement="node",
            cluster=Cluster(communicator=c),
        )  # fmt: skip
        for c in ("all_to_all", "all_gather")
    }
    a2a, gather = runs["all_to_all"], runs["all_gather"]
    assert gather["dispatch_fwd_ms"] > 10 * a2a["dispatch_fwd_ms"]
    assert gather["peak_memory_gb"] > a2a["peak_memory_gb"] + 1.0
    assert gather["compute_llm_s"] == a2a["compute_llm_s"]
    with pytest.raises(ValueError, match="communicator"):
        Cluster(communicator="broadcast")


def test_comm_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="dst"):
        comm.volumes(np.array([0]), np.array([4]), np.array([1.0]), num_ranks=4, ranks_per_node=2)
    with pytest.raises(ValueError, match="bw_inter"):
        comm.Network(bw_inter=0.0)


def test_dispatch_moves_every_llm_byte_once(rng, mllm10b) -> None:
    cfg, mods = mllm10b
    batch = _random_batch(rng, 16, 12)
    for mode in ("llm", "full"):
        layout = plan(batch, mode, config=cfg, modules=mods)
        fwd, bwd = dispatch_collectives(batch, layout, mode, cfg, 8)
        pieces = llm_pieces(batch, cfg, layout)
        llm = [v for name, v in fwd if name == "llm"]
        moved = sum(v.sent_intra.sum() + v.sent_inter.sum() + v.kept.sum() for v in llm)
        assert moved == pytest.approx(pieces.bytes.sum())
        # every encoded byte's gradient comes back
        back = sum(v.recv_intra.sum() + v.recv_inter.sum() + v.kept.sum() for _, v in bwd)
        assert back == pytest.approx(pieces.bytes[pieces.phase != "llm"].sum())
        if mode == "full":
            raw = dict(fwd[:2])
            assert raw["vision"].kept.sum() + raw["vision"].sent_inter.sum() + raw[
                "vision"
            ].sent_intra.sum() == pytest.approx(batch.of("vision").raw.sum() * 2 * 588)


# -- layouts and steps ---------------------------------------------------------------------


def test_layouts_keep_every_item(rng, mllm10b) -> None:
    cfg, mods = mllm10b
    batch = _random_batch(rng, 16, 10)
    for mode in MODES:
        layout = plan(batch, mode, config=cfg, modules=mods)
        assert layout.example.shape == batch.text.shape
        assert set(layout.items) == {"vision", "audio"}
        for name, dst in layout.items.items():
            assert dst.shape == batch.of(name).raw.shape
        for dst in (layout.example, *layout.items.values()):
            assert dst.min(initial=0) >= 0 and dst.max(initial=0) < 16


def test_disttrain_reorder_is_literal_ascending_greedy() -> None:
    # ascending: 1 -> g0, 2 -> g1, 3 -> g0 (load 1), 4 -> g1 (load 2), 10 -> g0 (load 4)
    dst = disttrain_reorder(np.array([10, 4, 3, 2, 1]), 2)
    assert dst.tolist() == [0, 1, 0, 1, 0]
    # zero-size samples spread by count instead of piling onto group 0
    assert np.bincount(disttrain_reorder(np.zeros(8, np.int64), 4)).tolist() == [2, 2, 2, 2]


def test_equal_lengths_give_the_same_step_in_every_mode(mllm10b) -> None:
    cfg, mods = mllm10b
    batch = Batch.uniform(16, 6, text=200, raw={"vision": 576, "audio": 1200})
    results = {}
    for mode in MODES:
        layout = plan(batch, mode, config=cfg, modules=mods, placement="node")
        results[mode] = simulate_step(batch, layout, mode, config=cfg, modules=mods, recipe=RECIPE)
        assert results[mode].dispatch_fwd_s == 0.0  # a plan no better than staying moves nothing
    base = results["none"]
    for mode, r in results.items():
        assert r.compute_s == pytest.approx(base.compute_s), mode
        assert r.step_time_s == pytest.approx(base.step_time_s), mode
        assert r.peak_memory_bytes == pytest.approx(base.peak_memory_bytes), mode
        assert r.imbalance("llm") == pytest.approx(1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_balancing_never_slows_the_step(seed, mllm10b) -> None:
    """OrchMLLM's modes (llm, full) at a mini-batch big enough to hide FSDP traffic."""
    cfg, mods = mllm10b
    batch = _random_batch(np.random.default_rng(seed), 32, 40)
    none = simulate_step(
        batch, plan(batch, "none", config=cfg, modules=mods), "none", config=cfg, modules=mods,
        recipe=RECIPE,
    )  # fmt: skip
    for mode in ("llm", "full"):
        for placement in ("none", "node"):
            layout = plan(batch, mode, config=cfg, modules=mods, placement=placement)
            r = simulate_step(batch, layout, mode, config=cfg, modules=mods, recipe=RECIPE)
            assert r.step_time_s < none.step_time_s, (mode, placement)
            assert r.mfu > none.mfu, (mode, placement)
            balanced = ("vision", "audio", "llm") if mode == "full" else ("llm",)
            for phase in balanced:
                assert r.compute_s[phase] <= none.compute_s[phase] * (1 + 1e-9), (mode, phase)
                assert r.imbalance(phase) < none.imbalance(phase), (mode, phase)
            assert r.peak_memory_bytes < none.peak_memory_bytes


def test_step_waits_for_the_slowest_rank(mllm10b) -> None:
    cfg, mods = mllm10b
    # rank 0: one long example, rank 1: one short one; nothing to overlap with FSDP traffic
    batch = Batch(
        2,
        text=np.array([4000, 100]),
        items={},
    )
    layout = plan(batch, "none", config=cfg, modules=mods)
    r = simulate_step(batch, layout, "none", config=cfg, modules=mods, recipe=RECIPE)
    t = mods["llm"].times_ms(batch.llm_lengths(cfg), layout.example, 2) * 1e-3
    assert r.compute_s["llm"] == pytest.approx(t.max())
    assert r.mean_compute_s["llm"] == pytest.approx(t.mean())
    assert r.step_time_s == pytest.approx(
        sum(max(r.compute_s[p], r.fsdp_s[p]) for p in r.compute_s)
    )


def test_emulated_setup_predicts_gpu_steps_figures(rng) -> None:
    """The prediction gpu_step prints: per mode step >= ideal, speed-ups are step-time ratios,
    and balancing every phase brings the step close to its ideal."""
    layers = {"vision": 9, "audio": 8, "llm": 7}
    setup = EmulatedSetup.load(CONFIGS / "mllm-10b.yaml", layers=layers, link_gbs=450.0)
    assert setup.ranks_per_node == 8 and setup.policies["audio"] == "binary_search"
    assert setup.model.config.llm.layers == 7 and setup.model.modules["llm"].layers == 7
    batches = [_random_batch(rng, 8, 30) for _ in range(2)]
    pred = setup.predict(batches)
    assert set(pred) == {"none", "llm", "full"}
    for mode, p in pred.items():
        assert p["step_time_s"] >= p["ideal_step_s"] > 0, mode
        assert p["step_over_ideal"] == pytest.approx(p["step_time_s"] / p["ideal_step_s"])
        assert p["speedup_vs_none"] == pytest.approx(pred["none"]["step_time_s"] / p["step_time_s"])
        assert 0 < p["peak_mem_bytes"] < emulated_memory("cuda").budget_bytes, mode
    assert pred["none"]["speedup_vs_none"] == 1.0
    assert pred["full"]["speedup_vs_none"] > 1.0
    assert pred["full"]["step_over_ideal"] < pred["none"]["step_over_ideal"]
    with pytest.raises(ValueError, match="layers"):
        EmulatedSetup.load(CONFIGS / "mllm-10b.yaml", layers={"llm": 7}, link_gbs=450.0)
    with pytest.raises(ValueError, match="link_gbs"):
        EmulatedSetup.load(CONFIGS / "tiny.yaml", layers=layers, link_gbs=0)


def test_largest_minibatch_is_the_boundary_whatever_the_start() -> None:
    """The searched mini-batch fits and one more example does not, from any starting guess;
    balancing fits at least as many examples as no balancing."""
    from orchmllm.sim.sweep import largest_minibatch, load_model, run_case, sample_pool

    model = load_model("mllm-84b")
    pools = {0: sample_pool(model, 32, 80, seed=1)}
    found = {}
    for mode in ("none", "full"):
        answers = {
            largest_minibatch(model, 32, mode, pools=pools, guess=g)[0] for g in (None, 1, 79)
        }
        assert len(answers) == 1, (mode, answers)
        b = found[mode] = answers.pop()
        assert 1 <= b < 79
        at = run_case(model, 32, mode, examples_per_rank=b, pools=pools)
        over = run_case(model, 32, mode, examples_per_rank=b + 1, pools=pools)
        assert not at["oom"] and over["oom"], (mode, b)
    assert found["full"] >= found["none"]


def test_batch_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="split evenly"):
        Batch(2, text=np.array([1, 2, 3]), items={})
    with pytest.raises(ValueError, match="text"):
        Batch(1, text=np.array([-1]), items={})
    with pytest.raises(ValueError, match="no modality named 'smell'"):
        Batch(1, text=np.array([1]), items={"smell": ItemLengths(np.array([0]), np.array([4]))})
    with pytest.raises(ValueError, match="vision item owners must index examples < 1"):
        Batch(1, text=np.array([1]), items={"vision": ItemLengths(np.array([1]), np.array([4]))})


# -- workload ------------------------------------------------------------------------------


def test_workload_batches_follow_the_config() -> None:
    from orchmllm.sim.sweep import load_model, sample_pool

    for name, side in (("mllm-10b", 448), ("mllm-84b", 896)):
        model = load_model(name)
        a = sample_pool(model, 8, 50, seed=3)
        b = sample_pool(model, 8, 50, seed=3)
        images, clips = a.of("vision").raw, a.of("audio").raw
        np.testing.assert_array_equal(a.text, b.text)
        np.testing.assert_array_equal(images, b.of("vision").raw)
        grid = -(-side // 14)
        assert 0 < images.max() <= grid * grid
        encoders = model.config.encoders
        assert (images % encoders["vision"].rate.divisor == 0).all()
        assert (clips % encoders["audio"].rate.divisor == 0).all()
        caps = [p.max_audio_s for p in model.data.tasks.values() if hasattr(p, "max_audio_s")]
        assert clips.max() <= max(caps) * 100
        assert a.text.min() >= 2 and a.text.max() <= model.data.max_text_tokens
        # about 0.55 images and 0.35 clips per example with the configs' task mix
        assert 0.4 < images.size / a.text.size < 0.75
        assert 0.2 < clips.size / a.text.size < 0.55
    nested = a.take(20)
    assert nested.examples_per_rank == 20
    assert nested.of("vision").raw.size <= a.of("vision").raw.size


def test_with_workload_scales_every_length_and_sets_the_audio_share() -> None:
    """Scale 2 doubles each drawn length of the same seed (up to the recipe's rounding and
    the text cap); an audio share moves weight between the image and the audio tasks only; bad
    values are refused."""
    from orchmllm.sim.sweep import audio_share, load_model, sample_pool, with_workload

    model = load_model("mllm-10b")
    assert with_workload(model) == model
    one, two = (sample_pool(with_workload(model, scale=s), 4, 200, seed=5) for s in (1.0, 2.0))
    for name in ("vision", "audio"):
        a, b = one.of(name).raw, two.of(name).raw
        np.testing.assert_array_equal(one.of(name).example, two.of(name).example)
        assert b.sum() / a.sum() == pytest.approx(2.0, rel=0.05)
    cap = model.data.max_text_tokens  # an example's text stays within the config's cap
    free = two.text < cap
    assert np.abs(two.text[free] - 2 * one.text[free]).max() <= 1
    assert (two.text[~free] == cap).all() and (one.text[~free] * 2 >= cap - 1).all()
    assert audio_share(model) == pytest.approx((0.25 + 0.10) / 0.90)
    mixed = with_workload(model, audio_share=0.7)
    assert audio_share(mixed) == pytest.approx(0.7)
    mix, base = mixed.data.task_weights, model.data.task_weights
    assert mix["chat"] == base["chat"] and sum(mix.values()) == pytest.approx(sum(base.values()))
    assert mix["caption"] / mix["vqa"] == pytest.approx(base["caption"] / base["vqa"])
    for bad in ({"scale": 0.0}, {"audio_share": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            with_workload(model, **bad)


def test_calibration_predicts_an_independent_measurement() -> None:
    """The llm-10b fit (Table 1 data) predicts the separately measured hidden-3584 blocks of
    h100_block_fwd_bwd.json (same shape, other batches) within 15%."""
    from importlib import resources

    rows = json.loads(
        resources.files("orchmllm.sim").joinpath("data/h100_block_fwd_bwd.json").read_text()
    )
    fit = block_fit(BlockShape(3584, 18944, 28, 4, "causal")).cost
    checked = 0
    for r in rows:
        if r["hidden"] == 3584:
            predicted = fit.alpha * r["tokens"] + fit.beta * r["sum_l2"] + fit.const
            assert abs(predicted / r["ms"] - 1) < 0.15, r
            checked += 1
    assert checked >= 10
