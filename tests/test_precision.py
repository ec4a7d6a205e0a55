"""The precision policy (grpo/precision.py): what each config means, bf16 autocast through
every path that runs the model (LoRA, the KV cache eager and compiled, the shared prefix,
multi-turn), the measured sampler-vs-trainer and float32-vs-bf16 log-prob budgets, and
float32 master weights under `model.dtype: bfloat16` (an update below bf16 resolution lands).

CPU autocast is bf16, as on a GPU, so everything a GPU run would hit here is hit here."""

from __future__ import annotations

import copy

import pytest
import torch

import grpo_kernels
from grpo.algo.logprobs import CompletionLogprobs
from grpo.config import load_config
from grpo.errors import GrpoError
from grpo.lora import LoRALinear
from grpo.models import KVCache, load_model
from grpo.precision import Precision, head_logits, head_operands
from grpo.rollout import Sampler
from grpo.rollout.multiturn import sample_turns
from grpo.rollout.sampler import Observation
from tests.conftest import live_lora

BF16 = Precision(torch.float32, torch.bfloat16)  # the tutorial's configs: fp32 + bf16 autocast
PROMPTS = [[5, 17, 33, 9, 40, 41, 42], [101, 7], [9, 9, 9, 10, 11]]
# Budgets (docs/precision.md), measured on the tiny Qwen3 below: sampler vs trainer under bf16
# autocast, max |diff| 1.5e-3 .. 3.8e-3 and mean 3.7e-4 .. 7.0e-4 over the 8 combinations of
# LoRA x compiled decode x shared prefix; float32 vs bf16 trainer: max 3.9e-3, mean 8.5e-4.
MAX_DIFF, MEAN_DIFF = 1e-2, 2e-3
SECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "lm_head")


def cfg_of(**model):
    return load_config(base={"model": {"path": "x", **model}})


def test_policy_of_each_config():
    p = Precision.from_config(cfg_of(autocast_bf16=True).model)
    assert (p.param_dtype, p.compute_dtype, p.kv_dtype) == (
        torch.float32,
        torch.bfloat16,
        torch.bfloat16,
    )
    assert p.autocast_enabled and p.head_dtype == p.trainable_dtype == torch.float32
    p = Precision.from_config(cfg_of().model)
    assert (p.param_dtype, p.compute_dtype) == (torch.float32, torch.float32)
    assert not p.autocast_enabled
    p = Precision.from_config(cfg_of(dtype="bfloat16").model)  # bf16 weights compute in bf16
    assert (p.param_dtype, p.compute_dtype) == (torch.bfloat16, torch.bfloat16)
    with pytest.raises(GrpoError, match="model.dtype: float16 cannot train here"):
        Precision.from_config(cfg_of(dtype="float16").model)
    assert (
        Precision.from_config(cfg_of(dtype="float16").model, training=False).compute_dtype
        == torch.float16
    )


def test_float32_policy_blocks_an_outer_autocast(tiny_checkpoints):
    """One policy decides: a float32 run stays float32 inside someone else's autocast."""
    model = load_model(tiny_checkpoints("qwen3"))
    ids = torch.tensor([PROMPTS[0]])
    want = model(ids)
    with torch.autocast("cpu", torch.bfloat16), Precision().autocast("cpu"):
        got = model(ids)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
def test_lora_under_autocast(base_dtype):
    """The crash of the tutorial configs: an in-place addmm_ is not autocast. Now the output
    is bf16, B's gradient float32, and both within bf16 rounding of the float64 reference."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 24).to(base_dtype)
    lora = LoRALinear(lin, rank=4, alpha=8)
    Precision(base_dtype, torch.bfloat16).prepare(lora)  # adapters float32, base as stored
    assert lora.lora_a.dtype == lora.lora_b.dtype == torch.float32
    assert lora.weight.dtype == base_dtype
    with torch.no_grad():
        lora.lora_b.normal_(0, 0.1)
    x = torch.randn(5, 32)
    with BF16.autocast("cpu"):
        y = lora(x)
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    assert lora.lora_b.grad.dtype == torch.float32 and lora.lora_b.grad.abs().sum() > 0
    d = x.double()
    ref = (
        d @ lin.weight.double().t()
        + lin.bias.double()
        + lora.scale * (d @ lora.lora_a.double().t() @ lora.lora_b.double().t())
    )
    assert (y.double() - ref).abs().max() <= 2**-7 * ref.abs().max()  # bf16: 8-bit mantissa


def lora_head(n=37, c=64, v=1003, rank=8):
    """hidden (N, C), a LoRALinear head (V, C) with non-zero A and B, scale 4 / 8 = 0.5, ids."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, c, generator=gen)
    head = LoRALinear(torch.nn.Linear(c, v, bias=False), rank=rank, alpha=4)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, c, generator=gen) * 2 / c**0.5)
        head.lora_a.copy_(torch.randn(rank, c, generator=gen) * 0.1)
        head.lora_b.copy_(torch.randn(v, rank, generator=gen) * 0.1)
    return hidden, head, torch.randint(0, v, (n,), generator=gen)


def test_head_operands_fold_reproduces_the_lora_heads_logits():
    hidden, head, _ = lora_head()
    h2, w2 = head_operands(head, hidden)
    assert h2.shape == (37, 72) and w2.shape == (1003, 72) and h2.dtype == torch.float32
    h, w, a, b = (t.detach().double() for t in (hidden, head.weight, head.lora_a, head.lora_b))
    expected = h @ w.t() + 0.5 * (h @ a.t()) @ b.t()  # the LoRA formula, float64
    torch.testing.assert_close((h2 @ w2.t()).double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h2 @ w2.t(), head(hidden), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["chunked", "naive"])
def test_head_operands_through_fused_logprobs(impl):
    """Log-probs and gradients to hidden, A and B through the fold = the LoRA formula (float64)."""
    hidden, head, ids = lora_head()
    grad = torch.randn(37, generator=torch.Generator().manual_seed(1))
    h = hidden.clone().requires_grad_(True)
    h2, w2 = head_operands(head, h)
    logprobs = grpo_kernels.fused_logprobs(h2, w2, ids, 0.7, impl=impl)
    ours = [logprobs, *torch.autograd.grad(logprobs, [h, head.lora_a, head.lora_b], grad)]
    leaves = [t.detach().double().requires_grad_(True) for t in (hidden, head.lora_a, head.lora_b)]
    x, a, b = leaves
    z = (x @ head.weight.double().t() + 0.5 * (x @ a.t()) @ b.t()) / 0.7
    expected_lp = torch.log_softmax(z, -1).gather(1, ids[:, None]).squeeze(1)
    expected = [expected_lp, *torch.autograd.grad(expected_lp, leaves, grad.double())]
    for got, exp in zip(ours, expected):
        torch.testing.assert_close(got.double(), exp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("static", [False, True])
def test_kv_cache_stores_the_compute_dtype(tiny_checkpoints, static):
    """Keys (float32 after rotary under autocast) and values (bf16) land in one bf16 cache; the
    static (compiled-step) write used to fail on the dtype mismatch."""
    model = load_model(tiny_checkpoints("qwen3"))
    cache = KVCache.for_model(model, rows=1, max_len=16, static=static, dtype=BF16.kv_dtype)
    ids = torch.tensor([PROMPTS[0]])
    with BF16.autocast("cpu"):
        h = model(
            ids,
            attention_mask=torch.ones(1, 16, dtype=torch.bool),
            kv_cache=cache,
            return_hidden=True,
        )
    assert cache.k_layers[0].dtype == torch.bfloat16 and cache.pos == len(PROMPTS[0])
    with BF16.autocast("cpu"):
        full = model(ids, return_hidden=True)
    assert (h.float() - full.float()).abs().max() <= 1e-2 * full.float().abs().max()


def head_check(model, hidden):
    """The sampler's head is the trainer's operands, in float32, whatever the autocast."""
    with BF16.autocast("cpu"):
        logits = head_logits(model.lm_head, hidden)
    assert logits.dtype == torch.float32
    want = torch.nn.functional.linear(hidden.double(), model.lm_head.weight.double())
    if isinstance(model.lm_head, LoRALinear):
        lm = model.lm_head
        want = want + lm.scale * hidden.double() @ lm.lora_a.double().t() @ lm.lora_b.double().t()
    assert (logits.double() - want).abs().max() <= 1e-5


def observe_fn(b: int, ids: list[int], stopped: bool) -> Observation:
    """Row b: two observations of (b % 3) + 1 tokens, then done."""
    k = observe_fn.calls.setdefault(b, 0)
    observe_fn.calls[b] += 1
    if k >= 2:
        return Observation([], reward=1.0, done=True)
    return Observation([200 + b, 201, 202][: b % 3 + 1], reward=0.1)


def rollout(sampler, multi_turn: bool):
    kw = dict(group_size=4, temperature=1.0, stop_ids=[3], seed=0, pad_id=0)
    if not multi_turn:
        return sampler.sample(PROMPTS, max_new_tokens=20, **kw)
    observe_fn.calls = {}
    return sample_turns(
        sampler,
        PROMPTS,
        observe=observe_fn,
        max_new_tokens=6,
        max_turns=3,
        max_total_tokens=40,
        turn_end_ids=list(range(4, 60)),
        **kw,
    )


# the compiled variants cost seconds each (a compile per shape): lora + multi-turn, the widest,
# stays in the default tier, the other three run in the process tier
BF16_AGREEMENT = [
    pytest.param(
        lora,
        compiled,
        multi_turn,
        id=f"{'lora' if lora else 'full'}-{'compiled' if compiled else 'eager'}-"
        f"{'multi' if multi_turn else 'single'}",
        marks=pytest.mark.process if compiled and not (lora and multi_turn) else (),
    )
    for lora in (False, True)
    for compiled in (False, True)
    for multi_turn in (False, True)
]


@pytest.mark.parametrize("lora, compiled, multi_turn", BF16_AGREEMENT)
def test_sampler_and_trainer_agree_under_bf16(tiny_checkpoints, lora, compiled, multi_turn):
    """The matrix: bf16 autocast x LoRA x compiled decode (aot_eager, the static cache) x
    shared prefix x single / multi-turn. The sampler's log-probs equal the trainer's within
    the budget, and the trainer's bf16 log-probs equal float32 ones within the same budget."""
    model = load_model(tiny_checkpoints("qwen3"))
    if lora:
        live_lora(model, SECTIONS, std=0.05)
    BF16.prepare(model)
    head_check(model, torch.randn(6, model.config.hidden_size))
    sampler = Sampler(
        model, precision=BF16, compile=compiled, compile_options={"backend": "aot_eager"}
    )
    r = rollout(sampler, multi_turn)
    if compiled:
        assert [c.dtype for c in sampler._caches.values()] == [torch.bfloat16]
    mask = r.generated_mask
    holes = r.multi_turn
    for G in (None, 4):  # full rows, shared prefix
        bf16 = CompletionLogprobs(model, BF16)(
            r.ids, r.attention_mask(), r.prompt_width, mask, 1.0, has_holes=holes, group_size=G
        )
        fp32 = CompletionLogprobs(model, Precision())(
            r.ids, r.attention_mask(), r.prompt_width, mask, 1.0, has_holes=holes, group_size=G
        )
        d = (bf16 - r.logprobs)[mask].abs()
        assert d.max() <= MAX_DIFF and d.mean() <= MEAN_DIFF, (G, d.max(), d.mean())
        assert d.max() > 0  # bf16 did run (float32 agrees to 1e-5: tests/test_on_policy.py)
        d = (bf16 - fp32)[mask].abs()
        assert d.max() <= MAX_DIFF and d.mean() <= MEAN_DIFF, (G, d.max(), d.mean())


def test_bf16_gradients_follow_float32(tiny_checkpoints):
    """The trainer's backward under autocast: LoRA gradients float32, close to float32's."""
    grads = {}
    for name, prec in (("fp32", Precision()), ("bf16", BF16)):
        model = load_model(tiny_checkpoints("qwen3"))
        torch.manual_seed(0)  # live_lora draws B from the global generator
        live_lora(model, SECTIONS, std=0.05)
        prec.prepare(model)
        r = Sampler(model).sample(
            PROMPTS, group_size=2, max_new_tokens=8, temperature=1.0, stop_ids=[3], seed=0, pad_id=0
        )
        model.train()
        lp = CompletionLogprobs(model, prec)(
            r.ids, r.attention_mask(), r.prompt_width, r.completion_mask, 1.0
        )
        lp.sum().backward()
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
        assert grads[name].dtype == torch.float32
    rel = (grads["bf16"] - grads["fp32"]).norm() / grads["fp32"].norm()
    assert rel <= 0.05, rel  # measured 0.5-1.4% per tensor here


def test_bf16_weights_keep_float32_master_weights(tmp_path, shared_tiny_model):
    """model.dtype: bfloat16, full fine-tuning: the trainable weights are float32, so an
    update far below bf16's resolution (lr 1e-6 on weights ~0.02: bf16 ulp ~1e-4) lands, and
    the frozen reference copy stays bf16."""
    from grpo.policy import build_policy

    cfg = load_config(
        base={
            "model": {"path": str(shared_tiny_model), "dtype": "bfloat16", "device": "cpu"},
            "lora": {"enabled": False},
        }
    )
    policy = build_policy(cfg, torch.device("cpu"), need_ref=True)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    assert params and all(p.dtype == torch.float32 for p in params)
    assert all(p.dtype == torch.bfloat16 for p in policy.ref_model.parameters())
    before = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with policy.precision.autocast("cpu"):
        loss = policy.model(ids).float().logsumexp(-1).mean()
    loss.backward()
    opt.step()
    moved = [(p - b).abs() for p, b in zip(params, before)]
    landed = sum(int((m > 0).sum()) for m in moved)
    total = sum(m.numel() for m in moved)
    assert landed >= 0.9 * total, (landed, total)  # Adam's first step: ~lr on every weight
    # the same update stored in bf16 would have been lost on (almost) every weight
    lost = sum(
        int(((b.bfloat16().float() + 1e-6).bfloat16().float() == b.bfloat16().float()).sum())
        for b in before
    )
    assert lost >= 0.9 * total


def test_float16_training_is_refused_in_one_line(tmp_path, shared_tiny_model):
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo",
            "sft",
            "--config",
            "configs/tiny_ci.yaml",
            f"model.path={shared_tiny_model}",
            "model.dtype=float16",
            f"train.output_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "model.dtype: float16 cannot train here" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_eval_runs_in_the_given_precision(tiny_checkpoints, tiny_tokenizer, monkeypatch):
    """Evaluation takes the run's precision: its KV cache is bf16 and its greedy completions
    are exactly those of a bf16 sampler (and a float32 evaluation's those of a float32 one)."""
    from grpo.eval import evaluate

    model = load_model(tiny_checkpoints("qwen3", vocab_size=300))
    rows = [{"prompt_ids": p, "ground_truth": "8", "full_answer": "#### 8"} for p in PROMPTS]
    caches = []
    for_model = KVCache.for_model.__func__
    monkeypatch.setattr(
        KVCache,
        "for_model",
        classmethod(lambda cls, *a, **kw: caches.append(for_model(cls, *a, **kw)) or caches[-1]),
    )
    pad = tiny_tokenizer.pad_token_id
    for prec in (Precision(), BF16):
        caches.clear()
        res = evaluate(
            model,
            tiny_tokenizer,
            copy.deepcopy(rows),
            stop_ids=[3],
            max_new_tokens=8,
            precision=prec,
            details=True,
        )
        assert res.summary["n"] == len(rows)
        assert caches and all(c.dtype == prec.kv_dtype for c in caches)
        want = Sampler(model, precision=prec).sample(
            PROMPTS,
            group_size=1,
            max_new_tokens=8,
            temperature=0.0,
            stop_ids=[3],
            seed=0,
            pad_id=pad,
        )
        texts = want.decode(tiny_tokenizer, skip_special_tokens=True)
        assert [r["completion"] for r in res.samples] == texts
