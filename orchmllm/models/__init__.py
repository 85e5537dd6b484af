"""Small reference multimodal LLM (ViT + Whisper-style audio encoder + Qwen2-style LLM)."""

from orchmllm.config import AudioConfig, LLMConfig, ModelConfig, VisionConfig

from .attention import packed_attention, padded_attention
from .audio import AudioEncoder
from .llm import LLM
from .mllm import MLLM, build_model, shard_model
from .vision import VisionEncoder

__all__ = [
    "LLM",
    "MLLM",
    "AudioConfig",
    "AudioEncoder",
    "LLMConfig",
    "ModelConfig",
    "VisionConfig",
    "VisionEncoder",
    "build_model",
    "packed_attention",
    "padded_attention",
    "shard_model",
]
