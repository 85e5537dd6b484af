"""The policy registry: one record per policy, live name lists, and a policy registered from
Python alone running end to end (``balance``, ``plan_step``, and real gloo processes through
``BatchDispatcher`` and the ``Orchestrator``)."""

import ast
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import orchmllm
from orchmllm.planner.balance import InfeasibleCapError, balance, plan_is_deterministic
from orchmllm.planner.cost import CostModel
from orchmllm.planner.policies import (
    PADDED_POLICIES,
    POLICIES,
    REGISTRY,
    PolicyInput,
    default_cost,
    get_policy,
    register_policy,
    unregister_policy,
)
from orchmllm.planner.step_options import EncoderPhase, StepOptions
from orchmllm.planner.step_plan import plan_step
from orchmllm.schema import AUDIO, IMAGE
from orchmllm.testing import assert_check_passed, run_checks
from tests.payloads import WIDTH, expected_sequence, gathered, payload_batches, payload_embed

CAPPED = ("greedy", "greedy_cost", "greedy_tolerance", "binary_search", "padded_cost", "conv")
TIMEOUT = 30.0


# ---------------------------------------------------------------------------------------------
# policies written in Python alone, and a recorder of their calls


def _snake(job: PolicyInput) -> np.ndarray:
    """Heaviest item first, dealt out in serpentine rank order 0..d-1, d-1..0, ...: every rank
    gets n/d items (+-1), so it meets any item cap a plan can meet."""
    w = job.cost.item_costs(job.lengths)
    order = np.lexsort((np.arange(w.size), -w))
    lap, pos = np.divmod(np.arange(w.size), job.num_ranks)
    dst = np.empty(w.size, dtype=np.int64)
    dst[order] = np.where(lap % 2 == 0, pos, job.num_ranks - 1 - pos)
    return dst


def _runs(job: PolicyInput) -> np.ndarray:
    """Padded batches: the length-sorted items cut into contiguous runs of n/d items (+-1)."""
    n = job.lengths.size
    dst = np.empty(n, dtype=np.int64)
    dst[np.lexsort((np.arange(n), job.lengths))] = np.arange(n) * job.num_ranks // n
    return dst


def _coin(job: PolicyInput) -> np.ndarray:
    """A plan that differs on every call (unseeded): only usable computed once and shared."""
    return np.random.default_rng().integers(0, job.num_ranks, size=job.lengths.size)


class _Recorder:
    """A policy function that keeps every ``(PolicyInput, dst)`` it was called with/returned."""

    def __init__(self, plan: Callable[[PolicyInput], np.ndarray]) -> None:
        self.plan, self.calls = plan, []

    def __call__(self, job: PolicyInput) -> np.ndarray:
        dst = self.plan(job)
        self.calls.append((job, dst))
        return dst

    def call_on(self, lengths: np.ndarray, src: np.ndarray) -> tuple[PolicyInput, np.ndarray]:
        """The one recorded call planned on these lengths and sources."""
        found = [
            (job, dst)
            for job, dst in self.calls
            if np.array_equal(job.lengths, lengths) and np.array_equal(job.src, src)
        ]
        assert len(found) == 1, (lengths, src, len(self.calls))
        return found[0]


@contextlib.contextmanager
def registered(name: str, plan: Callable, **facts: bool) -> Iterator[_Recorder]:
    """``plan`` registered as policy ``name`` (through a recorder) inside the block only."""
    recorder = _Recorder(plan)
    register_policy(name, recorder, **facts)
    try:
        yield recorder
    finally:
        unregister_policy(name)


@pytest.fixture
def snake() -> Iterator[_Recorder]:
    with registered("snake", _snake, capped=True) as recorder:
        yield recorder


# ---------------------------------------------------------------------------------------------
# the registry


def test_registry_is_the_one_source_of_policy_facts():
    assert tuple(REGISTRY) == tuple(POLICIES) and orchmllm.POLICIES is POLICIES
    assert {p.name for p in REGISTRY.values() if p.padded} == set(PADDED_POLICIES)
    assert {p.name for p in REGISTRY.values() if p.capped} == set(CAPPED)
    assert {p.name for p in REGISTRY.values() if p.needs_src} == {"identity", "greedy_stay"}
    assert {p.name for p in REGISTRY.values() if p.refined} == {"greedy", "greedy_cost"}
    no_reference = {p.name for p in REGISTRY.values() if p.reference is None}
    assert no_reference == {"identity", "greedy_stay"}
    assert all(callable(p.fn) and p.deterministic for p in REGISTRY.values())
    assert plan_is_deterministic(policies=POLICIES)
    assert not plan_is_deterministic(placement="ilp")
    with pytest.raises(ValueError, match="policy"):
        plan_is_deterministic(policies=["magic"])
    # No other module keeps its own list of policy names or padded policies.
    root = Path(orchmllm.__file__).parent
    for path in root.rglob("*.py"):
        if path.name == "policies.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = {t.id for t in targets if isinstance(t, ast.Name)}
                assert not names & {"POLICIES", "PADDED_POLICIES"}, path


def test_name_lists_are_live_views_of_the_registry():
    before = tuple(POLICIES)
    assert repr(POLICIES) == repr(before) and "greedy" in POLICIES and 3 not in POLICIES
    with registered("runs", _runs, padded=True, capped=True):
        assert tuple(POLICIES) == (*before, "runs") and POLICIES[-1] == "runs"
        assert "runs" in orchmllm.POLICIES and "runs" in PADDED_POLICIES
        assert default_cost("runs") == CostModel("padded") and get_policy("runs").capped
        assert "runs" in repr(POLICIES) and len(POLICIES) == len(before) + 1
    assert tuple(POLICIES) == before and "runs" not in POLICIES
    with pytest.raises(ValueError, match="policy must be one of .* got 'runs'"):
        get_policy("runs")


def test_a_registered_name_is_accepted_wherever_a_policy_is(snake):
    assert "snake" in orchmllm.POLICIES and "snake" not in PADDED_POLICIES
    phase = EncoderPhase("vision", IMAGE, "image_patches", 2, WIDTH, "snake")
    options = StepOptions((phase,), llm_policy="snake")
    assert options.deterministic and plan_is_deterministic(policies=["snake"])
    with registered("coin", _coin, deterministic=False):
        assert not plan_is_deterministic(policies=["snake", "coin"])
        assert not StepOptions((phase,), llm_policy="coin").deterministic
    with pytest.raises(ValueError, match="policy must be one of .* got 'coin'"):
        EncoderPhase("vision", IMAGE, "image_patches", 2, WIDTH, "coin")
    with pytest.raises(ValueError, match="llm_policy must be one of .* got 'coin'"):
        StepOptions((phase,), llm_policy="coin")


@pytest.mark.parametrize(
    "args,facts,match",
    [
        (("snake", _snake), {}, "'snake' is taken: already registered"),
        (("greedy", _snake), {}, "'greedy' is taken: a built-in policy"),
        (("", _snake), {}, "name must be a Python identifier .* got ''"),
        (("two words", _snake), {}, "name must be .* got 'two words'"),
        (("none", _snake), {}, "name must be .* other than 'none', got 'none'"),
        ((7, _snake), {}, "name must be .* got 7"),
        (("other", "snake"), {}, "fn of policy 'other' must be callable, got 'snake'"),
        (("other", lambda: None), {}, "fn of policy 'other' must take one argument"),
        (("other", lambda job, d: None), {}, "fn of policy 'other' must take one argument"),
        (("other", _snake), {"padded": "yes"}, "padded of policy 'other' must be True or"),
        (("other", _snake), {"deterministic": 1}, "deterministic of policy 'other' must be"),
    ],
)
def test_bad_registrations_name_what_is_wrong(snake, args, facts, match):
    before = dict(REGISTRY)
    with pytest.raises(ValueError, match=match):
        register_policy(*args, **facts)
    assert dict(REGISTRY) == before


def test_only_registered_policies_can_be_unregistered():
    with pytest.raises(ValueError, match="policy 'greedy' is built in"):
        unregister_policy("greedy")
    with pytest.raises(ValueError, match="policy 'snake' is not registered"):
        unregister_policy("snake")


# ---------------------------------------------------------------------------------------------
# a registered policy through balance()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=40),
    d=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    item_cap=st.booleans(),
)
def test_balance_runs_a_registered_policy_end_to_end(lengths, d, seed, item_cap):
    """The plan is the registered function's output on the validated inputs; loads, the item
    cap and the statistics are balance()'s own, as for a built-in."""
    n = len(lengths)
    src = np.random.default_rng(seed).integers(0, d, size=n)
    cap = -(-n // d) if item_cap else None
    with registered("snake", _snake, capped=True) as snake:
        a = balance(lengths, d, "snake", src=src, max_items_per_rank=cap)
        b = balance(lengths, d, "snake", src=src, max_items_per_rank=cap, backend="python")
        [(job, dst), _] = snake.calls
    assert np.array_equal(job.lengths, lengths) and job.lengths.dtype == np.int64
    assert np.array_equal(job.src, src) and job.num_ranks == d
    assert job.cost == CostModel("packed") and job.steps == 0 and job.tolerance is None
    assert job.max_items == (n if cap is None else cap)
    np.testing.assert_array_equal(a.dst, dst)
    np.testing.assert_array_equal(b.dst, dst)  # no reference: the python backend runs fn
    # Conservation: every item on one real rank; the loads are the cost of each batch.
    assert a.dst.shape == (n,) and ((a.dst >= 0) & (a.dst < d)).all()
    np.testing.assert_array_equal(a.loads, np.bincount(a.dst, weights=lengths, minlength=d))
    if cap is not None:
        assert np.bincount(a.dst, minlength=d).max() <= cap and a.stats["caps_steered"] == 0.0
    assert a.stats["tokens_moved"] + a.stats["tokens_kept"] == sum(lengths)
    kept = sum(x for x, s, t in zip(lengths, src, a.dst, strict=True) if s == t)
    assert a.stats["tokens_kept"] == kept
    assert a.stats["imbalance_after"] == pytest.approx(a.loads.max() / a.loads.mean())
    assert a.stats["gap_to_lb"] >= 1.0 - 1e-12


def test_a_load_cap_steers_a_registered_policy(snake):
    lengths = [5, 4, 3, 3, 3]  # snake: {5, 3, 3} and {4, 3}; the best plan: {5, 4} and {3, 3, 3}
    alone = balance(lengths, 2, "snake")
    assert alone.loads.max() == 11 and alone.stats.get("caps_steered") is None
    steered = balance(lengths, 2, "snake", max_load_per_rank=9)
    assert steered.loads.max() == 9 and steered.stats["caps_steered"] == 1.0
    with pytest.raises(InfeasibleCapError, match="policy='snake'.* smallest value .* is 9") as e:
        balance(lengths, 2, "snake", max_load_per_rank=8.5)
    assert e.value.proven and e.value.smallest == 9


def test_nothing_to_balance_calls_only_a_policy_that_needs_src(snake):
    assert balance([], 3, "snake").dst.shape == (0,)
    np.testing.assert_array_equal(balance([0] * 5, 2, "snake").dst, [0, 1, 0, 1, 0])
    with registered("keep", lambda job: job.src, needs_src=True) as keep:
        with pytest.raises(ValueError, match="src is required for policy='keep'"):
            balance([3, 1], 2, "keep")
        np.testing.assert_array_equal(balance([0, 0, 0], 2, "keep", src=[1, 1, 0]).dst, [1, 1, 0])
        np.testing.assert_array_equal(balance([2, 0, 5], 2, "keep", src=[1, 1, 0]).dst, [1, 1, 0])
        assert [job.lengths.tolist() for job, _ in keep.calls] == [[0, 0, 0], [2, 0, 5]]
    assert snake.calls == []


def test_a_padded_policy_balances_padded_batches():
    lengths = np.array([30, 2, 29, 3, 28, 4, 1, 27])
    with registered("runs", _runs, padded=True, capped=True) as runs:
        a = balance(lengths, 2, "runs")
        [(job, dst)] = runs.calls
        with pytest.raises(ValueError, match="cost must be kind='padded' for policy='runs'"):
            balance(lengths, 2, "runs", cost=CostModel("packed"))
    assert job.cost == CostModel("padded")
    np.testing.assert_array_equal(a.dst, dst)
    assert sorted(a.loads.tolist()) == [4 * 4, 4 * 30]  # count x longest of each run
    dealt = CostModel("padded").loads(lengths, np.arange(8) % 2, 2)  # round robin: 120 + 108
    assert a.loads.sum() < dealt.sum()


@pytest.mark.parametrize(
    "plan,match",
    [
        (
            lambda job: np.zeros(job.lengths.size - 1, dtype=np.int64),
            "must have one entry per item",
        ),
        (lambda job: np.full(job.lengths.size, job.num_ranks), r"must be in \[0, 2\), got 2"),
        (lambda job: np.full(job.lengths.size, -1), r"must be in \[0, 2\), got -1"),
        (lambda job: np.full(job.lengths.size, 0.5), "must be integers, got .*0.5.* at 0"),
        (lambda job: None, "must be 1-D"),
    ],
)
def test_a_bad_plan_from_a_registered_policy_is_refused(plan, match):
    with registered("bad", plan), pytest.raises(ValueError, match=f"dst of policy 'bad' {match}"):
        balance([4, 3, 2], 2, "bad")


# ---------------------------------------------------------------------------------------------
# a registered policy through plan_step


def _snake_phases() -> tuple[EncoderPhase, ...]:
    """Vision balanced by the registered ``snake``, audio by a built-in."""
    return (
        EncoderPhase("vision", IMAGE, "image_patches", 2, WIDTH, "snake"),
        EncoderPhase("audio", AUDIO, "audio_mels", 4, WIDTH, "binary_search"),
    )


def _check_step(plan, snake: _Recorder) -> None:
    """The vision and LLM phases move items where the registered policy said."""
    vision = plan.phases["vision"]
    _, dst = snake.call_on(vision.raw, vision.encoder.src_rank)
    np.testing.assert_array_equal(vision.encoder.dst_rank, dst)
    _, dst = snake.call_on(plan.seq_len, plan.llm.src_rank)
    np.testing.assert_array_equal(plan.llm.dst_rank, dst)
    assert len(snake.calls) == 2
    for name in ("vision", "llm"):
        stats = plan.stats()[name]
        assert stats["imbalance_after"] < stats["imbalance_before"], name


def test_plan_step_runs_a_registered_policy(snake):
    world = 4
    batches = payload_batches(world, _snake_phases())
    rows, src = gathered(batches)
    options = StepOptions(_snake_phases(), mode="full", llm_policy="snake")
    plan = plan_step(rows, src, options, num_ranks=world)
    _check_step(plan, snake)
    examples = np.concatenate([plan.llm.items_at(r) for r in range(world)])
    assert sorted(examples.tolist()) == list(range(sum(len(b) for b in batches)))


# ---------------------------------------------------------------------------------------------
# a registered policy on real gloo processes (each process registers it itself)


def _dispatch(disp, per_rank: list[list[int]], rank: int):
    """Dispatch items whose token values name them: ``global id * 1000 + position``."""
    glob = np.array([x for r in per_rank for x in r], dtype=np.int64)
    start = sum(len(x) for x in per_rank[:rank])
    ids = np.arange(start, start + len(per_rank[rank]), dtype=np.int64)
    keys = [i * 1000 + np.arange(glob[i]) for i in ids]
    tokens = {"key": torch.from_numpy(np.concatenate(keys) if keys else np.zeros(0, np.int64))}
    lengths = torch.tensor(per_rank[rank], dtype=torch.int64)
    d = disp.dispatch(tokens, lengths, {"id": torch.from_numpy(ids)})
    # Conservation: every item arrives once, at its planned rank, its tokens intact.
    mine = d.plan.items_at(rank)
    assert d.items["id"].tolist() == mine.tolist()
    expect = [i * 1000 + np.arange(glob[i]) for i in mine]
    assert d.tokens["key"].tolist() == (np.concatenate(expect).tolist() if expect else [])
    everywhere = [None] * dist.get_world_size()
    dist.all_gather_object(everywhere, d.items["id"].tolist())
    assert sorted(i for ids_ in everywhere for i in ids_) == list(range(glob.size))
    assert torch.equal(disp.undo(d, d.tokens["key"]), tokens["key"])
    return d, glob


def _per_rank(world: int, seed: int) -> list[list[int]]:
    """Skewed batches, the same on every rank: rank 0 holds the long items."""
    rng = np.random.default_rng(seed)
    return [
        rng.integers(1, 60 if r == 0 else 8, size=rng.integers(3, 9)).tolist() for r in range(world)
    ]


def _w_dispatcher(rank: int, world: int):
    with registered("snake", _snake, capped=True) as snake:
        _dispatcher(rank, world, snake)


def _dispatcher(rank: int, world: int, snake: _Recorder) -> None:
    disp = orchmllm.BatchDispatcher(
        "snake", topology=orchmllm.Topology.build(timeout=TIMEOUT), check_plan=True
    )
    assert disp.deterministic
    for seed in range(3):
        d, glob = _dispatch(disp, _per_rank(world, seed), rank)
        job, dst = snake.calls[-1]  # planned here, as on every rank
        assert np.array_equal(job.lengths, glob) and job.num_ranks == world
        np.testing.assert_array_equal(d.plan.dst_rank, dst)
        assert d.stats["imbalance_after"] < d.stats["imbalance_before"]
    assert len(snake.calls) == 3


def _w_shared_plan(rank: int, world: int):
    """A policy registered ``deterministic=False`` (here: a different plan on every call) is
    planned by rank 0 alone and its plan reaches every rank."""
    with registered("coin", _coin, deterministic=False) as coin:
        _shared_plan(rank, world, coin)


def _shared_plan(rank: int, world: int, coin: _Recorder) -> None:
    disp = orchmllm.BatchDispatcher("coin", topology=orchmllm.Topology.build(timeout=TIMEOUT))
    assert not disp.deterministic
    for seed in range(3):
        d, _ = _dispatch(disp, _per_rank(world, seed), rank)
        rank0 = [d.plan.dst_rank.tolist() if rank == 0 else None]
        dist.broadcast_object_list(rank0, src=0)
        assert d.plan.dst_rank.tolist() == rank0[0]
        if rank == 0:
            assert coin.calls[-1][1].tolist() == rank0[0]
    assert len(coin.calls) == (3 if rank == 0 else 0)


def _w_orchestrator(rank: int, world: int):
    with registered("snake", _snake, capped=True) as snake:
        _orchestrator(rank, world, snake)


def _orchestrator(rank: int, world: int, snake: _Recorder) -> None:
    phases = _snake_phases()
    batches = payload_batches(world, phases)
    exs = {ex["id"]: ex for b in batches for ex in b}
    batch = orchmllm.LocalBatch.from_examples(batches[rank], phases)
    orch = orchmllm.Orchestrator(
        StepOptions(phases, mode="full", llm_policy="snake"),
        topology=orchmllm.Topology.build(timeout=TIMEOUT),
    )
    plan = orch.plan_batch(batch)
    _check_step(plan, snake)

    def encoder(div: int) -> Callable:
        return lambda x, lengths: x.reshape(-1, div, x.shape[1])[:, 0]  # first row per token

    res = orch.run(batch, {p.name: encoder(p.divisor) for p in phases}, plan=plan)
    embeds = res.assemble(payload_embed(res.input_ids))
    starts = np.concatenate(([0], np.cumsum(res.lengths.numpy())))
    ids = []
    for i in range(len(res.example_ids)):
        seq = embeds[starts[i] : starts[i + 1]].numpy()
        ids.append(int(seq[0, 0]))
        assert np.array_equal(seq, expected_sequence(exs[ids[-1]], phases)[0]), ids[-1]
    assert ids == plan.llm.items_at(rank).tolist()
    everywhere = [None] * world
    dist.all_gather_object(everywhere, ids)
    assert sorted(i for x in everywhere for i in x) == sorted(exs)


CHECKS = {
    "dispatcher_plans_with_a_registered_policy": _w_dispatcher,
    "nondeterministic_policy_planned_once_and_shared": _w_shared_plan,
    "orchestrator_runs_a_registered_policy": _w_orchestrator,
}


@pytest.fixture(scope="module")
def session() -> list[dict[str, str | None]]:
    return run_checks(CHECKS, 2, timeout=90)


@pytest.mark.parametrize("name", list(CHECKS))
@pytest.mark.integration
def test_registered_policy_on_gloo_ranks(session, name):
    assert_check_passed(session, name)
