"""Model configuration: the ``model:`` section of a run config (schema in configs/tiny.yaml).

Plain frozen dataclasses so the simulator can read shapes without building a model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


def _require_positive(section: str, name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{section}.{name} must be a positive integer, got {value!r}")


def _from_dict(cls: type, section: str, raw: dict[str, Any]) -> Any:
    if not isinstance(raw, dict):
        raise ValueError(f"{section} must be a mapping, got {raw!r}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ValueError(f"{section} has unknown keys {unknown}; expected {sorted(names)}")
    missing = sorted(names - set(raw))
    if missing:
        raise ValueError(f"{section} is missing keys {missing}")
    obj = cls(**raw)
    for f in fields(cls):
        value = getattr(obj, f.name)
        if f.type == "int":
            _require_positive(section, f.name, value)
        elif f.type == "bool" and not isinstance(value, bool):
            raise ValueError(f"{section}.{f.name} must be true or false, got {value!r}")
        elif f.type == "float" and (not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"{section}.{f.name} must be a positive number, got {value!r}")
    if obj.hidden % obj.heads:
        raise ValueError(f"{section}.hidden={obj.hidden} is not divisible by heads={obj.heads}")
    if obj.heads % obj.kv_heads:
        raise ValueError(f"{section}.heads={obj.heads} is not divisible by kv_heads={obj.kv_heads}")
    return obj


@dataclass(frozen=True)
class VisionConfig:
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    patch: int
    downsample: int
    frozen: bool

    @property
    def patch_dim(self) -> int:
        """Values per flattened RGB patch."""
        return 3 * self.patch * self.patch

    def encoded_length(self, n_patches: int) -> int:
        """Tokens an image of ``n_patches`` raw patches contributes to the LLM sequence."""
        return n_patches // self.downsample


@dataclass(frozen=True)
class AudioConfig:
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    n_mels: int
    conv_stride: int
    downsample: int
    frozen: bool

    @property
    def frames_per_token(self) -> int:
        """Raw mel frames per encoded LLM token (conv stride times downsample rate)."""
        return self.conv_stride * self.downsample

    def encoded_length(self, n_frames: int) -> int:
        """Tokens a clip of ``n_frames`` mel frames contributes to the LLM sequence."""
        return n_frames // self.frames_per_token


@dataclass(frozen=True)
class LLMConfig:
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    rope_theta: float


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    vision: VisionConfig
    audio: AudioConfig
    llm: LLMConfig

    @property
    def encoders(self) -> dict[str, VisionConfig | AudioConfig]:
        """Encoder config per modality name (a row of ``orchmllm.schema.MODALITIES``)."""
        return {"vision": self.vision, "audio": self.audio}

    @property
    def feature_dims(self) -> dict[str, int]:
        """Raw row width per modality: what an encoder phase moves per raw row."""
        return {"vision": self.vision.patch_dim, "audio": self.audio.n_mels}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Validate and build from the ``model:`` mapping of a run config."""
        if not isinstance(raw, dict):
            raise ValueError(f"model must be a mapping, got {raw!r}")
        expected = {"vocab", "vision", "audio", "llm"}
        if set(raw) != expected:
            raise ValueError(f"model keys must be {sorted(expected)}, got {sorted(raw)}")
        _require_positive("model", "vocab", raw["vocab"])
        return cls(
            vocab=raw["vocab"],
            vision=_from_dict(VisionConfig, "model.vision", raw["vision"]),
            audio=_from_dict(AudioConfig, "model.audio", raw["audio"]),
            llm=_from_dict(LLMConfig, "model.llm", raw["llm"]),
        )
