"""One training step at cluster scale: phase times, dispatch traffic, memory and MFU.

Step time is ``sum over phases of max(slowest rank's compute, FSDP traffic of the phase)`` plus
the dispatch all-to-alls on the critical path:

- compute: each rank's batch in each phase through the calibrated module cost
  (``orchmllm.sim.compute``, the recomputed forward of checkpointed blocks included); FSDP
  collectives synchronise every phase, so a phase lasts as long as its slowest rank.
- FSDP: ZeRO-3 all-gathers the parameters forward and backward and reduce-scatters gradients
  (three passes of the bf16 weights, one for a frozen module) within the hybrid-shard group,
  prefetched layer by layer, so the traffic hides behind compute until a rank's batch is too
  small to cover it. A group larger than one node is bound by the network, else by NVLink.
- dispatch (``orchmllm.sim.comm``, ``dispatch_collectives``): the all-to-alls the orchestrator
  runs, each timed on its own.
- planning runs on the CPU during the previous step (prefetch) and is reported, not added;
  ``plan_hidden`` says whether it fits in the step.
- context parallelism (a layout with pieces, ``orchmllm.sim.context_parallel``): a piece's
  compute is the planner's piece cost; a rank's gathers of keys and values add to its LLM
  compute (not overlapped), the home's scatter of the pieces' rows is one more all-to-all each
  way, and the gathered keys and values add to the forward and backward peaks.

MFU counts useful FLOPs only (no padding, causal attention halved, no recompute) over the dense
bf16 peak. Memory is ``orchmllm.sim.memory``'s peak per phase under the run's training recipe
(static bytes plus the replayed step), per rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from orchmllm.config import ModelConfig, TrainRecipe
from orchmllm.planner.cost import FORWARD_FRACTION
from orchmllm.schema import LLM
from orchmllm.sim import comm
from orchmllm.sim import context_parallel as cp
from orchmllm.sim.batch import Batch
from orchmllm.sim.compute import H100_PEAK_FLOPS, Submodule
from orchmllm.sim.layout import Layout, llm_pieces, raw_row_bytes
from orchmllm.sim.memory import MemoryModel, moves_of_layout
from orchmllm.sim.replay_env import COMMUNICATORS


@dataclass(frozen=True)
class Cluster:
    """The machine the step runs on."""

    net: comm.Network = field(default_factory=comm.Network)
    memory: MemoryModel = field(default_factory=MemoryModel)
    peak_flops: float = H100_PEAK_FLOPS
    # how the dispatcher moves items: all_to_all (OrchMLLM's), or all_gather (every rank
    # receives the whole global batch and keeps its own: the paper's Figure 12 alternative)
    communicator: str = "all_to_all"

    def __post_init__(self) -> None:
        if self.communicator not in COMMUNICATORS:
            raise ValueError(
                f"communicator must be one of {COMMUNICATORS}, got {self.communicator!r}"
            )

    def dispatch_seconds(self, vol: comm.Volumes) -> float:
        """One move's duration under this cluster's communicator."""
        if self.communicator == "all_gather":
            return comm.all_gather_seconds(vol.held, self.net)
        return comm.all_to_all_seconds(vol, self.net)


@dataclass(frozen=True)
class StepResult:
    """Everything one simulated step reports (times in seconds, bytes per rank)."""

    step_time_s: float
    forward_s: float  # forward pass alone, dispatch included (the paper's Table 2 "duration")
    compute_s: dict[str, float]  # slowest rank per phase
    mean_compute_s: dict[str, float]  # average rank per phase
    fsdp_s: dict[str, float]
    dispatch_fwd_s: float
    dispatch_bwd_s: float
    useful_flops: float
    llm_tokens: int  # tokens through the LLM (the paper's throughput counts these)
    mfu: float
    peak_memory_bytes: float  # worst rank
    phase_memory_bytes: dict[str, float]  # worst rank per phase (forward, backward, optimizer)
    balanced_memory_bytes: float  # a rank holding every phase's average load
    budget_bytes: float
    dispatchers: dict[str, comm.Volumes]  # forward moves by dispatcher name
    plan_ms: float
    plan_hidden: bool
    # what the keys' and values' gathers add to the LLM phase's slowest rank (seconds)
    context_parallel_s: float = 0.0
    items_split: int = 0
    pieces: int = 0  # (example, rank) pairs of the split examples

    @property
    def oom(self) -> bool:
        return self.peak_memory_bytes > self.budget_bytes

    @property
    def inter_node_bytes_max_rank(self) -> float:
        """Busiest rank's inter-node bytes summed over the step's forward dispatchers."""
        if not self.dispatchers:
            return 0.0
        total = sum(self.dispatchers.values(), start=_zero(self.num_ranks))
        return total.inter_max_rank

    @property
    def num_ranks(self) -> int:
        return next(iter(self.dispatchers.values())).num_ranks if self.dispatchers else 0

    def imbalance(self, phase: str) -> float:
        """Slowest over mean rank compute in ``phase`` (1.0 = perfectly balanced)."""
        mean = self.mean_compute_s[phase]
        return self.compute_s[phase] / mean if mean > 0 else 1.0


def _zero(num_ranks: int) -> comm.Volumes:
    z = np.zeros(num_ranks)
    return comm.Volumes(z, z, z, z, z)


def fsdp_seconds(module: Submodule, num_ranks: int, cluster: Cluster) -> float:
    """ZeRO-3 parameter/gradient traffic of one module per step, per GPU."""
    group = min(cluster.memory.shard_group, num_ranks)
    if group <= 1:
        return 0.0
    passes = 1 if module.frozen else 3
    bw = cluster.net.bw_inter if group > cluster.net.ranks_per_node else cluster.net.bw_intra
    return passes * (group - 1) / group * 2.0 * module.parameters / bw


def dispatch_collectives(
    batch: Batch,
    layout: Layout,
    mode: str,
    config: ModelConfig,
    ranks_per_node: int,
    scatter: comm.Volumes | None = None,
) -> tuple[list[tuple[str, comm.Volumes]], list[tuple[str, comm.Volumes]]]:
    """The all-to-alls of one step as ``(dispatcher, volumes)``, forward and backward.

    As ``orchmllm.dist.orchestrator`` runs them: raw encoder inputs to the encoder layouts (``full``
    only), then one move per encoder output and one for text to the LLM layout; backward, each
    encoder output's gradient goes back. ``none`` and ``disttrain`` move nothing. ``scatter``
    (split examples' rows from their home to the pieces' ranks, dispatcher ``"pieces"``) runs
    after the LLM moves, its gradient back first in backward.
    """
    if mode not in ("llm", "full"):
        return [], []
    d = batch.num_ranks
    src = batch.example_src

    def vol(s: np.ndarray, t: np.ndarray, b: np.ndarray) -> comm.Volumes:
        return comm.volumes(s, t, b, num_ranks=d, ranks_per_node=ranks_per_node)

    fwd, bwd = [], []
    if mode == "full":
        for name in config.encoders:
            it = batch.of(name)
            rows = it.raw * float(raw_row_bytes(config, name))
            fwd.append((name, vol(src[it.example], layout.items[name], rows)))
    pieces = llm_pieces(batch, config, layout)
    to = layout.example[pieces.example]
    for phase in (*config.encoders, LLM):  # each encoder's outputs, then text
        k = pieces.phase == phase
        fwd.append((LLM, vol(pieces.src[k], to[k], pieces.bytes[k])))
        if phase != LLM:
            bwd.append((LLM, vol(to[k], pieces.src[k], pieces.bytes[k])))
    if scatter is not None and scatter.moves:
        back = comm.Volumes(
            scatter.recv_intra, scatter.recv_inter, scatter.sent_intra, scatter.sent_inter,
            scatter.kept,
        )  # fmt: skip
        fwd.append(("pieces", scatter))
        bwd.insert(0, ("pieces", back))
    return fwd, bwd


def by_dispatcher(collectives: list[tuple[str, comm.Volumes]]) -> dict[str, comm.Volumes]:
    """Volumes summed per dispatcher (the paper's Figure 13 groups traffic this way)."""
    out: dict[str, comm.Volumes] = {}
    for name, v in collectives:
        out[name] = out[name] + v if name in out else v
    return out


def simulate_step(
    batch: Batch,
    layout: Layout,
    mode: str,
    *,
    config: ModelConfig,
    modules: Mapping[str, Submodule],
    recipe: TrainRecipe,
    cluster: Cluster | None = None,
) -> StepResult:
    """Model one step of ``batch`` laid out as ``layout`` under the training ``recipe`` (see
    the module docstring)."""
    cluster = cluster or Cluster()
    d = batch.num_ranks
    phases = (*config.encoders, LLM)
    lengths = {name: batch.encoder_lengths(name, config) for name in config.encoders}
    lengths[LLM] = batch.llm_lengths(config)
    dst = {**layout.items, LLM: layout.example}
    rpn = cluster.net.ranks_per_node
    table = cp.piece_table(layout.pieces, lengths[LLM], d, rpn)
    compute, mean_compute, fsdp, critical = {}, {}, {}, {}
    useful = 0.0
    for phase in phases:
        m = modules[phase]
        if phase == LLM:
            t = cp.llm_rank_ms(m, lengths[phase], layout, table, d) * 1e-3
            kv = cp.kv_seconds(table, config, recipe, m, cluster.net, d)
        else:
            t, kv = m.times_ms(lengths[phase], dst[phase], d) * 1e-3, 0.0
        compute[phase] = float(t.max())
        critical[phase] = float((t + kv).max())
        mean_compute[phase] = float(t.mean())
        fsdp[phase] = fsdp_seconds(m, d, cluster)
        useful += m.useful_flops(lengths[phase])
    scatter = None
    if table.item.size:
        scatter = cp.scatter_volumes(
            table, layout.example, config, recipe, num_ranks=d, ranks_per_node=rpn
        )
    fwd, bwd = dispatch_collectives(batch, layout, mode, config, rpn, scatter)
    # a move where every item stays is skipped by all ranks together (the plan is global)
    dispatch_fwd = sum(cluster.dispatch_seconds(v) for _, v in fwd if v.moves)
    dispatch_bwd = sum(cluster.dispatch_seconds(v) for _, v in bwd if v.moves)
    step = sum(max(critical[p], fsdp[p]) for p in phases) + dispatch_fwd + dispatch_bwd
    # forward share of a phase: all of a frozen module, a third of a trained one, a quarter of
    # a recomputing one (forward, recomputed forward, backward at 1:1:2; the head counted alike)
    fwd_share = {
        p: 1.0
        if modules[p].frozen
        else FORWARD_FRACTION / (1.0 + FORWARD_FRACTION * modules[p].recomputes)
        for p in phases
    }
    forward = sum(max(critical[p], fsdp[p]) * fwd_share[p] for p in phases) + dispatch_fwd
    mem = cluster.memory
    features = mem.rank_features(config, recipe, batch, layout)
    moves = moves_of_layout(batch, layout, config)
    static = mem.static_bytes(config, recipe, d)
    phases = mem.phase_peaks(
        config, recipe, features, num_ranks=d, moves=moves, communicator=cluster.communicator
    )
    extra = cp.memory_terms(table, layout.example, config, recipe, modules[LLM], d)
    phases = {p: v + extra[p] if p in extra else v for p, v in phases.items()}
    memory = static + np.max(np.stack(list(phases.values())), axis=0)
    mean = {k: v.mean(keepdims=True) for k, v in features.items()}
    return StepResult(
        step_time_s=step,
        forward_s=forward,
        compute_s=compute,
        mean_compute_s=mean_compute,
        fsdp_s=fsdp,
        dispatch_fwd_s=dispatch_fwd,
        dispatch_bwd_s=dispatch_bwd,
        useful_flops=useful,
        llm_tokens=int(lengths[LLM].sum()),
        mfu=useful / (d * step * cluster.peak_flops) if step > 0 else 0.0,
        peak_memory_bytes=float(memory.max()),
        phase_memory_bytes={p: static + float(v.max()) for p, v in phases.items()},
        balanced_memory_bytes=float(
            mem.peak_bytes(
                config, recipe, mean, num_ranks=d, moves=moves, communicator=cluster.communicator
            )[0]
        ),
        budget_bytes=mem.budget_bytes,
        dispatchers=by_dispatcher(fwd),
        plan_ms=layout.plan_ms,
        plan_hidden=layout.plan_ms * 1e-3 < step,
        context_parallel_s=critical[LLM] - compute[LLM],
        items_split=int(layout.pieces.items.size),
        pieces=int(table.item.size),
    )
