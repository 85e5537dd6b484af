"""Loss normalisation over the data-parallel group: what a rebalanced training loop must get right.

Rebalancing moves examples between ranks. The gradient of the *global* mean loss does not
depend on which rank computes which example, but the usual per-rank mean does: with
``loss_r = sum(l_i on r) / n_r`` the step weighs a token by ``1 / n_r``, so a token on a rank
with few tokens counts more. Rebalancing changes every ``n_r`` and so the training. Divide by
the global count instead, ``N = sum_r n_r``, which :func:`global_num_items` all-reduces::

    n = orchmllm.global_num_items((labels[..., 1:] != -100).sum())  # HF shifts labels
    loss = model(**batch, num_items_in_batch=n).loss  # HF: sum of token losses / n

Then scale for the gradient reduction of the data-parallel wrapper:

- FSDP2 ``fully_shard`` (and DDP) *average* gradients over the ranks by default, so the
  reduced gradient is ``1 / world_size`` of the global-mean gradient. Multiply the loss by
  ``dist.get_world_size()`` before ``backward()`` (what the HF Trainer does when it averages
  tokens across devices), or
- make FSDP2 sum instead: on every ``FSDPModule`` of the model (the setting is per module,
  not recursive) call ``set_gradient_divide_factor(1.0)``; on gloo also
  ``set_force_sum_reduction_for_comms(True)`` (gloo has no ``PREMUL_SUM``). Then do not scale.

Either way every rank's loss is its share of one global mean: their sum over the ranks is
the global loss, and the gradients equal those of one process on the whole global batch,
whatever the layout (``tests/test_loss.py`` checks both forms against that reference).
"""

from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

__all__ = ["global_num_items"]


def _as_count(local_count: object) -> int:
    if isinstance(local_count, torch.Tensor):
        if local_count.numel() != 1 or local_count.is_floating_point() or local_count.is_complex():
            raise ValueError(
                "local_count must be a one-element integer tensor, got dtype "
                f"{local_count.dtype} and shape {tuple(local_count.shape)}"
            )
        local_count = local_count.item()
    if isinstance(local_count, bool) or not isinstance(local_count, numbers.Integral):
        raise ValueError(f"local_count must be an integer, got {local_count!r}")
    if local_count < 0:
        raise ValueError(f"local_count must be >= 0, got {local_count}")
    return int(local_count)


def _device_for(group: dist.ProcessGroup | None) -> torch.device:
    """The device a collective of ``group`` needs (NCCL: this rank's GPU, else the CPU)."""
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_num_items(
    local_count: int | torch.Tensor, *, group: dist.ProcessGroup | None = None
) -> int:
    """The number of loss-bearing items (target tokens, examples) over the whole group.

    Args:
        local_count: this rank's count, an ``int`` or a one-element integer tensor (e.g.
            ``(labels != -100).sum()``).
        group: the data-parallel process group (default: the world). Without an initialised
            process group the job is one process and the local count is returned.

    Returns:
        The sum of ``local_count`` over the ranks of ``group``, the same ``int`` on every rank.
        Divide each rank's *summed* loss by it (or pass it as HF's ``num_items_in_batch``) and
        scale for the gradient reduction as the module docstring says.

    Raises:
        ValueError: ``local_count`` is negative, not an integer, or a tensor with more than
            one element or a floating dtype.

    Collective: every rank of ``group`` calls it once per step, in the same order as its other
    collectives; it waits at most the group's timeout.
    """
    count = _as_count(local_count)
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return count
    total = torch.tensor([count], dtype=torch.int64, device=_device_for(group))
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return int(total.item())
