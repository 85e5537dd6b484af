"""The Hugging Face APIs the integrations call that changed between the supported releases.

The ``hf`` and ``trainer`` extras accept transformers from 4.57 (the oldest release with every
adapted family) and TRL from 0.24, the releases LLaMA-Factory, ms-swift and verl pin. Between
those and the newest, the models' feature functions changed what they return (a tensor or a
tuple, then a ``ModelOutput`` with ``pooler_output``), where they live (the Omni thinker's on
the thinker, later on its inner model), their argument names, and configs moved RoPE settings
from ``rope_scaling``/``rope_theta`` to ``rope_parameters``. As :mod:`orchmllm.compat` does for
torch, each difference is probed (a signature, an attribute, a result's type), never read from
a version string, and every call site goes through a function here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from torch import nn

__all__ = [
    "OLDEST",
    "plain_loss",
    "Features",
    "checkpointing",
    "MissingFamily",
    "features",
    "model_class",
    "part",
    "pil_image_processor",
    "rope_config",
    "rope_index",
    "rope_reads_token_types",
]

#: The oldest transformers release the integrations are tested with; it has every adapted
#: family (Qwen3-VL arrived in 4.57.0).
OLDEST = "4.57"


class MissingFamily(ImportError):
    """The installed transformers lacks a model family's classes."""


def model_class(name: str) -> type:
    """``transformers.<name>`` (a model or config class of an adapted family).

    Raises:
        MissingFamily: the installed transformers has no such class; the error names the
            class and a release that has it.
    """
    cls = getattr(transformers, name, None)
    if cls is None:
        raise MissingFamily(
            f"transformers {transformers.__version__} has no {name}: its family needs "
            f"transformers >= {OLDEST}"
        )
    return cls


def pil_image_processor(name: str) -> type:
    """The image processor ``<name>ImageProcessor`` that runs on PIL and numpy (no
    torchvision): ``...ImageProcessorPil`` where this release has one, else the older
    releases' plain (slow) ``...ImageProcessor``, which is that one."""
    return getattr(transformers, f"{name}ImageProcessorPil", None) or model_class(
        f"{name}ImageProcessor"
    )


def part(model: nn.Module, name: str) -> Any:
    """The attribute ``name`` of a model's inner model (``model.model``), or of the model where
    this release keeps it there (the Omni thinker's towers and functions, before its inner model
    held them); ``"language_model"``: the decoder, which is the inner model itself there."""
    inner = model.model
    if hasattr(inner, name):
        return getattr(inner, name)
    if name == "language_model" and not hasattr(model, name):
        return inner
    return getattr(model, name)


def checkpointing(model: nn.Module, enable: bool, *args: Any, **kwargs: Any) -> None:
    """Turn the HF model's activation checkpointing on (with the Trainer's arguments) or off:
    ``activation_checkpointing_enable``, or older releases' ``gradient_checkpointing_enable``."""
    action = "enable" if enable else "disable"
    name = f"activation_checkpointing_{action}"
    fn = getattr(model, name, None) or getattr(model, f"gradient_checkpointing_{action}")
    fn(*args, **kwargs)


def _takes(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` takes keyword ``name`` by name (not merely through ``**kwargs``)."""
    return name in inspect.signature(fn).parameters


def rope_config(theta: float, **params: Any) -> dict[str, Any]:
    """A text config's RoPE keywords (``rope_type``, ``mrope_section``...) as this release's
    configs take them: ``rope_parameters`` with the base inside, or the older
    ``rope_scaling`` and ``rope_theta``."""
    if _takes(transformers.LlamaConfig.__init__, "rope_parameters"):
        return {"rope_parameters": {**params, "rope_theta": theta}}
    return {"rope_scaling": dict(params), "rope_theta": theta}


@dataclass
class Features:
    """A feature function's result, whatever the release returns.

    Attributes:
        pooler_output: per item (a sequence of ``[tokens, hidden]``, or one tensor
            ``[items, tokens, hidden]``): the features the language model receives.
        last_hidden_state: the tower's concatenated output (the audio tower's features).
        deepstack_features: Qwen3-VL's DeepStack features, one ``[tokens, hidden]`` tensor per
            layer (empty elsewhere).
    """

    pooler_output: Any
    last_hidden_state: torch.Tensor | None = None
    deepstack_features: list[torch.Tensor] = field(default_factory=list)

    def tokens(self) -> torch.Tensor:
        """Every item's features, in order, as ``[tokens, hidden]`` (releases return them per
        item, per tile or already concatenated)."""
        out = self.pooler_output
        parts = [out] if isinstance(out, torch.Tensor) else list(out)
        return torch.cat([p.reshape(-1, p.shape[-1]) for p in parts])


def _concat(per_layer: Sequence[Any]) -> list[torch.Tensor]:
    return [t if isinstance(t, torch.Tensor) else torch.cat(list(t)) for t in per_layer]


def features(model: nn.Module, name: str, *args: Any, **kwargs: Any) -> Features:
    """Call the model's own feature function ``name`` (``get_image_features``...) on the
    inner model, or the model itself where this release keeps it there (the Omni thinker's).

    A required argument the caller does not pass is read from the model's config by its name
    (older releases require ``vision_feature_layer``...); ``return_dict=True`` is passed where
    the function names it or takes keywords (those that then return a ``ModelOutput``).
    Older releases return the features themselves: a tensor, a sequence per item, or (Qwen3-VL)
    the per-item features and the DeepStack features.
    """
    fn = part(model, name)
    params = list(inspect.signature(fn).parameters.values())
    for p in params[len(args) :]:
        required = p.default is inspect.Parameter.empty and p.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        )
        if required and p.name not in kwargs:
            kwargs[p.name] = getattr(model.config, p.name)
    if any(p.name == "return_dict" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        kwargs["return_dict"] = True
    out = fn(*args, **kwargs)
    if hasattr(out, "pooler_output") or hasattr(out, "last_hidden_state"):
        deepstack = getattr(out, "deepstack_features", None) or []
        return Features(
            getattr(out, "pooler_output", None),
            getattr(out, "last_hidden_state", None),
            _concat(deepstack),
        )
    if isinstance(out, torch.Tensor):
        return Features(out, out)
    if len(out) == 2 and not isinstance(out[0], torch.Tensor):  # Qwen3-VL: items, DeepStack
        return Features(out[0], None, _concat(out[1]))
    return Features(out)


def rope_index(
    model: nn.Module,
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor | None,
    **kwargs: Any,
) -> torch.Tensor:
    """The model's own ``get_rope_index`` position ids ``[3, batch, tokens]``: given the
    tokens' types (0 text, 1 image, 2 video; None: not known) where this release reads them,
    and ``kwargs`` (grids, seconds, attention mask) it takes; a keyword it does not take must
    be None."""
    fn = part(model, "get_rope_index")
    if mm_token_type_ids is not None and _takes(fn, "mm_token_type_ids"):
        kwargs["mm_token_type_ids"] = mm_token_type_ids
    unknown = [k for k, v in kwargs.items() if v is not None and not _takes(fn, k)]
    if unknown:
        raise TypeError(f"{type(model).__name__}.get_rope_index does not take {unknown}")
    return fn(input_ids, **{k: v for k, v in kwargs.items() if _takes(fn, k)})[0]


def rope_reads_token_types(model: nn.Module) -> bool:
    """Whether this release's ``get_rope_index`` reads the tokens' types
    (``mm_token_type_ids``); older ones find the items from the placeholder ids themselves."""
    return _takes(part(model, "get_rope_index"), "mm_token_type_ids")


def plain_loss(model: nn.Module, batch: dict[str, Any], num_items_in_batch: Any) -> torch.Tensor:
    """A plain (unbalanced) step's loss: the model's own forward on a padded ``batch`` with
    ``labels``, and its own ``loss_function`` summed over the targets and divided by
    ``num_items_in_batch`` (all ranks' targets). The forward is not asked for the loss: some
    releases' Qwen3-VL and Omni forwards drop ``num_items_in_batch`` (a per-rank mean).

    Args:
        model: the HF model, or a ``DistributedDataParallel`` around it.
    """
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    hf = getattr(model, "module", model)
    return hf.loss_function(
        logits=logits,
        labels=batch["labels"],
        vocab_size=logits.shape[-1],
        num_items_in_batch=num_items_in_batch,
    )
