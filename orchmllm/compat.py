"""The torch APIs OrchMLLM uses that arrived during torch 2.x, detected in one place.

Users train with the torch their cluster ships (a CUDA wheel, a vendor build whose version
string says little), so each API is probed for what it is (a module attribute, a method, a
keyword of a signature), never by comparing version strings. Every call site in the library
goes through a function here, which adapts the call to what the installed torch offers, or
raises :class:`MissingTorchFeature` naming the API and the oldest torch release that has it.
The releases in :data:`MINIMUM` were read from the sources of the torch 2.4 to 2.13 wheels.

Two features are optional and degrade instead of failing:

- ``varlen_attn``: without it :func:`varlen_attention` is None and packed attention runs each
  sequence through SDPA (slower on GPU, same result);
- ``FSDPModule.set_reduce_scatter_unused_params``: off by default in the library (a parameter
  unused on every rank must keep ``None``, as in a plain run); the models give every parameter
  a rank uses a gradient on every rank (empty inputs still run every module).

Other APIs, all older than the declared minimum torch, are not probed (``all_to_all_single``
with split sizes, ``Work.wait(timeout=)``, ``new_group(backend=, timeout=)``, ``nn.RMSNorm``):
``.ci/oldest-torch`` runs the whole suite on that minimum. The all-to-all's autograd is the
library's own ``autograd.Function`` (:mod:`orchmllm.dist.comm`), not ``torch.distributed.nn``;
``torch.distributed.checkpoint`` (``dcp.save``/``dcp.load`` and ``state_dict.get_state_dict``/
``set_state_dict``, used by :mod:`orchmllm.train.checkpoint`) is older than the minimum too.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.bias import CausalBias

__all__ = [
    "MINIMUM",
    "MissingTorchFeature",
    "accepts",
    "available",
    "broadcast",
    "collective",
    "default_store",
    "fully_shard",
    "is_fsdp_module",
    "leave_process",
    "mixed_precision",
    "scaled_dot_product_attention",
    "set_gradient_sum",
    "set_reduce_scatter_unused_params",
    "varlen_adapter",
    "varlen_attention",
]

#: Each probed API and the oldest torch release that has it (:func:`available` probes them).
MINIMUM: dict[str, str] = {
    "torch.distributed.fsdp.fully_shard": "2.6",
    "torch.distributed.fsdp.FSDPModule": "2.6",
    "torch.distributed.fsdp.MixedPrecisionPolicy": "2.6",
    "FSDPModule.set_gradient_divide_factor": "2.8",
    "FSDPModule.set_force_sum_reduction_for_comms": "2.8",
    "FSDPModule.set_reduce_scatter_unused_params": "2.13",
    "torch.nn.attention.varlen.varlen_attn": "2.10",
    "varlen_attn(is_causal= or window_size=)": "2.10",
    "varlen_attn(enable_gqa=)": "2.12",
    "scaled_dot_product_attention(enable_gqa=)": "2.5",
    "torch.distributed.broadcast(group_src=)": "2.6",
}


class MissingTorchFeature(RuntimeError):
    """An API OrchMLLM needs is absent from the installed torch."""

    def __init__(self, feature: str):
        self.feature = feature
        self.minimum = MINIMUM[feature]
        super().__init__(
            f"OrchMLLM needs {feature} (torch >= {self.minimum}); "
            f"the installed torch {torch.__version__} does not have it"
        )


@functools.cache
def _parameters(fn: Callable[..., Any]) -> tuple[frozenset[str], bool]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a readable signature
        return frozenset(), False
    return frozenset(p.name for p in params), any(p.kind is p.VAR_KEYWORD for p in params)


def accepts(fn: Callable[..., Any], keyword: str) -> bool:
    """Whether ``fn`` takes ``keyword=``. A ``**kwargs`` pass-through (a decorator, a test
    spy) takes any keyword: it forwards it to the function it wraps."""
    names, forwards = _parameters(fn)
    return forwards or keyword in names


def _attribute(module: str, name: str) -> Any:
    """``module.name``, or None where the installed torch lacks either."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _fsdp(name: str) -> Any:
    found = _attribute("torch.distributed.fsdp", name)
    if found is None:
        raise MissingTorchFeature(f"torch.distributed.fsdp.{name}")
    return found


# -- FSDP2 ----------------------------------------------------------------------------------


def fully_shard(module: nn.Module, *, mesh: Any = None, mp_policy: Any = None) -> nn.Module:
    """FSDP2's ``fully_shard(module, mesh=mesh)``, with ``mp_policy`` when given (see
    :func:`mixed_precision`)."""
    if mp_policy is None:
        return _fsdp("fully_shard")(module, mesh=mesh)
    return _fsdp("fully_shard")(module, mesh=mesh, mp_policy=mp_policy)


def mixed_precision(param: torch.dtype, *, reduce: torch.dtype) -> Any:
    """FSDP2's ``MixedPrecisionPolicy``: gather and compute parameters in ``param``, reduce
    gradients in ``reduce`` (the sharded master weights keep the dtype they were built in)."""
    return _fsdp("MixedPrecisionPolicy")(param_dtype=param, reduce_dtype=reduce)


def is_fsdp_module(module: object) -> bool:
    """Whether ``module`` was sharded by :func:`fully_shard`."""
    return isinstance(module, _fsdp("FSDPModule"))


def _method(module: object, name: str) -> Callable[..., Any]:
    found = getattr(module, name, None)
    if found is None:
        raise MissingTorchFeature(f"FSDPModule.{name}")
    return found


def set_gradient_sum(module: object) -> None:
    """Make one FSDP module sum gradients over ranks instead of averaging them.

    The training loss is already normalised by the global target count, so a rank's gradient
    is its share of the global one and the shares must add up. Forcing sum-type collectives
    keeps gloo working (it has no PREMUL_SUM). Both switches came in torch 2.8; before, the
    only divide-factor switch built an NCCL PREMUL_SUM reduction, which gloo cannot run.
    """
    divide = _method(module, "set_gradient_divide_factor")
    force_sum = _method(module, "set_force_sum_reduction_for_comms")
    divide(1.0)
    force_sum(True)


def set_gradient_sync(module: object, enabled: bool) -> None:
    """Whether the backward of ``module`` and its FSDP submodules reduce-scatters gradients
    (False: they accumulate unsharded on each rank until a backward with it True)."""
    _method(module, "set_requires_gradient_sync")(enabled)


def set_reduce_scatter_unused_params(module: object, enabled: bool = True) -> bool:
    """Reduce-scatter zeros for parameters that got no gradient, where torch can.

    Returns whether it was applied. Optional (see the module docstring): without it, a
    parameter without a gradient on one rank only would desynchronise the reduce-scatter,
    which the models rule out by running every module on every rank.
    """
    switch = getattr(module, "set_reduce_scatter_unused_params", None)
    if switch is None:
        return False
    switch(enabled)
    return True


# -- attention ------------------------------------------------------------------------------

VarlenAttention = Callable[..., Tensor]


def varlen_adapter(kernel: Callable[..., Tensor]) -> VarlenAttention:
    """``attend(q, k, v, cu_seqlens, max_len, *, causal)`` over torch's ``varlen_attn``.

    The call is built from ``kernel``'s signature: 2.10 takes ``is_causal``; 2.11 replaced
    it by ``window_size`` ((-1, 0) is causal); 2.12 added ``enable_gqa``. Without
    ``enable_gqa``, q may still have more heads than k and v: those versions hand the
    tensors to the flash kernel unchanged, and it groups query heads itself (the keyword
    came only to refuse GQA on a cuDNN backend that is never selected).
    """
    if accepts(kernel, "window_size"):

        def mask(causal: bool) -> dict[str, Any]:
            return {"window_size": (-1, 0) if causal else (-1, -1)}

    elif accepts(kernel, "is_causal"):

        def mask(causal: bool) -> dict[str, Any]:
            return {"is_causal": causal}

    else:
        raise MissingTorchFeature("varlen_attn(is_causal= or window_size=)")
    pass_gqa = accepts(kernel, "enable_gqa")

    def attend(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, *, causal: bool):
        extra = mask(causal)
        if pass_gqa:
            extra["enable_gqa"] = q.shape[1] != k.shape[1]
        return kernel(q, k, v, cu, cu, max_len, max_len, **extra)

    return attend


def _varlen_kernel() -> Callable[..., Tensor] | None:
    # Looked up on first use only: the module pulls in torch._dynamo, seconds of start-up a
    # CPU run does not need.
    return _attribute("torch.nn.attention.varlen", "varlen_attn")


@functools.cache
def varlen_attention() -> VarlenAttention | None:
    """torch's fused varlen attention through :func:`varlen_adapter`, or None (torch < 2.10)."""
    kernel = _varlen_kernel()
    return None if kernel is None else varlen_adapter(kernel)


@functools.cache
def _sdpa_has_enable_gqa() -> bool:
    # A builtin without a readable signature: try the keyword on the smallest input.
    x = torch.zeros(1, 1, 1, 1)
    try:
        F.scaled_dot_product_attention(x, x, x, enable_gqa=False)
    except TypeError:
        return False
    return True


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | CausalBias | None = None,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention``; ``enable_gqa`` is passed only when it is True."""
    if not enable_gqa:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
    if not available("scaled_dot_product_attention(enable_gqa=)"):
        raise MissingTorchFeature("scaled_dot_product_attention(enable_gqa=)")
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=True
    )


# -- collectives ----------------------------------------------------------------------------

_LET_GO_S = 1.0  # the most a collective waits for the backend's thread to drop its tensors


def collective(
    start: Callable[[], Any], *, tensors: Sequence[Tensor], timeout: float | None
) -> None:
    """Run the collective ``start()`` issues (``async_op=True``) and wait for it (at most
    ``timeout`` seconds; None: the group's own timeout); then wait until the backend's
    thread has dropped its references to ``tensors``, the tensors the collective was given.

    Why the second wait: when this thread drops a tensor the backend's thread (gloo's run
    loop, NCCL's watchdog) still holds, that thread frees it later and takes the GIL to do so,
    creating a Python thread state under an interpreter lock. A fork at that instant (a
    DataLoader worker starting) copies the lock held, and CPython releases without the fix of
    gh-112275 (this machine's 3.11.7 among them; later 3.11 releases have it) deadlock the
    child in ``os.fork`` before it runs: a worker that never delivers, a rank that hangs.
    Seen here, rarely and under load, in two-rank loader runs (gdb: the child waits in
    ``PyOS_AfterFork_Child``). Letting the backend go first keeps the last reference, and the
    freeing, in this thread. The wait is bounded and usually ends at once. Only CPU tensors
    are waited for: NCCL's watchdog keeps its tensors until the GPU is done with them, by
    design, and waiting for that would stall the step.
    """
    use_count = getattr(Tensor, "_use_count", None)  # private: probed, skipped if absent
    cpu = [t for t in tensors if t.device.type == "cpu"] if use_count is not None else []
    before = [use_count(t) for t in cpu]
    work = start()
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout=timedelta(seconds=timeout))
    del work  # this thread's reference: the backend's is the one to wait for
    deadline = time.monotonic() + _LET_GO_S
    for t, count in zip(cpu, before, strict=True):
        while use_count(t) > count and time.monotonic() < deadline:
            time.sleep(1e-4)


def broadcast(tensor: Tensor, *, group_src: int, group: Any = None, async_op: bool = False) -> Any:
    """``dist.broadcast`` from the rank ``group_src`` of ``group`` (not a global rank)."""
    if not available("torch.distributed.broadcast(group_src=)"):
        raise MissingTorchFeature("torch.distributed.broadcast(group_src=)")
    return dist.broadcast(tensor, group=group, group_src=group_src, async_op=async_op)


# -- the probes -----------------------------------------------------------------------------


def _has_method(name: str) -> bool:
    return hasattr(_attribute("torch.distributed.fsdp", "FSDPModule"), name)


def _varlen_accepts(*keywords: str) -> bool:
    kernel = _varlen_kernel()
    return kernel is not None and any(accepts(kernel, k) for k in keywords)


_PROBES: dict[str, Callable[[], bool]] = {
    "torch.distributed.fsdp.fully_shard": lambda: (
        _attribute("torch.distributed.fsdp", "fully_shard") is not None
    ),
    "torch.distributed.fsdp.FSDPModule": lambda: (
        _attribute("torch.distributed.fsdp", "FSDPModule") is not None
    ),
    "torch.distributed.fsdp.MixedPrecisionPolicy": lambda: (
        _attribute("torch.distributed.fsdp", "MixedPrecisionPolicy") is not None
    ),
    "FSDPModule.set_gradient_divide_factor": lambda: _has_method("set_gradient_divide_factor"),
    "FSDPModule.set_force_sum_reduction_for_comms": lambda: _has_method(
        "set_force_sum_reduction_for_comms"
    ),
    "FSDPModule.set_reduce_scatter_unused_params": lambda: _has_method(
        "set_reduce_scatter_unused_params"
    ),
    "torch.nn.attention.varlen.varlen_attn": lambda: _varlen_kernel() is not None,
    "varlen_attn(is_causal= or window_size=)": lambda: _varlen_accepts("is_causal", "window_size"),
    "varlen_attn(enable_gqa=)": lambda: _varlen_accepts("enable_gqa"),
    "scaled_dot_product_attention(enable_gqa=)": lambda: _sdpa_has_enable_gqa(),
    "torch.distributed.broadcast(group_src=)": lambda: accepts(dist.broadcast, "group_src"),
}


def available(feature: str) -> bool:
    """Whether the installed torch has ``feature`` (a key of :data:`MINIMUM`)."""
    if feature not in _PROBES:
        raise ValueError(f"feature must be one of {sorted(_PROBES)}, got {feature!r}")
    return _PROBES[feature]()


def default_store() -> dist.Store:
    """The key-value store the default process group was built on (private in every torch
    2.x, ``distributed_c10d._get_default_store``; the one call site in the library)."""
    return dist.distributed_c10d._get_default_store()


def leave_process(status: int) -> NoReturn:
    """End this process now with ``status``, its output flushed, skipping interpreter
    finalisation.

    A process that used gloo can abort while the interpreter shuts down: gloo's worker threads
    still hold tensors, and releasing them takes the GIL of a dying interpreter ("terminate
    called without an active exception", SIGABRT; torch PR 179291 tried an atexit fix and was
    abandoned). It happens after ``destroy_process_group`` too, about one run in six here, and
    turns a finished run into a failed job. Call it last: ``atexit`` handlers do not run, so
    close files and process groups first.

    Args:
        status: the exit status (0 for success).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
