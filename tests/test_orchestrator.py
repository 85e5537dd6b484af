"""MLLM Global Orchestrator: real gloo execution (composition, agreement, gradients)."""

import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

from orchmllm.data import EncodingRates, Rate, SyntheticConfig
from orchmllm.data.synthetic import iter_examples
from orchmllm.dist.orchestrator import Encoded, LocalBatch, Orchestrator
from orchmllm.dist.topology import Topology
from orchmllm.planner.assembly import assembly
from orchmllm.planner.step_options import (
    MODES,
    EncoderPhase,
    ItemField,
    StepOptions,
    default_phases,
)
from orchmllm.schema import IMAGE, TEXT, Modality, register_modality
from orchmllm.testing import run_distributed
from tests.payloads import PHASES, WIDTH, expected_sequence, payload_batches, payload_embed

pytestmark = pytest.mark.integration  # every test here starts processes

# -- distributed execution ----------------------------------------------------------------


class _Counter:
    """Records every all-to-all this process issues (instrumentation, not a replacement)."""

    def __init__(self):
        self.calls = []
        self.orig = dist.all_to_all_single

    def __call__(self, output, input, *args, **kwargs):
        self.calls.append((input.dtype, input.numel()))
        return self.orig(output, input, *args, **kwargs)


def _identity_encoders(weights, calls, phases=PHASES):
    def make(name, div):
        def enc(x, lengths):
            calls.append((name, int(x.shape[0]), int(lengths.numel())))
            first = x.reshape(-1, div, x.shape[1])[:, 0]  # downsample: first row of each group
            return first @ weights[name]

        return enc

    return {p.name: make(p.name, p.divisor) for p in phases}


def _moves(plan) -> bool:
    return not (
        np.array_equal(plan.src_rank, plan.dst_rank)
        and np.array_equal(plan.src_slot, plan.dst_slot)
    )


def _composition_worker(rank, world):
    batches = payload_batches(world)
    exs = {ex["id"]: ex for b in batches for ex in b}
    batch = LocalBatch.from_examples(batches[rank], PHASES)
    counter = _Counter()
    dist.all_to_all_single = counter
    out = {}
    topology = Topology.build(ranks_per_node=2, timeout=30)  # every mode's orchestrator's
    try:
        for mode in MODES:
            orch = Orchestrator(StepOptions(PHASES, mode=mode), topology=topology)
            weights = {n: torch.eye(WIDTH, requires_grad=True) for n in ("vision", "audio")}
            enc_calls = []
            counter.calls.clear()
            res = orch.run(batch, _identity_encoders(weights, enc_calls))
            forward = list(counter.calls)
            embeds = res.assemble(payload_embed(res.input_ids))
            # Check every sequence against the example it claims to be.
            starts = np.concatenate(([0], np.cumsum(res.lengths.numpy())))
            for i, gid in enumerate(res.example_ids):
                seq = embeds[starts[i] : starts[i + 1]].detach().numpy()
                ex = exs[int(seq[0, 0])]
                rows, targets = expected_sequence(ex)
                assert np.array_equal(seq, rows), (mode, gid)
                assert np.array_equal(res.targets[starts[i] : starts[i + 1]].numpy(), targets)
            counter.calls.clear()
            (embeds**2).sum().backward()
            backward = list(counter.calls)
            plan = orch.plan_batch(batch)
            out[mode] = {
                "ids": sorted(int(embeds[s, 0]) for s in starts[:-1]),
                "tokens": int(res.lengths.sum()),
                "forward": forward,
                "backward": backward,
                "enc_calls": enc_calls,
                "stats": res.stats,
                "moving": [_moves(p.encoder) for p in plan.phases.values()]
                + [_moves(p.to_llm) for p in plan.phases.values()],
                "raw_rows": {n: int(batch.raw[n].shape[0]) for n in batch.raw},
                "num_targets": res.num_targets,
                "local_targets": int(res.loss_mask.sum()),
            }
    finally:
        dist.all_to_all_single = counter.orig
    return out


def _check_composition(results, world):
    batches = payload_batches(world)
    all_ids = sorted(ex["id"] for b in batches for ex in b)
    total_tokens = sum(len(expected_sequence(ex)[0]) for b in batches for ex in b)
    for mode in MODES:
        per = [r[mode] for r in results]
        # Conservation: every example and token exactly once, targets normalised globally.
        assert sorted(i for p in per for i in p["ids"]) == all_ids
        assert sum(p["tokens"] for p in per) == total_tokens
        assert sum(p["local_targets"] for p in per) == per[0]["num_targets"]
        # Every rank runs every encoder once, even with nothing to encode.
        for p in per:
            assert [c[0] for c in p["enc_calls"]] == ["vision", "audio"]
        if mode != "full":
            assert per[1]["enc_calls"] == [("vision", 0, 0), ("audio", 0, 0)]
        if mode == "none":
            assert all(not p["forward"] and not p["backward"] for p in per)
            continue
        # Each encoder output crosses the network once: one all-to-all per encoder forward
        # (raw inputs add one per encoder in full mode), one for text, one per encoder back.
        raw_moves = 2 if mode == "full" else 0
        assert per[0]["moving"] == [mode == "full"] * 2 + [True] * 2  # the data makes all move
        for p in per:
            assert len(p["forward"]) == raw_moves + 2 + 1, p["forward"]
            assert len(p["backward"]) == 2
        floats = sum(n for p in per for dt, n in p["forward"] if dt == torch.float32)
        raw = sum(p["raw_rows"][n] for p in per for n in p["raw_rows"]) * WIDTH
        out_rows = total_tokens - sum(len(ex["input_ids"]) for b in batches for ex in b)
        assert floats == (raw if mode == "full" else 0) + out_rows * WIDTH
        s = per[0]["stats"]
        assert s["llm"]["bytes_intra"] + s["llm"]["bytes_inter"] > 0


class _Broadcasts:
    """Counts this process's broadcasts (instrumentation, not a replacement)."""

    def __init__(self):
        self.calls = 0
        self.orig = dist.broadcast

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.orig(*args, **kwargs)


def _agreement_worker(rank, world):
    """ILP placement stops CBC on a clock, so each rank solving it could reach another plan:
    Orchestrator.plan computes it on rank 0 and broadcasts it; deterministic plans do not."""
    batch = LocalBatch.from_examples(payload_batches(world)[rank], PHASES)
    weights = {n: torch.eye(WIDTH) for n in ("vision", "audio")}
    topology = Topology.build(ranks_per_node=2, timeout=30)
    counter = _Broadcasts()
    dist.broadcast = counter
    out = {}
    try:
        for placement in ("ilp", "assign"):
            orch = Orchestrator(StepOptions(PHASES, placement=placement), topology=topology)
            counter.calls = 0
            plan = orch.plan_batch(batch)
            res = orch.run(batch, _identity_encoders(weights, []))  # plans again, inside
            out[placement] = {
                "broadcasts": counter.calls,
                "plans": [plan.llm.fingerprint()]
                + [p.encoder.fingerprint() for p in plan.phases.values()]
                + [p.to_llm.fingerprint() for p in plan.phases.values()],
                "plan_ms": [plan.llm_stats["plan_ms"]]
                + [p.stats["plan_ms"] for p in plan.phases.values()],
                "examples": res.example_ids.tolist(),
                "mine": plan.llm.items_at(rank).tolist(),
            }
    finally:
        dist.broadcast = counter.orig
    return out


# A made-up third modality: one table row and one phase are all it takes.
DEPTH = Modality("depth", 3, "depth_maps", "greedy", arch="vit", unit="patch")
PHASES3 = (*PHASES, EncoderPhase("depth", DEPTH.kind, DEPTH.key, 3, WIDTH, DEPTH.policy))


def _third_modality_worker(rank, world):
    """Plan, dispatch and assemble a step with three encoder phases (full mode)."""
    register_modality(DEPTH)  # in this process: segments of kind 3 become valid
    batches = payload_batches(world, PHASES3)
    exs = {ex["id"]: ex for b in batches for ex in b}
    batch = LocalBatch.from_examples(batches[rank], PHASES3)
    orch = Orchestrator(StepOptions(PHASES3, mode="full"), topology=Topology.build(timeout=30))
    weights = {p.name: torch.eye(WIDTH, requires_grad=True) for p in PHASES3}
    calls = []
    res = orch.run(batch, _identity_encoders(weights, calls, PHASES3))
    embeds = res.assemble(payload_embed(res.input_ids))
    starts = np.concatenate(([0], np.cumsum(res.lengths.numpy())))
    ids = []
    for i in range(len(res.example_ids)):
        seq = embeds[starts[i] : starts[i + 1]].detach().numpy()
        ids.append(int(seq[0, 0]))
        assert np.array_equal(seq, expected_sequence(exs[ids[-1]], PHASES3)[0]), ids[-1]
    return {
        "ids": ids,
        "depth_rows": int((embeds[:, 1] == DEPTH.kind).sum()),
        "called": sorted({name for name, _, _ in calls}),
        "depth_imbalance": res.stats["depth"]["imbalance_before"],
    }


def _stale_plan_worker(rank, world):
    """A plan given to run() that is not this batch's is refused on every rank, before any move
    (so no rank waits on a collective the others skipped)."""
    batches = payload_batches(world)
    orch = Orchestrator(StepOptions(PHASES), topology=Topology.build(ranks_per_node=2, timeout=30))
    plan = orch.plan_batch(LocalBatch.from_examples(batches[rank], PHASES))
    other = LocalBatch.from_examples(batches[(rank + 1) % world], PHASES)
    encoders = _identity_encoders({n: torch.eye(WIDTH) for n in ("vision", "audio")}, [])
    with pytest.raises(ValueError, match=f"rank {rank}'s batch"):
        orch.run(other, encoders, plan=plan)
    own = LocalBatch.from_examples(batches[rank], PHASES)
    return orch.run(own, encoders, plan=plan).num_targets


# Items that state their LLM tokens and carry a record (which example and item they are, how
# many tokens they become, a scale) to their encoder: the per-item metadata channel.
GRID = ItemField("grid", width=3)
SCALE = ItemField("scale", dtype="float64")
META_PHASES = (EncoderPhase("vision", IMAGE, "image_patches", 1, WIDTH, fields=(GRID, SCALE)),)


def _meta_example(eid: int, rng: np.random.Generator) -> dict:
    """Text, then items of random raw rows (every row holds ``eid``) and random tokens."""
    segments, images, grid, scale = [[TEXT, int(rng.integers(1, 5))]], [], [], []
    for j in range(int(rng.integers(0, 4)) if eid % 3 else 0):  # some examples hold no item
        raw, tokens = int(rng.integers(1, 6)), int(rng.integers(1, 5))
        segments += [[IMAGE, raw, tokens], [TEXT, int(rng.integers(1, 4))]]
        images.append(np.full((raw, WIDTH), eid, np.float32))
        grid.append([eid, j, tokens])
        scale.append(0.5 + j)
    n_text = sum(c for k, c, *_ in segments if k == TEXT)
    return {
        "id": eid,
        "segments": segments,
        "input_ids": eid * 1000 + np.arange(n_text),
        "loss_mask": np.ones(n_text, np.int64),
        "image_patches": images,
        "item_meta": {"vision": {"grid": grid, "scale": scale}},
    }


def _meta_sequence(ex: dict) -> np.ndarray:
    """Per position of the example's sequence: (example, item or -1, token or text index)."""
    rows, t, j = [], 0, 0
    for kind, count, *tokens in ex["segments"]:
        if kind == TEXT:
            rows += [[ex["id"], -1, t + k] for k in range(count)]
            t += count
        else:
            rows += [[ex["id"], j, k] for k in range(tokens[0])]
            j += 1
    return np.array(rows)


def _meta_encoder(calls: list):
    def enc(x, lengths, meta):
        grid, scale = meta["grid"], meta["scale"]
        calls.append(int(lengths.numel()))
        assert grid.dtype == torch.int64 and scale.dtype == torch.float64
        assert grid.shape == (lengths.numel(), 3) and scale.shape == (lengths.numel(), 1)
        # The record arrived with its own item: its rows hold the example id the record names.
        owner = torch.repeat_interleave(grid[:, 0], lengths)
        assert torch.equal(x[:, 0].long(), owner)
        tokens = grid[:, 2]
        where = torch.cat(
            [torch.stack([g[0].expand(n), g[1].expand(n), torch.arange(n)], 1) for g, n in
             zip(grid, tokens.tolist(), strict=True)] or [grid.new_zeros(0, 3)]
        )  # fmt: skip
        embeds = where.double().requires_grad_(True)
        return Encoded(embeds, {"where": where, "scale": scale.repeat_interleave(tokens, 0)})

    return enc


def _item_meta_worker(rank, world):
    exs = _meta_exs(rank)
    everyone = {e["id"]: e for r in range(world) for e in _meta_exs(r)}
    topology = Topology.build(timeout=30)
    out = {}
    for mode in ("none", "full"):
        orch = Orchestrator(StepOptions(META_PHASES, mode=mode), topology=topology)
        calls = []
        res = orch.run(LocalBatch.from_examples(exs, META_PHASES), {"vision": _meta_encoder(calls)})
        assert calls  # called on every rank, also one that holds no item
        text = torch.stack(
            [res.input_ids // 1000, torch.full_like(res.input_ids, -1), res.input_ids % 1000], 1
        )
        got = res.assemble(text.double()).detach().long()
        where = res.token_values("where", fill=-1)
        scale = res.token_values("scale", fill=0.0)
        is_item = res.mask("vision")
        assert torch.equal(where[is_item], got[is_item]) and (where[~is_item] == -1).all()
        assert torch.equal(res.mask("text"), ~is_item) and torch.equal(is_item, got[:, 1] >= 0)
        starts = np.concatenate(([0], np.cumsum(res.lengths.numpy())))
        for begin, end in zip(starts[:-1], starts[1:], strict=True):
            ex = everyone[int(got[begin, 0])]
            assert np.array_equal(got[begin:end].numpy(), _meta_sequence(ex))
        item_scale = scale[is_item, 0]
        expected = 0.5 + got[is_item, 1].double()
        assert torch.equal(item_scale, expected)
        out[mode] = sorted(int(got[s, 0]) for s in starts[:-1])
    return out


def _meta_exs(rank: int) -> list[dict]:
    rng = np.random.default_rng(rank)
    return [_meta_example(rank * 10 + i, rng) for i in range(4 if rank != 1 else 1)]


WORLD = 4


def _worker(rank, world):
    """The distributed checks in one spawn (process start-up dominates their cost)."""
    return {
        "composition": _composition_worker(rank, world),
        "grad": _grad_worker(rank, world),
        "agreement": _agreement_worker(rank, world),
        "third": _third_modality_worker(rank, world),
        "stale_plan": _stale_plan_worker(rank, world),
        "item_meta": _item_meta_worker(rank, world),
    }


@pytest.fixture(scope="module")
def distributed():
    return run_distributed(_worker, WORLD, timeout=60)


def test_a_third_modality_runs_through_planning_dispatch_and_assembly(distributed):
    per = [r["third"] for r in distributed]
    batches = payload_batches(WORLD, PHASES3)
    exs = [ex for b in batches for ex in b]
    depth_rows = sum(len(a) // 3 for ex in exs for a in ex["depth_maps"])
    assert depth_rows > 0
    assert sorted(i for p in per for i in p["ids"]) == sorted(ex["id"] for ex in exs)
    assert sum(p["depth_rows"] for p in per) == depth_rows  # every depth row, exactly once
    assert all(p["called"] == ["audio", "depth", "vision"] for p in per)  # on every rank


def test_item_records_reach_the_encoder_and_token_values_the_llm_layout(distributed):
    """Per-item records move with their items to the encoder (it checks each against its
    rows), items that state their token counts are planned by them, and the per-token values
    an encoder returns land at their tokens' positions in the LLM layout; every example
    arrives exactly once, in both the sampled and the balanced layout."""
    every = sorted(ex["id"] for r in range(WORLD) for ex in _meta_exs(r))
    for mode in ("none", "full"):
        assert sorted(i for r in distributed for i in r["item_meta"][mode]) == every


def test_a_plan_of_another_batch_is_refused_on_every_rank(distributed):
    targets = [r["stale_plan"] for r in distributed]  # the right plan still runs afterwards
    assert len(set(targets)) == 1 and targets[0] > 0


def test_composition_conservation_and_one_move_per_encoder(distributed):
    _check_composition([r["composition"] for r in distributed], WORLD)


def test_ilp_plans_are_computed_once_and_agree_across_ranks(distributed):
    per = [r["agreement"] for r in distributed]
    n_examples = sum(len(b) for b in payload_batches(WORLD))
    for placement, broadcasts in (("ilp", 2 * 2), ("assign", 0)):
        runs = [p[placement] for p in per]
        # plan_batch and run each agree on one plan: its size, then the plan itself.
        assert [r["broadcasts"] for r in runs] == [broadcasts] * WORLD
        assert all(r["plans"] == runs[0]["plans"] for r in runs)
        if placement == "ilp":  # solved once: rank 0's timings reached every rank
            assert all(r["plan_ms"] == runs[0]["plan_ms"] for r in runs)
        assert all(r["examples"] == r["mine"] for r in runs)
        assert sorted(i for r in runs for i in r["examples"]) == list(range(n_examples))


# -- gradients: balancing never changes them ------------------------------------------------


def _seq_cumsum(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    cs = torch.cumsum(x, 0)
    ends = torch.cumsum(lengths, 0)
    before = torch.cat([x.new_zeros(1, x.shape[1]), cs[ends[:-1] - 1]])
    return cs - before.repeat_interleave(lengths, 0)


def _linear_encoder(weight: torch.Tensor, group_width: int):
    """Merge consecutive raw rows into one token, then a differentiable projection."""
    return lambda x, lengths: torch.tanh(x.double().reshape(-1, group_width) @ weight)


def _plan_into(orch: Orchestrator, batch: LocalBatch, box: dict) -> None:
    box["plan"] = orch.plan_batch(batch)


def _grad_worker(rank, world):
    rates = EncodingRates({"vision": Rate(downsample=2), "audio": Rate(stride=2, downsample=2)})
    cfg = SyntheticConfig(
        num_examples=60, seed=5, scale=0.02, patch=2, feature_dims={"vision": 12, "audio": 8},
        vocab_size=64,
    ).with_task_settings(max_image_side=224)  # fmt: skip
    exs = list(iter_examples(cfg, rates))
    phases = default_phases(rates, feature_dims=cfg.widths)
    mine = exs[rank * 6 : (rank + 1) * 6]
    if rank == 1:  # a rank that sampled no image and no audio
        mine = [ex for ex in exs if not ex["image_patches"] and not ex["audio_mels"]][:3]
        assert mine
    batch = LocalBatch.from_examples(mine, phases)
    topology = Topology.build(timeout=30)  # one gloo group for every mode's orchestrator
    out = {}
    for mode in MODES:
        torch.manual_seed(0)
        hidden = 6
        w = {
            "vision": torch.randn(cfg.widths["vision"] * 2, hidden, dtype=torch.float64),
            "audio": torch.randn(cfg.widths["audio"] * 4, hidden, dtype=torch.float64),
        }
        emb = torch.randn(cfg.vocab_size, hidden, dtype=torch.float64)
        head = torch.randn(hidden, cfg.vocab_size, dtype=torch.float64)
        for p in (*w.values(), emb, head):
            p.requires_grad_(True)
        encoders = {
            "vision": _linear_encoder(w["vision"], cfg.widths["vision"] * 2),
            "audio": _linear_encoder(w["audio"], cfg.widths["audio"] * 4),
        }
        orch = Orchestrator(StepOptions(phases, mode=mode), topology=topology)
        # Prefetched plan (gathered and planned in a thread) equals the synchronous one.
        box = {}
        t = threading.Thread(target=_plan_into, args=(orch, batch, box))
        t.start()
        t.join(60)
        sync = orch.plan_batch(batch)
        assert box["plan"].same_as(sync)
        res = orch.run(batch, encoders, plan=box["plan"])
        x = res.assemble(emb[res.input_ids])
        # A causal mix within each sequence, so a wrong position changes the loss.
        logits = _seq_cumsum(x, res.lengths) @ head
        loss = (
            torch.nn.functional.cross_entropy(
                logits[res.loss_mask], res.targets[res.loss_mask], reduction="sum"
            )
            / res.num_targets
        )
        loss.backward()
        grads = [p.grad for p in (w["vision"], w["audio"], emb, head)]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        total = loss.detach().clone()
        dist.all_reduce(total)
        out[mode] = (float(total), flat.numpy())
    return out


def test_gradients_equal_across_modes_with_an_empty_rank(distributed):
    results = [r["grad"] for r in distributed]
    ref_loss, ref = results[0]["none"]
    for r in results:
        for mode in MODES:
            loss, grad = r[mode]
            assert np.isclose(loss, ref_loss, rtol=1e-12)
            np.testing.assert_allclose(grad, ref, rtol=1e-9, atol=1e-12)


def test_options_and_topology_agree_on_one_ranks_per_node_and_assembly_needs_its_plan():
    """Single process (no group): what the orchestrator refuses before any collective."""
    assert not dist.is_initialized()
    with pytest.raises(TypeError, match="options must be a StepOptions, got tuple"):
        Orchestrator(PHASES)
    filled = Orchestrator(StepOptions(PHASES), topology=Topology.build(ranks_per_node=4))
    assert filled.ranks_per_node == filled.options.ranks_per_node == 4
    own = Orchestrator(StepOptions(PHASES, ranks_per_node=2))  # builds its topology from it
    assert own.topology.ranks_per_node == 2
    with pytest.raises(ValueError, match="ranks_per_node=4 but the topology's ranks_per_node=2"):
        Orchestrator(filled.options, topology=own.topology)
    batch = LocalBatch.from_examples(payload_batches(1)[0], PHASES)
    layout = assembly(own.plan(batch.metadata, np.zeros(len(batch.metadata), np.int64)), 0)
    with pytest.raises(ValueError, match="assembly was given without plan"):
        own.run(batch, _identity_encoders({}, []), assembly=layout)
    split = StepOptions(PHASES, context_parallel=2, placement="none")
    with pytest.raises(ValueError, match=r"options.context_parallel=2 needs a topology built"):
        Orchestrator(split, topology=own.topology)
