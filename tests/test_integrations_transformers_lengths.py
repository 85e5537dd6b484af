"""Token counts from metadata equal what the real HF processors produce.

Each processor is built from its default constructor (nothing downloaded), the tokenizer is
trained here (``tiny.train_tokenizer``); images and clips are generated, written to files
and read back by the length functions through their headers only. Every count must be equal:
patches or tiles and tokens per image (Qwen2-VL dynamic resolution, LLaVA's fixed grid,
LLaVA-OneVision's anyres grid, InternVL's cropped tiles), frames and tokens per clip (Whisper's
feature extractor, Qwen2-Audio's processor), and whole rows' ``input_ids`` lengths through
``datasets.map``.
"""

from __future__ import annotations

import copy
import wave
from types import SimpleNamespace

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", exc_type=ModuleNotFoundError)
datasets = pytest.importorskip("datasets")
Image = pytest.importorskip("PIL.Image")

from orchmllm.integrations.hf_compat import pil_image_processor  # noqa: E402
from orchmllm.integrations.transformers import lengths as L  # noqa: E402
from orchmllm.integrations.transformers import tiny  # noqa: E402
from orchmllm.integrations.transformers.tiles import (  # noqa: E402
    InternVLAdapter,
    LlavaAdapter,
    LlavaOnevisionAdapter,
)

SPECIALS = ["<pad>", "<image>", "<video>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]
SPECIALS += ["<|image_pad|>", "<|video_pad|>"]  # Qwen3-VL's placeholders
SPECIALS += ["<img>", "</img>", "<IMG_CONTEXT>"]  # InternVL's
# (width, height): tiny (grown to min_pixels), odd, exact multiples, wide, tall, over max_pixels,
# beyond LLaVA-OneVision's largest pinpoint (2304) in one side and in both.
SIZES = [(1, 1), (10, 10), (28, 28), (56, 56), (57, 83), (83, 57), (321, 123), (640, 480)]
SIZES += [(1000, 30), (30, 1000), (1999, 1001), (2400, 300), (310, 2450), (2350, 2330)]
# A 1 x 1 image's layout is ambiguous to older releases' processors, which guess it.
CHANNELS_LAST = {"input_data_format": "channels_last"}
# Samples at 16 kHz: under one hop, hop boundaries, odd, the 30 s cut, beyond it.
SAMPLES = [1, 159, 160, 161, 8000, 48077, 479_999, 480_000, 480_001, 720_000]


@pytest.fixture(scope="module")
def tokenizer():
    texts = ["what is in the picture? a cat on a mat.", "listen: the audio says hello"] * 20
    return tiny.train_tokenizer(texts, specials=SPECIALS)


def _image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


def _sizes(n: int = 12, seed: int = 0) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    return SIZES + [tuple(int(v) for v in rng.integers(16, 1500, 2)) for _ in range(n)]


@pytest.fixture(scope="module")
def image_files(tmp_path_factory) -> list[tuple[str, tuple[int, int]]]:
    folder = tmp_path_factory.mktemp("images")
    out = []
    for i, (w, h) in enumerate(_sizes()):
        path = str(folder / f"{i}.png")
        _image(w, h, seed=i).save(path)
        out.append((path, (w, h)))
    return out


@pytest.mark.parametrize(
    "settings",
    [{}, {"min_pixels": 100 * 28 * 28, "max_pixels": 300 * 28 * 28}, {"patch_size": 16}],
    ids=["defaults", "budget", "patch16"],
)
def test_qwen_image_equals_processor(settings, image_files):
    processor = pil_image_processor("Qwen2VL")(**settings)
    rule = L.QwenVision.from_processor(processor)
    for path, size in image_files:
        assert L.image_size(path) == size  # the header alone
        item = rule.image(*L.image_size(path))
        out = processor(images=[Image.open(path)], return_tensors="np", **CHANNELS_LAST)
        grid = out["image_grid_thw"][0]
        assert (item.rows, item.tokens) == (out["pixel_values"].shape[0], grid.prod() // 4), size


def test_qwen_video_frames_and_size_rules():
    """A video's patches: its frames padded to the temporal patch (pure rule), times one
    frame's grid under the video pixel budget (the image processor resizes by the same rule
    with the video processor's default budget: the video processor itself needs
    torchvision, see the next test)."""
    rule = L.QwenVision()
    frame = pil_image_processor("Qwen2VL")(
        min_pixels=rule.video_min_pixels, max_pixels=rule.video_max_pixels
    )
    for w, h in [(64, 48), (320, 240), (1280, 720), (100, 700)]:
        grid = frame(images=[_image(w, h)], return_tensors="np", **CHANNELS_LAST)
        grid = grid["image_grid_thw"][0]
        for frames in (1, 2, 3, 7, 16):
            item = rule.video(frames, w, h)
            t = -(-frames // 2)
            assert item.rows == t * grid[1] * grid[2]
            assert item.tokens == item.rows // 4


def test_qwen_video_equals_video_processor():
    pytest.importorskip("torchvision")
    from transformers.video_utils import VideoMetadata

    for sample in (False, True):
        processor = transformers.Qwen2VLVideoProcessor(do_sample_frames=sample, fps=2)
        image = pil_image_processor("Qwen2VL")()
        rule = L.QwenVision.from_processor(image, video_processor=processor)
        for frames, (w, h), fps in [(5, (140, 100), 10.0), (40, (320, 240), 25.0)]:
            video = np.random.default_rng(0).integers(0, 255, (frames, h, w, 3), dtype=np.uint8)
            meta = VideoMetadata(total_num_frames=frames, fps=fps, width=w, height=h)
            out = processor(videos=[video], video_metadata=[meta], return_tensors="np")
            item = rule.video(frames, w, h, fps=fps)
            assert item.rows == out["pixel_values_videos"].shape[0]
            assert item.tokens == out["video_grid_thw"][0].prod() // 4


def _images_only(processor_class: type) -> type:
    """``processor_class`` for images: without torchvision, transformers cannot check a video
    processor's class (not even None's), and older releases insist on the family's tokenizer
    class (the tests' is a tiny one), so those two checks are skipped."""

    class ImagesOnly(processor_class):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name not in ("video_processor", "tokenizer"):
                super().check_argument_for_proper_class(argument_name, argument)

    return ImagesOnly


def _llava(tokenizer, *, crop=True, strategy="default", extra=1):
    return transformers.LlavaProcessor(
        image_processor=pil_image_processor("CLIP")(do_center_crop=crop),
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=extra,
        image_token="<image>",
    )


def _onevision(tokenizer, *, tile=384, strategy="full", aspect="anyres_max_9"):
    """Defaults as the released checkpoints (SigLIP 384 px tiles, 27 x 27 features, 6 x 6
    pinpoints); another tile size gets a 3 x 3 grid of pinpoints."""
    image = {"size": {"height": tile, "width": tile}}
    if tile != 384:
        image["image_grid_pinpoints"] = [[tile * h, tile * w] for h in (1, 2, 3) for w in (1, 2, 3)]
    return _images_only(transformers.LlavaOnevisionProcessor)(
        image_processor=pil_image_processor("LlavaOnevision")(**image),
        tokenizer=tokenizer,
        num_image_tokens=(tile // 14) ** 2,
        vision_feature_select_strategy=strategy,
        vision_aspect_ratio=aspect,
    )


def _qwen3(tokenizer):
    """Qwen3-VL's processor on its 16-pixel patches (the image processor is Qwen2-VL's)."""
    image = pil_image_processor("Qwen2VL")(patch_size=16)
    return _images_only(transformers.Qwen3VLProcessor)(image_processor=image, tokenizer=tokenizer)


def _internvl(tokenizer, *, max_patches=12, thumbnail=True):
    """InternVL's processor (GotOcr2's image processor, 448 px crops of 256 tokens); it reads
    its image tokens from the tokenizer, as InternVL's tokenizer names them (set on a copy:
    other processors read a tokenizer's ``video_token`` too)."""
    tokenizer = copy.copy(tokenizer)
    for name, token in (
        ("start_image_token", "<img>"),
        ("end_image_token", "</img>"),
        ("context_image_token", "<IMG_CONTEXT>"),
        ("video_token", "<video>"),
    ):
        setattr(tokenizer, name, token)
        setattr(tokenizer, f"{name}_id", tokenizer.convert_tokens_to_ids(token))  # fmt: skip
    image = pil_image_processor("GotOcr2")(
        size={"height": 448, "width": 448},
        crop_to_patches=True,
        max_patches=max_patches,
        use_thumbnail=thumbnail,
    )
    return _images_only(transformers.InternVLProcessor)(
        image_processor=image, tokenizer=tokenizer, image_seq_length=256
    )


# case -> (family, its processor from the tokenizer)
PROCESSORS = {
    "qwen3-vl": ("qwen3-vl", _qwen3),
    "llava-crop": ("llava", _llava),
    "llava-nocrop": ("llava", lambda t: _llava(t, crop=False, strategy="full", extra=0)),
    "onevision": ("llava-onevision", _onevision),
    "onevision-336-max4-default": (
        "llava-onevision",
        lambda t: _onevision(t, tile=336, strategy="default", aspect="anyres_max_4"),
    ),
    "internvl": ("internvl", _internvl),
    "internvl-max6-nothumbnail": (
        "internvl",
        lambda t: _internvl(t, max_patches=6, thumbnail=False),
    ),
}


@pytest.mark.parametrize("case", list(PROCESSORS))
def test_image_rules_equal_processor(case, tokenizer, image_files):
    """A row with one image: its tokens, its rows (LLaVA: one tile; LLaVA-OneVision: the base
    tile and the grid's) and the whole row's ``input_ids`` length."""
    family, build = PROCESSORS[case]
    processor = build(tokenizer)
    count = L.lengths_for(processor, family=family, columns={"image": "image"})
    image_id = tokenizer.convert_tokens_to_ids(processor.image_token)
    for path, size in image_files:
        if family == "llava" and max(size) > 1500:
            continue  # LLaVA's no-crop resizing of huge images is slow and adds nothing
        row = {"text": f"what is in the picture? {processor.image_token} a cat", "image": path}
        images = [Image.open(path)]
        out = processor(text=[row["text"]], images=images, return_tensors="np", **CHANNELS_LAST)
        got = count(row)
        assert got["num_tokens"] == out["input_ids"].shape[1], size
        assert got["vision_tokens"] == int((out["input_ids"] == image_id).sum()), size
        pixels = out["pixel_values"]  # Qwen: patches x features; LLaVA: tiles x C x H x W
        tiles = pixels.shape[0] if family.startswith("qwen") else np.prod(pixels.shape[:-3])
        assert got["vision_rows"] == tiles, size


def _wav(path: str, samples: int, rate: int = 16000) -> None:
    data = (np.random.default_rng(samples).standard_normal(samples) * 3000).astype(np.int16)
    with wave.open(path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(data.tobytes())


def test_whisper_audio_equals_feature_extractor_and_qwen2_audio(tokenizer, tmp_path):
    fe = transformers.WhisperFeatureExtractor()
    processor = transformers.Qwen2AudioProcessor(feature_extractor=fe, tokenizer=tokenizer)
    count = L.lengths_for(processor, family="qwen2-audio", columns={"audio": "audio"})
    rule = L.WhisperAudio.from_processor(processor)
    audio_id = tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    for n in SAMPLES:
        path = str(tmp_path / f"{n}.wav")
        _wav(path, n)
        assert L.audio_samples(path, sampling_rate=16000) == n
        clip = np.random.default_rng(n).standard_normal(n).astype(np.float32)
        feats = fe([clip], sampling_rate=16000, return_attention_mask=True, return_tensors="np")
        assert feats["input_features"].shape[-1] == rule.padded_frames
        assert rule.audio(n).rows == feats["attention_mask"].sum()
        row = {"text": "listen: <|audio_bos|><|AUDIO|><|audio_eos|> hello", "audio": path}
        out = processor(text=[row["text"]], audio=[clip], return_tensors="np")
        got = count(row)
        assert got["audio_tokens"] == int((out["input_ids"] == audio_id).sum()), n
        assert got["num_tokens"] == out["input_ids"].shape[1]
        assert got["audio_rows"] == out["feature_attention_mask"].sum()
    encoder = transformers.WhisperPreTrainedModel._get_feat_extract_output_lengths
    plain = L.WhisperAudio.from_processor(fe, pool=1)  # Whisper's encoder: its conv stride
    for n in SAMPLES:
        frames = torch.tensor(plain.audio(n).rows)
        assert plain.audio(n).tokens == int(encoder(None, frames))
    assert L.audio_samples({"duration": 2.5}, sampling_rate=16000) == 40000
    assert L.audio_samples({"num_samples": 8000, "sampling_rate": 8000}, sampling_rate=16000)


def _adapter(family: str, tokenizer):
    """The family's adapter on a config matching :func:`_llava` / :func:`_onevision` /
    :func:`_internvl`'s defaults (the adapter reads the model's config only)."""
    if family == "internvl":
        token = tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
        config = transformers.InternVLConfig(image_token_id=token, image_seq_length=256)
        return InternVLAdapter(SimpleNamespace(config=config))
    ids = {"image_token_index": tokenizer.convert_tokens_to_ids("<image>")}
    if family == "llava":
        vision = transformers.CLIPVisionConfig(image_size=224, patch_size=14)
        return LlavaAdapter(
            SimpleNamespace(config=transformers.LlavaConfig(vision_config=vision, **ids))
        )
    ids["video_token_index"] = tokenizer.convert_tokens_to_ids("<video>")
    config = transformers.LlavaOnevisionConfig(**ids)
    return LlavaOnevisionAdapter(SimpleNamespace(config=config))


@pytest.mark.parametrize("case", ["llava-crop", "onevision", "internvl"])
def test_dataset_map_adds_counts(case, tokenizer, image_files):
    """The row function under ``datasets.map`` (two processes): one column per count, from
    paths alone, for rows of none, one and several images (LLaVA-OneVision tiles only a row's
    only image), and the row's ``segments`` are the ones the family's adapter makes of the
    processed row."""
    family, build = PROCESSORS[case]
    processor = build(tokenizer)
    mark = processor.image_token
    rows = [
        {"text": "a cat " * (i + 1) + f"{mark} mat " * k, "images": [p for p, _ in image_files[:k]]}
        for i, k in enumerate([0, 1, 2, 3])
    ]
    wide = next(p for p, size in image_files if size == (1999, 1001))
    rows.append({"text": f"{mark} wide", "images": [wide]})
    ds = datasets.Dataset.from_list(rows)
    out = ds.map(L.lengths_for(processor, family=family), num_proc=2)
    adapter = _adapter(family, tokenizer)
    image_id = tokenizer.convert_tokens_to_ids(mark)
    for row, got in zip(rows, out, strict=True):
        images = [[Image.open(p) for p in row["images"]]] if row["images"] else None
        processed = processor(
            text=[row["text"]], images=images, return_tensors="np", **CHANNELS_LAST
        )
        ids = processed["input_ids"][0]
        assert got["num_tokens"] == ids.size
        assert got["vision_tokens"] == got["image_tokens"] == int((ids == image_id).sum())
        labels = np.full_like(ids, -100)  # no targets: the adapter checks labels only there
        fields = {k: processed[k] for k in ("pixel_values", "image_sizes") if k in processed}
        example = adapter.to_example({"input_ids": ids, "labels": labels, **fields})
        assert got["segments"] == example["segments"]


def test_bad_metadata_names_the_argument(tokenizer):
    rule = L.QwenVision()
    with pytest.raises(ValueError, match="width"):
        rule.image(0, 10)
    with pytest.raises(ValueError, match="aspect ratio"):
        rule.image(1000, 2)
    with pytest.raises(ValueError, match="num_samples"):
        L.WhisperAudio().audio(-1)
    with pytest.raises(ValueError, match="an image must be"):
        L.image_size(3.5)
    processor = transformers.LlavaProcessor(
        image_processor=pil_image_processor("CLIP")(),
        tokenizer=tokenizer,
        patch_size=14,
        image_token="<image>",
    )
    count = L.lengths_for(processor, family="llava")
    with pytest.raises(ValueError, match="1 image placeholders.*'images' 2 items"):
        count({"text": "<image>", "images": [(10, 10), (20, 20)]})
    with pytest.raises(ValueError, match="family must be one of"):
        L.lengths_for(processor, family="nope")
    with pytest.raises(
        ValueError, match=r"family='qwen2.5-vl'.*LlavaProcessor.*family \['llava'\]"
    ):  # the wrong processor for the family: named, with the family it is
        L.lengths_for(processor, family="qwen2.5-vl")
    onevision = _onevision(tokenizer)
    with pytest.raises(ValueError, match="width"):
        L.AnyResGrid.from_processor(onevision).image(0, 10, alone=False)
    onevision.num_image_tokens = None
    with pytest.raises(ValueError, match="num_image_tokens"):
        L.lengths_for(onevision, family="llava-onevision")
    onevision.num_image_tokens, onevision.vision_aspect_ratio = 729, "pad"
    with pytest.raises(ValueError, match="vision_aspect_ratio.*'pad'"):
        L.AnyResGrid.from_processor(onevision)
    qwen3 = L.lengths_for(_qwen3(tokenizer), family="qwen3-vl")
    video = {"num_frames": 8, "width": 64, "height": 48}
    with pytest.raises(ValueError, match="video token count is not modelled.*timestamp"):
        qwen3({"text": "<|video_pad|>", "videos": [video]})
    internvl = L.lengths_for(_internvl(tokenizer), family="internvl")
    with pytest.raises(ValueError, match="video token count is not modelled.*FrameN"):
        internvl({"text": "<video>", "videos": [video]})


def test_exif_rotation_swaps_the_size(tmp_path):
    """A JPEG whose EXIF says 'rotate 90': ``load_image`` (what pipelines decode with)
    transposes it, and the header read says so."""
    path = str(tmp_path / "rotated.jpg")
    exif = Image.Exif()
    exif[0x0112] = 6
    _image(64, 32).save(path, exif=exif)
    loaded = transformers.image_utils.load_image(path)
    assert L.image_size(path) == loaded.size == (32, 64)


def test_image_size_of_undecoded_hf_image_column(image_files):
    """An HF ``Image`` column cast with ``decode=False`` holds ``{"bytes", "path"}``: the size
    comes from the header of the file or of the bytes."""
    paths = [p for p, _ in image_files[:4]]
    ds = datasets.Dataset.from_dict({"image": paths})
    ds = ds.cast_column("image", datasets.Image(decode=False))
    for value, (path, size) in zip(ds["image"], image_files, strict=False):
        assert L.image_size(value) == size
        with open(path, "rb") as f:
            assert L.image_size({"bytes": f.read(), "path": None}) == size
