"""What only a CUDA GPU can check: the fused ``varlen_attn`` kernel behind packed attention, the
chunked LM head (its loss and per-token log-probabilities) in the GPU's precisions, and the NCCL
backend under the dispatcher and the orchestrator (world size 1, one GPU).

Every test here is marked ``cuda`` and skipped without a GPU; ``pytest -m cuda`` runs them (as
``benchmarks/gpu_check.py`` does), together with the single-process NCCL training smoke test
in ``tests/test_gpu_step.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from orchmllm import compat
from orchmllm.config import load_config
from orchmllm.dist.dispatcher import BatchDispatcher
from orchmllm.dist.loss import chunked_cross_entropy, token_log_probs
from orchmllm.dist.orchestrator import LocalBatch, Orchestrator
from orchmllm.dist.topology import Topology
from orchmllm.models import build_model, packed_attention
from orchmllm.planner.step_options import StepOptions
from orchmllm.testing import run_distributed
from tests.payloads import PHASES, WIDTH, expected_sequence, payload_batches, payload_embed

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 60.0
LENGTHS = [1, 7, 64, 129, 300, 33]  # a one-token sequence, odd lengths, one past a tile


def _per_sequence_sdpa(q, k, v, lengths, *, causal):
    """The reference: each sequence alone through SDPA in float64, query heads grouped by
    repeating k and v (no ``enable_gqa`` needed)."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for qs, ks, vs in zip(*(t.double().split(lengths) for t in (q, k, v)), strict=True):
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), is_causal=causal
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def _tolerance(dtype: torch.dtype, *, terms: int) -> float:
    """Normwise relative error allowed: the result rounded to ``dtype`` (bf16 also rounds the
    softmax weights before they meet v: two roundings, a factor 4 of margin over them) plus
    float32 accumulation over ``terms`` keys (random-walk growth, sqrt(terms), same margin)."""
    return 4 * torch.finfo(dtype).eps + 4 * torch.finfo(torch.float32).eps * math.sqrt(terms)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach()
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_attention_on_cuda_matches_per_sequence_sdpa(dtype, causal):
    """bf16 runs torch's fused varlen kernel (grouped-query heads: 8 query, 2 key/value), fp32
    the per-sequence SDPA path; both must equal each sequence attended alone, forward and
    backward."""
    fused = dtype == torch.bfloat16
    if fused and compat.varlen_attention() is None:
        pytest.skip(f"torch {torch.__version__} has no varlen_attn (2.10+)")
    g = torch.Generator(device="cuda").manual_seed(0)
    total, dev = sum(LENGTHS), torch.device("cuda")
    q, k, v = (
        torch.randn(total, heads, 64, device=dev, generator=g, dtype=dtype).requires_grad_()
        for heads in (8, 2, 2)
    )
    lengths = torch.tensor(LENGTHS, device=dev)
    out = packed_attention(q, k, v, lengths, causal=causal)
    grad_out = torch.randn(out.shape, device=dev, generator=g, dtype=dtype)
    out.backward(grad_out)

    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _per_sequence_sdpa(*ref_in, LENGTHS, causal=causal)
    ref.backward(grad_out.double())
    assert out.dtype == dtype and out.shape == q.shape
    tol = _tolerance(dtype, terms=max(LENGTHS))
    err = _relative_error(out, ref)
    assert err <= tol, f"{dtype} forward: relative error {err:.2e} > {tol:.2e}"
    for name, t, r in zip("qkv", (q, k, v), ref_in, strict=True):
        err = _relative_error(t.grad, r.grad)
        # the backward rounds twice more (the output gradient and the softmax gradient)
        assert err <= 2 * tol, f"{dtype} d{name}: relative error {err:.2e} > {2 * tol:.2e}"


def check_lm_head(device: str, dtype: torch.dtype) -> None:
    """The chunked LM head (:func:`token_log_probs`, :func:`chunked_cross_entropy`) against the
    whole logits in float64 of the same inputs: log-probabilities within the rounding of the
    logits to ``dtype`` (the head's product rounds them before they are upcast, as HF's plain
    loss does), gradients of their sum within the same relative error, the loss their sum."""
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(300, 64, generator=g) / 4).to(device, dtype).requires_grad_()
    weight = (torch.randn(1000, 64, generator=g) / 4).to(device, dtype).requires_grad_()
    targets = torch.randint(0, 1000, (300,), generator=g).to(device)
    targets[::5] = -100
    valid = targets != -100
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    logits = h64 @ w64.T
    ref = torch.log_softmax(logits, -1).gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    ref = torch.where(valid, ref, 0.0)
    tol = 4 * torch.finfo(dtype).eps * float(logits.detach().abs().max()) + 1e-6
    got = token_log_probs(hidden, weight, targets, chunk=128)
    assert float((got.log_probs.detach().double() - ref.detach()).abs().max()) <= tol
    got.log_probs.sum().backward()
    ref.sum().backward()
    for ours, want in ((hidden.grad, h64.grad), (weight.grad, w64.grad)):
        assert _relative_error(ours, want) <= 8 * torch.finfo(dtype).eps
    loss = chunked_cross_entropy(hidden.detach(), weight.detach(), targets, chunk=128)
    assert abs(float(loss) + float(ref.detach().sum())) <= tol * int(valid.sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_lm_head_on_cuda_matches_the_whole_logits(dtype):
    check_lm_head("cuda", dtype)


def test_every_encoder_runs_on_an_empty_batch_in_bf16():
    """A rank with no item of a modality still runs its encoder (FSDP2 needs every call). On
    an H100 with torch 2.11 the padded audio encoder's SDPA returned no tensor for a batch of
    zero clips and the trainer's step failed; every encoder must give ``[0, hidden]`` and zero
    gradients."""
    cfg = load_config(ROOT / "configs" / "tiny.yaml").model
    model = build_model(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    empty = torch.zeros(0, dtype=torch.int64, device="cuda")
    outs = [
        model.encoders[name](
            torch.zeros(0, enc.feature_dim, dtype=torch.bfloat16, device="cuda"), empty
        )
        for name, enc in cfg.encoders.items()
    ]
    assert all(out.shape == (0, cfg.llm.hidden) for out in outs)
    sum(out.sum() for out in outs).backward()
    for name, p in model.encoders.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0, name


# -- NCCL at world size 1 ------------------------------------------------------------------


def _keys(ids, lengths) -> torch.Tensor:
    """Token-major key of every item: ``id * 1000 + position``."""
    return torch.cat([i * 1000 + torch.arange(lengths[i]) for i in ids])


def _dispatch_and_orchestrate(rank: int, world: int, device_type: str) -> dict:
    """The dispatcher and the orchestrator on this rank's device: move a batch and back, and
    run a multimodal step (identity encoders) with its backward. Returns what the CPU/gloo
    run must equal, on the host."""
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    out = {"backend": torch.distributed.get_backend()}

    topology = Topology.build(ranks_per_node=1, timeout=TIMEOUT)
    disp = BatchDispatcher("greedy", topology=topology, check_plan=True)
    lengths = [5, 1, 9, 3, 0, 7]
    key = _keys(range(len(lengths)), lengths)
    tokens = {
        "key": key.to(device),
        "emb": (key % 251).float()[:, None].repeat(1, 3).to(device),  # small ints: exact
        "half": (key % 251).to(torch.bfloat16)[:, None].to(device),
    }
    items = {"id": torch.arange(len(lengths), device=device)}
    d = disp.dispatch(tokens, torch.tensor(lengths, device=device), items)
    assert all(t.device == device for t in (*d.tokens.values(), *d.items.values()))
    mine = d.items["id"].cpu()
    assert sorted(mine.tolist()) == list(range(len(lengths)))  # every item once
    assert torch.equal(d.tokens["key"].cpu(), _keys(mine.tolist(), lengths))  # intact
    assert torch.equal(d.tokens["emb"][:, 0], (d.tokens["key"] % 251).float())
    for name, t in tokens.items():  # undo(dispatch(x)) == x
        assert torch.equal(disp.undo(d, d.tokens[name]), t), name
    assert torch.equal(disp.undo(d, d.items["id"], items=True), items["id"])
    out["dispatch_order"] = mine.tolist()

    batch = LocalBatch.from_examples(payload_batches(1)[0], PHASES).to(device)
    weights = {p.name: torch.eye(WIDTH, device=device, requires_grad=True) for p in PHASES}

    def encoder(name, div):
        return lambda x, lengths: x.reshape(-1, div, x.shape[1])[:, 0] @ weights[name]

    orch = Orchestrator(StepOptions(PHASES, mode="full"), topology=topology)
    res = orch.run(batch, {p.name: encoder(p.name, p.divisor) for p in PHASES})
    embeds = res.assemble(payload_embed(res.input_ids))
    (embeds**2).sum().backward()
    out.update(
        example_ids=[int(i) for i in res.example_ids],
        lengths=res.lengths.cpu(),
        input_ids=res.input_ids.cpu(),
        targets=res.targets.cpu(),
        num_targets=res.num_targets,
        embeds=embeds.detach().cpu(),
        grads={n: w.grad.cpu() for n, w in weights.items()},
        device=str(embeds.device),
    )
    return out


@pytest.mark.integration
def test_nccl_dispatcher_and_orchestrator_equal_gloo():
    """World size 1 on NCCL: the dispatcher conserves items and contents through dispatch and
    undo on the GPU, and the orchestrator's LLM batch, assembled sequences and encoder
    gradients equal the CPU/gloo run's exactly."""
    (gpu,) = run_distributed(_dispatch_and_orchestrate, 1, "cuda", backend="nccl", timeout=120)
    (cpu,) = run_distributed(_dispatch_and_orchestrate, 1, "cpu", timeout=120)
    assert gpu["backend"] == "nccl" and cpu["backend"] == "gloo"
    assert gpu["device"].startswith("cuda") and cpu["device"] == "cpu"
    assert gpu["dispatch_order"] == cpu["dispatch_order"]
    examples = {ex["id"]: ex for ex in payload_batches(1)[0]}
    starts = np.concatenate(([0], np.cumsum(gpu["lengths"].numpy())))
    for i, eid in enumerate(gpu["example_ids"]):  # every sequence is its example, exactly
        rows, targets = expected_sequence(examples[eid])
        assert np.array_equal(gpu["embeds"][starts[i] : starts[i + 1]].numpy(), rows), eid
        assert np.array_equal(gpu["targets"][starts[i] : starts[i + 1]].numpy(), targets), eid
    assert sorted(gpu["example_ids"]) == sorted(examples)
    for key in ("example_ids", "num_targets"):
        assert gpu[key] == cpu[key], key
    for key in ("lengths", "input_ids", "targets", "embeds"):
        assert torch.equal(gpu[key], cpu[key]), key
    for name in gpu["grads"]:
        torch.testing.assert_close(gpu["grads"][name], cpu["grads"][name], rtol=1e-6, atol=1e-6)
