"""Small reference multimodal LLM (ViT + Whisper-style audio encoder + Qwen2-style LLM)."""

from orchmllm.config import LLMConfig, ModelConfig, VitConfig, WhisperConfig

from .attention import packed_attention, padded_attention
from .audio import AudioEncoder
from .llm import LLM
from .mllm import ENCODERS, MLLM, build_model
from .parallelize import apply_checkpointing, compute_dtype, parallelize, shard_model, storage_dtype
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
    "apply_checkpointing",
    "build_model",
    "compute_dtype",
    "packed_attention",
    "padded_attention",
    "parallelize",
    "shard_model",
    "storage_dtype",
]
