"""Context parallelism on the simulator: the LLM phase's pieces, their compute, traffic and memory.

The planner cuts an example into pieces (``StepOptions.context_parallel``, the record
:class:`orchmllm.planner.context_parallel.Pieces`); this module says what a step of such a plan
costs, modelled on the runtime being built (issue 40):

- **where**: a split example moves whole to its *home*, the rank of its first token (the LLM
  dispatch as for any example); the home assembles the sequence and sends every other member
  its token rows (hidden-size rows in the compute dtype, one extra all-to-all forward, its
  gradient backward: :func:`scatter_volumes`).
- **compute**: a piece of ``t`` tokens of an example of ``L`` tokens cut in ``k`` pieces costs
  :meth:`orchmllm.planner.cost.CostModel.piece_costs` of the LLM's calibrated cost (``alpha*t
  + beta*L^2/k``, load-balanced causal chunking): the planner's own model, so the simulated
  compute of a piece agrees with the plan's loads by construction.
- **traffic** (:func:`kv_seconds`): in every LLM layer each member all-gathers the sequence's
  keys and values in its group: it receives the other members' ``(L - t)`` rows of ``2 *
  kv_heads * head_dim`` values forward, and backward a reduce-scatter of the same size; the
  recomputed forward of a checkpointed block gathers again. Bytes over NVLink when the
  example's pieces are in one node, else over the network (:class:`orchmllm.sim.comm.Network`),
  plus the ring's per-peer latency per collective. Assumed not to overlap compute (the
  attention waits for the gathered keys and values): a rank's LLM time is its compute plus its
  gathers, on the phase's critical path.
- **memory** (:func:`memory_terms`): a member's rows are its pieces' tokens
  (:func:`llm_sequences`, read by the memory model's features), plus the gathered keys and
  values SDPA saves for backward: ``2 * L * kv_dim`` values per layer (a new buffer, the
  member's own rows included): every layer's without activation checkpointing, only the
  recomputed block's (and their gradient before the reduce-scatter) with it; the home also
  holds the assembled sequence beyond its own piece (as a rank holds its assembled embeddings
  through the LLM's forward today). The terms are added to the phase peaks (forward,
  backward): an upper bound where the buffer is not live at the phase's peak.

The baseline *fixed* context parallelism (:func:`fixed_layout`) is classic CP: the ranks in
groups of ``N``, every example cut over its group's ``N`` ranks (``min(N, L)`` pieces, the
planner's chunking), the examples balanced over the groups by LPT on the LLM's cost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from orchmllm.config import ModelConfig, TrainRecipe
from orchmllm.planner.balance import balance
from orchmllm.planner.context_parallel import Pieces
from orchmllm.schema import LLM, is_integer
from orchmllm.sim import comm
from orchmllm.sim.batch import Batch
from orchmllm.sim.compute import Submodule
from orchmllm.sim.layout import Layout, plan
from orchmllm.sim.replay_env import Dtypes

__all__ = [
    "ContextParallel",
    "PieceTable",
    "fixed_layout",
    "fixed_pieces",
    "kv_seconds",
    "layout_of",
    "llm_rank_ms",
    "llm_sequences",
    "memory_terms",
    "piece_table",
    "scatter_volumes",
]


@dataclass(frozen=True)
class ContextParallel:
    """How a simulated step splits the LLM phase's examples.

    Attributes:
        size: the group size ``N`` (1: no splitting).
        fixed: classic context parallelism: every example over its group's ``N`` ranks
            (:func:`fixed_layout`); else the planner's (split what exceeds ``max_load_ms``
            or lowers the slowest rank).
        max_load_ms: the planner's budget per rank in the LLM's cost (ms), or None.

    Raises:
        ValueError: ``size`` is not an integer >= 1; ``fixed`` or ``max_load_ms`` with
            ``size`` 1; ``max_load_ms`` not > 0.
    """

    size: int = 1
    fixed: bool = False
    max_load_ms: float | None = None

    def __post_init__(self) -> None:
        if not is_integer(self.size) or self.size < 1:
            raise ValueError(f"size must be an integer >= 1, got {self.size!r}")
        if self.size == 1 and (self.fixed or self.max_load_ms is not None):
            raise ValueError(f"fixed and max_load_ms need size > 1, got {self!r}")
        if self.max_load_ms is not None and not self.max_load_ms > 0:
            raise ValueError(f"max_load_ms must be > 0 or None, got {self.max_load_ms!r}")

    @property
    def label(self) -> str:
        """``none``, ``fixed N`` or ``planned N`` (a record's ``context_parallel``)."""
        if self.size == 1:
            return "none"
        return f"{'fixed' if self.fixed else 'planned'} {self.size}"


def layout_of(
    batch: Batch,
    mode: str,
    cp: ContextParallel,
    *,
    config: ModelConfig,
    modules: Mapping[str, Submodule],
    placement: str,
    ranks_per_node: int,
    policies: Mapping[str, str] | None = None,
) -> Layout:
    """The step's layout under ``cp``: :func:`fixed_layout`, else the step planner's (with
    ``context_parallel`` and the budget where ``cp.size`` > 1)."""
    if cp.fixed:
        return fixed_layout(
            batch, cp.size, config=config, modules=modules, ranks_per_node=ranks_per_node,
            policies=policies,
        )  # fmt: skip
    split = {}
    if cp.size > 1:
        split = {"context_parallel": cp.size, "llm_max_load": cp.max_load_ms}
    return plan(
        batch, mode, config=config, modules=modules, placement=placement,
        ranks_per_node=ranks_per_node, policies=policies, **split,
    )  # fmt: skip


def fixed_pieces(lengths: np.ndarray, first_rank: np.ndarray, size: int) -> Pieces:
    """Classic context parallelism's pieces: example ``i`` in ``k = min(size, L_i)`` pieces on
    ranks ``first_rank[i] .. first_rank[i]+k-1`` with the planner's load-balanced chunking
    (``2k`` chunks of ``floor`` bounds, the ``j``-th rank holds chunks ``j`` and ``2k-1-j``;
    see :mod:`orchmllm.planner.context_parallel`). Every example needs a token."""
    L = np.asarray(lengths, dtype=np.int64)
    if L.size and L.min() < 1:
        raise ValueError(f"lengths must be >= 1, got {int(L.min())}")
    k = np.minimum(size, L)
    item = np.repeat(np.arange(L.size, dtype=np.int64), k)
    j = np.arange(item.size, dtype=np.int64) - np.repeat(np.cumsum(k) - k, k)
    K, Lx = k[item], L[item]

    def bound(c: np.ndarray) -> np.ndarray:
        return c * Lx // (2 * K)

    middle = j == K - 1  # its two chunks touch: one range
    a0, a1 = bound(j), np.where(middle, bound(j + 2), bound(j + 1))
    b0, b1 = bound(2 * K - 1 - j), bound(2 * K - j)
    rank = np.asarray(first_rank, dtype=np.int64)[item] + j
    second = ~middle & (b1 > b0)
    it = np.concatenate([item, item[second]])
    rk = np.concatenate([rank, rank[second]])
    start = np.concatenate([a0, b0[second]])
    end = np.concatenate([a1, b1[second]])
    keep = end > start
    order = np.lexsort((start[keep], it[keep]))
    return Pieces(it[keep][order], rk[keep][order], start[keep][order], end[keep][order])


def fixed_layout(
    batch: Batch,
    size: int,
    *,
    config: ModelConfig,
    modules: Mapping[str, Submodule],
    ranks_per_node: int,
    policies: Mapping[str, str] | None = None,
) -> Layout:
    """Classic context parallelism of group size ``size`` (module docstring): the encoders as
    OrchMLLM's ``full`` mode balances them, the examples balanced over the ``num_ranks /
    size`` groups (LPT on the LLM's packed cost, from the group they were sampled in), each
    cut over its group's ranks; an example's home is its group's first rank."""
    d = batch.num_ranks
    if not is_integer(size) or size < 2 or d % size:
        raise ValueError(f"size must be an integer >= 2 dividing num_ranks={d}, got {size!r}")
    base = plan(
        batch, "full", config=config, modules=modules, placement="none",
        ranks_per_node=ranks_per_node, policies=policies,
    )  # fmt: skip
    seq = batch.llm_lengths(config)
    src = batch.example_src // size
    groups = balance(seq, d // size, "greedy", src=src, cost=modules[LLM].cost)
    home = np.asarray(groups.dst, dtype=np.int64) * size
    return Layout(home, base.items, base.plan_ms, fixed_pieces(seq, home, size))


@dataclass(frozen=True)
class PieceTable:
    """The pieces as the step model reads them: one row per (example, rank), int64 arrays.

    Attributes:
        item: the split example.
        rank: the rank computing the piece.
        tokens: the piece's tokens (its ranges summed).
        length: the example's whole sequence.
        pieces: how many ranks the example is on.
        spans_nodes: whether the example's ranks are on more than one node (bool).
        block_start: the first rank of the smallest aligned block of ranks (a power of two
            long) holding the example's pieces: the group its gathers run in.
        block_size: that block's ranks.
    """

    item: np.ndarray
    rank: np.ndarray
    tokens: np.ndarray
    length: np.ndarray
    pieces: np.ndarray
    spans_nodes: np.ndarray
    block_start: np.ndarray
    block_size: np.ndarray


def piece_table(
    pieces: Pieces, lengths: np.ndarray, num_ranks: int, ranks_per_node: int
) -> PieceTable:
    """``pieces`` summed per (example, rank), with each example's length, piece count, whether
    its ranks span nodes and its block."""
    uniq, inv = np.unique(pieces.item * num_ranks + pieces.rank, return_inverse=True)
    tokens = np.bincount(inv, weights=pieces.end - pieces.start).astype(np.int64)
    item, rank = uniq // num_ranks, uniq % num_ranks
    split, per = np.unique(item, return_inverse=True)
    lo = np.full(split.size, num_ranks)
    hi = np.full(split.size, -1)
    np.minimum.at(lo, per, rank)
    np.maximum.at(hi, per, rank)
    size = np.ones(split.size, dtype=np.int64)
    while np.any(wide := lo // size != hi // size):
        size[wide] *= 2
    spans = lo // ranks_per_node != hi // ranks_per_node
    L = np.asarray(lengths, dtype=np.int64)[item]
    return PieceTable(
        item, rank, tokens, L, np.bincount(per)[per], spans[per], (lo // size * size)[per],
        size[per],
    )  # fmt: skip


def _is_split(layout: Layout, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=bool)
    out[layout.pieces.item] = True
    return out


def llm_sequences(
    lengths: np.ndarray, layout: Layout, num_ranks: int
) -> tuple[np.ndarray, np.ndarray]:
    """The LLM phase's sequences as each rank computes them: ``(tokens, rank)`` of every
    whole example and of every piece (one per example and rank)."""
    L = np.asarray(lengths, dtype=np.int64)
    if not layout.pieces.item.size:
        return L, layout.example
    whole = ~_is_split(layout, L.size)
    p = layout.pieces
    uniq, inv = np.unique(p.item * num_ranks + p.rank, return_inverse=True)
    tokens = np.bincount(inv, weights=p.end - p.start).astype(np.int64)
    ranks = np.concatenate([layout.example[whole], uniq % num_ranks])
    return np.concatenate([L[whole], tokens]), ranks


def llm_rank_ms(
    module: Submodule, lengths: np.ndarray, layout: Layout, table: PieceTable, num_ranks: int
) -> np.ndarray:
    """Each rank's LLM compute (ms): its whole examples through the module's cost, and its
    pieces at :meth:`~orchmllm.planner.cost.CostModel.piece_costs` (the planner's model; its
    ``const`` once per rank that holds anything, as for whole examples)."""
    cost = module.cost
    L = np.asarray(lengths, dtype=np.float64)
    if not table.item.size:
        return module.times_ms(L, layout.example, num_ranks)
    whole = ~_is_split(layout, L.size)
    bare = dataclasses.replace(cost, const=0.0)
    t = bare.loads(L[whole], layout.example[whole], num_ranks)
    t += np.bincount(
        table.rank,
        weights=cost.piece_costs(table.length, table.tokens, table.pieces),
        minlength=num_ranks,
    )
    busy = np.bincount(layout.example[whole], minlength=num_ranks) > 0
    busy |= np.bincount(table.rank, minlength=num_ranks) > 0
    return np.maximum(t + cost.const * cost.multiplier * busy, 0.0)


def _kv_row_bytes(config: ModelConfig, recipe: TrainRecipe) -> int:
    """Bytes of one token's keys and values in one layer: ``2 * kv_heads * head_dim`` values
    in the compute dtype."""
    m = config.llm
    return 2 * (m.hidden // m.heads) * m.kv_heads * Dtypes.of(recipe.precision).compute


def kv_seconds(
    table: PieceTable,
    config: ModelConfig,
    recipe: TrainRecipe,
    module: Submodule,
    net: comm.Network,
    num_ranks: int,
) -> np.ndarray:
    """Each rank's time in the keys' and values' gathers of one step (module docstring): per
    layer and pass (forward, backward's reduce-scatter, the recomputed forward of a
    checkpointed block), its pieces' other members' ``(L - t)`` rows at the link speed of
    their group (NVLink inside a node, else the network), plus one collective's peer
    latencies (``block_size - 1``, a ring) per block it gathers in: the examples of one
    block gather together."""
    if not table.item.size:
        return np.zeros(num_ranks)
    passes = config.llm.layers * (3 if module.recomputes else 2)
    bw = np.where(table.spans_nodes, net.bw_inter, net.bw_intra)
    per = (table.length - table.tokens) * _kv_row_bytes(config, recipe) / bw
    seconds = np.bincount(table.rank, weights=per, minlength=num_ranks)
    base = num_ranks + 1  # a block holds up to num_ranks ranks
    uniq = np.unique((table.rank * base + table.block_start) * base + table.block_size)
    latency = (uniq % base - 1) * net.peer_latency_s
    seconds += np.bincount(uniq // (base * base), weights=latency, minlength=num_ranks)
    return passes * seconds


def scatter_volumes(
    table: PieceTable,
    home: np.ndarray,
    config: ModelConfig,
    recipe: TrainRecipe,
    *,
    num_ranks: int,
    ranks_per_node: int,
) -> comm.Volumes:
    """The home-to-members move of the pieces' rows (hidden-size rows in the compute dtype);
    backward, its gradient runs the other way (the same volumes, sent and received swapped)."""
    row = config.llm.hidden * Dtypes.of(recipe.precision).compute
    return comm.volumes(
        home[table.item], table.rank, table.tokens * float(row), num_ranks=num_ranks,
        ranks_per_node=ranks_per_node,
    )  # fmt: skip


def memory_terms(
    table: PieceTable,
    home: np.ndarray,
    config: ModelConfig,
    recipe: TrainRecipe,
    module: Submodule,
    num_ranks: int,
) -> dict[str, np.ndarray]:
    """Bytes a rank holds because of its pieces beyond what its own tokens' rows account for,
    per phase (``forward``, ``backward``; module docstring)."""
    zero = np.zeros(num_ranks)
    if not table.item.size:
        return {"forward": zero, "backward": zero}
    s = Dtypes.of(recipe.precision).compute
    layer = np.bincount(
        table.rank, weights=table.length * float(_kv_row_bytes(config, recipe)), minlength=num_ranks
    )
    at_home = table.rank == home[table.item]
    assembled = np.bincount(
        table.rank[at_home],
        weights=(table.length - table.tokens)[at_home] * float(config.llm.hidden * s),
        minlength=num_ranks,
    )
    if module.recomputes:  # one block's gathered K/V; backward also their gradient
        saved_fwd, saved_bwd = layer, 2 * layer
    else:  # every layer's, and backward the current layer's gradient
        saved_fwd = config.llm.layers * layer
        saved_bwd = saved_fwd + layer
    return {"forward": saved_fwd + assembled, "backward": saved_bwd + assembled}
