"""Encoder architectures: what every part of the package reads of one, torch-free.

An architecture is one folder, ``orchmllm/models/<name>/`` (torchtitan's habit): its
``__init__`` holds the torch-free spec (the config dataclass of its ``model.encoders.<modality>``
section, with its feature width, stride, padding and parameter count: all that the config, the
planner and the simulator read) and registers it; its ``module`` part holds the ``nn.Module``
and attaches it to the same record. A user's architecture is one file that does both:

    @dataclass(frozen=True)
    class ImuConfig(EncoderConfig):
        arch: ClassVar[str] = "imu_conv"
        padded: ClassVar[bool] = False
        channels: int = 6
        ...

    orchmllm.register_architecture(ImuConfig, module=ImuEncoder)

The table is read where it is used (:func:`architecture`, :data:`ARCHS`), never copied at
import, so an architecture registered by a plugin after the package's import is found.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from orchmllm.schema import Rate

__all__ = [
    "ARCHS",
    "Architecture",
    "EncoderConfig",
    "TransformerConfig",
    "architecture",
    "register_architecture",
    "unregister_architecture",
]


@dataclass(frozen=True)
class TransformerConfig:
    """A stack of transformer blocks: width, MLP width, depth and (grouped-query) heads."""

    hidden: int = 64
    ffn: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4

    def check(self, path: str) -> None:
        """Attention heads split the width, and query heads group evenly over key/value
        heads."""
        if self.hidden % self.heads:
            raise ValueError(f"{path} hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"{path} heads={self.heads} is not divisible by kv_heads={self.kv_heads}"
            )


@dataclass(frozen=True)
class EncoderConfig(TransformerConfig):
    """An encoder: a front end over raw rows, transformer blocks, a final norm, then a
    connector to the LLM's width (:mod:`orchmllm.models.layers`). A subclass is one
    architecture: it names itself (``arch``), says whether its attention runs over padded
    batches (``padded``), its raw row width (``feature_dim``) and its front end's weights.

    Attributes:
        hidden: the blocks' width.
        ffn: their MLP's width.
        layers: how many blocks.
        heads: attention heads.
        kv_heads: key/value heads (``heads`` group evenly over them).
        downsample: encoder positions merged into one LLM token by the connector.
        frozen: run forward only (no gradients, no optimizer state).
    """

    arch: ClassVar[str]
    padded: ClassVar[bool]  # attention over padded batches (else packed sequences)

    downsample: int = 1
    frozen: bool = False

    @property
    def stride(self) -> int:
        """Raw rows per encoder position (1 unless a front end strides)."""
        return 1

    @property
    def feature_dim(self) -> int:
        """Values per raw row: what an encoder phase moves per raw row."""
        raise NotImplementedError

    @property
    def rate(self) -> Rate:
        """How its raw rows become LLM tokens."""
        return Rate(stride=self.stride, downsample=self.downsample)

    @property
    def front_end_parameters(self) -> int:
        """Weights of the front end that turns raw rows into ``hidden``-wide positions."""
        raise NotImplementedError

    def parameters(self, llm_hidden: int) -> int:
        """Weights of the whole encoder: front end, blocks (pre-norm LayerNorms, a fused q|k|v
        projection with bias, an output projection, a GELU MLP), final LayerNorm, connector
        (merge ``downsample`` positions, two linear layers to ``llm_hidden``).

        Args:
            llm_hidden: the LLM's width, the connector's output.

        Returns:
            The count, which equals the module's (a test holds every architecture to it).
        """
        h, f, head_dim = self.hidden, self.ffn, self.hidden // self.heads
        qkv = (self.heads + 2 * self.kv_heads) * head_dim
        block = 4 * h + (h + 1) * qkv + self.heads * head_dim * h + (h + 1) * f + (f + 1) * h
        connector = (h * self.downsample + 1) * llm_hidden + (llm_hidden + 1) * llm_hidden
        return self.front_end_parameters + self.layers * block + 2 * h + connector


@dataclass(frozen=True)
class Architecture:
    """One encoder architecture: its config class and, once its torch part is imported, its
    module (called ``module(config, llm_hidden)``)."""

    config: type[EncoderConfig]
    module: Any = None  # type[torch.nn.Module]; this floor does not import torch

    @property
    def name(self) -> str:
        return self.config.arch


_TABLE: dict[str, Architecture] = {}


def register_architecture(config: type[EncoderConfig], *, module: Any = None) -> Architecture:
    """Add an encoder architecture, or attach its module to one registered without.

    Args:
        config: its config dataclass, a subclass of :class:`EncoderConfig` naming ``arch``
            and ``padded``; the name is what a config's ``model.encoders.<modality>.arch``
            says.
        module: its ``nn.Module`` class, built as ``module(config, llm_hidden)`` (None: the
            spec alone, for torch-free users; its torch part attaches it later).

    Returns:
        The record.

    Raises:
        ValueError: ``config`` is no :class:`EncoderConfig` subclass naming ``arch`` and
            ``padded``, or the name is taken by another config class or module.
    """
    if not (isinstance(config, type) and issubclass(config, EncoderConfig)):
        raise ValueError(f"config must be an EncoderConfig subclass, got {config!r}")
    for attr in ("arch", "padded"):
        if not hasattr(config, attr):
            raise ValueError(f"{config.__name__} must set the class attribute {attr!r}")
    name = config.arch
    old = _TABLE.get(name)
    if old is not None and (
        old.config is not config or (module is not None and old.module not in (None, module))
    ):
        raise ValueError(f"architecture {name!r} is taken by {old.config.__name__}")
    record = Architecture(config, module if module is not None else getattr(old, "module", None))
    _TABLE[name] = record
    return record


def unregister_architecture(name: str) -> None:
    """Remove an architecture (tests, temporary rows).

    Raises:
        ValueError: none is called ``name``.
    """
    architecture(name)
    del _TABLE[name]


def architecture(name: str) -> Architecture:
    """The architecture called ``name``.

    Raises:
        ValueError: none is (the message lists the table).
    """
    if name not in _TABLE:
        raise ValueError(f"no encoder architecture {name!r}; registered: {sorted(_TABLE)}")
    return _TABLE[name]


class _Configs(Mapping[str, type[EncoderConfig]]):
    """A live view of the table, architecture name -> its config class."""

    def __getitem__(self, name: str) -> type[EncoderConfig]:
        return _TABLE[name].config

    def __iter__(self) -> Iterator[str]:
        return iter(list(_TABLE))

    def __len__(self) -> int:
        return len(_TABLE)

    def __repr__(self) -> str:
        return f"ARCHS({dict(self)!r})"


ARCHS: Mapping[str, type[EncoderConfig]] = _Configs()
"""Encoder architecture name -> its config class, read at use (a live view)."""
