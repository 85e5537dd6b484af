"""Small reference multimodal LLM (ViT + Whisper-style audio encoder + Qwen2-style LLM).

One folder per encoder architecture (``vit/``, ``whisper/``): its torch-free spec in the
folder's ``__init__`` (registered in :mod:`orchmllm.models.spec`, read by the config, the
planner and the simulator) and its ``nn.Module`` in ``module.py``. This package's names load on
first use, so the torch-free specs import without torch. The FSDP2 recipe is the submodule
``orchmllm.models.parallelize`` (its function of that name is imported from there).
"""

from orchmllm._lazy import lazy_names

_LAZY = {
    "ARCHS": "orchmllm.models.spec",
    "EncoderConfig": "orchmllm.models.spec",
    "register_architecture": "orchmllm.models.spec",
    "LLMConfig": "orchmllm.config",
    "ModelConfig": "orchmllm.config",
    "VitConfig": "orchmllm.models.vit",
    "WhisperConfig": "orchmllm.models.whisper",
    "packed_attention": "orchmllm.models.attention",
    "padded_attention": "orchmllm.models.attention",
    "AudioEncoder": "orchmllm.models.whisper.module",
    "VisionEncoder": "orchmllm.models.vit.module",
    "LLM": "orchmllm.models.llm",
    "MLLM": "orchmllm.models.mllm",
    "build_model": "orchmllm.models.mllm",
    "apply_checkpointing": "orchmllm.models.parallelize",
    "compute_dtype": "orchmllm.models.parallelize",
    "shard_model": "orchmllm.models.parallelize",
    "storage_dtype": "orchmllm.models.parallelize",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_names(__name__, _LAZY)
