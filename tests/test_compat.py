"""orchmllm.compat: each adapter against fakes of every torch signature, then the real torch."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp
import torch.nn.functional as F
from torch import nn

from orchmllm import compat
from orchmllm.testing import run_distributed

# -- fakes of torch.nn.attention.varlen.varlen_attn, one per signature it has had ------------


def _recording(signature_of):
    """A kernel with ``signature_of``'s signature that records its call and returns q."""
    calls = []

    def kernel(*args, **kwargs):
        inspect.signature(signature_of).bind(*args, **kwargs)  # TypeError as torch would
        calls.append((args, kwargs))
        return args[0]

    kernel.__signature__ = inspect.signature(signature_of)
    kernel.calls = calls
    return kernel


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                return_aux=None): ...  # fmt: skip


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1)): ...  # fmt: skip


def varlen_2_12(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                block_table=None, num_splits=None): ...  # fmt: skip


def varlen_unknown(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, mask=None): ...


def _qkv(kv_heads: int):
    q = torch.randn(7, 4, 8)
    return q, torch.randn(7, kv_heads, 8), torch.randn(7, kv_heads, 8)


@pytest.mark.parametrize(
    ("signature", "causal", "expected"),
    [
        (varlen_2_10, True, {"is_causal": True}),
        (varlen_2_10, False, {"is_causal": False}),
        (varlen_2_11, True, {"window_size": (-1, 0)}),
        (varlen_2_11, False, {"window_size": (-1, -1)}),
        (varlen_2_12, True, {"window_size": (-1, 0), "enable_gqa": True}),
        (varlen_2_12, False, {"window_size": (-1, -1), "enable_gqa": True}),
    ],
)
def test_varlen_call_is_built_from_the_signature(signature, causal, expected):
    kernel = _recording(signature)
    q, k, v = _qkv(kv_heads=2)  # grouped-query attention
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out = compat.varlen_adapter(kernel)(q, k, v, cu, 4, causal=causal)
    assert out is q
    ((args, kwargs),) = kernel.calls
    assert all(a is b for a, b in zip(args[:5], (q, k, v, cu, cu), strict=True))
    assert args[5:] == (4, 4)
    assert kwargs == expected


def test_varlen_enable_gqa_follows_the_head_counts():
    kernel = _recording(varlen_2_12)
    cu = torch.tensor([0, 7], dtype=torch.int32)
    for kv_heads, gqa in ((4, False), (2, True), (1, True)):
        compat.varlen_adapter(kernel)(*_qkv(kv_heads), cu, 7, causal=True)
        assert kernel.calls[-1][1]["enable_gqa"] is gqa


def test_varlen_without_enable_gqa_gets_none():
    """What the library did before: enable_gqa= passed to a 2.11 kernel is a TypeError."""
    kernel = _recording(varlen_2_11)
    q, k, v = _qkv(kv_heads=1)
    cu = torch.tensor([0, 7], dtype=torch.int32)
    with pytest.raises(TypeError):
        kernel(q, k, v, cu, cu, 7, 7, window_size=(-1, 0), enable_gqa=True)
    compat.varlen_adapter(kernel)(q, k, v, cu, 7, causal=True)
    assert "enable_gqa" not in kernel.calls[-1][1]


def test_varlen_unknown_signature_names_the_feature():
    with pytest.raises(compat.MissingTorchFeature, match=r"is_causal= or window_size=.*2\.10"):
        compat.varlen_adapter(_recording(varlen_unknown))


# -- fakes of FSDPModule: the methods a torch release has or lacks ---------------------------


class FakeFSDP27:
    """FSDPModule as torch 2.6/2.7 has it: no divide factor, no force-sum, no unused params."""

    def __init__(self):
        self.calls = []

    def set_reduce_scatter_divide_factor(self, factor):
        self.calls.append(("set_reduce_scatter_divide_factor", factor))


class FakeFSDP28(FakeFSDP27):
    def set_gradient_divide_factor(self, factor):
        self.calls.append(("set_gradient_divide_factor", factor))

    def set_force_sum_reduction_for_comms(self, enable):
        self.calls.append(("set_force_sum_reduction_for_comms", enable))


class FakeFSDP213(FakeFSDP28):
    def set_reduce_scatter_unused_params(self, enabled, *, recurse=True):
        self.calls.append(("set_reduce_scatter_unused_params", enabled))


def test_gradient_sum_needs_torch_2_8():
    old = FakeFSDP27()
    with pytest.raises(compat.MissingTorchFeature, match=r"set_gradient_divide_factor.*2\.8"):
        compat.set_gradient_sum(old)
    assert old.calls == []  # nothing half-applied
    new = FakeFSDP28()
    compat.set_gradient_sum(new)
    assert new.calls == [
        ("set_gradient_divide_factor", 1.0),
        ("set_force_sum_reduction_for_comms", True),
    ]


def test_unused_params_switch_is_applied_only_where_torch_has_it():
    old, new = FakeFSDP28(), FakeFSDP213()
    assert compat.set_reduce_scatter_unused_params(old) is False and old.calls == []
    assert compat.set_reduce_scatter_unused_params(new) is True
    assert new.calls == [("set_reduce_scatter_unused_params", True)]


def test_missing_fully_shard_names_the_minimum(monkeypatch):
    monkeypatch.delattr(torch.distributed.fsdp, "fully_shard")
    monkeypatch.delattr(torch.distributed.fsdp, "FSDPModule")
    with pytest.raises(compat.MissingTorchFeature, match=r"fsdp\.fully_shard \(torch >= 2\.6\)"):
        compat.fully_shard(nn.Linear(2, 2))
    with pytest.raises(compat.MissingTorchFeature, match=r"fsdp\.FSDPModule \(torch >= 2\.6\)"):
        compat.is_fsdp_module(nn.Linear(2, 2))
    assert not compat.available("torch.distributed.fsdp.fully_shard")


# -- fakes of F.scaled_dot_product_attention and dist.broadcast ------------------------------


@pytest.fixture
def fresh_sdpa_probe():
    compat._sdpa_has_enable_gqa.cache_clear()
    yield
    compat._sdpa_has_enable_gqa.cache_clear()


def test_sdpa_without_enable_gqa(monkeypatch, fresh_sdpa_probe):
    """torch < 2.5: plain attention still runs (no keyword passed); GQA names the minimum."""
    real = F.scaled_dot_product_attention
    calls = []

    def sdpa_2_4(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        calls.append(is_causal)
        return real(query, key, value, attn_mask=attn_mask, is_causal=is_causal)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa_2_4)
    x = torch.randn(1, 2, 3, 4)
    torch.testing.assert_close(compat.scaled_dot_product_attention(x, x, x), real(x, x, x))
    with pytest.raises(compat.MissingTorchFeature, match=r"enable_gqa=\) \(torch >= 2\.5\)"):
        compat.scaled_dot_product_attention(x, x[:, :1], x[:, :1], enable_gqa=True)
    assert calls == [False]  # the probe's call was refused before reaching the kernel
    assert not compat.available("scaled_dot_product_attention(enable_gqa=)")


def test_broadcast_group_src(monkeypatch):
    calls = []

    def broadcast_2_5(tensor, src, group=None, async_op=False): ...

    def broadcast_2_6(tensor, src=None, group=None, async_op=False, group_src=None):
        calls.append((src, group_src, async_op))
        return "work"

    t = torch.zeros(1)
    monkeypatch.setattr(dist, "broadcast", broadcast_2_5)
    with pytest.raises(compat.MissingTorchFeature, match=r"group_src=\) \(torch >= 2\.6\)"):
        compat.broadcast(t, group_src=0)
    monkeypatch.setattr(dist, "broadcast", broadcast_2_6)
    assert compat.broadcast(t, group_src=1, async_op=True) == "work"

    def spy(*args, **kwargs):  # a pass-through wrapper, as tests that count broadcasts use
        return broadcast_2_6(*args, **kwargs)

    monkeypatch.setattr(dist, "broadcast", spy)
    assert compat.broadcast(t, group_src=0) == "work"
    assert calls == [(None, 1, True), (None, 0, False)]


def test_error_names_feature_minimum_and_installed_version():
    err = compat.MissingTorchFeature("FSDPModule.set_reduce_scatter_unused_params")
    assert err.minimum == "2.13" and isinstance(err, RuntimeError)
    assert "set_reduce_scatter_unused_params (torch >= 2.13)" in str(err)
    assert torch.__version__ in str(err)
    with pytest.raises(ValueError, match="feature must be one of"):
        compat.available("torch.magic")


# -- the real torch ------------------------------------------------------------------------


def _installed() -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", torch.__version__).groups()
    return int(major), int(minor)


@pytest.mark.parametrize("feature", sorted(compat.MINIMUM))
def test_minimum_table_matches_the_installed_torch(feature):
    """Run on the pinned torch by .ci/run and on the oldest supported one by .ci/oldest-torch:
    a feature is detected exactly when the installed release is at least its minimum."""
    minimum = tuple(int(x) for x in compat.MINIMUM[feature].split("."))
    assert compat.available(feature) == (_installed() >= minimum), torch.__version__


def test_real_varlen_signature_accepts_the_built_call():
    if compat.varlen_attention() is None:
        pytest.skip(f"torch {torch.__version__} has no varlen_attn")
    from torch.nn.attention.varlen import varlen_attn

    kernel = _recording(varlen_attn)
    cu = torch.tensor([0, 7], dtype=torch.int32)
    for causal in (False, True):
        compat.varlen_adapter(kernel)(*_qkv(kv_heads=2), cu, 7, causal=causal)
    assert len(kernel.calls) == 2  # both bound to the real signature


def test_real_sdpa_grouped_query_equals_repeated_heads():
    q, k, v = (torch.randn(2, h, 5, 8, dtype=torch.float64) for h in (4, 2, 2))
    out = compat.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expanded = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), is_causal=True
    )
    torch.testing.assert_close(out, expanded)


def _input(rank: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))


def _fsdp_sum_worker(rank: int, world: int):
    """A two-layer model sharded with compat on 3 gloo ranks, rank r on its own input.
    Also a broadcast inside the group of global ranks [1, 2] from group rank 0."""
    group = dist.new_group([1, 2], backend="gloo")
    value = torch.tensor([10.0 * (rank + 1)])
    if rank in (1, 2):
        compat.broadcast(value, group_src=0, group=group, async_op=True).wait()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    reference = [p.detach().clone() for p in model.parameters()]
    for layer in (model[0], model[2]):
        compat.fully_shard(layer)
    compat.fully_shard(model)
    sharded = [m for m in model.modules() if compat.is_fsdp_module(m)]
    for m in sharded:
        compat.set_gradient_sum(m)
    applied = compat.set_reduce_scatter_unused_params(model)
    model(_input(rank)).square().sum().backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    return value.item(), len(sharded), applied, reference, grads


@pytest.mark.integration
def test_real_fsdp_sums_gradients_over_ranks():
    world = 3
    results = run_distributed(_fsdp_sum_worker, world, timeout=60)
    assert [r[0] for r in results] == [10.0, 20.0, 20.0]  # group rank 0 is global rank 1
    assert all(r[1] == 3 for r in results)
    assert all(
        r[2] is compat.available("FSDPModule.set_reduce_scatter_unused_params") for r in results
    )
    # The gradient of the summed loss over every rank's input, computed in one process.
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    with torch.no_grad():
        for p, ref in zip(model.parameters(), results[0][3], strict=True):
            p.copy_(ref)
    sum(model(_input(r).double()).square().sum() for r in range(world)).backward()
    for rank_result in results:
        for p, g in zip(model.parameters(), rank_result[4], strict=True):
            torch.testing.assert_close(g.double(), p.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.integration
def test_leave_process_ends_with_the_status_and_the_output_written():
    """What a finished torchrun rank does last: its status comes out, and what it wrote to
    block-buffered pipes is flushed, though nothing of interpreter shutdown runs."""
    code = (
        "import sys; from orchmllm.compat import leave_process; "
        "sys.stdout.write('summary, no newline'); sys.stderr.write('log'); leave_process(3)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3
    assert (out.stdout, out.stderr) == ("summary, no newline", "log")


# -- collectives: the backend lets go of its tensors before the call returns -------------------


def _references_left(rank: int, world: int) -> list[int]:
    """For 200 all-gathers through ``compat.collective``: how many references to the
    tensors it was given remain beyond this thread's own once it returns."""
    left = []
    for step in range(200):
        t = torch.arange(4) + rank + step
        out = [torch.empty_like(t) for _ in range(world)]
        compat.collective(
            lambda t=t, out=out: dist.all_gather(out, t, async_op=True),
            tensors=[*out, t],
            timeout=30,
        )
        assert torch.equal(out[1 - rank], torch.arange(4) + 1 - rank + step)
        left.append(sum(x._use_count() - 1 for x in (*out, t)))
    return left


@pytest.mark.integration
def test_a_collective_returns_once_the_backend_let_go_of_its_tensors():
    """Else gloo's thread frees them later, taking the GIL: a fork then (a DataLoader worker
    starting) can deadlock the child on CPython <= 3.11.7 (see compat.collective). Returning
    straight after ``wait()`` leaves references behind on a few percent of calls."""
    for left in run_distributed(_references_left, 2, timeout=60):
        assert left == [0] * 200
