"""Batch Post-Balancing Dispatcher: gather lengths, plan, move the batch, and move it back.

Each rank passes the mini-batch it sampled. Only the lengths are all-gathered (on a CPU
group, so it can overlap with GPU work); every rank then runs the same balancing policy on
the same numbers, builds the same :class:`~orchmllm.planner.plan.Rearrangement`, and moves its
examples with one all-to-all per dtype. A plan that is not a pure function of the lengths
(``placement="ilp"``, time-limited) is computed on rank 0 and broadcast instead
(:func:`~orchmllm.dist.agreement.agreed_plan`). :meth:`BatchDispatcher.undo` moves results
computed on the balanced layout back (autograd-aware), so a loss normalised over the
global batch has the same gradient with or without dispatch.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from orchmllm.dist import comm
from orchmllm.dist.agreement import PeerFailed
from orchmllm.dist.move_path import MovePath
from orchmllm.dist.topology import Topology
from orchmllm.planner.balance import balance, plan_is_deterministic
from orchmllm.planner.cost import CostModel, imbalance
from orchmllm.planner.plan import Rearrangement
from orchmllm.planner.policies import POLICIES
from orchmllm.planner.validate import check_caps

__all__ = ["BatchDispatcher", "Dispatched", "PlanMismatchError", "debug_enabled"]

LAYOUTS = ("packed", "padded")
_CREATED = itertools.count()  # dispatchers are built on every rank together: the same ids


PlanMismatchError = comm.MismatchError
"""Ranks pass tensors or options that do not agree, or computed different plans."""


def debug_enabled() -> bool:
    """Debug mode: ``ORCHMLLM_DEBUG=1`` or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``."""
    flag = os.environ.get("ORCHMLLM_DEBUG", "").strip().lower()
    return flag in ("1", "true", "yes", "on") or (
        os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
    )


@dataclass
class Dispatched:
    """A batch in the balanced layout, and what :meth:`BatchDispatcher.undo` needs.

    ``tokens``, ``lengths`` and ``items`` hold this rank's new items in destination-slot order.

    Attributes:
        tokens: name -> token-major tensor (packed: ``[sum(lengths), ...]``; padded:
            ``[B, max(lengths), ...]``, ``pad_value`` elsewhere).
        lengths: int64 ``[B]``, the new items' lengths.
        items: name -> item-major tensor ``[B, ...]``.
        plan: the :class:`~orchmllm.planner.plan.Rearrangement` executed, the same on every rank.
        stats: the step's metrics (see :meth:`BatchDispatcher.dispatch`).
        global_lengths: the gathered lengths in global item order (``plan.items_at(rank)``
            indexes them).
        layout: ``packed`` or ``padded``, as dispatched.
        rank: this rank in the dispatcher's group.
        source_pad_to: padded layout: each token tensor's padded length ``T`` before the move
            (:meth:`BatchDispatcher.undo` pads back to the largest); empty when packed.
    """

    tokens: dict[str, torch.Tensor]
    lengths: torch.Tensor
    items: dict[str, torch.Tensor]
    plan: Rearrangement
    stats: dict[str, Any]
    global_lengths: np.ndarray
    layout: str
    rank: int
    source_pad_to: dict[str, int] = field(default_factory=dict)


def _row_bytes(t: torch.Tensor, lead: int) -> int:
    """Bytes per row once the ``lead`` leading dims are flattened into rows."""
    return int(np.prod(t.shape[lead:], dtype=np.int64)) * t.element_size()


def _pack(t: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[B, T, ...]`` -> ``[sum(lengths), ...]`` (valid positions, item by item)."""
    mask = torch.arange(t.shape[1], device=t.device)[None, :] < lengths.to(t.device)[:, None]
    return t[mask]


def _pad(packed: torch.Tensor, lengths: torch.Tensor, pad_to: int, value: float) -> torch.Tensor:
    """``[sum(lengths), ...]`` -> ``[B, pad_to, ...]`` filled with ``value`` elsewhere."""
    lengths = lengths.to(packed.device)
    out = packed.new_full((lengths.numel(), pad_to, *packed.shape[1:]), value)
    mask = torch.arange(pad_to, device=packed.device)[None, :] < lengths[:, None]
    out[mask] = packed
    return out


class BatchDispatcher:
    """Rebalances variable-length mini-batches across the ranks of a topology's group.

    Construct it on every rank together (without a ``topology`` it builds its own, a
    collective). What each rank passes to :meth:`dispatch` (tensor names, dtypes, trailing
    shapes, ``requires_grad``, the policy and its options, a precomputed plan) is always
    compared, at no extra collective: it rides in the lengths gather.

    Args:
        policy: a name from ``orchmllm.POLICIES`` (None: ``greedy`` for the packed layout,
            ``padded_cost`` for the padded one).
        topology: the job's process groups (:class:`orchmllm.dist.topology.Topology`): the
            data-parallel group the batch moves on, the gloo group the lengths are gathered
            on, ranks per node (for ``greedy_stay``, ``placement`` and the intra-/inter-node
            byte counts) and the timeout of every collective. None builds one over the
            default group that this dispatcher owns, so it never shares a group with a
            loader prefetching in a thread (dropping the dispatcher destroys the group);
            share one topology between objects that do not gather at the same time.
        placement: ``none``, or how balanced batches are permuted over the ranks to keep
            traffic inside nodes (``orchmllm.planner.placement``; needs the topology's
            ``ranks_per_node``); ``ilp`` is time-limited, so its plan is computed on rank 0
            and broadcast.
        cost: the cost model the policy balances (None: the policy's default); the load
            statistics use it too (None: the layout's).
        layout: ``packed`` (token tensors are ``[sum(lengths), ...]``) or ``padded``
            (``[B, T, ...]``, re-padded to the new local maximum after the move).
        check_plan: also all-gather a fingerprint of the computed plan and raise
            :class:`PlanMismatchError` when ranks disagree (None: on in debug mode, see
            :func:`debug_enabled`).
        max_items_per_rank: a cap on the items any rank gets, which every plan meets.
        max_load_per_rank: a cap on any rank's load, in the policy's cost (a memory budget,
            e.g. tokens for packed batches), which every plan meets. A cap no plan meets
            raises :class:`orchmllm.InfeasibleCapError` in :meth:`dispatch`, naming the
            smallest value that works.
        pad_value: the value of padding positions in the padded layout (:meth:`dispatch`
            and :meth:`undo` outputs).

    Raises:
        ValueError: an unknown ``layout`` or ``policy``, a ``cost`` that is not a
            :class:`~orchmllm.planner.cost.CostModel`, a cap that is not an integer >= 1 (items) or
            a number > 0 (load), or a ``placement`` with a topology without
            ``ranks_per_node``.
        RuntimeError: ``torch.distributed`` is not initialised.
    """

    def __init__(
        self,
        policy: str | None = None,
        *,
        topology: Topology | None = None,
        placement: str = "none",
        cost: CostModel | None = None,
        layout: str = "packed",
        check_plan: bool | None = None,
        max_items_per_rank: int | None = None,
        max_load_per_rank: float | None = None,
        pad_value: float = 0,
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if policy is None:
            policy = "greedy" if layout == "packed" else "padded_cost"
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if cost is not None and not isinstance(cost, CostModel):
            raise ValueError(f"cost must be a CostModel or None, got {cost!r}")
        check_caps(max_items_per_rank, max_load_per_rank)
        if placement != "none" and (topology is None or topology.ranks_per_node is None):
            raise ValueError(
                f"placement={placement!r} needs ranks_per_node: pass "
                "topology=Topology.build(ranks_per_node=...)"
            )
        if not dist.is_initialized():
            raise RuntimeError("BatchDispatcher needs an initialised torch.distributed group")
        self.topology = topology if topology is not None else Topology.build()
        self.policy = policy
        self.placement = placement
        self.layout = layout
        self.max_items_per_rank = max_items_per_rank
        self.max_load_per_rank = max_load_per_rank
        self.pad_value = pad_value
        self.check_plan = debug_enabled() if check_plan is None else bool(check_plan)
        self.deterministic = plan_is_deterministic(placement=placement, policies=(policy,))
        # Stats use the layout's cost; the policy itself gets `cost` (None: its default).
        self.cost = cost
        self._id, self._calls = next(_CREATED), 0
        self._path = MovePath(self.topology)
        self.stats_cost = cost if cost is not None else CostModel(layout)

    # -- public -------------------------------------------------------------------------

    def dispatch(
        self,
        tokens: dict[str, torch.Tensor],
        lengths: torch.Tensor,
        items: dict[str, torch.Tensor] | None = None,
        *,
        plan: Rearrangement | None = None,
    ) -> Dispatched:
        """Move this rank's items to their balanced ranks; every rank calls this together.

        ``plan``: a plan computed ahead for exactly these items, used instead of planning
        here, e.g. ``PlannedBatch.plan`` of a ``BalancedDataLoader(mode="local")`` that
        planned it in its background thread, so only the gather and the all-to-all remain
        on the step. The lengths are still gathered (the move needs every item's size);
        a plan whose items are not the gathered ones (count per rank, gather order) raises
        ``ValueError`` on every rank.

        Args:
            tokens: name -> token-major tensor of this rank's items (packed:
                ``[sum(lengths), ...]``; padded: ``[B, T, ...]`` with ``T >= max(lengths)``).
            lengths: 1-D integer tensor ``[B]``, the tokens of each item (>= 0).
            items: name -> item-major tensor ``[B, ...]`` (labels, ids) that moves with its
                item (None: none).
            plan: a plan computed ahead for exactly these items (None: plan here).

        Returns:
            The :class:`Dispatched` batch. Its ``stats``: ``imbalance_before``/``_after``,
            ``loads_before``/``_after`` (per rank, in the cost), ``bytes_intra``/``_inter``
            (summed over ranks), this rank's ``bytes_sent``/``bytes_recv``,
            ``bytes_sent_max_rank``, ``items_moved``, ``tokens_moved``, ``tokens_kept``,
            ``num_items``, ``padded_tokens_before``/``_after`` (padded layout),
            ``gather_ms``, ``plan_ms``, ``move_ms``, and the policy's own statistics.

        Raises:
            ValueError: this rank's ``lengths``, ``tokens`` or ``items`` are malformed
                (raised before any collective, on that rank alone), ``plan`` is not a
                :class:`~orchmllm.planner.plan.Rearrangement`, or it does not match the gathered
                lengths.
            InfeasibleCapError: a cap no plan meets (on every rank; with a broadcast plan,
                on rank 0, and :class:`~orchmllm.dist.agreement.PeerFailed` on the others).
            PlanMismatchError: the ranks pass different tensor names, dtypes, trailing
                shapes, ``requires_grad``, options or plans; or, with ``check_plan``, they
                computed different plans.
            PeerFailed: a collective did not complete within ``timeout`` (or a peer's
                connection closed), naming the ranks that did not arrive (a roll call in the
                job's store, :func:`orchmllm.dist.comm.roll_call`).
        """
        items = {} if items is None else dict(items)
        local_lengths = self._check_inputs(tokens, lengths, items)
        if plan is not None and not isinstance(plan, Rearrangement):
            raise ValueError(f"plan must be a Rearrangement or None, got {type(plan).__name__}")
        with self._named("dispatch"):
            return self._dispatch(tokens, lengths, items, plan, local_lengths)

    def _dispatch(
        self,
        tokens: dict[str, torch.Tensor],
        lengths: torch.Tensor,
        items: dict[str, torch.Tensor],
        plan: Rearrangement | None,
        local_lengths: np.ndarray,
    ) -> Dispatched:
        rank = self.topology.rank
        t0 = time.perf_counter()
        rows, src = comm.all_gather_rows(
            local_lengths[:, None],
            group=self.topology.meta_group,
            timeout=self.topology.timeout,
            agree=self._agreement(tokens, items, plan),
        )
        glob = rows[:, 0] if rows.size else np.zeros(0, dtype=np.int64)
        t1 = time.perf_counter()
        plan, policy_stats = self._plan(glob, src, plan)
        t2 = time.perf_counter()
        if self.check_plan:
            self._check_plan(plan, glob)

        new_ids = plan.items_at(rank)
        new_lengths = torch.as_tensor(glob[new_ids], dtype=torch.int64, device=lengths.device)
        tok_names, item_names = sorted(tokens), sorted(items)
        flat = [self._to_packed(tokens[k], lengths) for k in tok_names]
        moved = self._path.move(
            plan,
            flat + [items[k] for k in item_names],
            [glob] * len(flat) + [np.ones_like(glob)] * len(item_names),
        )
        t3 = time.perf_counter()
        new_max = int(glob[new_ids].max()) if new_ids.size else 0
        new_tokens = {
            k: self._from_packed(m, new_lengths, new_max)
            for k, m in zip(tok_names, moved[: len(flat)], strict=True)
        }
        new_items = dict(zip(item_names, moved[len(flat) :], strict=True))
        stats = self._stats(plan, glob, policy_stats, tokens, items)
        stats.update(gather_ms=1e3 * (t1 - t0), plan_ms=1e3 * (t2 - t1), move_ms=1e3 * (t3 - t2))
        return Dispatched(
            tokens=new_tokens,
            lengths=new_lengths,
            items=new_items,
            plan=plan,
            stats=stats,
            global_lengths=glob,
            layout=self.layout,
            rank=rank,
            source_pad_to={k: int(tokens[k].shape[1]) for k in tok_names}
            if self.layout == "padded"
            else {},
        )

    def _plan(
        self, glob: np.ndarray, src: np.ndarray, given: Rearrangement | None
    ) -> tuple[Rearrangement, dict[str, float]]:
        """The plan of the gathered lengths (``given``, checked, or the policy's; the same
        on every rank) and the policy's own statistics."""
        world = self.topology.size
        if given is not None:
            _check_given_plan(given, src, world)
            return given, {}
        assignment = self._path.plan(
            lambda: balance(
                glob,
                world,
                self.policy,
                src=src,
                cost=self.cost,
                ranks_per_node=self.topology.ranks_per_node,
                placement=self.placement,
                max_items_per_rank=self.max_items_per_rank,
                max_load_per_rank=self.max_load_per_rank,
            ),
            deterministic=self.deterministic,
        )
        return Rearrangement.from_assignment(src, assignment.dst, num_ranks=world), assignment.stats

    def undo(
        self, dispatched: Dispatched, tensor: torch.Tensor, *, items: bool = False
    ) -> torch.Tensor:
        """Move a tensor computed on the balanced layout back to the original layout.

        Token-major by default (packed ``[sum(new lengths), ...]`` or padded
        ``[B', T', ...]``, returned as ``[B, T, ...]`` with the original ``T`` when the
        dispatched tensors were padded); ``items=True`` for item-major ``[B', ...]``.
        Autograd-aware: the backward is the forward move. Every rank calls this together.

        Args:
            dispatched: what :meth:`dispatch` returned for this batch.
            tensor: a result on the balanced layout: token-major, rows aligned with
                ``dispatched.lengths``, or item-major ``[B', ...]`` with ``items=True``.
            items: ``tensor`` is item-major (one row per item) instead of token-major.

        Returns:
            The tensor in this rank's original layout and item order: packed
            ``[sum(lengths), ...]``, padded ``[B, T, ...]`` (``pad_value`` elsewhere), or
            ``[B, ...]`` with ``items=True``.

        Raises:
            ValueError: ``tensor``'s rows do not match the dispatched items.
            PeerFailed: the move did not complete within ``timeout``, naming the ranks that
                did not arrive (as :meth:`dispatch`).
        """
        with self._named("undo"):
            return self._undo(dispatched, tensor, items=items)

    def _undo(self, dispatched: Dispatched, tensor: torch.Tensor, *, items: bool) -> torch.Tensor:
        plan = dispatched.plan
        glob = dispatched.global_lengths
        if items:
            return self._path.move_back(plan, [tensor], [np.ones_like(glob)])[0]
        flat = self._to_packed(tensor, dispatched.lengths, layout=dispatched.layout)
        out = self._path.move_back(plan, [flat], [glob])[0]
        if dispatched.layout == "packed":
            return out
        orig_ids = plan.source_items_at(dispatched.rank)
        orig_lengths = torch.as_tensor(glob[orig_ids], dtype=torch.int64)
        pad_to = max(dispatched.source_pad_to.values(), default=0)
        pad_to = max(pad_to, int(orig_lengths.max()) if orig_ids.size else 0)
        return _pad(out, orig_lengths, pad_to, self.pad_value)

    # -- helpers ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _named(self, what: str) -> Iterator[None]:
        """This dispatcher's next collective call, ``what``: a collective that fails (timed
        out, a peer's connection closed) is raised as :class:`PeerFailed` naming the ranks
        that did not answer a roll call, as the trainer names them; errors the ranks raise
        together (mismatches, a peer's reported failure) pass unchanged."""
        self._calls += 1
        call = f"dispatcher-{self._id}-{self._calls}"
        try:
            yield
        except RuntimeError as exc:
            if isinstance(exc, PlanMismatchError | PeerFailed):
                raise
            where = f"rank {self.topology.rank}: BatchDispatcher.{what} (call {self._calls})"
            named = self._path.absent(exc, call=call, what=where)
            if named is None:
                raise
            raise named from exc

    def _to_packed(
        self, t: torch.Tensor, lengths: torch.Tensor, layout: str | None = None
    ) -> torch.Tensor:
        return _pack(t, lengths) if (layout or self.layout) == "padded" else t

    def _from_packed(self, t: torch.Tensor, lengths: torch.Tensor, pad_to: int) -> torch.Tensor:
        return _pad(t, lengths, pad_to, self.pad_value) if self.layout == "padded" else t

    def _check_inputs(
        self,
        tokens: dict[str, torch.Tensor],
        lengths: torch.Tensor,
        items: dict[str, torch.Tensor],
    ) -> np.ndarray:
        if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1:
            raise ValueError(f"lengths must be a 1-D tensor, got {lengths!r}")
        if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
            raise ValueError(f"lengths must be an integer tensor, got dtype {lengths.dtype}")
        local = lengths.detach().cpu().numpy().astype(np.int64)
        if local.size and local.min() < 0:
            raise ValueError(f"lengths must be >= 0, got {int(local.min())}")
        for arg, value in (("tokens", tokens), ("items", items)):
            if not isinstance(value, dict):
                raise ValueError(
                    f"{arg} must be a dict of name -> tensor (e.g. {{'hidden': x}}), got "
                    f"{type(value).__name__}"
                )
        b, total = local.size, int(local.sum())
        top = int(local.max()) if b else 0
        for name, t in tokens.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"tokens[{name!r}] must be a tensor, got {type(t).__name__}")
            if self.layout == "packed" and (t.dim() < 1 or t.shape[0] != total):
                raise ValueError(
                    f"tokens[{name!r}] has shape {tuple(t.shape)}; packed layout needs dim 0 = "
                    f"sum(lengths) = {total}"
                )
            if self.layout == "padded" and (t.dim() < 2 or t.shape[0] != b or t.shape[1] < top):
                raise ValueError(
                    f"tokens[{name!r}] has shape {tuple(t.shape)}; padded layout needs "
                    f"[B={b}, T>={top}, ...]"
                )
        for name, t in items.items():
            if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != b:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"items[{name!r}] must be [B={b}, ...], got {shape}")
        return local

    def _agreement(
        self, tokens: dict, items: dict, plan: Rearrangement | None
    ) -> dict[str, object]:
        """What every rank must pass alike, field by field (compared in the lengths gather,
        so a difference fails there on every rank, not as a gloo abort or a hang later)."""
        lead = 2 if self.layout == "padded" else 1
        tensors = [(f"tokens[{k!r}]", tokens[k], lead) for k in sorted(tokens)]
        tensors += [(f"items[{k!r}]", items[k], 1) for k in sorted(items)]
        return {
            "tensor names": tuple(name for name, _, _ in tensors),
            "dtypes": tuple((name, str(t.dtype)) for name, t, _ in tensors),
            "trailing shapes": tuple((name, tuple(t.shape[skip:])) for name, t, skip in tensors),
            "requires_grad": tuple((name, t.requires_grad) for name, t, _ in tensors),
            "policy": (
                self.policy, self.layout, self.placement, self.topology.ranks_per_node, self.cost,
                self.max_items_per_rank, self.max_load_per_rank,
            ),
            "plan": None if plan is None else plan.fingerprint(),
        }  # fmt: skip

    def _check_plan(self, plan: Rearrangement, glob: np.ndarray) -> None:
        """Debug mode: every rank computed the same plan from the same gathered lengths."""
        mine = plan.fingerprint()
        table = comm.all_gather_fixed(
            np.array([mine]), group=self.topology.meta_group, timeout=self.topology.timeout
        )
        comm.check_agreement(
            table,
            {"computed plan (fingerprint)": mine},
            rank=self.topology.rank,
            what=f"plans computed from the same {glob.size} gathered lengths (every rank must "
            "use the same policy, cost, placement and orchmllm version)",
        )

    def _stats(
        self,
        plan: Rearrangement,
        glob: np.ndarray,
        policy_stats: dict[str, float],
        tokens: dict[str, torch.Tensor],
        items: dict[str, torch.Tensor],
    ) -> dict[str, Any]:
        lead = 2 if self.layout == "padded" else 1
        token_bytes = sum(_row_bytes(t, lead) for t in tokens.values())
        item_bytes = sum(_row_bytes(t, 1) for t in items.values())
        per_item = glob * token_bytes + item_bytes
        traffic = plan.traffic(sizes=per_item, ranks_per_node=self.topology.ranks_per_node)
        rank = self.topology.rank
        before = self.stats_cost.loads(glob, plan.src_rank, plan.num_ranks)
        after = self.stats_cost.loads(glob, plan.dst_rank, plan.num_ranks)
        stay = plan.src_rank == plan.dst_rank
        stats: dict[str, Any] = {
            "imbalance_before": imbalance(before),
            "imbalance_after": imbalance(after),
            "loads_before": before.tolist(),
            "loads_after": after.tolist(),
            "bytes_intra": traffic["intra"],
            "bytes_inter": traffic["inter"],
            "bytes_sent": int(plan.send_counts(rank, sizes=per_item)[~_eye(plan, rank)].sum()),
            "bytes_recv": int(plan.recv_counts(rank, sizes=per_item)[~_eye(plan, rank)].sum()),
            "bytes_sent_max_rank": traffic["max_sent_rank"],
            "items_moved": int((~stay).sum()),
            "tokens_moved": int(glob[~stay].sum()),
            "tokens_kept": int(glob[stay].sum()),
            "num_items": int(glob.size),
        }
        if self.layout == "padded":
            stats["padded_tokens_before"] = _padded_tokens(glob, plan.src_rank, plan.num_ranks)
            stats["padded_tokens_after"] = _padded_tokens(glob, plan.dst_rank, plan.num_ranks)
        stats.update({k: v for k, v in policy_stats.items() if k not in stats})
        return stats


def _check_given_plan(plan: Rearrangement, src: np.ndarray, world: int) -> None:
    """A plan passed to ``dispatch`` must move exactly the gathered items: as many per rank,
    numbered in gather order (rank 0's items in local order, then rank 1's, ...)."""
    in_gather_order = np.arange(src.size) - np.searchsorted(src, src)
    if (
        plan.num_ranks == world
        and np.array_equal(plan.src_rank, src)
        and np.array_equal(plan.src_slot, in_gather_order)
    ):
        return
    got = np.bincount(plan.src_rank, minlength=plan.num_ranks).tolist()
    passed = np.bincount(src, minlength=world).tolist()
    why = (
        f"it takes {got} items from the ranks, they passed {passed}"
        if got != passed
        else "its items are not numbered in gather order"
    )
    raise ValueError(
        f"plan does not match the gathered lengths: {why}; pass the plan made from this "
        "step's lengths"
    )


def _eye(plan: Rearrangement, rank: int) -> np.ndarray:
    return np.arange(plan.num_ranks) == rank


def _padded_tokens(lengths: np.ndarray, ranks: np.ndarray, num_ranks: int) -> int:
    """Sum over ranks of B_r * max(l on r): the padded tensor sizes."""
    top = np.zeros(num_ranks, dtype=np.int64)
    np.maximum.at(top, ranks, lengths)
    return int((np.bincount(ranks, minlength=num_ranks) * top).sum())
