"""The loss of a rebalanced step: normalised over the data-parallel group, computed in chunks.

Normalisation is what a rebalanced training loop must get right.

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

The LM head's logits are ``tokens x vocab`` (152,064 entries a token for Qwen2): a step's whole
fp32 logits would outgrow the model. :func:`chunked_cross_entropy` never holds more than one
chunk of them; :func:`token_log_probs` neither, for trainers that weigh each token's
log-probability themselves (TRL's).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from orchmllm.schema import IGNORE_INDEX

__all__ = ["TokenScores", "chunked_cross_entropy", "global_num_items", "token_log_probs"]


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


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T`` over the targets, divided by ``denom``.

    Computes the logits ``chunk`` rows at a time and their gradients in the same pass (as
    fused linear-cross-entropy kernels do), so the ``[rows, vocab]`` logits never exist at
    once: per chunk, fp32 logits, their softmax gradient in place and its copy in the
    hidden states' dtype. The FLOPs are those of the plain head: one logits product forward,
    two backward. What is kept for backward is the two gradients (``hidden``'s and
    ``weight``'s, in their dtypes).
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, denom: float):
        acc = torch.promote_types(hidden.dtype, torch.float32)  # bf16 accumulates in fp32
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk]
            t = targets[start : start + chunk]
            logits = (h @ weight.T).to(acc)
            valid = t != IGNORE_INDEX
            safe = torch.where(valid, t, 0)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            loss += torch.where(valid, lse - picked, 0.0).sum()
            grad = torch.exp(logits.sub_(lse[:, None]))  # softmax, in place
            grad[torch.arange(t.shape[0], device=t.device), safe] -= 1.0
            grad *= valid[:, None] / denom
            grad = grad.to(hidden.dtype)
            grad_hidden[start : start + chunk] = grad @ weight
            grad_weight += (grad.T @ h).to(acc)
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return loss / denom

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_out, grad_weight * grad_out, None, None, None


class _ChunkedLogProbs(torch.autograd.Function):
    """Each target's log-probability under ``hidden @ weight.T``, with the distribution's
    entropy and whether the target is its top token, ``chunk`` rows of logits at a time.

    Unlike :class:`_ChunkedCrossEntropy` the caller weighs each token's log-probability as it
    likes (a trainer's loss: a sum, DFT's probability-weighted sum), so the gradient is not
    known in forward: backward recomputes each chunk's logits (one more logits product than
    the plain head) from ``hidden``, ``weight`` and the saved log-sum-exps.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int):
        acc = torch.promote_types(hidden.dtype, torch.float32)
        rows = hidden.shape[0]
        log_probs = torch.zeros(rows, dtype=acc, device=hidden.device)
        entropy = torch.zeros(rows, dtype=acc, device=hidden.device)
        is_top1 = torch.zeros(rows, dtype=torch.bool, device=hidden.device)
        lse = torch.zeros(rows, dtype=acc, device=hidden.device)
        for start in range(0, rows, chunk):
            part = slice(start, start + chunk)
            t = targets[part]
            valid = t != IGNORE_INDEX
            safe = torch.where(valid, t, 0)
            logits = (hidden[part] @ weight.T).to(acc)
            lse[part] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            log_probs[part] = torch.where(valid, picked - lse[part], 0.0)
            top = logits.argmax(dim=-1)
            is_top1[part] = valid & (top == t)
            probs = torch.exp(logits.sub_(lse[part, None]))  # softmax, in place
            mean_logit = (probs * logits).sum(dim=-1)  # logits shifted by lse: E[logit] - lse
            entropy[part] = torch.where(valid, -mean_logit, 0.0)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(entropy, is_top1)
        return log_probs, entropy, is_top1

    @staticmethod
    def backward(ctx, grad_log_probs: Tensor, _grad_entropy: Tensor, _grad_top1: Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors
        acc = lse.dtype
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.chunk):
            part = slice(start, start + ctx.chunk)
            t = targets[part]
            valid = t != IGNORE_INDEX
            safe = torch.where(valid, t, 0)
            h = hidden[part]
            # d log p_t / d logits = onehot(t) - softmax, times each token's upstream gradient
            grad = torch.exp((h @ weight.T).to(acc).sub_(lse[part, None])).neg_()
            grad[torch.arange(t.shape[0], device=t.device), safe] += 1.0
            grad *= torch.where(valid, grad_log_probs[part], 0.0)[:, None]
            grad = grad.to(hidden.dtype)
            grad_hidden[part] = grad @ weight
            grad_weight += (grad.T @ h).to(acc)
        return grad_hidden, grad_weight.to(weight.dtype), None, None


class TokenScores(NamedTuple):
    """Per target token, in ``targets``' shape (zero where nothing is predicted)."""

    log_probs: Tensor  # log p(target), differentiable
    entropy: Tensor  # the next-token distribution's entropy, no gradient
    is_top1: Tensor  # bool: the target is the most likely token


def token_log_probs(hidden: Tensor, weight: Tensor, targets: Tensor, *, chunk: int) -> TokenScores:
    """Each target's log-probability under the LM head, without the ``[tokens, vocab]``
    logits: what trainers that weigh tokens themselves take (TRL's fused LM head protocol:
    its loss, entropy and token accuracy).

    Args:
        hidden: ``[tokens, hidden]``, the final normed hidden states.
        weight: ``[vocab, hidden]``, the LM head's weight.
        targets: int64 ``[tokens]``, the next token at each position, ``IGNORE_INDEX`` where
            nothing is predicted.
        chunk: tokens per chunk (the logits of one chunk exist at a time, in backward too).

    Returns:
        :class:`TokenScores` in fp32 (fp64 for fp64 inputs); ``-log_probs.sum()`` equals
        ``F.cross_entropy(hidden @ weight.T, targets, reduction="sum")``.

    Raises:
        ValueError: ``chunk`` is not a positive integer, or the shapes disagree.
    """
    _check_head(hidden, weight, targets, chunk)
    return TokenScores(*_ChunkedLogProbs.apply(hidden, weight, targets, chunk))


def _check_head(hidden: Tensor, weight: Tensor, targets: Tensor, chunk: object) -> None:
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    if (
        hidden.dim() != 2
        or targets.shape != hidden.shape[:1]
        or weight.shape[1:] != hidden.shape[1:]
    ):
        raise ValueError(
            f"hidden [tokens, h], weight [vocab, h] and targets [tokens] disagree: "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}"
        )


def chunked_cross_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, *, chunk: int, denom: float = 1.0
) -> Tensor:
    """The LM-head loss without the whole ``[tokens, vocab]`` logits.

    Args:
        hidden: ``[tokens, hidden]``, the final normed hidden states.
        weight: ``[vocab, hidden]``, the LM head's weight.
        targets: int64 ``[tokens]``, the next token at each position, ``IGNORE_INDEX`` where
            nothing is predicted.
        chunk: tokens per chunk (the logits of one chunk exist at a time).
        denom: the loss is divided by it (the global number of targets: see
            :func:`global_num_items`).

    Returns:
        ``F.cross_entropy(hidden @ weight.T, targets, reduction="sum") / denom``, a scalar in
        fp32 (fp64 for fp64 inputs).

    Raises:
        ValueError: ``chunk`` is not a positive integer, or the shapes disagree.
    """
    _check_head(hidden, weight, targets, chunk)
    return _ChunkedCrossEntropy.apply(hidden, weight, targets, chunk, float(denom))
