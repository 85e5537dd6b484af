"""The reference MLLM: one encoder per modality of the model config and a decoder LLM (the
training recipe, FSDP2 included, is applied from outside: :mod:`orchmllm.models.parallelize`).

The submodules are independent; the orchestrator decides which items each one sees on
which rank. :meth:`MLLM.forward` only runs a caller-supplied step function inside the root
module call, so FSDP2's root hooks (lazy init, final backward callback that reduce-scatters
gradients of groups an input did not reach) fire around the whole multi-phase step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

import orchmllm.models.vit.module  # noqa: F401  (the built-in modules attach to their specs)
import orchmllm.models.whisper.module  # noqa: F401
from orchmllm.config import ModelConfig
from orchmllm.models.llm import LLM
from orchmllm.models.spec import EncoderConfig, architecture

T = TypeVar("T")


def build_encoder(section: EncoderConfig, llm_hidden: int) -> nn.Module:
    """A modality's encoder, by its config section's architecture (looked up now, so one a
    plugin registered is found).

    Raises:
        ValueError: the architecture is unknown or was registered without a module.
    """
    arch = architecture(section.arch)
    if arch.module is None:
        raise ValueError(
            f"encoder architecture {section.arch!r} has no module: register it with "
            "orchmllm.register_architecture(config, module=...)"
        )
    return arch.module(section, llm_hidden)


class MLLM(nn.Module):
    """``encoders``: one encoder per modality of ``cfg.encoders``, keyed by its name, built by
    its architecture; ``llm``: the decoder."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.encoders = nn.ModuleDict(
            {name: build_encoder(section, cfg.llm.hidden) for name, section in cfg.encoders.items()}
        )
        self.llm = LLM(cfg.llm, cfg.vocab)

    def forward(self, step: Callable[[MLLM], T]) -> T:
        """Run ``step(self)``: one forward over all phases, as one call of the FSDP root."""
        return step(self)


def init_weights(model: nn.Module) -> None:
    """Normal(0, 0.02) weights, zero biases, unit norm scales (GPT-2 / Qwen2 style)."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


def build_model(
    cfg: ModelConfig,
    *,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> MLLM:
    """The MLLM with weights that depend only on ``seed`` and the device type (identical on
    every rank of a job); the caller's random streams are left as they were.

    The model is created and initialised on ``device`` itself: drawing billions of weights
    with the host's generator takes most of a minute (MLLM-10B with a quarter of its layers),
    a GPU's takes a second.
    """
    device = torch.device(device)
    with (
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        device,
    ):
        torch.manual_seed(seed)
        model = MLLM(cfg)
        init_weights(model)
    # Converting parameters already in ``dtype`` is a no-op that a fake tensor refuses (it
    # cannot be swapped in place): the memory oracle builds the model under FakeTensorMode.
    if any(p.dtype != dtype for p in model.parameters()):
        model = model.to(dtype=dtype)
    return model
