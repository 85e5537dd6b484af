"""Length samplers and the per-task example recipe built on them: bounds, rounding rules,
determinism, and bad input that names the argument."""

import numpy as np
import pytest

from orchmllm.recipe import RecipeConfig, sample_examples, split_text
from orchmllm.schema import AUDIO, IMAGE, TASKS, TEXT, EncodingRates
from orchmllm.workloads import DISTRIBUTIONS, PATCH, sample_lengths


@pytest.mark.parametrize("side, patch", [(224, PATCH), (448, PATCH), (896, PATCH), (224, 4)])
def test_image_patches_respect_the_resolution_bound(side, patch):
    patches = sample_lengths("llava_image", 5000, 0, max_image_side=side, patch=patch)
    grid = -(-side // patch)
    assert patches.min() >= 1 and patches.max() <= grid * grid


def test_larger_bound_gives_more_patches_and_default_is_448():
    np.testing.assert_array_equal(
        sample_lengths("llava_image", 1000, 7),
        sample_lengths("llava_image", 1000, 7, max_image_side=448),
    )
    small = sample_lengths("llava_image", 5000, 1, max_image_side=224)
    large = sample_lengths("llava_image", 5000, 1, max_image_side=896)
    assert large.mean() > 2 * small.mean()


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_every_distribution_is_seeded_and_positive(dist):
    a, b = sample_lengths(dist, 500, 3), sample_lengths(dist, 500, 3)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.int64 and a.min() >= 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dist": "nope", "n": 3}, "dist"),
        ({"dist": "text", "n": -1}, "n must"),
        ({"dist": "llava_image", "n": 3, "max_image_side": 5}, "max_image_side"),
        ({"dist": "llava_image", "n": 3, "patch": 0}, "patch"),
    ],
)
def test_bad_input_names_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sample_lengths(**kwargs)


# -- the example recipe --------------------------------------------------------------------

RATES = EncodingRates(vision_downsample=4, audio_conv_stride=2, audio_downsample=2)


@pytest.mark.parametrize("scale", [1.0, 0.1, 0.03])
def test_recipe_lengths_follow_the_rules(scale):
    cfg = RecipeConfig(scale=scale, max_text_tokens=512, max_audio_s=20.0)
    ex = sample_examples(cfg, 4000, 1, rates=RATES)
    assert set(np.unique(ex.task)) == set(range(len(TASKS)))
    assert (ex.image_patches % 4 == 0).all() and ex.image_patches.min() >= 4
    assert (ex.audio_frames % 4 == 0).all() and ex.audio_frames.min() >= 4
    assert ex.audio_frames.max() <= 20.0 * 100 * scale
    # the cap bounds an example's whole text, and it binds for long chats at full scale
    assert ex.text.min() >= 2 and ex.text.max() <= 512
    if scale == 1.0:
        assert ex.text[ex.task == TASKS.index("chat")].max() == 512
    assert np.all(np.diff(ex.image_example) >= 0) and np.all(np.diff(ex.audio_example) >= 0)
    again = sample_examples(cfg, 4000, 1, rates=RATES)
    for name in ("task", "text", "image_patches", "audio_frames"):
        np.testing.assert_array_equal(getattr(ex, name), getattr(again, name))


# images and clips an example of each task may hold
ITEMS = {
    "caption": ({1}, {0}),
    "vqa": ({1, 2}, {0, 1}),
    "asr": ({0}, {1}),
    "spoken_qa": ({0}, {1}),
    "chat": ({0}, {0}),
}


def test_recipe_runs_lay_out_each_example():
    """An example's runs hold exactly its lengths: its items in order and its text, starting
    with a prompt token and with at least one target."""
    ex = sample_examples(
        RecipeConfig(scale=0.1, p_multi_image=0.5, p_spoken_question=0.5), 600, 2, rates=RATES
    )
    seen_spoken = seen_multi = False
    for i in range(ex.task.size):
        runs = ex.runs(i)
        task = TASKS[ex.task[i]]
        kinds = [k for k, _, _ in runs]
        assert kinds[0] == TEXT and not runs[0][2]  # position 0 is a prompt token
        assert any(target for _, _, target in runs)
        assert not any(target for k, _, target in runs if k != TEXT)
        assert sum(c for k, c, _ in runs if k == TEXT) == ex.text[i]
        assert all(c >= 1 for _, c, _ in runs)
        images = [c for k, c, _ in runs if k == IMAGE]
        clips = [c for k, c, _ in runs if k == AUDIO]
        assert images == ex.image_patches[ex.image_example == i].tolist()
        assert clips == ex.audio_frames[ex.audio_example == i].tolist()
        assert len(images) in ITEMS[task][0] and len(clips) in ITEMS[task][1]
        seen_spoken |= task == "vqa" and len(clips) == 1
        seen_multi |= len(images) == 2
    assert seen_spoken and seen_multi


@pytest.mark.parametrize("total", [2, 3, 17, 1000])
def test_split_text_sums_and_keeps_a_prompt_and_a_target(total):
    rng = np.random.default_rng(total)
    for _ in range(50):
        weights = rng.lognormal(2.0, 1.0, int(rng.integers(2, 12)))
        is_target = rng.random(weights.size) < 0.5
        is_target[0], is_target[rng.integers(1, weights.size)] = False, True
        counts = split_text(total, weights, is_target)
        assert counts.sum() == total and counts.min() >= 0
        assert counts[0] >= 1 and counts[np.flatnonzero(is_target)[-1]] >= 1
        # cumulative rounding: each run is within one token of its share (plus its reserve)
        share = weights / weights.sum() * (total - 2)
        assert np.all(np.abs(counts - share) <= 2)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"task_weights": {"dance": 1.0}}, "task_weights"),
        ({"task_weights": {"asr": 0.0}}, "task_weights"),
        ({"max_text_tokens": 1}, "max_text_tokens"),
        ({"patch": 14, "max_image_side": 10}, "max_image_side"),
        ({"p_spoken_question": -0.1}, "p_spoken_question"),
        ({"scale": float("inf")}, "scale"),
        ({"max_audio_s": 0.0}, "max_audio_s"),
    ],
)
def test_bad_recipe_config_names_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        RecipeConfig(**kwargs)
    with pytest.raises(ValueError, match="n must"):
        sample_examples(RecipeConfig(), -1, 0, rates=RATES)
