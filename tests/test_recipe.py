"""The per-task example recipe: rounding rules, determinism, the task table and its
registration, and bad input that names the argument."""

import dataclasses

import numpy as np
import pytest

from orchmllm.data.recipe import (
    PAPER_MIX,
    TASKS,
    CaptionParams,
    ClipParams,
    DocumentParams,
    RecipeConfig,
    Task,
    TaskDraw,
    TaskParams,
    VqaParams,
    register_task,
    sample_examples,
    split_text,
    unregister_task,
    weighted_tasks,
)
from orchmllm.schema import AUDIO, IMAGE, TEXT, EncodingRates, Rate

RATES = EncodingRates({"vision": Rate(downsample=4), "audio": Rate(stride=2, downsample=2)})


@pytest.mark.parametrize("scale", [1.0, 0.1, 0.03])
def test_recipe_lengths_follow_the_rules(scale):
    cfg = RecipeConfig(scale=scale, max_text_tokens=512).with_task_settings(max_audio_s=20.0)
    ex = sample_examples(cfg, 4000, 1, rates=RATES)
    assert set(np.unique(ex.task)) == set(range(len(PAPER_MIX)))  # the default mix
    images, clips = ex.items["vision"], ex.items["audio"]
    assert (images.raw % 4 == 0).all() and images.raw.min() >= 4
    assert (clips.raw % 4 == 0).all() and clips.raw.min() >= 4
    assert clips.raw.max() <= 20.0 * 100 * scale
    # the cap bounds an example's whole text, and it binds for long chats at full scale
    assert ex.text.min() >= 2 and ex.text.max() <= 512
    if scale == 1.0:
        assert ex.text[ex.task == list(TASKS).index("chat")].max() == 512
    assert np.all(np.diff(images.example) >= 0) and np.all(np.diff(clips.example) >= 0)
    again = sample_examples(cfg, 4000, 1, rates=RATES)
    np.testing.assert_array_equal(ex.task, again.task)
    np.testing.assert_array_equal(ex.text, again.text)
    for name in ("vision", "audio"):
        np.testing.assert_array_equal(ex.items[name].raw, again.items[name].raw)
        np.testing.assert_array_equal(ex.items[name].example, again.items[name].example)


def test_documents_are_long_texts_within_their_bounds_and_weight_0_changes_nothing():
    """``document``: a prompt and a continuation of min_tokens-max_tokens before scale, the
    text cap applied; naming it at weight 0 leaves every other example's draw alone."""
    base = RecipeConfig(scale=0.1, max_text_tokens=10_000)
    cfg = base.with_weights({"document": 0.5})
    ex = sample_examples(cfg, 400, 3, rates=RATES)
    docs = ex.task == list(TASKS).index("document")
    assert 100 < docs.sum() < 300
    lo, hi = DocumentParams.min_tokens * 0.1, DocumentParams.max_tokens * 0.1
    assert ex.text[docs].min() >= lo and ex.text[docs].max() == 10_000  # the cap binds
    assert np.mean(ex.text[docs] < 10_000) > 0.5 and hi > 10_000
    runs = ex.runs(int(np.flatnonzero(docs)[0]))
    assert [(k, t) for k, _, t in runs] == [(TEXT, False), (TEXT, True)]
    unnamed = sample_examples(base, 400, 3, rates=RATES)
    zero = sample_examples(base.with_weights({"document": 0.0}), 400, 3, rates=RATES)
    np.testing.assert_array_equal(zero.task, unnamed.task)
    np.testing.assert_array_equal(zero.text, unnamed.text)
    with pytest.raises(ValueError, match=r"tasks.document.max_tokens must be >= min_tokens"):
        RecipeConfig(tasks={"document": DocumentParams(1.0, min_tokens=10, max_tokens=5)})


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
    cfg = RecipeConfig(scale=0.1).with_task_settings(p_multi_image=0.5, p_spoken_question=0.5)
    ex = sample_examples(cfg, 600, 2, rates=RATES)
    seen_spoken = seen_multi = False
    for i in range(ex.task.size):
        runs = ex.runs(i)
        task = list(TASKS)[ex.task[i]]
        kinds = [k for k, _, _ in runs]
        assert kinds[0] == TEXT and not runs[0][2]  # position 0 is a prompt token
        assert any(target for _, _, target in runs)
        assert not any(target for k, _, target in runs if k != TEXT)
        assert sum(c for k, c, _ in runs if k == TEXT) == ex.text[i]
        assert all(c >= 1 for _, c, _ in runs)
        images = [c for k, c, _ in runs if k == IMAGE]
        clips = [c for k, c, _ in runs if k == AUDIO]
        for name, held in (("vision", images), ("audio", clips)):
            items = ex.items[name]
            assert held == items.raw[items.example == i].tolist()
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
        ({"tasks": {"dance": TaskParams(1.0)}}, "no task named 'dance'"),
        ({"tasks": {"asr": ClipParams(0.0)}}, "positive total weight"),
        ({"tasks": {"asr": ClipParams(-1.0)}}, "tasks.asr.weight"),
        ({"tasks": {"asr": TaskParams(1.0)}}, "tasks.asr must be a ClipParams"),
        ({"max_text_tokens": 1}, "max_text_tokens"),
        ({"tasks": {"caption": CaptionParams(1.0, max_image_side=10)}}, "max_image_side"),
        ({"tasks": {"vqa": VqaParams(1.0, p_spoken_question=-0.1)}}, "vqa.p_spoken_question"),
        ({"scale": float("inf")}, "scale"),
        ({"tasks": {"asr": ClipParams(1.0, max_audio_s=0.0)}}, "asr.max_audio_s"),
    ],
)
def test_bad_recipe_config_names_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        RecipeConfig(**kwargs)
    with pytest.raises(ValueError, match="n must"):
        sample_examples(RecipeConfig(), -1, 0, rates=RATES)


def _clip_pair(gen: np.random.Generator, n: int, params: TaskParams) -> TaskDraw:
    """A registered task's draw: prompt, two clips, answer."""
    prompt, answer = gen.integers(3, 9, n), gen.integers(5, 40, n)
    clips = gen.integers(100, 900, (n, 2))
    return TaskDraw(np.column_stack([prompt, clips[:, 0], clips[:, 1], answer]))


CLIP_PAIR = Task(
    "clip_pair",
    (("text", False), ("audio", False), ("audio", False), ("text", True)),
    draw=_clip_pair,
)


@pytest.fixture
def clip_pair():
    yield register_task(CLIP_PAIR)
    unregister_task(CLIP_PAIR.name)


def test_a_registered_task_draws_after_the_paper_mix_and_leaves_it_unchanged():
    """With weight 0 a registered task changes no draw (the paper mix's stream is first); with
    weight its examples hold its runs, scaled and rounded to the audio divisor."""
    plain = sample_examples(RecipeConfig(), 500, 4, rates=RATES)
    register_task(CLIP_PAIR)
    try:
        assert "clip_pair" not in RecipeConfig().tasks  # drawn only where a recipe names it
        assert RecipeConfig().params("clip_pair").weight == 0.0
        same = sample_examples(RecipeConfig(), 500, 4, rates=RATES)
        cfg = RecipeConfig(scale=0.5).with_weights({"clip_pair": 1.0})
        ex = sample_examples(cfg, 800, 4, rates=RATES)
    finally:
        unregister_task(CLIP_PAIR.name)
    np.testing.assert_array_equal(plain.task, same.task)
    np.testing.assert_array_equal(plain.text, same.text)
    for name in ("vision", "audio"):
        np.testing.assert_array_equal(plain.items[name].raw, same.items[name].raw)
    mine = np.flatnonzero(ex.task == len(TASKS))  # the row after the table's last
    assert mine.size > 50
    clips = ex.items["audio"]
    for i in mine[:40]:
        runs = ex.runs(int(i))
        assert [kind for kind, _, _ in runs] == [TEXT, AUDIO, AUDIO, TEXT]
        assert runs[-1][2] and not runs[0][2]
        held = [c for kind, c, _ in runs if kind == AUDIO]
        assert held == clips.raw[clips.example == i].tolist()
        assert all(c % 4 == 0 and 48 <= c <= 452 for c in held)  # 0.5 x [100, 900), /4


def test_register_task_refuses_what_it_cannot_draw(clip_pair):
    assert register_task(clip_pair) is clip_pair  # the same row again: a no-op
    with pytest.raises(ValueError, match="already"):
        register_task(dataclasses.replace(clip_pair, runs=(("text", True),)))
    with pytest.raises(ValueError, match="draw"):
        register_task(Task("nodraw", (("text", True),)))
    with pytest.raises(ValueError, match="no modality named 'smell'"):
        register_task(Task("odour", (("smell", False),), draw=_clip_pair))
    with pytest.raises(ValueError, match="no registered task 'chat'"):
        unregister_task("chat")


def test_each_task_bounds_its_own_images():
    """``max_image_side`` is a task's own: caption's bound leaves vqa's images alone."""
    cfg = RecipeConfig(
        tasks={
            "caption": CaptionParams(1.0, max_image_side=112),
            "vqa": VqaParams(1.0, max_image_side=448, p_spoken_question=0.0),
        }
    )
    ex = sample_examples(cfg, 2000, 3, rates=EncodingRates())
    images = ex.items["vision"]
    caption = np.isin(images.example, np.flatnonzero(ex.task == list(TASKS).index("caption")))
    assert caption.sum() > 500 and (~caption).sum() > 500
    assert images.raw[caption].max() <= (112 // 14) ** 2
    assert images.raw[~caption].max() > (112 // 14) ** 2


def test_settings_and_weights_by_name():
    cfg = RecipeConfig().with_task_settings(max_audio_s=12.0)
    assert {n for n, p in cfg.tasks.items() if getattr(p, "max_audio_s", None) == 12.0} == {
        "vqa",
        "asr",
        "spoken_qa",
    }
    with pytest.raises(ValueError, match="setting 'max_audo_s'"):
        cfg.with_task_settings(max_audo_s=1.0)
    assert RecipeConfig(tasks=weighted_tasks({"chat": 2.0})).task_weights == {"chat": 2.0}
    with pytest.raises(ValueError, match="no task named 'dance'"):
        weighted_tasks({"dance": 1.0})
