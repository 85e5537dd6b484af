"""The split LLM phase of an HF language model: attention over pieces of long sequences
(context parallelism, issue 40), through transformers' attention-function registry.

``wrap(model, context_parallel=N)`` sets the language model's attention implementation to
``orchmllm_cp_<original>`` (:func:`attention_name`), registered here in
``transformers.AttentionInterface`` and ``AttentionMaskInterface``. In a step whose plan
split an example (:attr:`orchmllm.LLMBatch.pieces`), every attention layer hands its
queries, keys and values to :meth:`~orchmllm.dist.context_parallel.PackedPieces.attend`
(a piece's queries over its whole sequence's keys, gathered in its context-parallel group),
and the mask function builds no ``[tokens, tokens]`` mask; in any other step both are the
original implementation's, unchanged.

The pieces reach the attention function as a keyword of the language model's call
(:data:`PIECES_KWARG`), which transformers passes down to every attention call: a keyword
rather than a context variable because activation checkpointing recomputes the layers in the
backward, after the forward's context has ended, and the recomputation gets the layer's
arguments again. The mask is built once, in the forward, so a context variable
(:func:`pieces_attention`) tells its function that pieces are in the step.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import orchmllm

__all__ = ["PIECES_KWARG", "PREFIX", "attention_name", "original_attention", "pieces_attention"]

PREFIX = "orchmllm_cp_"  # + the original implementation: the registered name
PIECES_KWARG = "orchmllm_pieces"  # the language model's keyword that carries the pieces
# An attention function's arguments the pieces' attention cannot honour (when set).
UNSUPPORTED = ("sliding_window", "softcap", "s_aux")

_IN_STEP: ContextVar[bool] = ContextVar("orchmllm_pieces_in_step", default=False)


def original_attention(name: str) -> str:
    """The implementation ``name`` stands for: ``name`` itself, or the original one behind a
    registered name (a model wrapped twice)."""
    return name.removeprefix(PREFIX)


def attention_name(original: str) -> str:
    """The registered implementation that attends over pieces in a split step and is
    ``original`` otherwise; registers it (and its mask function) with transformers, which
    adds a name to its registries and changes no other."""
    name = PREFIX + original
    AttentionInterface.register(name, _attention(original))
    AttentionMaskInterface.register(name, _mask(original))
    return name


@contextlib.contextmanager
def pieces_attention(batch: orchmllm.LLMBatch) -> Iterator[dict[str, Any]]:
    """Around a language model's call on ``batch``: the keywords that bring its pieces
    (:attr:`orchmllm.LLMBatch.pieces`) to the attention layers (none when nothing is split),
    and no attention mask built while it runs."""
    if batch.pieces is None:
        yield {}
        return
    token = _IN_STEP.set(True)
    try:
        yield {PIECES_KWARG: batch.pieces}
    finally:
        _IN_STEP.reset(token)


def _original_function(module: nn.Module, original: str) -> Callable[..., Any]:
    """The attention function of ``original`` for ``module``: transformers' registered one,
    or for ``eager`` the module's own modeling file's (eager is no registered function)."""
    if original != "eager":
        return ALL_ATTENTION_FUNCTIONS[original]
    fn = getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)
    if fn is None:
        raise ValueError(
            f"{type(module).__name__}'s module has no eager_attention_forward to fall back to; "
            "load the model with attn_implementation='sdpa'"
        )
    return fn


def _attention(original: str) -> Callable[..., tuple[torch.Tensor, None]]:
    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pieces = kwargs.pop(PIECES_KWARG, None)
        if pieces is None:
            fn = _original_function(module, original)
            return fn(module, query, key, value, attention_mask, **kwargs)
        _check_split(module, query, kwargs)
        scaling, dim = kwargs.get("scaling"), query.shape[-1]
        if scaling is not None and scaling != dim**-0.5:  # attend() scales by dim**-0.5
            query = query * (scaling * dim**0.5)
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, dim]
        return pieces.attend(q, k, v)[None], None

    return attention


def _check_split(module: nn.Module, query: torch.Tensor, kwargs: dict[str, Any]) -> None:
    """What the pieces' causal attention over one packed row cannot give, refused by name."""
    if query.shape[0] != 1:
        raise ValueError(
            f"the split attention takes one packed row, got a batch of {query.shape[0]}"
        )
    if kwargs.get("dropout"):
        raise ValueError(
            f"{type(module).__name__} has attention dropout {kwargs['dropout']}, which the "
            "split attention does not apply: set the config's attention_dropout to 0"
        )
    unsupported = {k: kwargs[k] for k in UNSUPPORTED if kwargs.get(k) is not None}
    if unsupported:
        raise ValueError(
            f"{type(module).__name__} attends with {unsupported}, which the split attention "
            "(plain causal attention over whole sequences) does not apply"
        )


def _mask(original: str) -> Callable[..., Any]:
    def mask(*args: Any, **kwargs: Any) -> Any:
        if _IN_STEP.get():
            return None  # the pieces' attention masks by position itself
        return ALL_MASK_ATTENTION_FUNCTIONS[original](*args, **kwargs)

    return mask
