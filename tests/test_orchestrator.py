"""MLLM Global Orchestrator: pure planning properties and real gloo execution."""

import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

from orchmllm.data import AUDIO, IMAGE, TEXT, EncodingRates, SyntheticConfig
from orchmllm.data.synthetic import iter_examples
from orchmllm.orchestrator import (
    IGNORE_INDEX,
    MODES,
    EncoderPhase,
    LocalBatch,
    Orchestrator,
    _assembly,
    default_phases,
    local_metadata,
    plan_step,
)
from orchmllm.testing import run_distributed

# -- payload examples: every row says where it belongs ------------------------------------
WIDTH = 4  # raw feature width = hidden, so an identity encoder keeps payloads intact
PHASES = (
    EncoderPhase("vision", IMAGE, "image_patches", 2, WIDTH, "greedy"),
    EncoderPhase("audio", AUDIO, "audio_mels", 4, WIDTH, "binary_search"),
)
DIV = {IMAGE: 2, AUDIO: 4}


def _payload_example(eid: int, segments: list[list[int]]) -> dict:
    """Rows carry (example, kind, item, row): text token t is id eid*1000 + t."""
    n_text = sum(c for k, c in segments if k == TEXT)
    items = {IMAGE: [], AUDIO: []}
    for kind, count in segments:
        if kind != TEXT:
            j = len(items[kind])
            rows = np.arange(count) // DIV[kind]
            items[kind].append(
                np.stack([np.full(count, eid), np.full(count, kind), np.full(count, j), rows], 1)
            )
    mask = (np.arange(n_text) % 3 != 0).astype(np.int64)  # position 0 never a target
    return {
        "id": eid,
        "segments": segments,
        "input_ids": eid * 1000 + np.arange(n_text),
        "loss_mask": mask,
        "image_patches": [a.astype(np.float32) for a in items[IMAGE]],
        "audio_mels": [a.astype(np.float32) for a in items[AUDIO]],
    }


def _payload_batches(world: int) -> list[list[dict]]:
    """Random interleavings; rank 1 gets text-only examples (no image, no audio)."""
    rng = np.random.default_rng(7)
    batches, eid = [], 0
    for rank in range(world):
        batch = []
        for _ in range(int(rng.integers(2, 5))):
            segs = [[TEXT, int(rng.integers(1, 6))]]
            if rank != 1:
                for _ in range(int(rng.integers(0, 4))):
                    kind = int(rng.choice([IMAGE, AUDIO]))
                    segs.append([kind, DIV[kind] * int(rng.integers(1, 8))])
                    if rng.random() < 0.5:
                        segs.append([TEXT, int(rng.integers(1, 6))])
            batch.append(_payload_example(eid, segs))
            eid += 1
        batches.append(batch)
    return batches


def _expected_sequence(ex: dict) -> tuple[np.ndarray, np.ndarray]:
    """The assembled payload rows and next-token targets of one example, built directly."""
    rows, kinds_seen, t = [], {IMAGE: 0, AUDIO: 0}, 0
    text_tokens = []  # (position, token, is_target)
    for kind, count in ex["segments"]:
        if kind == TEXT:
            for _ in range(count):
                text_tokens.append((len(rows), ex["input_ids"][t], ex["loss_mask"][t]))
                rows.append([ex["id"], 0, t, -1])
                t += 1
        else:
            j = kinds_seen[kind]
            kinds_seen[kind] += 1
            rows += [[ex["id"], kind, j, g] for g in range(count // DIV[kind])]
    targets = np.full(len(rows), IGNORE_INDEX)
    for pos, tok, is_target in text_tokens:
        if is_target and pos > 0:
            targets[pos - 1] = tok
    return np.array(rows, dtype=np.float32), targets


def _payload_embed(ids: torch.Tensor) -> torch.Tensor:
    return torch.stack(
        [ids // 1000, torch.zeros_like(ids), ids % 1000, torch.full_like(ids, -1)], 1
    ).float()


def _gathered(batches):
    local = [local_metadata(b) for b in batches]
    rows = np.concatenate(local)
    src = np.repeat(np.arange(len(batches)), [len(m) for m in local])
    return rows, src


# -- pure planning ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_plan_is_pure_and_conserves_everything(mode):
    world = 4
    batches = _payload_batches(world)
    rows, src = _gathered(batches)
    plan = plan_step(rows, src, num_ranks=world, phases=PHASES, mode=mode)
    again = plan_step(rows.copy(), src.copy(), num_ranks=world, phases=PHASES, mode=mode)
    assert plan.same_as(again) and plan.llm.fingerprint() == again.llm.fingerprint()
    n_ex = sum(len(b) for b in batches)
    seen = []
    for r in range(world):
        lay = _assembly(plan, r)
        seen += lay.examples.tolist()
        # The LLM input is a permutation of every received row (text + encoder outputs).
        assert np.array_equal(np.sort(lay.index), np.arange(sum(lay.rows.values())))
        assert lay.lengths.sum() == lay.index.size
    assert sorted(seen) == list(range(n_ex))
    exs = [ex for b in batches for ex in b]
    assert plan.seq_len.tolist() == [len(_expected_sequence(ex)[0]) for ex in exs]
    assert plan.num_targets == sum((_expected_sequence(ex)[1] != IGNORE_INDEX).sum() for ex in exs)
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


def test_full_mode_balances_synthetic_phases():
    rates = EncodingRates(4, 2, 2)
    cfg = SyntheticConfig(num_examples=64, seed=2, scale=0.1)
    exs = list(iter_examples(cfg, rates))
    phases = default_phases(rates, patch_dim=cfg.patch_dim, n_mels=cfg.n_mels)
    rows, src = _gathered([exs[i : i + 8] for i in range(0, 64, 8)])
    stats = plan_step(rows, src, num_ranks=8, phases=phases, mode="full").stats()
    for name in ("vision", "audio", "llm"):
        s = stats[name]
        assert s["imbalance_after"] < s["imbalance_before"], (name, s)
        assert np.isclose(sum(s["loads_before"]), sum(s["loads_after"])) or name == "audio"
    assert stats["vision"]["imbalance_after"] < 1.15 and stats["llm"]["imbalance_after"] < 1.25


def test_balanced_sampling_moves_nothing():
    # Two ranks holding mirror-image batches are already balanced in every phase: a plan that
    # is not strictly better than staying put is dropped, so nothing moves.
    segs = [[[TEXT, 3], [IMAGE, 8]], [[TEXT, 5], [AUDIO, 16], [TEXT, 2]], [[TEXT, 9]]]
    batch = [_payload_example(i, s) for i, s in enumerate(segs)]
    rows, src = _gathered([batch, batch])
    plan = plan_step(rows, src, num_ranks=2, phases=PHASES, mode="full")
    for move in [plan.llm] + [p.encoder for p in plan.phases.values()]:
        assert np.array_equal(move.src_rank, move.dst_rank)
    for s in plan.stats().values():
        assert s["imbalance_after"] == s["imbalance_before"] == 1.0


def test_bad_input_raises():
    batches = _payload_batches(2)
    rows, src = _gathered(batches)
    with pytest.raises(ValueError, match="mode"):
        plan_step(rows, src, num_ranks=2, phases=PHASES, mode="some")
    with pytest.raises(ValueError, match="no phase"):
        plan_step(rows, src, num_ranks=2, phases=PHASES[:1])
    with pytest.raises(ValueError, match="src"):
        plan_step(rows, src[:-1], num_ranks=2, phases=PHASES)
    shuffled = rows.copy()
    shuffled[[0, -1]] = shuffled[[-1, 0]]
    with pytest.raises(ValueError, match="examples"):
        plan_step(shuffled, src, num_ranks=2, phases=PHASES)
    with pytest.raises(ValueError, match="loss_mask"):
        local_metadata([{**batches[0][0], "loss_mask": [0]}])
    bad = {**batches[0][0], "image_patches": [np.zeros((3, WIDTH), np.float32)]}
    with pytest.raises(ValueError, match="image_patches"):
        LocalBatch.from_examples([bad], PHASES)


# -- distributed execution ----------------------------------------------------------------


class _Counter:
    """Records every all-to-all this process issues (instrumentation, not a replacement)."""

    def __init__(self):
        self.calls = []
        self.orig = dist.all_to_all_single

    def __call__(self, output, input, *args, **kwargs):
        self.calls.append((input.dtype, input.numel()))
        return self.orig(output, input, *args, **kwargs)


def _identity_encoders(weights, calls):
    def make(name, div):
        def enc(x, lengths):
            calls.append((name, int(x.shape[0]), int(lengths.numel())))
            first = x.reshape(-1, div, x.shape[1])[:, 0]  # downsample: first row of each group
            return first @ weights[name]

        return enc

    return {"vision": make("vision", DIV[IMAGE]), "audio": make("audio", DIV[AUDIO])}


def _moves(plan) -> bool:
    return not (
        np.array_equal(plan.src_rank, plan.dst_rank)
        and np.array_equal(plan.src_slot, plan.dst_slot)
    )


def _composition_worker(rank, world):
    batches = _payload_batches(world)
    exs = {ex["id"]: ex for b in batches for ex in b}
    batch = LocalBatch.from_examples(batches[rank], PHASES)
    counter = _Counter()
    dist.all_to_all_single = counter
    out = {}
    try:
        for mode in MODES:
            orch = Orchestrator(PHASES, mode=mode, ranks_per_node=2, timeout=30)
            weights = {n: torch.eye(WIDTH, requires_grad=True) for n in ("vision", "audio")}
            enc_calls = []
            counter.calls.clear()
            res = orch.run(batch, _identity_encoders(weights, enc_calls))
            forward = list(counter.calls)
            embeds = res.assemble(_payload_embed(res.input_ids))
            # Check every sequence against the example it claims to be.
            starts = np.concatenate(([0], np.cumsum(res.lengths.numpy())))
            for i, gid in enumerate(res.example_ids):
                seq = embeds[starts[i] : starts[i + 1]].detach().numpy()
                ex = exs[int(seq[0, 0])]
                rows, targets = _expected_sequence(ex)
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
    batches = _payload_batches(world)
    all_ids = sorted(ex["id"] for b in batches for ex in b)
    total_tokens = sum(len(_expected_sequence(ex)[0]) for b in batches for ex in b)
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
    batch = LocalBatch.from_examples(_payload_batches(world)[rank], PHASES)
    weights = {n: torch.eye(WIDTH) for n in ("vision", "audio")}
    counter = _Broadcasts()
    dist.broadcast = counter
    out = {}
    try:
        for placement in ("ilp", "assign"):
            orch = Orchestrator(PHASES, placement=placement, ranks_per_node=2, timeout=30)
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


WORLD = 4


def _worker(rank, world):
    """The distributed checks in one spawn (process start-up dominates their cost)."""
    return {
        "composition": _composition_worker(rank, world),
        "grad": _grad_worker(rank, world),
        "agreement": _agreement_worker(rank, world),
    }


@pytest.fixture(scope="module")
def distributed():
    return run_distributed(_worker, WORLD, timeout=60)


def test_composition_conservation_and_one_move_per_encoder(distributed):
    _check_composition([r["composition"] for r in distributed], WORLD)


def test_ilp_plans_are_computed_once_and_agree_across_ranks(distributed):
    per = [r["agreement"] for r in distributed]
    n_examples = sum(len(b) for b in _payload_batches(WORLD))
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
    rates = EncodingRates(2, 2, 2)
    cfg = SyntheticConfig(
        num_examples=60, seed=5, scale=0.02, patch=2, n_mels=8, vocab_size=64,
        max_image_side=224,
    )  # fmt: skip
    exs = list(iter_examples(cfg, rates))
    phases = default_phases(rates, patch_dim=cfg.patch_dim, n_mels=cfg.n_mels)
    mine = exs[rank * 6 : (rank + 1) * 6]
    if rank == 1:  # a rank that sampled no image and no audio
        mine = [ex for ex in exs if not ex["image_patches"] and not ex["audio_mels"]][:3]
        assert mine
    batch = LocalBatch.from_examples(mine, phases)
    meta = dist.new_group(backend="gloo")
    out = {}
    for mode in MODES:
        torch.manual_seed(0)
        hidden = 6
        w = {
            "vision": torch.randn(cfg.patch_dim * 2, hidden, dtype=torch.float64),
            "audio": torch.randn(cfg.n_mels * 4, hidden, dtype=torch.float64),
        }
        emb = torch.randn(cfg.vocab_size, hidden, dtype=torch.float64)
        head = torch.randn(hidden, cfg.vocab_size, dtype=torch.float64)
        for p in (*w.values(), emb, head):
            p.requires_grad_(True)
        encoders = {
            "vision": _linear_encoder(w["vision"], cfg.patch_dim * 2),
            "audio": _linear_encoder(w["audio"], cfg.n_mels * 4),
        }
        orch = Orchestrator(phases, mode=mode, meta_group=meta, timeout=30)
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
