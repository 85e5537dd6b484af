"""Simulated cases: sample a global batch, plan it with the real planner, model the step.

A case is one (model, ranks, mode, placement, policies, mini-batch) over a few sampled steps;
:func:`run_case` returns one flat record (the benchmark's JSON row). :func:`largest_minibatch`
is the paper's rule for the mini-batch (the largest that never runs out of memory), applied to
the memory model; :func:`fitting_minibatches` applies it to one seed's sampled steps the way
``python -m orchmllm.sim.plan_memory`` and ``benchmarks/reproduce_paper.py`` both do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from orchmllm.config import DataConfig, ModelConfig, TrainRecipe, load_config
from orchmllm.data.recipe import TASKS
from orchmllm.data.workload_facts import fact
from orchmllm.planner.balance import InfeasibleCapError
from orchmllm.schema import LLM
from orchmllm.sim.batch import Batch
from orchmllm.sim.compute import Submodule, submodules
from orchmllm.sim.context_parallel import ContextParallel, layout_of
from orchmllm.sim.layout import tailored
from orchmllm.sim.step import Cluster, StepResult, simulate_step
from orchmllm.sim.workload import sample_batch

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PAPER_MODELS = ("mllm-10b", "mllm-18b", "mllm-84b")


@dataclass(frozen=True)
class SimModel:
    """A run config's model, data and training-recipe sections, with its calibrated
    submodules (recomputing checkpointed blocks as the recipe says)."""

    name: str
    config: ModelConfig
    data: DataConfig
    modules: Mapping[str, Submodule] = field(repr=False)
    recipe: TrainRecipe = field(default_factory=TrainRecipe)


def load_model(name: str, *, configs_dir: Path = CONFIGS) -> SimModel:
    """``configs/<name>.yaml`` (or a path to a run config) as a simulated model."""
    path = Path(name)
    if not path.suffix:
        path = configs_dir / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"name: no run config at {path}")
    run = load_config(path)
    modules = submodules(run.model, checkpointing=run.recipe.checkpointing > 0)
    return SimModel(path.stem, run.model, run.data, modules, run.recipe)


def _requires(task: str, modality: str) -> bool:
    """Whether every example of ``task`` holds ``modality`` (an optional item does not
    count: a vqa example's spoken question)."""
    t = TASKS[task]
    return any(k == modality for k, _ in t.runs) and modality not in t.optional


def _shares(mix: Mapping[str, float]) -> tuple[list[str], list[str]]:
    image = [t for t in mix if _requires(t, "vision")]
    audio = [t for t in mix if _requires(t, "audio") and t not in image]
    return image, audio


def audio_share(model: SimModel) -> float:
    """The audio tasks' share of the weight of the tasks that hold an image or a clip (the
    paper mix: asr and spoken_qa against caption and vqa; chat holds neither)."""
    mix = model.data.task_weights
    image, audio = _shares(mix)
    both = sum(mix[t] for t in image + audio)
    return sum(mix[t] for t in audio) / both if both else 0.0


def with_workload(
    model: SimModel,
    *,
    scale: float = 1.0,
    audio_share: float | None = None,
    long_text_share: float | None = None,
) -> SimModel:
    """``model`` drawing a different workload: every length times ``scale`` (on top of the
    config's own ``data.scale``), and with ``audio_share`` the audio tasks' share of the
    image-or-audio tasks' weight (:func:`audio_share`), each group keeping its inner
    proportions and the other tasks their weights; with ``long_text_share`` that share of
    the examples is a long ``document`` (the recipe's task: 32k-128k tokens before
    ``scale``, :class:`orchmllm.data.recipe.DocumentParams`; issue 40's long-item mix:
    :func:`long_item_mix`), the text cap raised to let them through. For sensitivity sweeps:
    the shipped workload is the config's.

    Raises:
        ValueError: ``scale`` not positive, ``audio_share`` or ``long_text_share`` outside
            [0, 1], or an ``audio_share`` for a mix without both an image and an audio task.
    """
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")
    mix = model.data.task_weights
    data = model.data
    if long_text_share is not None:
        if not 0.0 <= long_text_share < 1.0:
            raise ValueError(f"long_text_share must be in [0, 1), got {long_text_share!r}")
        others = sum(w for t, w in mix.items() if t != "document")
        mix["document"] = others * long_text_share / (1.0 - long_text_share)
        longest = data.params("document").max_tokens
        data = dataclasses.replace(data, max_text_tokens=max(data.max_text_tokens, longest))
    if audio_share is not None:
        if not 0.0 <= audio_share <= 1.0:
            raise ValueError(f"audio_share must be in [0, 1], got {audio_share!r}")
        image, audio = _shares(mix)
        w_image, w_audio = sum(mix[t] for t in image), sum(mix[t] for t in audio)
        if not (w_image > 0 and w_audio > 0):
            raise ValueError(f"audio_share: the mix {mix} needs an image and an audio task")
        both = w_image + w_audio
        for group, weight, share in (
            (image, w_image, 1 - audio_share),
            (audio, w_audio, audio_share),
        ):
            for t in group:
                mix[t] = mix[t] / weight * share * both
    data = dataclasses.replace(data.with_weights(mix), scale=data.scale * scale)
    return dataclasses.replace(model, data=data)


def long_item_mix(model: SimModel) -> SimModel:
    """``model``'s mix with issue 40's long items: ``document.share`` of the examples (5%)
    a ``document`` of 32k-128k tokens, the rest the config's mix."""
    return with_workload(model, long_text_share=float(fact("document.share")))


def default_steps(num_ranks: int) -> int:
    """Sampled steps per case: several where a step holds few examples; at scale one step
    is already a large sample of the length distribution."""
    return max(1, min(4, 256 // num_ranks))


def placement_for(mode: str) -> str:
    """Node-wise placement where a mode moves data (the paper's setting), none elsewhere."""
    return "node" if mode in ("llm", "full") else "none"


def sample_pool(
    model: SimModel, num_ranks: int, examples_per_rank: int, seed: int | Sequence[int]
) -> Batch:
    """One step's global batch drawn from the model's data mix (``seed`` seeds
    ``numpy.random.default_rng``)."""
    return sample_batch(
        model.data,
        model.config,
        num_ranks=num_ranks,
        examples_per_rank=examples_per_rank,
        seed=seed,
    )


def policy_label(policies: Mapping[str, str] | None) -> str:
    """``tailored`` for the paper's choice, else the policies that differ from it."""
    default = tailored()
    diff = {k: v for k, v in (policies or {}).items() if default.get(k) != v}
    return ",".join(f"{k}={v}" for k, v in sorted(diff.items())) or "tailored"


def _steps(
    model: SimModel,
    num_ranks: int,
    mode: str,
    *,
    examples_per_rank: int,
    placement: str,
    steps: int,
    seed: int,
    policies: Mapping[str, str] | None,
    cluster: Cluster,
    pools: Mapping[int, Batch] | None,
    context_parallel: ContextParallel,
) -> list[StepResult]:
    out = []
    for step in range(steps):
        if pools is not None and step in pools:
            batch = pools[step].take(examples_per_rank)
        else:
            batch = sample_pool(model, num_ranks, examples_per_rank, seed + step)
        layout = layout_of(
            batch,
            mode,
            context_parallel,
            config=model.config,
            modules=model.modules,
            placement=placement,
            ranks_per_node=cluster.net.ranks_per_node,
            policies=policies,
        )
        out.append(
            simulate_step(
                batch,
                layout,
                mode,
                config=model.config,
                modules=model.modules,
                recipe=model.recipe,
                cluster=cluster,
            )  # fmt: skip
        )
    return out


def summarize(
    model: SimModel,
    num_ranks: int,
    mode: str,
    results: Sequence[StepResult],
    *,
    examples_per_rank: int,
    placement: str,
    policies: Mapping[str, str] | None,
    cluster: Cluster,
    context_parallel: ContextParallel | None = None,
) -> dict[str, Any]:
    """Mean over sampled steps of one configuration, as a flat record."""
    cpl = context_parallel or ContextParallel()
    steps = len(results)
    total_time = sum(r.step_time_s for r in results)
    llm_tokens = sum(r.llm_tokens for r in results)
    record: dict[str, Any] = {
        "model": model.name,
        "ranks": num_ranks,
        "mode": mode,
        "placement": placement,
        "policies": policy_label(policies),
        "examples_per_rank": examples_per_rank,
        "steps": steps,
        "step_time_s": total_time / steps,
        "forward_s": float(np.mean([r.forward_s for r in results])),
        "mfu": sum(r.useful_flops for r in results) / (num_ranks * total_time * cluster.peak_flops),
        "tokens_per_s_per_gpu": llm_tokens / (num_ranks * total_time),
        "dispatch_fwd_ms": 1e3 * float(np.mean([r.dispatch_fwd_s for r in results])),
        "dispatch_bwd_ms": 1e3 * float(np.mean([r.dispatch_bwd_s for r in results])),
        "inter_node_bytes_max_rank": float(np.mean([r.inter_node_bytes_max_rank for r in results])),
        "plan_ms": float(np.mean([r.plan_ms for r in results])),
        "plan_hidden": all(r.plan_hidden for r in results),
        "peak_memory_gb": max(r.peak_memory_bytes for r in results) / 1e9,
        **{
            f"{phase}_memory_gb": max(r.phase_memory_bytes[phase] for r in results) / 1e9
            for phase in results[0].phase_memory_bytes
        },
        "memory_budget_gb": results[0].budget_bytes / 1e9,
        "oom": any(r.oom for r in results),
        "context_parallel": cpl.label,
        "context_parallel_ms": 1e3 * float(np.mean([r.context_parallel_s for r in results])),
        "items_split": float(np.mean([r.items_split for r in results])),
        "pieces": float(np.mean([r.pieces for r in results])),
    }
    for phase in model.modules:
        record[f"compute_{phase}_s"] = float(np.mean([r.compute_s[phase] for r in results]))
        record[f"imbalance_{phase}"] = float(np.mean([r.imbalance(phase) for r in results]))
        record[f"fsdp_{phase}_s"] = results[0].fsdp_s[phase]
        record[f"inter_node_bytes_mean_rank_{phase}"] = float(
            np.mean(
                [
                    r.dispatchers[phase].inter_mean_rank if phase in r.dispatchers else 0.0
                    for r in results
                ]
            )
        )
    return record


def run_case(
    model: SimModel,
    num_ranks: int,
    mode: str,
    *,
    examples_per_rank: int,
    placement: str = "none",
    steps: int = 1,
    seed: int = 0,
    policies: Mapping[str, str] | None = None,
    cluster: Cluster | None = None,
    pools: Mapping[int, Batch] | None = None,
    context_parallel: ContextParallel | None = None,
) -> dict[str, Any]:
    """Mean over ``steps`` sampled steps of one configuration, as a flat record.

    Step ``k`` uses seed ``seed + k`` (or ``pools[k].take(...)``), so every mode of a
    comparison sees the same batches; ``context_parallel`` says how the LLM phase splits
    examples (default: it does not).
    """
    cpl = context_parallel or ContextParallel()
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps!r}")
    cluster = cluster or Cluster()
    results = _steps(
        model,
        num_ranks,
        mode,
        examples_per_rank=examples_per_rank,
        placement=placement,
        steps=steps,
        seed=seed,
        policies=policies,
        cluster=cluster,
        pools=pools,
        context_parallel=cpl,
    )
    return summarize(
        model,
        num_ranks,
        mode,
        results,
        examples_per_rank=examples_per_rank,
        placement=placement,
        policies=policies,
        cluster=cluster,
        context_parallel=cpl,
    )


def _largest(fits: Callable[[int], bool], hi: int, guess: int) -> int:
    """Largest ``b`` in ``[0, hi]`` with ``fits(b)`` (monotone, ``fits(0)`` assumed), probing
    outward from ``guess`` in doubling steps and then bisecting, so a good guess costs two or
    three probes."""
    g = min(max(guess, 1), hi)
    if fits(g):
        lo, top, step = g, hi, 1
        while lo + step <= hi:
            if not fits(lo + step):
                top = lo + step - 1
                break
            lo, step = lo + step, 2 * step
    else:
        lo, top, step = 0, g - 1, 1
        while g - step > 0:
            if fits(g - step):
                lo = g - step
                break
            top, step = g - step - 1, 2 * step
    while lo < top:  # invariant: lo fits (0 trivially), every b > top does not
        mid = (lo + top + 1) // 2
        if fits(mid):
            lo = mid
        else:
            top = mid - 1
    return lo


def largest_minibatch(
    model: SimModel,
    num_ranks: int,
    mode: str,
    *,
    pools: Mapping[int, Batch],
    placement: str = "none",
    policies: Mapping[str, str] | None = None,
    cluster: Cluster | None = None,
    guess: int | None = None,
    context_parallel: ContextParallel | None = None,
) -> tuple[int, dict[str, Any] | None]:
    """The paper's rule for the mini-batch (section 8.1): the largest whose worst rank fits
    the memory budget in every pooled step, and its record (``None`` if not even one example
    fits). The mini-batch must stay below the pools' size, else ``ValueError``.

    The search starts at ``guess`` (e.g. the answer at a neighbouring scale) or, for a balancing
    mode, where a rank holding every phase's average tokens would fit (cheap: no plan), since a
    balanced layout's worst rank sits near it; the answer does not depend on the start, only
    the number of plans made does. ``context_parallel`` applies to ``mode``'s steps (the
    start's ``none`` steps split nothing); a mini-batch whose LLM phase no plan keeps under
    its budget (``max_load_ms``) does not fit."""
    cluster = cluster or Cluster()
    cpl = context_parallel or ContextParallel()
    hi = min(p.examples_per_rank for p in pools.values())
    seen: dict[tuple[str, int], list[StepResult]] = {}

    def results(b: int, how: str) -> list[StepResult]:
        if (how, b) not in seen:
            seen[how, b] = _steps(
                model,
                num_ranks,
                how,
                examples_per_rank=b,
                placement=placement if how == mode else "none",
                steps=len(pools),
                seed=0,
                policies=policies,
                cluster=cluster,
                pools=pools,
                context_parallel=cpl if how == mode else ContextParallel(),
            )
        return seen[how, b]

    def fits(b: int) -> bool:
        try:
            return not any(r.oom for r in results(b, mode))
        except InfeasibleCapError:  # the plan cannot keep the LLM phase under its budget
            return False

    def mean_fits(b: int) -> bool:
        return all(r.balanced_memory_bytes <= r.budget_bytes for r in results(b, "none"))

    if guess is None:
        guess = (hi + 1) // 2 if mode == "none" else _largest(mean_fits, hi, (hi + 1) // 2)
    b = _largest(fits, hi, guess)
    if b == hi:
        raise ValueError(f"pools: {hi} examples per rank all fit; sample larger pools")
    if b == 0:
        return 0, None
    record = summarize(
        model,
        num_ranks,
        mode,
        results(b, mode),
        examples_per_rank=b,
        placement=placement,
        policies=policies,
        cluster=cluster,
        context_parallel=cpl,
    )
    return b, record


def llm_token_capacity(model: SimModel, num_ranks: int, cluster: Cluster | None = None) -> int:
    """The most LLM tokens a rank can hold under the memory model: the longest text-only
    sequence whose step fits the budget with one such sequence on every rank (0 if none
    does). A rank's LLM memory grows with its tokens, so a rank holding more tokens in
    shorter sequences does not fit either (the encoders' phases aside)."""
    cluster = cluster or Cluster()

    def fits(tokens: int) -> bool:
        batch = Batch.uniform(num_ranks, 1, text=tokens, raw={})
        layout = layout_of(
            batch, "none", ContextParallel(), config=model.config, modules=model.modules,
            placement="none", ranks_per_node=cluster.net.ranks_per_node,
        )  # fmt: skip
        step = simulate_step(
            batch, layout, "none", config=model.config, modules=model.modules,
            recipe=model.recipe, cluster=cluster,
        )  # fmt: skip
        return not step.oom

    hi = 1 << 24  # 16M tokens: beyond any GPU's memory at any model size
    return _largest(fits, hi, 1 << 16) if fits(1) else 0


def memory_budget_ms(model: SimModel, num_ranks: int, cluster: Cluster | None = None) -> float:
    """The LLM phase's per-rank budget (``llm_max_load``, ms) that memory sets: the cost of
    :func:`llm_token_capacity` tokens without their attention (``alpha * T + const``), so a
    rank within it holds at most that many tokens whatever its sequences' lengths."""
    cost = model.modules[LLM].cost
    tokens = llm_token_capacity(model, num_ranks, cluster)
    return float(cost.multiplier * (cost.alpha * tokens + cost.const))


def step_pools(
    model: SimModel, num_ranks: int, per_rank: int, seed: int, steps: int
) -> dict[int, Batch]:
    """``steps`` sampled steps of ``per_rank`` examples per rank; step ``k`` draws with
    ``numpy.random.default_rng([seed, k])``."""
    return {k: sample_pool(model, num_ranks, per_rank, (seed, k)) for k in range(steps)}


def fitting_minibatches(
    model: SimModel,
    num_ranks: int,
    modes: Sequence[str],
    *,
    seed: int,
    steps: int | None = None,
    cluster: Cluster | None = None,
    guesses: Mapping[str, int | None] | None = None,
) -> tuple[dict[int, Batch], dict[str, tuple[int, dict[str, Any] | None]]]:
    """The largest mini-batch of each mode (:func:`largest_minibatch`, node-wise placement
    where the mode moves data) on one seed's sampled steps (:func:`default_steps` of them),
    and those steps.

    The steps hold ``2 * data.examples_per_rank`` examples per rank, grown by half until
    some mini-batch does not fit, so the answer depends on the config, the seed and the
    cluster only (``guesses`` change where the search starts, not its result)."""
    steps = steps or default_steps(num_ranks)
    per_rank = 2 * model.data.examples_per_rank
    guesses = guesses or {}
    while True:
        pools = step_pools(model, num_ranks, per_rank, seed, steps)
        try:
            found = {
                mode: largest_minibatch(
                    model,
                    num_ranks,
                    mode,
                    pools=pools,
                    placement=placement_for(mode),
                    cluster=cluster,
                    guess=guesses.get(mode),
                )  # fmt: skip
                for mode in modes
            }
        except ValueError:  # every pooled mini-batch fits: sample larger steps
            per_rank = int(1.5 * per_rank) + 1
            continue
        return pools, found
