"""Small reference multimodal LLM (ViT + Whisper-style audio encoder + Qwen2-style LLM)."""

from orchmllm.config import LLMConfig, ModelConfig, VitConfig, WhisperConfig

from .attention import packed_attention, padded_attention
from .audio import AudioEncoder
from .llm import LLM
from .mllm import ENCODERS, MLLM, build_model, shard_model
from .vision import VisionEncoder

__all__ = [
    "ENCODERS",
    "LLM",
    "MLLM",
    "AudioEncoder",
    "LLMConfig",
    "ModelConfig",
    "VisionEncoder",
    "VitConfig",
    "WhisperConfig",
    "build_model",
    "packed_attention",
    "padded_attention",
    "shard_model",
]
