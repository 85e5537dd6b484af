"""Context parallelism on the simulator: the pieces' layout, compute, traffic and memory, issue
40's long-item mix, and the benchmark's quick path."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from benchmarks.context_parallel_sim import main as bench_main
from orchmllm.data.workload_facts import fact
from orchmllm.planner.balance import balance
from orchmllm.planner.context_parallel import Pieces
from orchmllm.schema import LLM
from orchmllm.sim import comm
from orchmllm.sim import context_parallel as cp
from orchmllm.sim.batch import Batch
from orchmllm.sim.layout import Layout
from orchmllm.sim.step import simulate_step
from orchmllm.sim.sweep import (
    load_model,
    long_item_mix,
    memory_budget_ms,
    sample_pool,
    with_workload,
)

D, RPN = 16, 8


@pytest.fixture(scope="module")
def model():
    return long_item_mix(load_model("mllm-10b"))


@pytest.fixture(scope="module")
def batch(model):
    b = sample_pool(model, D, 6, 3)
    assert b.llm_lengths(model.config).max() > 32768  # the pool holds long items
    return b


def _layout(model, batch, c: cp.ContextParallel) -> Layout:
    return cp.layout_of(
        batch, "full", c, config=model.config, modules=model.modules, placement="none",
        ranks_per_node=RPN,
    )  # fmt: skip


def _step(model, batch, layout):
    return simulate_step(
        batch, layout, "full", config=model.config, modules=model.modules, recipe=model.recipe
    )


def _covers(pieces: Pieces, lengths: np.ndarray) -> None:
    """Every split item's ranges, by start, tile [0, length) exactly."""
    for i in pieces.items:
        p = pieces.of(i)
        order = np.argsort(p.start)
        start, end = p.start[order], p.end[order]
        assert start[0] == 0 and end[-1] == lengths[i]
        assert np.array_equal(start[1:], end[:-1])
        assert np.all(end > start)


@pytest.mark.parametrize(
    "how", [cp.ContextParallel(8), cp.ContextParallel(8, fixed=True)], ids=["planned", "fixed"]
)
def test_pieces_conserve_tokens(model, batch, how):
    layout = _layout(model, batch, how)
    lengths = batch.llm_lengths(model.config)
    p = layout.pieces
    assert p.items.size > 0
    _covers(p, lengths)
    # a split example's home (where the dispatch takes it) holds its first token
    first = p.start == 0
    assert np.array_equal(layout.example[p.item[first]], p.rank[first])
    seq, at = cp.llm_sequences(lengths, layout, D)
    assert seq.sum() == lengths.sum()
    table = cp.piece_table(p, lengths, D, RPN)
    assert np.bincount(table.item, weights=table.tokens).sum() == lengths[p.items].sum()
    # the group's pieces stay inside one node (group 8 = a node)
    assert not table.spans_nodes.any()
    if how.fixed:  # every example over min(N, L) ranks of its group
        assert np.array_equal(np.bincount(table.item), np.minimum(8, lengths))


def test_pieces_compute_is_the_planners_load(model, batch):
    """By construction: every rank's simulated LLM compute is the plan's load of it."""
    lengths = batch.llm_lengths(model.config)
    cost = model.modules[LLM].cost
    a = balance(
        lengths, D, "greedy", src=batch.example_src, cost=cost, ranks_per_node=RPN,
        context_parallel=8,
    )  # fmt: skip
    assert a.pieces.items.size > 0
    dst = np.asarray(a.dst).copy()
    first = a.pieces.start == 0
    dst[a.pieces.item[first]] = a.pieces.rank[first]
    layout = Layout(dst, {}, 0.0, a.pieces)
    table = cp.piece_table(a.pieces, lengths, D, RPN)
    ours = cp.llm_rank_ms(model.modules[LLM], lengths, layout, table, D)
    np.testing.assert_allclose(ours, a.loads, rtol=1e-9)
    # the pieces of an example sum to its cost: splitting moves work, it adds none
    bare = dataclasses.replace(cost, const=0.0)
    total = bare.loads(lengths, np.zeros_like(lengths), 1)[0]
    assert ours.sum() - D * cost.const == pytest.approx(total, rel=1e-9)


def test_fixed_pieces_follow_the_chunking():
    p = cp.fixed_pieces(np.array([20, 3, 1]), np.array([8, 0, 4]), 4)
    _covers(p, np.array([20, 3, 1]))
    one = p.of(0)  # 8 chunks of 2..3 tokens: rank 8 holds chunks 0 and 7, rank 11 chunks 3-4
    assert set(one.rank.tolist()) == {8, 9, 10, 11}
    assert one.rank[one.start == 0][0] == 8 and one.rank[one.end == 20][0] == 8
    assert np.sum(one.rank == 11) == 1
    assert set(p.of(1).rank.tolist()) == {0, 1, 2} and p.of(2).rank.tolist() == [4]


def test_traffic_is_zero_without_a_split_and_grows_with_the_pieces(model):
    cfg, m, net = model.config, model.modules[LLM], comm.Network()
    L = np.array([65536])
    empty = cp.piece_table(Pieces.empty(), L, D, RPN)
    assert not cp.kv_seconds(empty, cfg, model.recipe, m, net, D).any()
    short = Batch(D, np.full(D, 100), {})
    none = _step(model, short, _layout(model, short, cp.ContextParallel(8)))
    assert none.context_parallel_s == 0.0 and "pieces" not in none.dispatchers
    kv, scattered = [], []
    for k in (2, 4, 8):
        table = cp.piece_table(cp.fixed_pieces(L, np.array([0]), k), L, D, RPN)
        kv.append(cp.kv_seconds(table, cfg, model.recipe, m, net, D).sum())
        vol = cp.scatter_volumes(table, np.array([0]), cfg, model.recipe, num_ranks=D,
                                 ranks_per_node=RPN)  # fmt: skip
        scattered.append(vol.sent_intra.sum())
        # the home keeps its own piece's rows and sends the others'
        row = cfg.llm.hidden * 2
        assert vol.kept.sum() + vol.sent_intra.sum() == L[0] * row
    assert kv[0] < kv[1] < kv[2] and scattered[0] < scattered[1] < scattered[2]
    # across nodes the same bytes take the network
    far = cp.piece_table(
        Pieces(np.zeros(2, np.int64), np.array([0, 8]), np.array([0, 100]), np.array([100, 200])),
        np.array([200]), D, RPN,
    )  # fmt: skip
    near = cp.piece_table(
        Pieces(np.zeros(2, np.int64), np.array([0, 1]), np.array([0, 100]), np.array([100, 200])),
        np.array([200]), D, RPN,
    )  # fmt: skip
    assert far.spans_nodes.all() and far.block_size[0] == 16 and near.block_size[0] == 2
    slow = cp.kv_seconds(far, cfg, model.recipe, m, net, D).max()
    assert slow > cp.kv_seconds(near, cfg, model.recipe, m, net, D).max()


def test_a_piece_needs_less_memory_than_the_whole_item(model):
    """One 120k-token example among short ones: on one rank it does not fit; cut in 8 every
    rank's peak is far below it, the gathered keys and values included."""
    text = np.full(D, 200)
    text[5] = 120_000
    b = Batch(D, text, {})
    whole = _step(model, b, _layout(model, b, cp.ContextParallel()))
    split = _step(model, b, _layout(model, b, cp.ContextParallel(8, fixed=True)))
    assert split.items_split == D and split.pieces > D
    assert split.peak_memory_bytes < 0.5 * whole.peak_memory_bytes
    # the gathered K/V is in the split step's memory: more than its rows alone would hold
    table = cp.piece_table(
        _layout(model, b, cp.ContextParallel(8, fixed=True)).pieces, text, D, RPN
    )
    extra = cp.memory_terms(table, np.zeros(D, np.int64), model.config, model.recipe,
                            model.modules[LLM], D)  # fmt: skip
    assert extra["backward"].min() > 0


def test_the_long_item_mix_draws_the_recipes_documents_as_5_percent(model):
    """``long_item_mix`` is the config's mix plus the recipe's document task at
    ``document.share`` of the examples, the text cap raised to let them through."""
    docs = model.data.params("document")
    assert model.data.max_text_tokens >= docs.max_tokens
    weights = model.data.task_weights
    assert weights["document"] / sum(weights.values()) == pytest.approx(fact("document.share"))
    pool = sample_pool(model, 64, 32, 0)
    long = pool.text >= docs.min_tokens * model.data.scale
    assert 0.03 < long.mean() < 0.07
    assert pool.text.max() <= docs.max_tokens * model.data.scale + 20  # the prompt's tokens
    with pytest.raises(ValueError, match="long_text_share must be in"):
        with_workload(model, long_text_share=1.0)


def test_context_parallel_rejects_bad_settings():
    with pytest.raises(ValueError, match="size must be an integer >= 1"):
        cp.ContextParallel(0)
    with pytest.raises(ValueError, match="need size > 1"):
        cp.ContextParallel(1, fixed=True)
    with pytest.raises(ValueError, match="max_load_ms must be > 0"):
        cp.ContextParallel(8, max_load_ms=-1.0)
    with pytest.raises(ValueError, match="dividing num_ranks"):
        cp.fixed_layout(Batch(6, np.full(6, 10), {}), 4, config=None, modules={}, ranks_per_node=8)


def test_memory_budget_holds_the_capacity(model):
    cost = model.modules[LLM].cost
    budget = memory_budget_ms(model, 64)
    tokens = (budget / cost.multiplier - cost.const) / cost.alpha
    assert 32768 < tokens < 1 << 20


def test_benchmark_quick_path(tmp_path):
    out = tmp_path / "cp.json"
    bench_main(["--quick", "--json", str(out)])
    records = json.loads(out.read_text())
    names = {"none", "fixed 8", "planned 8", "planned 8, memory budget"}
    assert {r["strategy"] for r in records} == names
    assert {r["batch"] for r in records} == {"largest", "equal"}
    fields = {"step_time_s", "tokens_per_s_per_gpu", "mfu", "peak_memory_gb", "examples_per_rank",
              "fits", "context_parallel_ms", "items_split", "run_command"}  # fmt: skip
    for r in records:
        assert fields <= r.keys()
        if r["examples_per_rank"]:
            assert r["fits"] and r["peak_memory_gb"] <= r["memory_budget_gb"]
            assert (r["items_split"] > 0) == (r["strategy"] != "none")
    equal = {r["strategy"]: r for r in records if r["batch"] == "equal"}
    assert len({r["examples_per_rank"] for r in equal.values()}) == 1
    # at one mini-batch, splitting never needs more memory than keeping examples whole
    for name in names - {"none"}:
        assert equal[name]["peak_memory_gb"] <= equal["none"]["peak_memory_gb"]
