"""The loss: global_num_items (the all-reduced count, and the gradient property it exists
for) and the chunked LM-head cross-entropy.

On 2 gloo ranks with real FSDP2 (``fully_shard``), float64: the same global batch laid out two
ways (as sampled, and balanced by ``orchmllm.balance``) gives the gradient of one process on the
whole batch when each rank's summed loss is divided by ``global_num_items`` (and scaled for
FSDP's mean over ranks, either way the module docstring gives), and different gradients with
the usual per-rank mean.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import orchmllm
from orchmllm.dist.loss import chunked_cross_entropy, token_log_probs
from orchmllm.schema import IGNORE_INDEX
from orchmllm.testing import assert_check_passed, run_checks

VOCAB, HIDDEN = 32, 16
# Token counts of the global batch; "sampled" gives rank 0 the first four sequences.
LENGTHS = np.array([3, 5, 4, 2, 30, 9, 21, 6])
SAMPLED = np.array([0, 0, 0, 0, 1, 1, 1, 1])


def _sequences() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (int(n) + 1,), generator=g) for n in LENGTHS]


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, VOCAB)
    ).double()


def _token_losses(model: nn.Module, seqs: list[torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy of every target token (each sequence predicts its own tail)."""
    if not seqs:
        return torch.zeros(0, dtype=torch.float64)
    inputs = torch.cat([s[:-1] for s in seqs])
    targets = torch.cat([s[1:] for s in seqs])
    return F.cross_entropy(model(inputs), targets, reduction="none")


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def _fsdp_grads(layout: np.ndarray, rank: int, world: int, norm: str) -> dict[str, torch.Tensor]:
    """One backward of the FSDP2 model on this rank's share of ``layout``, loss by ``norm``."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    model = _model()
    fully_shard(model)
    if norm == "global_sum_reduction":
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    seqs = [s for s, r in zip(_sequences(), layout, strict=True) if r == rank]
    losses = _token_losses(model, seqs)
    if norm == "per_rank_mean":
        loss = losses.mean()
    else:
        loss = losses.sum() / orchmllm.global_num_items(losses.numel())
        if norm == "global_times_world":
            loss = loss * world
    loss.backward()
    return _full_grads(model)


def _reference_grads() -> dict[str, torch.Tensor]:
    """One process, no FSDP, the whole global batch, mean over all its target tokens."""
    model = _model()
    _token_losses(model, _sequences()).mean().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


def check_counts(rank: int, world: int) -> None:
    expected = sum(range(1, world + 1))
    assert orchmllm.global_num_items(rank + 1) == expected
    assert orchmllm.global_num_items(np.int64(rank + 1)) == expected
    assert orchmllm.global_num_items(torch.tensor(rank + 1)) == expected
    assert orchmllm.global_num_items(torch.tensor([0])) == 0
    labels = torch.full((2, 10), -100)
    labels[0, : rank + 3] = 1
    assert orchmllm.global_num_items((labels != -100).sum()) == sum(r + 3 for r in range(world))
    sub = dist.new_group([0])  # a group this rank may not be in is never waited on
    if rank == 0:
        assert orchmllm.global_num_items(5, group=sub) == 5


def check_layout_invariance(rank: int, world: int) -> None:
    balanced = orchmllm.balance(LENGTHS, world, "greedy", src=SAMPLED).dst
    tokens = [np.bincount(lay, weights=LENGTHS, minlength=world) for lay in (SAMPLED, balanced)]
    assert tokens[0].max() / tokens[0].mean() > 1.5 > tokens[1].max() / tokens[1].mean()
    ref = _reference_grads()
    for norm in ("global_times_world", "global_sum_reduction"):
        for layout in (SAMPLED, balanced):
            diff = _max_rel_diff(_fsdp_grads(layout, rank, world, norm), ref)
            assert diff < 1e-12, (norm, layout.tolist(), diff)
    # The per-rank mean weighs a token by 1 / (its rank's tokens): the layout changes the
    # gradient (it is the global one only where every rank happens to hold as many tokens).
    sampled = _fsdp_grads(SAMPLED, rank, world, "per_rank_mean")
    moved = _fsdp_grads(balanced, rank, world, "per_rank_mean")
    assert _max_rel_diff(sampled, moved) > 1e-2
    assert _max_rel_diff(sampled, ref) > 1e-2


CHECKS = {"counts": check_counts, "layout_invariance": check_layout_invariance}


@pytest.fixture(scope="module")
def results():
    return run_checks(CHECKS, 2, timeout=60)


@pytest.mark.integration
@pytest.mark.parametrize("name", list(CHECKS))
def test_distributed(results, name):
    assert_check_passed(results, name)


def test_single_process_is_the_local_count():
    assert not dist.is_initialized()
    assert orchmllm.global_num_items(17) == 17
    assert orchmllm.global_num_items(torch.tensor(4)) == 4


@pytest.mark.parametrize("bad", [-1, 2.0, True, "3", None, torch.tensor([1, 2]), torch.tensor(1.0)])
def test_bad_counts_name_the_argument(bad):
    with pytest.raises(ValueError, match="local_count"):
        orchmllm.global_num_items(bad)


@pytest.mark.parametrize("chunk", [1, 10, 37, 4096])
def test_chunked_cross_entropy_equals_the_whole_logits_loss(chunk):
    """Loss and both gradients of the plain ``[tokens, vocab]`` cross-entropy, whatever the
    chunking; targets ignored where IGNORE_INDEX."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 8, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 8, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (37,), generator=g)
    targets[::3] = IGNORE_INDEX
    loss = chunked_cross_entropy(hidden, weight, targets, denom=5.0, chunk=chunk)
    (loss * 2).backward()
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref = F.cross_entropy(h2 @ w2.T, targets, ignore_index=IGNORE_INDEX, reduction="sum") / 5.0
    (ref * 2).backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(hidden.grad, h2.grad)
    torch.testing.assert_close(weight.grad, w2.grad)


def test_chunked_cross_entropy_refuses_bad_input():
    h, w, t = torch.zeros(4, 3), torch.zeros(5, 3), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="chunk must be a positive integer, got 0"):
        chunked_cross_entropy(h, w, t, chunk=0)
    with pytest.raises(ValueError, match="disagree"):
        chunked_cross_entropy(h, w[:, :2], t, chunk=2)


@pytest.mark.parametrize("chunk", [1, 10, 37, 4096])
def test_token_log_probs_equal_the_whole_logits_and_take_any_weighting(chunk):
    """Per-token log-probabilities, entropies and top-1 flags of the plain ``[tokens, vocab]``
    log-softmax, zero where ignored; their gradients under a per-token weighting (DFT's
    probability-weighted loss, TRL's ``loss_type="dft"``) equal the plain head's."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(37, 8, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 8, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (37,), generator=g)
    targets[::3] = IGNORE_INDEX
    valid = targets != IGNORE_INDEX
    got = token_log_probs(hidden, weight, targets, chunk=chunk)
    (-(got.log_probs * got.log_probs.exp().detach()).sum()).backward()
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    log_softmax = torch.log_softmax(h2 @ w2.T, dim=-1)
    picked = log_softmax.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    ref = torch.where(valid, picked, 0.0)
    (-(ref * ref.exp().detach()).sum()).backward()
    torch.testing.assert_close(got.log_probs, ref)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    torch.testing.assert_close(got.entropy, torch.where(valid, entropy, 0.0).detach())
    assert torch.equal(got.is_top1, valid & (log_softmax.argmax(-1) == targets))
    assert not got.entropy.requires_grad and got.is_top1.dtype == torch.bool
    torch.testing.assert_close(hidden.grad, h2.grad)
    torch.testing.assert_close(weight.grad, w2.grad)
    summed = chunked_cross_entropy(hidden.detach(), weight.detach(), targets, chunk=chunk)
    assert (-got.log_probs.sum()).item() == pytest.approx(summed.item(), rel=1e-12)


def test_token_log_probs_refuse_bad_input():
    h, w, t = torch.zeros(4, 3), torch.zeros(5, 3), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="chunk must be a positive integer, got True"):
        token_log_probs(h, w, t, chunk=True)
    with pytest.raises(ValueError, match="disagree"):
        token_log_probs(h, w, t[:3], chunk=2)
