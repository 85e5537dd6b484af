"""Every number the synthetic workload is drawn from, with where it comes from.

The workload (:mod:`orchmllm.data.workloads`' length samplers and
:mod:`orchmllm.data.recipe`'s tasks) decides how heavy an example is, and so every simulated
figure. Its numbers live here, in one
table: each is a public dataset statistic with its source, or says ``assumed:`` and why (a shape
no publication gives). None was chosen to reproduce a figure of the paper; how the simulator's
results move when every length is scaled is ``benchmarks/reproduce_paper.py``'s sensitivity
section. ``tests/test_workload_facts.py`` checks that every entry names a source or an
assumption and that the two modules draw with no number of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FACTS", "Fact", "fact"]


@dataclass(frozen=True)
class Fact:
    """One number (or tuple of numbers) of the workload and its source."""

    value: float | tuple[float, ...]
    source: str


_LLAVA = (
    "LLaVA-1.5 mix665k (Liu et al. 2023, 'Improved Baselines with Visual Instruction Tuning', "
    "Table 7)"
)
_LIBRI = (
    "LibriSpeech (Panayotov et al. 2015, Table 1): train-clean-100 holds 28,539 utterances in "
    "100.6 h"
)

FACTS: dict[str, Fact] = {
    # -- images (orchmllm.data.workloads.llava_image) ----------------------------------------------
    "image.source_weights": Fact(
        (0.55, 0.20, 0.15, 0.10),
        f"{_LLAVA}: shares of COCO, VG/GQA, TextVQA/OpenImages and OCR-VQA images",
    ),
    "image.long_side_px": Fact(
        (640.0, 500.0, 1024.0),
        "COCO images are at most 640 px (Lin et al. 2014); Visual Genome's as distributed "
        "500 px; TextVQA's OpenImages 1024 px (Singh et al. 2019)",
    ),
    "image.cover_median_px": Fact(350.0, "assumed: OCR-VQA book covers, thumbnails of ~350 px"),
    "image.cover_sigma": Fact(0.25, "assumed: spread of the cover sizes (log-normal)"),
    "image.cover_clip_px": Fact((150.0, 800.0), "assumed: the smallest and largest covers"),
    "image.aspects": Fact((4 / 3, 3 / 2, 16 / 9, 1.0, 3 / 4), "assumed: common photo aspects"),
    "image.aspect_weights": Fact((0.5, 0.15, 0.1, 0.1, 0.15), "assumed: 4:3 the most common"),
    "image.patch_px": Fact(14, "ViT-L/14 and Qwen2-VL patches are 14 px (paper section 8)"),
    "image.max_side_px": Fact(448, "the paper's MLLM-10B resolution bound (section 8)"),
    # -- audio (orchmllm.data.workloads.librispeech, .spoken_qa) -----------------------------------
    "audio.frames_per_s": Fact(100, "Whisper's log-mel frames: a 10 ms hop (Radford et al. 2022)"),
    "librispeech.main_share": Fact(0.8, f"assumed: most of {_LIBRI} (mean 12.7 s) near its mode"),
    "librispeech.main_mean_s": Fact(14.5, f"assumed: the mode of {_LIBRI}; mixture mean 12.8 s"),
    "librispeech.main_sd_s": Fact(2.5, "assumed: spread of the long utterances"),
    "librispeech.short_s": Fact((1.5, 10.0), "assumed: the short utterances, uniform"),
    "librispeech.clip_s": Fact(
        (1.0, 24.5),
        "assumed: cut at 24.5 s (LibriSpeech splits its utterances at up to about 35 s, "
        "Panayotov et al. 2015)",
    ),
    "spoken_qa.median_s": Fact(12.0, "assumed: AIR-Bench clips (Yang et al. 2024) run to 30 s"),
    "spoken_qa.sigma": Fact(0.6, "assumed: spread of the AIR-Bench clip durations"),
    "spoken_qa.clip_s": Fact((2.0, 30.0), "AIR-Bench clips are up to 30 s (Yang et al. 2024)"),
    # -- text (orchmllm.data.workloads.text) -------------------------------------------------------
    "sharegpt.median_tokens": Fact(
        700.0, "assumed: the 40K ShareGPT conversations of the LLaVA-1.5 mix, typical length"
    ),
    "sharegpt.sigma": Fact(0.8, "assumed: spread of ShareGPT conversation lengths"),
    "sharegpt.clip_tokens": Fact((16, 8192), "assumed: the shortest and longest conversations"),
    # -- the paper's task mix (orchmllm.data.recipe) -----------------------------------------------
    "mix.weights": Fact(
        (0.25, 0.30, 0.25, 0.10, 0.10),
        "assumed: caption, vqa, asr, spoken_qa, chat; the paper (section 3.1) names the "
        "datasets, not their proportions; spoken QA is upsampled from its 2% so every task "
        "appears in small batches",
    ),
    "mix.p_multi_image": Fact(0.1, "assumed: a vqa example with a second image"),
    "mix.p_spoken_question": Fact(0.1, "assumed: a vqa example whose first question is spoken"),
    "caption.prefix_tokens": Fact((4, 10), "assumed: a system/role prefix, uniform [4, 10)"),
    "caption.prompt_tokens": Fact((8, 21), "assumed: 'Describe the image ...' prompts"),
    "caption.brief_share": Fact(
        0.6, f"assumed: brief COCO-style captions against detailed descriptions in {_LLAVA}"
    ),
    "caption.brief_median_tokens": Fact(
        13.0, "COCO captions average 10.5 words (Chen et al. 2015) at 1.3 tokens a word"
    ),
    "caption.brief_sigma": Fact(0.3, "assumed: spread of caption lengths"),
    "caption.detailed_median_tokens": Fact(110.0, "assumed: LLaVA-Instruct detailed descriptions"),
    "caption.detailed_sigma": Fact(0.4, "assumed: spread of detailed descriptions"),
    "vqa.turns_poisson_mean": Fact(
        2.5, f"assumed: {_LLAVA} packs several VQAv2/GQA questions on one image per example"
    ),
    "vqa.max_turns": Fact(10, "assumed: the longest such conversation"),
    "vqa.short_share": Fact(
        0.7,
        f"assumed: answers under 'Answer the question using a single word or phrase' in {_LLAVA}",
    ),
    "vqa.short_answer_tokens": Fact((1, 5), "a word or phrase: 1-4 tokens"),
    "vqa.question_median_tokens": Fact(12.0, "assumed: VQAv2 questions are short"),
    "vqa.question_sigma": Fact(0.4, "assumed: spread of question lengths"),
    "vqa.long_answer_median_tokens": Fact(60.0, "assumed: LLaVA-Instruct conversational answers"),
    "vqa.long_answer_sigma": Fact(0.5, "assumed: spread of conversational answers"),
    "vqa.prefix_tokens": Fact((4, 10), "assumed: as the caption prefix"),
    "vqa.bridge_tokens": Fact((2, 5), "assumed: the text joining a second image"),
    "vqa.spoken_question_s": Fact((2.0, 8.0), "assumed: a spoken question of a few seconds"),
    "asr.prompt_tokens": Fact((6, 15), "assumed: 'Transcribe the audio' prompts"),
    "asr.words_per_s": Fact(2.73, f"{_LIBRI}: 990k words in 100.6 h"),
    "asr.tokens_per_word": Fact(1.3, "assumed: an English BPE vocabulary (Qwen2's)"),
    "asr.noise_sigma": Fact(0.15, "assumed: speaking rates vary between readers"),
    "spoken_qa.prompt_tokens": Fact((4, 10), "assumed: as the caption prefix"),
    "spoken_qa.question_median_tokens": Fact(30.0, "assumed: AIR-Bench questions with choices"),
    "spoken_qa.question_sigma": Fact(0.4, "assumed: spread of the questions"),
    "spoken_qa.choice_share": Fact(
        0.75, "assumed: AIR-Bench's foundation part is single-choice, its chat part free text"
    ),
    "spoken_qa.choice_answer_tokens": Fact((1, 4), "a choice's letter or word"),
    "spoken_qa.chat_answer_median_tokens": Fact(40.0, "assumed: AIR-Bench chat answers"),
    "spoken_qa.chat_answer_sigma": Fact(0.5, "assumed: spread of chat answers"),
    "chat.prefix_tokens": Fact((6, 20), "assumed: a system prompt"),
    "chat.max_turn_pairs": Fact(8, "assumed: ShareGPT conversations of 1-8 user/assistant pairs"),
    # -- long items (the recipe's document task; orchmllm.sim.sweep.long_item_mix) ----------
    "document.share": Fact(0.05, "assumed: issue 40's example, 5% of the examples are long"),
}


def fact(name: str) -> float | tuple[float, ...]:
    """The value of table entry ``name``.

    Raises:
        KeyError: no entry is called ``name``.
    """
    return FACTS[name].value
