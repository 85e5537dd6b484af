"""Tiny random-weight models of every adapted family, and rows as their processors give them.

What the tests and ``examples/hf_mllm.py`` train on, with nothing downloaded: each family's
config class with 2 layers and width 32, and a synthetic dataset whose rows are what the
family's Hugging Face processor returns for one example (``input_ids`` with the placeholder
tokens expanded, ``labels``, ``pixel_values``, ``image_grid_thw``, ``input_features``, ...,
without the batch dimension). :func:`collate` is the plain pipeline's collate: it pads the
token fields and concatenates the rest, as the processor batches them.

Item sizes are heavy-tailed, so a plain split of examples over ranks leaves the ranks unequal
in every phase.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from orchmllm.integrations.hf_compat import MissingFamily, model_class, rope_config
from orchmllm.schema import IGNORE_INDEX

VOCAB, HIDDEN = 256, 32
TEXT_VOCAB = 200  # text tokens are drawn below this; special tokens above
IMAGE_TOKEN, VIDEO_TOKEN, AUDIO_TOKEN = 240, 241, 242
VISION_START, VISION_END, AUDIO_START, AUDIO_END = 243, 244, 245, 246
BOS, EOS = 254, 255
N_MELS = 16
SIDE = 8  # the tile side of the LLaVA-style towers (pixels)
MODALITIES = ("image", "video", "audio")
# Sequence fields (one entry per token): padded to the batch's longest, with these values.
PAD = {"input_ids": 0, "attention_mask": 0, "labels": IGNORE_INDEX, "mm_token_type_ids": 0}


def _text_config(**extra: object) -> dict:
    return {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "initializer_range": 0.2,  # sharp attention: positions (M-RoPE) matter to the loss
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        **extra,
    }


MROPE = {"rope_type": "default", "mrope_section": [2, 1, 1]}
QWEN_VISION = {"depth": 2, "num_heads": 2, "in_channels": 3, "patch_size": 2}
QWEN_VISION.update(temporal_patch_size=2, spatial_merge_size=2)
QWEN_TOKENS = {
    "image_token_id": IMAGE_TOKEN,
    "video_token_id": VIDEO_TOKEN,
    "vision_start_token_id": VISION_START,
    "vision_end_token_id": VISION_END,
}
TILE_TOWER = {"image_size": SIDE, "patch_size": 2, "num_hidden_layers": 2}
TILE_TOWER.update(hidden_size=16, intermediate_size=32, num_attention_heads=2)


def _qwen2_vl() -> transformers.PreTrainedModel:
    vision = {**QWEN_VISION, "embed_dim": 16, "hidden_size": HIDDEN, "mlp_ratio": 2}
    config = model_class("Qwen2VLConfig")(
        text_config=_text_config(**rope_config(100.0, **MROPE)), vision_config=vision, **QWEN_TOKENS
    )
    return model_class("Qwen2VLForConditionalGeneration")(config)


def _qwen2_5_vl() -> transformers.PreTrainedModel:
    vision = {**QWEN_VISION, "hidden_size": 16, "intermediate_size": 32, "out_hidden_size": HIDDEN}
    vision.update(window_size=8, fullatt_block_indexes=[1], tokens_per_second=2)
    config = model_class("Qwen2_5_VLConfig")(
        text_config=_text_config(**rope_config(100.0, **MROPE)), vision_config=vision, **QWEN_TOKENS
    )
    return model_class("Qwen2_5_VLForConditionalGeneration")(config)


def _qwen3_vl() -> transformers.PreTrainedModel:
    vision = {**QWEN_VISION, "hidden_size": 16, "intermediate_size": 32, "out_hidden_size": HIDDEN}
    vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
    rope = rope_config(100.0, **MROPE, mrope_interleaved=True)
    config = model_class("Qwen3VLConfig")(
        text_config=_text_config(head_dim=8, **rope),
        vision_config=vision,
        **QWEN_TOKENS,
    )
    return model_class("Qwen3VLForConditionalGeneration")(config)


def _qwen2_5_omni() -> transformers.PreTrainedModel:
    vision = {**QWEN_VISION, "hidden_size": 16, "intermediate_size": 32, "out_hidden_size": HIDDEN}
    vision.update(window_size=8, fullatt_block_indexes=[1])
    audio = {"num_mel_bins": N_MELS, "encoder_layers": 2, "encoder_attention_heads": 2}
    audio.update(encoder_ffn_dim=32, d_model=16, output_dim=HIDDEN, n_window=16)
    audio.update(max_source_positions=256)
    config = model_class("Qwen2_5OmniThinkerConfig")(
        text_config=_text_config(**rope_config(100.0, **MROPE)),
        vision_config=vision,
        audio_config=audio,
        image_token_index=IMAGE_TOKEN,
        video_token_index=VIDEO_TOKEN,
        audio_token_index=AUDIO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        audio_start_token_id=AUDIO_START,
        audio_end_token_id=AUDIO_END,
        position_id_per_seconds=5,
    )
    return model_class("Qwen2_5OmniThinkerForConditionalGeneration")(config)


def _llava() -> transformers.PreTrainedModel:
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**TILE_TOWER),
        text_config=transformers.LlamaConfig(**_text_config()),
        image_token_index=IMAGE_TOKEN,
        image_seq_length=(SIDE // 2) ** 2,
    )
    return transformers.LlavaForConditionalGeneration(config)


def _llava_onevision() -> transformers.PreTrainedModel:
    side = [[SIDE * h, SIDE * w] for h in (1, 2, 3) for w in (1, 2, 3)]
    config = model_class("LlavaOnevisionConfig")(
        vision_config=transformers.SiglipVisionConfig(**TILE_TOWER),
        text_config=transformers.Qwen2Config(**_text_config()),
        image_token_index=IMAGE_TOKEN,
        video_token_index=VIDEO_TOKEN,
        image_grid_pinpoints=side,
        vision_aspect_ratio="anyres_max_4",
    )
    return model_class("LlavaOnevisionForConditionalGeneration")(config)


def _internvl() -> transformers.PreTrainedModel:
    tower = {**TILE_TOWER, "image_size": [SIDE, SIDE], "patch_size": [2, 2]}
    config = model_class("InternVLConfig")(
        vision_config=model_class("InternVLVisionConfig")(**tower),
        text_config=transformers.Qwen2Config(**_text_config()),
        image_token_id=IMAGE_TOKEN,
        image_seq_length=(SIDE // 4) ** 2,
    )
    return model_class("InternVLForConditionalGeneration")(config)


# -- items as the processors give them ------------------------------------------------------


@dataclass
class Piece:
    """One item of an example: its tokens in the sequence and its processor fields."""

    tokens: list[int]
    fields: dict[str, np.ndarray]


def _size(rng: np.random.Generator, mean: float, hi: int) -> int:
    return int(np.clip(rng.lognormal(np.log(mean), 0.7), 1, hi))


def _qwen_vision(kind: str, family: str, rng: np.random.Generator) -> list[Piece]:
    """Qwen's patch rows (3 channels x 2 frames x 2 x 2 pixels) and grid; a video in Qwen3-VL
    is one run of placeholders per frame group, each after its timestamp's text."""
    h, w = 2 * _size(rng, 2.5, 6), 2 * _size(rng, 2.5, 6)
    t = 1 if kind == "image" else int(rng.integers(1, 4))
    rows = rng.standard_normal((t * h * w, 24)).astype(np.float32)
    grid = np.array([[t, h, w]])
    token = IMAGE_TOKEN if kind == "image" else VIDEO_TOKEN
    prefix = "pixel_values" if kind == "image" else "pixel_values_videos"
    fields = {prefix: rows, f"{kind}_grid_thw": grid}
    if kind == "video" and family in ("qwen2.5-vl", "qwen2.5-omni"):
        key = "second_per_grid_ts" if family == "qwen2.5-vl" else "video_second_per_grid"
        fields[key] = np.array([rng.choice([0.5, 1.0, 2.0])], dtype=np.float32)
    per_run = [t] if kind == "image" or family != "qwen3-vl" else [1] * t
    pieces = []
    for k, frames in enumerate(per_run):
        stamp = _text(rng, 2) if len(per_run) > 1 else []
        n = frames * h * w // 4
        pieces.append(
            Piece(
                stamp + [VISION_START, *[token] * n, VISION_END],
                fields if k == 0 else {},
            )
        )
    return pieces


def _omni_audio(rng: np.random.Generator) -> list[Piece]:
    frames = _size(rng, 40, 160) + 4
    tokens = ((frames - 1) // 2 + 1 - 2) // 2 + 1
    features = rng.standard_normal((1, N_MELS, frames)).astype(np.float32)
    fields = {"input_features": features, "feature_attention_mask": np.ones((1, frames), np.int64)}
    return [Piece([AUDIO_START, *[AUDIO_TOKEN] * tokens, AUDIO_END], fields)]


def _tiles(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((n, 3, SIDE, SIDE)).astype(np.float32)


def _llava_image(rng: np.random.Generator) -> list[Piece]:
    n = (SIDE // 2) ** 2
    return [Piece([*[IMAGE_TOKEN] * n], {"pixel_values": _tiles(1, rng)})]


def _internvl_image(rng: np.random.Generator) -> list[Piece]:
    tiles = _size(rng, 2, 6)
    tokens = [VISION_START, *[IMAGE_TOKEN] * (tiles * (SIDE // 4) ** 2), VISION_END]
    return [Piece(tokens, {"pixel_values": _tiles(tiles, rng)})]


def _onevision(kind: str, model: torch.nn.Module, rng: np.random.Generator) -> list[Piece]:
    """Anyres tiles of an image of a random size (their count and the packed feature's token
    count by the model's own rules), or a video of 2 frames."""
    if kind == "video":
        frames = 2
        tokens = frames * math.ceil(SIDE / 4) ** 2 + 1
        fields = {"pixel_values_videos": _tiles(frames, rng)[None]}
        return [Piece([VISION_START, *[VIDEO_TOKEN] * tokens, VISION_END], fields)]
    size = [SIDE * _size(rng, 1.5, 3) + int(rng.integers(0, SIDE)) for _ in range(2)]
    config = model.config
    tiles = transformers.models.llava_onevision.modeling_llava_onevision.image_size_to_num_patches(
        size, config.image_grid_pinpoints, config.vision_config.image_size
    )
    per_tile = (SIDE // 2) ** 2
    features = torch.zeros(tiles, per_tile, HIDDEN, dtype=model.dtype)
    packed, _ = model.model.pack_image_features(
        [features], torch.tensor([size]), model.model.image_newline, config.vision_aspect_ratio
    )
    fields = {"pixel_values": _tiles(tiles, rng)[None], "image_sizes": np.array([size])}
    tokens = [VISION_START, *[IMAGE_TOKEN] * packed[0].shape[0], VISION_END]
    return [Piece(tokens, fields)]


def _text(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, TEXT_VOCAB, max(int(n), 1)).tolist()


@dataclass(frozen=True)
class Family:
    """A tiny model of one adapted family and how its processor lays out an item."""

    build: Callable[[], torch.nn.Module]
    modalities: tuple[str, ...]
    item: Callable[[str, torch.nn.Module, np.random.Generator], list[Piece]]


def _qwen_item(family: str) -> Callable:
    def item(kind: str, model: torch.nn.Module, rng: np.random.Generator) -> list[Piece]:
        return _omni_audio(rng) if kind == "audio" else _qwen_vision(kind, family, rng)

    return item


FAMILIES: dict[str, Family] = {
    "qwen2-vl": Family(_qwen2_vl, ("image", "video"), _qwen_item("qwen2-vl")),
    "qwen2.5-vl": Family(_qwen2_5_vl, ("image", "video"), _qwen_item("qwen2.5-vl")),
    "qwen3-vl": Family(_qwen3_vl, ("image", "video"), _qwen_item("qwen3-vl")),
    "qwen2.5-omni": Family(_qwen2_5_omni, MODALITIES, _qwen_item("qwen2.5-omni")),
    "llava": Family(_llava, ("image",), lambda kind, model, rng: _llava_image(rng)),
    "llava-onevision": Family(_llava_onevision, ("image", "video"), _onevision),
    "internvl": Family(_internvl, ("image",), lambda kind, model, rng: _internvl_image(rng)),
}
"""``--model`` name -> the family's tiny model and item layout."""


def build_model(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The tiny model of family ``name`` (a key of :data:`FAMILIES`), random weights seeded by
    ``seed`` (the same on every rank), on the CPU in ``dtype``.

    Raises:
        ValueError: an unknown ``name``.
        MissingFamily: the installed transformers lacks the family's classes.
    """
    if name not in FAMILIES:
        raise ValueError(f"name must be one of {list(FAMILIES)}, got {name!r}")
    torch.manual_seed(seed)
    try:
        model = FAMILIES[name].build()
    except MissingFamily as e:
        raise MissingFamily(f"the {name} family: {e}") from None
    return model.to(dtype=dtype)


def make_rows(
    name: str,
    model: torch.nn.Module,
    num_examples: int,
    *,
    modalities: Sequence[str] | None = None,
    seed: int = 0,
    text_only: float = 0.0,
) -> list[dict[str, torch.Tensor]]:
    """Processor-format rows for family ``name``: a prompt, up to two items of each of
    ``modalities`` and at least one (default: every modality the family takes) in random order
    with text between, and an answer, the only text with labels. A share ``text_only`` of the
    rows (each drawn with that probability) hold no item.

    Raises:
        ValueError: an unknown ``name``, a modality the family does not take, or a
            ``text_only`` outside [0, 1].
    """
    if not 0.0 <= text_only <= 1.0:
        raise ValueError(f"text_only must be in [0, 1], got {text_only!r}")
    if name not in FAMILIES:
        raise ValueError(f"name must be one of {list(FAMILIES)}, got {name!r}")
    family = FAMILIES[name]
    modalities = tuple(family.modalities if modalities is None else modalities)
    unknown = sorted(set(modalities) - set(family.modalities))
    if unknown:
        raise ValueError(f"{name} takes modalities {family.modalities}, got {unknown}")
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num_examples):
        kinds = [m for m in modalities for _ in range(int(rng.integers(0, 3)))]
        if modalities and not kinds:
            kinds = [modalities[int(rng.integers(len(modalities)))]]
        if text_only and rng.random() < text_only:
            kinds = []
        rng.shuffle(kinds)
        ids, types, fields = [BOS, *_text(rng, _size(rng, 8, 48))], [], {}
        for kind in kinds:
            for piece in family.item(kind, model, rng):
                ids += piece.tokens + _text(rng, _size(rng, 3, 12))
                for key, value in piece.fields.items():
                    fields.setdefault(key, []).append(value)
        answer = _text(rng, _size(rng, 12, 80))
        ids = np.array(ids + answer + [EOS])
        labels = np.where(np.arange(ids.size) >= ids.size - len(answer) - 1, ids, IGNORE_INDEX)
        row = {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": labels}
        if name.startswith("qwen") and name != "qwen2.5-omni":
            types = np.where(ids == IMAGE_TOKEN, 1, np.where(ids == VIDEO_TOKEN, 2, 0))
            row["mm_token_type_ids"] = types
        row.update({k: _pad_cat(v) for k, v in fields.items()})
        rows.append({k: torch.from_numpy(np.asarray(v)) for k, v in row.items()})
    return rows


def _pad_cat(arrays: Sequence[np.ndarray | torch.Tensor]) -> np.ndarray:
    """Concatenate along dim 0, every other dim zero-padded to the largest."""
    arrays = [np.asarray(a) for a in arrays]
    shape = np.max([a.shape for a in arrays], axis=0)
    out = []
    for a in arrays:
        pad = [(0, 0)] + [(0, int(s - n)) for s, n in zip(shape[1:], a.shape[1:], strict=True)]
        out.append(np.pad(a, pad))
    return np.concatenate(out)


def collate(rows: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The plain pipeline's collate: token fields right-padded (:data:`PAD`), every other
    field concatenated over the batch (trailing dims zero-padded), as a processor batches. A
    field a row lacks, or holds as None (a ``datasets.Dataset`` of rows with different
    fields), is left out for that row."""
    rows = [{k: v for k, v in r.items() if v is not None} for r in rows]
    width = max(len(r["input_ids"]) for r in rows)
    out = {}
    for key in dict.fromkeys(k for r in rows for k in r):
        if key in PAD:
            padded = [
                np.pad(np.asarray(r[key]), (0, width - len(r[key])), constant_values=PAD[key])
                for r in rows
            ]
            out[key] = torch.from_numpy(np.stack(padded))
        else:
            out[key] = torch.from_numpy(_pad_cat([r[key] for r in rows if key in r]))
    return out


def train_tokenizer(
    texts: Sequence[str], *, specials: Sequence[str], vocab_size: int = 400
) -> transformers.PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer trained on ``texts`` with the ``tokenizers`` library
    (nothing downloaded): each of ``specials`` (placeholders, chat markers; the first is also
    the padding token) is one token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(specials), initial_alphabet=alphabet
    )
    tok.train_from_iterator(texts, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=specials[0])
