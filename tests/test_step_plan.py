"""The pure step planner: determinism, conservation, composition, balance, bad input."""

import dataclasses

import numpy as np
import pytest

from orchmllm.data import AUDIO, IMAGE, TEXT, EncodingRates, Rate, SyntheticConfig
from orchmllm.data.synthetic import iter_examples
from orchmllm.dist.orchestrator import LocalBatch
from orchmllm.planner import segments, step_options, step_plan
from orchmllm.planner.assembly import assembly
from orchmllm.planner.cost import CostModel
from orchmllm.planner.policies import default_cost
from orchmllm.planner.segments import local_metadata
from orchmllm.planner.step_options import MODES, StepOptions, default_phases
from orchmllm.planner.step_plan import plan_step
from orchmllm.schema import IGNORE_INDEX
from tests.payloads import (
    PHASES,
    WIDTH,
    expected_sequence,
    gathered,
    payload_batches,
    payload_example,
)


@pytest.mark.parametrize("mode", MODES)
def test_plan_is_pure_and_conserves_everything(mode):
    world = 4
    batches = payload_batches(world)
    rows, src = gathered(batches)
    plan = plan_step(rows, src, StepOptions(PHASES, mode=mode), num_ranks=world)
    again = plan_step(rows.copy(), src.copy(), StepOptions(PHASES, mode=mode), num_ranks=world)
    assert plan.same_as(again) and plan.llm.fingerprint() == again.llm.fingerprint()
    n_ex = sum(len(b) for b in batches)
    seen = []
    for r in range(world):
        lay = assembly(plan, r)
        seen += lay.examples.tolist()
        # The LLM input is a permutation of every received row (text + encoder outputs).
        assert np.array_equal(np.sort(lay.index), np.arange(sum(lay.rows.values())))
        assert lay.lengths.sum() == lay.index.size
    assert sorted(seen) == list(range(n_ex))
    exs = [ex for b in batches for ex in b]
    assert plan.seq_len.tolist() == [len(expected_sequence(ex)[0]) for ex in exs]
    assert plan.num_targets == sum((expected_sequence(ex)[1] != IGNORE_INDEX).sum() for ex in exs)
    for name, pp in plan.phases.items():
        # Composition: outputs leave from the encoder layout to their example's LLM rank.
        assert np.array_equal(pp.to_llm.src_rank, pp.encoder.dst_rank)
        assert np.array_equal(pp.to_llm.src_slot, pp.encoder.dst_slot)
        assert np.array_equal(pp.to_llm.dst_rank, plan.llm.dst_rank[pp.example])
        if mode != "full":
            assert np.array_equal(pp.encoder.dst_rank, pp.encoder.src_rank), name
        assert plan.stats()[name]["imbalance_after"] <= plan.stats()[name]["imbalance_before"]
    if mode == "none":
        assert np.array_equal(plan.llm.dst_rank, plan.llm.src_rank)


@pytest.mark.parametrize("placement", ["none", "auto"])
def test_phases_planned_in_threads_give_the_same_plan(monkeypatch, placement):
    """Large steps plan their phases side by side in threads; the plan is the one the
    sequential path computes (here forced both ways on one step)."""
    world = 8
    rows, src = gathered(payload_batches(world))
    options = StepOptions(PHASES, placement=placement, ranks_per_node=2)
    monkeypatch.setattr(step_plan, "PARALLEL_MIN_SEGMENTS", 0)
    threaded = plan_step(rows, src, options, num_ranks=world)
    monkeypatch.setattr(step_plan, "PARALLEL_MIN_SEGMENTS", rows.shape[0] + 1)
    sequential = plan_step(rows, src, options, num_ranks=world)
    assert threaded.same_as(sequential)
    for name, stats in threaded.stats().items():
        timings = {k for k in stats if k.endswith("_ms")}
        same = {k: v for k, v in stats.items() if k not in timings}
        assert same == {k: v for k, v in sequential.stats()[name].items() if k not in timings}


def test_full_mode_balances_synthetic_phases():
    rates = EncodingRates({"vision": Rate(downsample=4), "audio": Rate(stride=2, downsample=2)})
    cfg = SyntheticConfig(num_examples=64, seed=2, scale=0.1)
    exs = list(iter_examples(cfg, rates))
    phases = default_phases(rates, feature_dims=cfg.widths)
    rows, src = gathered([exs[i : i + 8] for i in range(0, 64, 8)])
    stats = plan_step(rows, src, StepOptions(phases, mode="full"), num_ranks=8).stats()
    for name in ("vision", "audio", "llm"):
        s = stats[name]
        assert s["imbalance_after"] < s["imbalance_before"], (name, s)
        assert np.isclose(sum(s["loads_before"]), sum(s["loads_after"])) or name == "audio"
    assert stats["vision"]["imbalance_after"] < 1.15 and stats["llm"]["imbalance_after"] < 1.25


def test_balanced_sampling_moves_nothing():
    # Two ranks holding mirror-image batches are already balanced in every phase: a plan that
    # is not strictly better than staying put is dropped, so nothing moves.
    segs = [[[TEXT, 3], [IMAGE, 8]], [[TEXT, 5], [AUDIO, 16], [TEXT, 2]], [[TEXT, 9]]]
    batch = [payload_example(i, s) for i, s in enumerate(segs)]
    rows, src = gathered([batch, batch])
    plan = plan_step(rows, src, StepOptions(PHASES, mode="full"), num_ranks=2)
    for move in [plan.llm] + [p.encoder for p in plan.phases.values()]:
        assert np.array_equal(move.src_rank, move.dst_rank)
    for s in plan.stats().values():
        assert s["imbalance_after"] == s["imbalance_before"] == 1.0


def test_bad_input_raises():
    batches = payload_batches(2)
    rows, src = gathered(batches)
    with pytest.raises(ValueError, match="mode"):
        plan_step(rows, src, StepOptions(PHASES, mode="some"), num_ranks=2)
    with pytest.raises(ValueError, match="no phase"):
        plan_step(rows, src, StepOptions(PHASES[:1]), num_ranks=2)
    with pytest.raises(ValueError, match="src"):
        plan_step(rows, src[:-1], StepOptions(PHASES), num_ranks=2)
    shuffled = rows.copy()
    shuffled[[0, -1]] = shuffled[[-1, 0]]
    with pytest.raises(ValueError, match="examples"):
        plan_step(shuffled, src, StepOptions(PHASES), num_ranks=2)
    with pytest.raises(ValueError, match="loss_mask"):
        local_metadata([{**batches[0][0], "loss_mask": [0]}])
    two = np.asarray(batches[0][0]["loss_mask"]).copy()
    two[-1] = 2
    with pytest.raises(ValueError, match=r"examples\[0\] loss_mask must hold 0 or 1, got 2"):
        local_metadata([{**batches[0][0], "loss_mask": two}])
    short = {**batches[0][0], "input_ids": np.asarray(batches[0][0]["input_ids"])[:-1]}
    with pytest.raises(ValueError, match=r"examples\[0\] input_ids has"):
        LocalBatch.from_examples([short], PHASES)
    with pytest.raises(ValueError, match="placement must be one of .* got 'nodes'"):
        StepOptions(PHASES, placement="nodes")
    with pytest.raises(ValueError, match="llm_policy must be one of .* got 'fast'"):
        StepOptions(PHASES, llm_policy="fast")
    with pytest.raises(ValueError, match="policy must be one of .* got 'fast'"):
        dataclasses.replace(PHASES[0], policy="fast")
    with pytest.raises(ValueError, match="divisor must be an integer >= 1, got True"):
        dataclasses.replace(PHASES[0], divisor=True)
    bad = {**batches[0][0], "image_patches": [np.zeros((3, WIDTH), np.float32)]}
    with pytest.raises(ValueError, match="image_patches"):
        LocalBatch.from_examples([bad], PHASES)


def test_items_that_state_their_tokens_are_planned_by_them():
    """``[kind, count, tokens]``: a Hugging Face item (tiles, a clip, packed image features)
    whose LLM tokens are not its raw rows over the divisor plans and assembles by its stated
    count; rows without the tokens column (four columns) still plan as before."""
    segs = [[[TEXT, 3], [IMAGE, 8, 5], [TEXT, 2]], [[TEXT, 4], [IMAGE, 6], [AUDIO, 16, 3]]]
    batch = [payload_example(i, [s[:2] for s in e]) for i, e in enumerate(segs)]
    for ex, e in zip(batch, segs, strict=True):
        ex["segments"] = e
    rows = local_metadata(batch)
    assert rows.shape == (6, 5) and rows[:, segments.TOKENS].tolist() == [-1, 5, -1, -1, -1, 3]
    src = np.zeros(len(rows), np.int64)
    plan = plan_step(rows, src, StepOptions(PHASES), num_ranks=1)
    assert plan.seq_len.tolist() == [3 + 5 + 2, 4 + 6 // 2 + 3]
    assert plan.phases["vision"].encoded.tolist() == [5, 3]
    assert plan.phases["audio"].encoded.tolist() == [3]
    assert assembly(plan, 0).rows == {"text": 9, "vision": 8, "audio": 3}
    four = plan_step(rows[:, :4], src, StepOptions(PHASES), num_ranks=1)
    assert four.seq_len.tolist() == [3 + 8 // 2 + 2, 4 + 6 // 2 + 16 // 4]
    with pytest.raises(ValueError, match=r"rows must be \(n, 4\) or \(n, 5\)"):
        plan_step(rows[:, :3], src, StepOptions(PHASES), num_ranks=1)
    for bad in ([TEXT, 3, 3], [IMAGE, 8, 0], [IMAGE, 8, 1, 1]):
        with pytest.raises(ValueError, match="segments"):
            local_metadata([{**batch[0], "segments": [bad]}])


def test_item_records_are_declared_checked_and_optional():
    """A phase's ``fields`` declare the per-item record its items carry (LocalBatch.item_meta);
    a record of another shape or a missing one is refused, naming the example and field; an
    example without items needs neither the record nor the modality's field."""
    grid = step_options.ItemField("grid", width=3)
    phases = (dataclasses.replace(PHASES[0], fields=(grid,)), PHASES[1])
    ex = payload_example(0, [[TEXT, 2], [IMAGE, 4], [TEXT, 1], [IMAGE, 2]])
    text_only = payload_example(1, [[TEXT, 3]])
    del text_only["image_patches"], text_only["audio_mels"]
    ex["item_meta"] = {"vision": {"grid": [[1, 2, 2], [1, 1, 2]]}}
    batch = LocalBatch.from_examples([text_only, ex], phases)
    assert batch.item_meta["vision"]["grid"].tolist() == [[1, 2, 2], [1, 1, 2]]
    assert batch.raw["audio"].shape == (0, WIDTH) and "audio" not in batch.item_meta
    with pytest.raises(ValueError, match=r"examples\[0\] item_meta\['vision'\]\['grid'\] has"):
        LocalBatch.from_examples([{**ex, "item_meta": {"vision": {"grid": [[1, 2]]}}}], phases)
    with pytest.raises(ValueError, match=r"examples\[0\] has 2 vision items but no item_meta"):
        LocalBatch.from_examples([{**ex, "item_meta": {}}], phases)
    with pytest.raises(ValueError, match="dtype must be one of"):
        step_options.ItemField("grid", dtype="float32")
    with pytest.raises(ValueError, match="distinct names"):
        dataclasses.replace(PHASES[0], fields=(grid, grid))


@pytest.mark.parametrize("costs", ["default", "own_kind", "other_kind"])
def test_phase_loads_are_the_phase_cost_of_the_plan(costs):
    """Each phase's ``loads_before``/``loads_after`` are its cost model's loads of the sampled
    and the planned layout, whether the policy optimised that model (the default or one of its
    kind) or balanced its own default (a model of the other kind)."""
    world = 8
    rows, src = gathered(payload_batches(world))
    packed, padded = CostModel("packed", alpha=2.0, beta=0.01), CostModel("padded", beta=0.5)
    own = {"greedy": packed, "binary_search": padded}
    other = {"greedy": padded, "binary_search": packed}
    pick = {"default": {}, "own_kind": own, "other_kind": other}[costs]
    phases = tuple(dataclasses.replace(p, cost=pick.get(p.policy)) for p in PHASES)
    options = StepOptions(phases, llm_cost=pick.get("greedy"))
    plan = plan_step(rows, src, options, num_ranks=world)
    stats = plan.stats()
    llm_model = options.llm_cost or default_cost("greedy")
    moves = {"llm": (plan.seq_len, plan.llm, llm_model)}
    for p in phases:
        pp = plan.phases[p.name]
        moves[p.name] = (pp.raw // p.stride, pp.encoder, p.cost or default_cost(p.policy))
    for name, (lengths, move, model) in moves.items():
        before = model.loads(lengths, move.src_rank, world)
        after = model.loads(lengths, move.dst_rank, world)
        assert stats[name]["loads_before"] == before.tolist(), name
        assert stats[name]["loads_after"] == after.tolist(), name
        assert max(stats[name]["loads_after"]) <= max(stats[name]["loads_before"]), name
