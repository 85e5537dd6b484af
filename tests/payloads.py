"""Payload examples for orchestrator and step-planner tests: every raw row and text token says
which example, modality, item and row it is, so an assembled sequence can be checked exactly."""

import numpy as np
import torch

from orchmllm.planner.segments import local_metadata
from orchmllm.planner.step_options import EncoderPhase
from orchmllm.schema import AUDIO, IGNORE_INDEX, IMAGE, TEXT

WIDTH = 4  # raw feature width = hidden, so an identity encoder keeps payloads intact
PHASES = (
    EncoderPhase("vision", IMAGE, "image_patches", 2, WIDTH, "greedy"),
    EncoderPhase("audio", AUDIO, "audio_mels", 4, WIDTH, "binary_search"),
)


def payload_example(eid: int, segments: list[list[int]], phases=PHASES) -> dict:
    """Rows carry (example, kind, item, row): text token t is id eid*1000 + t."""
    n_text = sum(c for k, c in segments if k == TEXT)
    div = {p.kind: p.divisor for p in phases}
    items = {p.kind: [] for p in phases}
    for kind, count in segments:
        if kind != TEXT:
            j = len(items[kind])
            rows = np.arange(count) // div[kind]
            items[kind].append(
                np.stack([np.full(count, eid), np.full(count, kind), np.full(count, j), rows], 1)
            )
    mask = (np.arange(n_text) % 3 != 0).astype(np.int64)  # position 0 never a target
    return {
        "id": eid,
        "segments": segments,
        "input_ids": eid * 1000 + np.arange(n_text),
        "loss_mask": mask,
        **{p.key: [a.astype(np.float32) for a in items[p.kind]] for p in phases},
    }


def payload_batches(world: int, phases=PHASES) -> list[list[dict]]:
    """Random interleavings; rank 1 gets text-only examples (no image, no audio)."""
    rng = np.random.default_rng(7)
    batches, eid = [], 0
    for rank in range(world):
        batch = []
        for _ in range(int(rng.integers(2, 5))):
            segs = [[TEXT, int(rng.integers(1, 6))]]
            if rank != 1:
                for _ in range(int(rng.integers(0, 4))):
                    p = phases[int(rng.integers(len(phases)))]
                    segs.append([p.kind, p.divisor * int(rng.integers(1, 8))])
                    if rng.random() < 0.5:
                        segs.append([TEXT, int(rng.integers(1, 6))])
            batch.append(payload_example(eid, segs, phases))
            eid += 1
        batches.append(batch)
    return batches


def expected_sequence(ex: dict, phases=PHASES) -> tuple[np.ndarray, np.ndarray]:
    """The assembled payload rows and next-token targets of one example, built directly."""
    rows, kinds_seen, t = [], {p.kind: 0 for p in phases}, 0
    div = {p.kind: p.divisor for p in phases}
    text_tokens = []  # (position, token, is_target)
    for kind, count in ex["segments"]:
        if kind == TEXT:
            for _ in range(count):
                text_tokens.append((len(rows), ex["input_ids"][t], ex["loss_mask"][t]))
                rows.append([ex["id"], 0, t, -1])
                t += 1
        else:
            j = kinds_seen[kind]
            kinds_seen[kind] += 1
            rows += [[ex["id"], kind, j, g] for g in range(count // div[kind])]
    targets = np.full(len(rows), IGNORE_INDEX)
    for pos, tok, is_target in text_tokens:
        if is_target and pos > 0:
            targets[pos - 1] = tok
    return np.array(rows, dtype=np.float32), targets


def payload_embed(ids: torch.Tensor) -> torch.Tensor:
    return torch.stack(
        [ids // 1000, torch.zeros_like(ids), ids % 1000, torch.full_like(ids, -1)], 1
    ).float()


def gathered(batches):
    local = [local_metadata(b) for b in batches]
    rows = np.concatenate(local)
    src = np.repeat(np.arange(len(batches)), [len(m) for m in local])
    return rows, src
