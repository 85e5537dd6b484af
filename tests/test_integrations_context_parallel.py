"""HF models with rows longer than a rank's budget: ``wrap(context_parallel=N, llm_max_load=B)``
splits them over the ranks of a context-parallel group, and the step trains as the model's own
forward on the whole rows does.

4 gloo ranks, tiny models in float64, the loss computed here (HF's upcasts to float32): a
LLaVA (1-D RoPE, pieces on up to 4 ranks) and a Qwen2.5-VL (M-RoPE, pieces on 2 ranks), each
with two rows several times longer than the others (an image amid them, so positions after it
are not token indices). The split step's losses and parameter gradients, summed over the
ranks, are the plain forward's; Qwen's 3-D positions of every piece are ``get_rope_index``'s at
those tokens of the whole row; every rank's tokens fit the budget; with activation
checkpointing too (the pieces reach the attention as a keyword, which the recomputation gets
again). In one process: outside a split step the registered attention is the original one;
over packed whole sequences it is the layer's own attention, its scaling included.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import orchmllm
from orchmllm.dist.context_parallel import PackedPieces
from orchmllm.testing import run_distributed

pytest.importorskip("transformers", exc_type=ModuleNotFoundError)  # the hf extra

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from orchmllm.integrations import hf_compat  # noqa: E402
from orchmllm.integrations import transformers as omt  # noqa: E402
from orchmllm.integrations.transformers import split_attention, tiny  # noqa: E402

WORLD, PER_RANK = 4, 2
LONG = {1: (300, 500), 6: (200, 600)}  # row -> (prompt, answer) tokens added
CASES = {"llava": (4, 800), "qwen2.5-vl": (2, 800)}  # family -> (context_parallel, budget)


def _lengthen(row: dict, prompt: int, answer: int, rng: np.random.Generator) -> dict:
    """``row`` with ``prompt`` unlabelled text tokens after BOS and ``answer`` labelled ones
    before EOS (its items stay between)."""
    ids, labels = row["input_ids"].numpy(), row["labels"].numpy()
    pre, post = (rng.integers(0, tiny.TEXT_VOCAB, n) for n in (prompt, answer))
    out = dict(row)
    out["input_ids"] = np.concatenate([ids[:1], pre, ids[1:-1], post, ids[-1:]])
    unlabelled = np.full(prompt, -100)
    out["labels"] = np.concatenate([labels[:1], unlabelled, labels[1:-1], post, ids[-1:]])
    if "mm_token_type_ids" in row:
        types = row["mm_token_type_ids"].numpy()
        out["mm_token_type_ids"] = np.concatenate([types[:1], 0 * pre, types[1:-1], 0 * post, [0]])
    out["attention_mask"] = np.ones_like(out["input_ids"])
    return {k: torch.as_tensor(np.asarray(v)) for k, v in out.items()}


def _rows(name: str, model: torch.nn.Module) -> list[dict]:
    rows = tiny.make_rows(name, model, WORLD * PER_RANK, seed=11)
    rng = np.random.default_rng(5)
    return [_lengthen(r, *LONG[i], rng) if i in LONG else r for i, r in enumerate(rows)]


def _own_loss(logits: torch.Tensor, targets: torch.Tensor, n: int) -> torch.Tensor:
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, targets.reshape(-1), ignore_index=-100, reduction="sum") / n


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    """``p``'s gradient, zeros where it has none (LLaVA's unused last vision layer)."""
    return torch.zeros_like(p) if p.grad is None else p.grad.clone()


def _summed_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters' gradients summed over the ranks (what FSDP's reduction gives)."""
    out = {}
    for key, p in model.named_parameters():
        grad = _grad(p)
        dist.all_reduce(grad)
        out[key] = grad
    model.zero_grad(set_to_none=True)
    return out


def _mrope_mismatches(model, balanced, out, batch) -> int:  # noqa: ANN001
    """Tokens of this rank whose M-RoPE position differs from ``get_rope_index`` on the whole
    padded rows at that token (a collective: the positions move to the pieces)."""
    got = balanced.adapter.position_ids(out.batch)[:, 0]
    expected = hf_compat.rope_index(
        model, batch["input_ids"], batch["mm_token_type_ids"],
        image_grid_thw=batch.get("image_grid_thw"), video_grid_thw=batch.get("video_grid_thw"),
        second_per_grid_ts=batch.get("second_per_grid_ts"),
        attention_mask=batch["attention_mask"],
    )  # fmt: skip
    pieces = out.batch.pieces
    split = {s.key for s in pieces.pieces.values()}
    whole = iter(e for e in out.batch.example_ids.tolist() if e not in split)
    lengths = out.batch.lengths.tolist()
    bad = 0
    for i, (rows, at) in enumerate(
        zip(got.split(lengths, 1), pieces.positions.split(lengths), strict=True)
    ):
        example = pieces.pieces[i].key if i in pieces.pieces else next(whole)
        bad += int((rows[0] != at).sum() + (rows[1:] != expected[:, example, at]).sum())
    return bad


def _count_attention(language_model: torch.nn.Module) -> list[int]:
    """A counter (``[calls]``) of the language model's attention modules' forwards."""
    calls = [0]

    def count(*_: object) -> None:
        calls[0] += 1

    for module in language_model.modules():
        if type(module).__name__.endswith("Attention"):
            module.register_forward_pre_hook(count)
    return calls


def _split_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    results = {}
    for name, (cp, budget) in CASES.items():
        model = tiny.build_model(name, seed=0, dtype=torch.float64)
        rows = _rows(name, model)
        mine = rows[rank * PER_RANK : (rank + 1) * PER_RANK]  # global ids: the rows' indices
        batch = tiny.collate(rows)
        n = int((batch["labels"][:, 1:] != -100).sum())
        plain = _own_loss(model(**batch).logits[:, :-1], batch["labels"][:, 1:], n)
        plain.backward()
        plain_grads = {k: _grad(p) for k, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        record = {"plain": float(plain), "tokens": [len(r["input_ids"]) for r in rows]}
        split = {"context_parallel": cp, "llm_max_load": budget}
        for key, kwargs in (("unsplit", {}), ("split", split), ("checkpointed", split)):
            balanced = omt.wrap(model, **kwargs)
            calls = _count_attention(balanced.adapter.language_model(model))
            if key == "checkpointed":
                balanced.activation_checkpointing_enable()
            out = balanced(mine)
            loss = _own_loss(out.logits[0], out.batch.targets, out.batch.num_targets)
            loss.backward()
            balanced.activation_checkpointing_disable()
            total = loss.detach().clone()
            dist.all_reduce(total)
            grads = _summed_grads(model)
            record[key] = {
                "loss": float(total),
                "grad_diff": max(float((grads[k] - g).abs().max()) for k, g in plain_grads.items()),
                "tokens": int(out.batch.lengths.sum()),
                "items_split": out.batch.stats["llm"].get("items_split", 0),
                "pieces_here": 0 if out.batch.pieces is None else len(out.batch.pieces.pieces),
                "attention": model.config.get_text_config()._attn_implementation,
                "attention_calls": calls[0],
            }
            if key == "split" and name.startswith("qwen"):
                record[key]["mrope_mismatches"] = _mrope_mismatches(model, balanced, out, batch)
        results[name] = record
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_split_worker, WORLD, timeout=240)


@pytest.mark.integration
@pytest.mark.parametrize("name", list(CASES))
def test_rows_split_over_context_parallel_ranks_train_as_the_models_own_forward(runs, name):
    """The split step's loss and gradients (summed over the ranks) are the plain forward's on
    the whole rows, to 1e-5 in float64; the long rows really were split, over more than one
    rank, through the registered attention; with activation checkpointing too (the backward
    recomputes every attention layer, the pieces' gathers included)."""
    cp, budget = CASES[name]
    for record in (r[name] for r in runs):
        assert max(record["tokens"]) > budget  # the long rows do not fit a rank
        split = record["split"]
        assert split["items_split"] >= 1 and split["attention"] == "orchmllm_cp_sdpa"
        assert split["tokens"] <= budget
        layers = split["attention_calls"]
        assert record["checkpointed"]["attention_calls"] == 2 * layers > 0
        for key in ("unsplit", "split", "checkpointed"):
            assert abs(record[key]["loss"] - record["plain"]) < 1e-5, (key, record)
            assert record[key]["grad_diff"] < 1e-5, (key, record)
    holders = sum(r[name]["split"]["pieces_here"] for r in runs)
    assert holders >= 2 * runs[0][name]["split"]["items_split"]  # each split one on >= 2 ranks


@pytest.mark.integration
def test_qwen_pieces_take_the_whole_rows_mrope_positions(runs):
    """Every token of every rank, pieces included, has the 3-D position ``get_rope_index``
    gives it in its whole row, and its position in the row as the text position."""
    assert [r["qwen2.5-vl"]["split"]["mrope_mismatches"] for r in runs] == [0] * WORLD


@pytest.mark.parametrize("original", ["sdpa", "eager"])
def test_outside_a_split_step_the_registered_attention_is_the_original(original):
    """The registered implementation's attention and mask functions, in a step without
    pieces (a padded batch here: the mask matters), give the original's outputs exactly."""
    model = tiny.build_model("qwen2.5-vl", seed=0, dtype=torch.float64)
    batch = tiny.collate(tiny.make_rows("qwen2.5-vl", model, 3, seed=2))
    model.set_attn_implementation({"text_config": original})
    expected = model(**batch).logits
    name = split_attention.attention_name(original)
    model.set_attn_implementation({"text_config": name})
    assert model.config.get_text_config()._attn_implementation == name
    got = model(**batch).logits
    assert torch.equal(got, expected)
    assert split_attention.original_attention(name) == original


def test_splitting_needs_torch_distributed():
    model = tiny.build_model("llava", seed=0)
    with pytest.raises(ValueError, match="context_parallel=2 needs torch.distributed"):
        omt.wrap(model, context_parallel=2, llm_max_load=100)
    assert model.config.get_text_config()._attn_implementation == "sdpa"  # left as it was


def test_the_registered_attention_over_pieces_is_the_layers_own_attention():
    """In one process, over packed whole sequences (a real ``PackedPieces`` with nothing
    split), the registered attention gives the original packing's outputs, with the layer's
    own scaling (not the default one); what it cannot honour is refused by name."""
    model = tiny.build_model("llava", seed=0, dtype=torch.float64)
    lm = model.model.language_model
    attention = [m for m in lm.modules() if type(m).__name__.endswith("Attention")]
    for module in attention:
        module.scaling = 0.3  # not head_dim ** -0.5
    lengths = torch.tensor([5, 9, 7])
    pieces = PackedPieces(lengths.tolist(), {}, topology=orchmllm.Topology.build())
    x = torch.randn(1, int(lengths.sum()), tiny.HIDDEN, dtype=torch.float64)
    call = {"inputs_embeds": x, "position_ids": omt.restart_positions(lengths)[None]}
    expected = lm(**call, use_cache=False).last_hidden_state
    name = split_attention.attention_name("sdpa")
    model.set_attn_implementation({"text_config": name})
    split = {split_attention.PIECES_KWARG: pieces}
    got = lm(**call, use_cache=False, **split).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    fn, module = ALL_ATTENTION_FUNCTIONS[name], attention[0]
    q = torch.zeros(1, 4, int(lengths.sum()), 8, dtype=torch.float64)
    kv = q[:, :2]
    for kwargs, message in (
        ({"dropout": 0.1}, "attention dropout 0.1"),
        ({"sliding_window": 4}, r"attends with \{'sliding_window': 4\}"),
    ):
        with pytest.raises(ValueError, match=message):
            fn(module, q, kv, kv, None, **split, **kwargs)
    with pytest.raises(ValueError, match="one packed row, got a batch of 2"):
        fn(module, q.expand(2, -1, -1, -1), kv, kv, None, **split)
