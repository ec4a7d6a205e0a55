"""The lm_head's precision (`model.head_precision`, `Precision.head`): one setting read into the
policy and used by the sampler's logits (`head_logits`, the packed CPU head) and the trainer's
fused log-probs (`head_operands` -> `grpo_kernels.fused_logprobs`) alike. float32 is the default and
bitwise what ran before; tf32 is float32 on a CPU (TF32 is a CUDA format); bf16 multiplies bf16
operands with float32 accumulation and never copies a bf16 weight to float32. Checked against
float64 under the bf16 error-budget rule (<= 1.5x the same-dtype torch reference's error)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import grpo_kernels
from grpo.algo.logprobs import CompletionLogprobs, head_logprobs
from grpo.config import load_config
from grpo.lora import LoRALinear
from grpo.models import load_model
from grpo.precision import Precision, cpu_packing_missing, head_logits, head_operands
from grpo.rollout import Sampler
from grpo.rollout.onednn_weights import MIN_NUMEL, PackedLinears
from grpo.settings import ConfigError
from tests.conftest import live_lora

REPO = Path(__file__).resolve().parents[1]
HEADS = ("float32", "tf32", "bf16")
PROMPTS = [[5, 17, 33, 9, 40, 41, 42], [101, 7], [9, 9, 9, 10, 11]]
SECTIONS = ("q_proj", "v_proj", "lm_head")  # a live LoRA head: the fold in every mode
# Sampler vs trainer |log p| gap on the tiny Qwen3 (docs/precision.md, "Head precision"):
# float32 and tf32 heads under float32 compute agree to fp32 tolerance (measured 9.5e-7). A bf16
# head measured max 3.3e-6 .. 1.1e-5, mean 6e-8 .. 9e-8 under float32 compute (the two round
# the same bf16 logits; a hidden state 1e-7 apart can round its bf16 operand the other way, so
# the max allows one bf16 ulp of a logit ~0.25), and max 2.0e-3 .. 4.6e-3, mean 4.0e-4 .. 7.6e-4
# under bf16 autocast (float32 head: 1.4e-3 .. 2.3e-3, 3.1e-4 .. 5.5e-4), held to the budget of
# tests/test_precision.py.
FP32_GAP = 1e-5
BF16_GAP = {False: (1e-3, 1e-6), True: (1e-2, 2e-3)}  # autocast -> (max, mean)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cfg_of(**model):
    return load_config(base={"model": {"path": "x", **model}})


# ---------------------------------------------------------------- the setting


def test_head_precision_setting_reaches_the_policy():
    p = Precision.from_config(cfg_of().model)
    assert p.head == "float32" and p.head_dtype == torch.float32
    assert p.describe().endswith("head float32")  # the line as it was
    p = Precision.from_config(cfg_of(head_precision="bf16", autocast_bf16=True).model)
    assert (p.head, p.head_dtype, p.compute_dtype) == ("bf16", torch.bfloat16, torch.bfloat16)
    assert p.describe().endswith("head bfloat16 (fp32 accumulation)")
    p = Precision.from_config(cfg_of(head_precision="tf32").model)
    assert p.head == "tf32" and p.head_dtype == torch.float32
    assert p.describe().endswith("head float32 (TF32 matmuls on CUDA)")
    with pytest.raises(ValueError, match="head precision must be one of"):
        Precision(head="fp16")


def test_invalid_head_precision_fails_in_one_line_naming_the_field():
    with pytest.raises(ConfigError) as err:
        cfg_of(head_precision="fp16")
    msg = str(err.value)
    assert msg.startswith("model.head_precision:") and "\n" not in msg
    assert "'float32', 'tf32', 'bf16'" in msg and "'fp16'" in msg
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo",
            "config",
            "--config",
            "configs/tiny_ci.yaml",
            "model.head_precision=fp16",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "model.head_precision" in ln]
    assert len(lines) == 1 and "fp16" in lines[0], r.stderr


def test_tf32_matmuls_is_scoped_and_a_no_op_on_a_cpu():
    before = torch.get_float32_matmul_precision()
    with grpo_kernels.tf32_matmuls("cpu"):
        assert torch.get_float32_matmul_precision() == before
    with grpo_kernels.tf32_matmuls("cuda", enabled=False):
        assert torch.get_float32_matmul_precision() == before
    with pytest.raises(RuntimeError, match="inside"):
        with grpo_kernels.tf32_matmuls(torch.device("cuda")):  # sets a flag only: no device needed
            assert torch.get_float32_matmul_precision() == "high"
            raise RuntimeError("inside")
    assert torch.get_float32_matmul_precision() == before  # restored, on an exception too


# ---------------------------------------------------------------- operands and float64


def lora_head(n=37, c=64, v=1003, rank=8, lora=True, dtype=torch.float32):
    """hidden (N, C), a head (V, C) with logits ~ N(0, 16) (large enough for bf16 rounding to
    show), a LoRA head with non-zero A and B (scale 4 / 8 = 0.5), ids (N,), grad (N,)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, c, generator=gen)
    base = torch.nn.Linear(c, v, bias=False)
    with torch.no_grad():
        base.weight.copy_(torch.randn(v, c, generator=gen) * 4 / c**0.5)
    base = base.to(dtype)
    head = base
    if lora:
        head = LoRALinear(base, rank=rank, alpha=4)
        with torch.no_grad():
            head.lora_a.copy_(torch.randn(rank, c, generator=gen) * 0.1)
            head.lora_b.copy_(torch.randn(v, rank, generator=gen) * 0.1)
    ids = torch.randint(0, v, (n,), generator=gen)
    return hidden, head, ids, torch.randn(n, generator=gen)


def old_operands(lm_head, hidden):
    """`head_operands` as it was before the setting: always float32."""
    h, w = hidden.float(), lm_head.weight.float()
    if isinstance(lm_head, LoRALinear):
        low = lm_head.scale * (lm_head.dropout(h) @ lm_head.lora_a.float().t())
        return torch.cat([h, low], dim=-1), torch.cat([w, lm_head.lora_b.float()], dim=-1)
    return h, w


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_default_and_float32_head_are_bitwise_as_before(lora):
    """The default changes nothing (operands, logits, fused log-probs); tf32 on a CPU is it."""
    hidden, head, ids, _ = lora_head(lora=lora)
    want_h, want_w = old_operands(head, hidden)
    want_logits = F.linear(want_h, want_w)
    want_lp = grpo_kernels.fused_logprobs(want_h, want_w, ids, 0.7, impl="chunked")
    for mode in (None, "float32", "tf32"):
        kw = {} if mode is None else {"head_precision": mode}
        h, w = head_operands(head, hidden, **kw)
        assert h.dtype == w.dtype == torch.float32
        assert torch.equal(h, want_h) and torch.equal(w, want_w)
        assert torch.equal(head_logits(head, hidden, **kw), want_logits)
        assert torch.equal(head_logprobs(head, hidden, ids, 0.7, "chunked", **kw), want_lp)


def logprobs_of(logits, ids, temperature):
    return torch.log_softmax(logits.double() / temperature, -1).gather(1, ids[:, None])[:, 0]


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("mode", HEADS)
@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_each_head_against_float64(mode, lora):
    """Sampler path (head_logits, log-softmax) and trainer path (fused log-probs and their
    gradients to hidden and the adapters) against float64: float32 and tf32 (a CPU) to fp32
    tolerance; bf16 within 1.5x the error of torch's own bf16 head (bf16 operands, fp32
    accumulation inside torch.matmul, then .float()) and sampler = trainer within its budget."""
    hidden, head, ids, grad = lora_head(lora=lora)
    t = 0.7
    x = hidden.clone().requires_grad_(True)
    leaves = [x, head.lora_a, head.lora_b] if lora else [x]
    trainer = head_logprobs(head, x, ids, t, "chunked", head_precision=mode)
    ours = [trainer, *torch.autograd.grad(trainer, leaves, grad)]
    with torch.no_grad():
        sampler = logprobs_of(head_logits(head, hidden, mode), ids, t)
    assert trainer.dtype == torch.float32

    def formula(cast, leaves):  # the LoRA formula (not the fold), operands through `cast`
        x, *ab = leaves
        z = (cast(x) @ cast(head.weight.detach()).t()).double()
        if ab:
            z = z + 0.5 * (((cast(x) @ cast(ab[0]).t()) @ cast(ab[1]).t()).double())
        lp = torch.log_softmax(z / t, -1).gather(1, ids[:, None])[:, 0]
        return [lp, *torch.autograd.grad(lp, leaves, grad.double())]

    gold = formula(lambda a: a.double(), [a.detach().double().requires_grad_(True) for a in leaves])
    if mode != "bf16":
        for got, exp in zip(ours, gold):
            torch.testing.assert_close(got.double(), exp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sampler, gold[0], rtol=1e-5, atol=1e-5)
        return
    ref = formula(lambda a: a.bfloat16(), [a.detach().clone().requires_grad_(True) for a in leaves])
    for name, got, r, exp in zip(("logprobs", "d_hidden", "d_lora_a", "d_lora_b"), ours, ref, gold):
        assert rel_err(got, exp) <= 1.5 * rel_err(r, exp) + 1e-6, (
            name,
            rel_err(got, exp),
            rel_err(r, exp),
        )
    assert rel_err(sampler, gold[0]) <= 1.5 * rel_err(ref[0], gold[0]) + 1e-6
    assert rel_err(trainer, gold[0]) > 1e-4  # bf16 did run (float32: ~1e-7)
    assert (sampler - trainer.double()).abs().max() <= BF16_GAP[False][0]


def test_bf16_head_never_copies_a_bf16_weight_to_float32(tiny_checkpoints, monkeypatch):
    """bf16 weights, bf16 head: the operands the sampler and the trainer multiply are the
    weight itself (same storage, bf16); a float32 weight (master weights) is cast to bf16."""
    hidden, head, ids, _ = lora_head(lora=False, dtype=torch.bfloat16)
    h, w = head_operands(head, hidden, "bf16")
    assert h.dtype == w.dtype == torch.bfloat16
    assert w.data_ptr() == head.weight.data_ptr()  # not even a bf16 copy
    assert head_operands(head, hidden)[1].dtype == torch.float32  # the default: as before
    h, w = head_operands(lora_head(lora=True)[1], hidden, "bf16")  # float32 base + adapters
    assert h.dtype == w.dtype == torch.bfloat16 and w.shape == (1003, 72)

    model = load_model(tiny_checkpoints("qwen3"), dtype=torch.bfloat16)
    weight = model.lm_head.weight
    seen = []
    fused, mm = grpo_kernels.fused_logprobs, grpo_kernels.matmul_fp32

    def spy_fused(h, w, *a, **kw):
        seen.append(("trainer", h.dtype, w.dtype, w.data_ptr()))
        return fused(h, w, *a, **kw)

    def spy_mm(a, b):
        seen.append(("sampler", a.dtype, b.dtype, b.data_ptr()))
        return mm(a, b)

    monkeypatch.setattr(grpo_kernels, "fused_logprobs", spy_fused)
    monkeypatch.setattr("grpo.precision.matmul_fp32", spy_mm)
    prec = Precision(torch.bfloat16, torch.bfloat16, "bf16")
    r = Sampler(model, precision=prec, pack=False).sample(
        PROMPTS, group_size=2, max_new_tokens=6, temperature=1.0, stop_ids=[3], seed=0, pad_id=0
    )
    CompletionLogprobs(model, prec)(
        r.ids, r.attention_mask(), r.prompt_width, r.completion_mask, 1.0
    )
    assert {s[0] for s in seen} == {"sampler", "trainer"}
    for who, h_dtype, w_dtype, ptr in seen:
        assert (h_dtype, w_dtype, ptr) == (torch.bfloat16, torch.bfloat16, weight.data_ptr()), who


# ---------------------------------------------------------------- sampler vs trainer


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32_compute", "bf16_autocast"])
@pytest.mark.parametrize("mode", HEADS)
def test_sampler_and_trainer_agree_for_each_head(tiny_checkpoints, mode, autocast):
    """The sampler's log-probs (its head through `head_logits`) = the trainer's (the fused
    kernels on `head_operands`) for the same head, with a live LoRA head (the fold); float32
    and tf32 under float32 compute to fp32 tolerance, bf16 within its measured budget, and bf16
    moves the log-probs off the float32 head's (it ran)."""
    model = load_model(tiny_checkpoints("qwen3"))
    live_lora(model, SECTIONS, std=0.05)
    prec = Precision(torch.float32, torch.bfloat16 if autocast else torch.float32, mode)
    prec.prepare(model)
    r = Sampler(model, precision=prec).sample(
        PROMPTS, group_size=4, max_new_tokens=16, temperature=1.0, stop_ids=[3], seed=0, pad_id=0
    )
    mask = r.completion_mask
    with torch.no_grad():
        for G in (None, 4):  # full rows, shared prefix
            lp = CompletionLogprobs(model, prec)(
                r.ids, r.attention_mask(), r.prompt_width, mask, 1.0, group_size=G
            )
            d = (lp - r.logprobs)[mask].abs()
            if mode == "bf16" or autocast:
                max_gap, mean_gap = BF16_GAP[autocast]
                assert d.max() <= max_gap and d.mean() <= mean_gap, (G, d.max(), d.mean())
            else:
                assert d.max() <= FP32_GAP, (G, d.max())
        fp32_head = Precision(prec.param_dtype, prec.compute_dtype)
        lp32 = CompletionLogprobs(model, fp32_head)(
            r.ids, r.attention_mask(), r.prompt_width, mask, 1.0, group_size=4
        )
    moved = (lp - lp32)[mask].abs().max()
    assert moved > 0 if mode == "bf16" else moved == 0, moved


def test_compiled_decode_with_a_bf16_head(tiny_checkpoints):
    """The compiled decode step (aot_eager, the static cache) traces the bf16 head too."""
    model = load_model(tiny_checkpoints("qwen3"))
    live_lora(model, SECTIONS, std=0.05)
    prec = Precision(torch.float32, torch.bfloat16, "bf16")
    prec.prepare(model)
    sampler = Sampler(model, precision=prec, compile=True, compile_options={"backend": "aot_eager"})
    r = sampler.sample(
        PROMPTS, group_size=2, max_new_tokens=10, temperature=1.0, stop_ids=[3], seed=0, pad_id=0
    )
    assert sampler._compiled_shapes  # the compiled step ran
    with torch.no_grad():
        lp = CompletionLogprobs(model, prec)(
            r.ids, r.attention_mask(), r.prompt_width, r.completion_mask, 1.0
        )
    d = (lp - r.logprobs)[r.completion_mask].abs()
    assert d.max() <= BF16_GAP[True][0] and d.mean() <= BF16_GAP[True][1], (d.max(), d.mean())


# ---------------------------------------------------------------- the packed CPU head


class _HeadOnly(torch.nn.Module):
    def __init__(self, v: int, c: int):
        super().__init__()
        self.lm_head = torch.nn.Linear(c, v, bias=False)


@pytest.mark.skipif(
    cpu_packing_missing(torch.float32) is not None, reason=str(cpu_packing_missing(torch.float32))
)
@pytest.mark.parametrize("mode", HEADS)
def test_packed_cpu_head_follows_the_head_precision(mode, monkeypatch):
    """A packed head (V x C >= MIN_NUMEL) packs in the head's operand dtype and gives the
    logits of `head_logits`; bf16 where this CPU cannot pack bf16: the head stays plain."""
    model = _HeadOnly(MIN_NUMEL // 64, 64)
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    prec = Precision(head=mode)
    want = head_logits(model.lm_head, hidden, mode)
    packed = PackedLinears(model, prec)
    with packed.installed():
        got = packed.head(hidden)
    if mode == "bf16" and cpu_packing_missing(torch.bfloat16) is not None:
        assert got is None and packed._head is None
    else:
        assert packed._head[2].dtype == prec.head_dtype and got.dtype == torch.float32
        tol = 2**-7 * want.abs().max() if mode == "bf16" else 1e-5  # one bf16 ulp
        assert (got - want).abs().max() <= tol
    if mode == "bf16":  # a CPU without bf16 packing: unpacked head, float32 packing unchanged
        monkeypatch.setattr(
            "grpo.rollout.onednn_weights.cpu_packing_missing",
            lambda dt: None if dt == torch.float32 else "no bf16",
        )
        packed = PackedLinears(model, prec)
        with packed.installed():
            assert packed.head(hidden) is None and packed._head is None
        packed = PackedLinears(model, Precision())
        with packed.installed():
            assert packed._head[2].dtype == torch.float32 and packed.head(hidden) is not None


# ---------------------------------------------------------------- Triton, TF32


_INTERPRETED_TF32 = """
import torch
import grpo_kernels
gen = torch.Generator().manual_seed(0)
h = torch.randn(37, 64, generator=gen).requires_grad_(True)
w = (torch.randn(1003, 64, generator=gen) * 0.5).requires_grad_(True)
ids = torch.randint(0, 1003, (37,), generator=gen)
grad = torch.randn(37, generator=gen)
lp = grpo_kernels.fused_logprobs(h, w, ids, 0.7, impl="triton", tf32=True)
got = [lp, *torch.autograd.grad(lp, [h, w], grad)]
# float64 on the TF32-rounded operands the kernels multiply (the interpreter's dots are plain
# float32); the CPU's gradient GEMMs take the unrounded ones, at most 2**-11 away relatively
x, y = (grpo_kernels.round_to_tf32(t.detach()).double().requires_grad_(True) for t in (h, w))
gold = torch.log_softmax(x @ y.t() / 0.7, -1).gather(1, ids[:, None])[:, 0]
want = [gold, *torch.autograd.grad(gold, [x, y], grad.double())]
torch.testing.assert_close(got[0].double(), want[0], rtol=1e-5, atol=1e-5)
for a, b in zip(got[1:], want[1:]):
    assert ((a.double() - b).norm() / b.norm()).item() <= 2**-10
print("OK")
"""


def run_interpreted(script: str) -> None:
    """`script` in a fresh Python with TRITON_INTERPRET=1 (the kernels on the CPU); it must
    print OK last."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    r = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


@pytest.mark.process
def test_triton_takes_tf32_through_forward_and_backward_interpreted():
    """`fused_logprobs(..., tf32=True)` reaches the Triton launchers in the forward and the
    backward (the config the autograd Function keeps): against float64 on the TF32-rounded
    operands (the interpreter's `tl.dot` is plain float32; the rounding is the kernels' own,
    `test_triton_tf32_rounds_its_operands_interpreted`); the tensor cores on CUDA below."""
    run_interpreted(_INTERPRETED_TF32)


_INTERPRETED_TF32_ROUNDING = """
import math, torch
import grpo_kernels
from grpo_kernels.logprobs import triton_logprobs
# Operands whose TF32 roundings multiply and add exactly in float32 (k / 16 with |k| < 64: every
# partial sum of 64 products is a multiple of 2**-8 below 2**10), nudged by 0.05-0.2 of a TF32
# ulp so that each rounds back to them (up or down): the kernel's logits are then exact if and
# only if it rounds its operands, whatever order it sums in.
gen = torch.Generator().manual_seed(0)
N, C, V, T = 29, 64, 301, 0.7
def operand(rows):
    base = torch.randint(-63, 64, (rows, C), generator=gen).float() / 16
    base = torch.where(base == 0, torch.full_like(base, 0.0625), base)
    ulp = torch.exp2(torch.floor(torch.log2(base.abs())) - 10)
    nudge = (0.05 + 0.15 * torch.rand(rows, C, generator=gen))  # of a TF32 ulp; below a power of
    nudge = nudge * torch.sign(torch.randn(rows, C, generator=gen))  # two the ulp halves
    return base, base + nudge * ulp
h_r, h = operand(N)
w_r, w = operand(V)
assert torch.equal(grpo_kernels.round_to_tf32(h), h_r)
assert torch.equal(grpo_kernels.round_to_tf32(w), w_r)
assert not torch.equal(h, h_r) and not torch.equal(w, w_r)
ids = torch.randint(0, V, (N,), generator=gen)
g = torch.randn(N, generator=gen).double()

def reference(hh, ww):  # float64 log-probs and the gradients the CPU backward computes from them
    x = h.double().requires_grad_(True)  # the GEMMs use the unrounded operands on a CPU
    y = w.double().requires_grad_(True)
    z = hh.double() @ ww.double().t()
    z = z + (x @ y.t() - (x @ y.t()).detach()) * 0  # gradient path only
    lp = torch.log_softmax(z / T, -1).gather(1, ids[:, None])[:, 0]
    p = torch.softmax(z.detach() / T, -1)
    G = (torch.nn.functional.one_hot(ids, V).double() - p) * (g / T)[:, None]
    return lp.detach(), G @ w.double(), G.t() @ h.double()

x, y = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
lp = triton_logprobs(x, y, ids, T, tf32=True)
d_h, d_w = torch.autograd.grad(lp, [x, y], g.float())
want = reference(h_r, w_r)  # rounded operands: what a TF32 dot that rounds computes
plain = reference(h, w)  # unrounded: what the interpreter computes when the kernel does not round
z = (h_r.double() @ w_r.double().t()) / T
tol = 16 * 2**-24 * (z.abs().max().item() + math.log(V))  # float32 softmax, exp, log: ulps
gap = (plain[0] - want[0]).abs().max().item()
assert gap > 10 * tol, (gap, tol)  # the two answers are far apart at this tolerance
err = (lp.double() - want[0]).abs().max().item()
assert err <= tol, f"log-probs {err:.3g} from the rounded operands' (tolerance {tol:.3g}; "\\
    f"unrounded operands: {gap:.3g})"
for name, got, ref, other in (("d_hidden", d_h, want[1], plain[1]),
                              ("d_weight", d_w, want[2], plain[2])):
    rel = ((got.double() - ref).norm() / ref.norm()).item()
    rel_plain = ((other - ref).norm() / ref.norm()).item()
    assert rel_plain > 1e-4 and rel <= 1e-5, (name, rel, rel_plain)
print("OK")
"""


def test_triton_tf32_rounds_its_operands_interpreted():
    """With `tf32=True` the kernels round float32 operands to the nearest TF32 value before
    `tl.dot` (the tensor cores truncate what they are given; cuBLAS, the sampler's head, rounds).
    The interpreter computes `tl.dot` in plain float32, so its log-probs must equal the float64
    log-softmax of the *rounded* operands (operands chosen so that float32 sums them exactly),
    and the backward's G must come from those logits; without the rounding they differ by more
    than 10x the float32 tolerance."""
    run_interpreted(_INTERPRETED_TF32_ROUNDING)


def test_round_to_tf32_is_round_to_nearest():
    """`round_to_tf32` (the kernels' rounding, in torch): nearest TF32 value, ties away from
    zero, checked against float64 arithmetic on hand-picked and random values."""
    x = torch.tensor(
        [
            1.0,
            1 + 2**-11,
            1 + 2**-12,
            1 + 3 * 2**-12,
            -(1 + 2**-11),
            2**-130,
            float("inf"),
            -float("inf"),
            3.4028235e38,
        ]
    )
    want = [
        1.0,
        1 + 2**-10,
        1.0,
        1 + 2**-10,
        -(1 + 2**-10),
        2**-130,
        float("inf"),
        -float("inf"),
        float("inf"),
    ]
    assert grpo_kernels.round_to_tf32(x).tolist() == want
    assert grpo_kernels.round_to_tf32(torch.tensor([float("nan")])).isnan().all()
    r = torch.randn(10000, generator=torch.Generator().manual_seed(0)) * 1e3
    got = grpo_kernels.round_to_tf32(r).double()
    e = torch.floor(torch.log2(r.double().abs()))
    ulp = torch.exp2(e - 10)
    exact = r.double() / ulp  # the value in TF32 ulps: round half away from zero
    want = torch.sign(exact) * torch.floor(exact.abs() + 0.5) * ulp
    assert torch.equal(got, want)


# ---------------------------------------------------------------- CUDA (Triton, TF32)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("mode", ["tf32", "bf16"])
@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_cuda_head_precision_against_float64(mode, lora):
    """On CUDA the trainer's head runs the Triton kernels (TF32 dots for tf32, bf16 tensor
    cores for bf16): log-probs within 1.5x (gradients 2x) the same-precision torch reference's
    error against float64, sampler = trainer within the bf16 budget, and tf32 really is not
    IEEE float32 (the flag reached the kernel). Not run on the CPU-only dev machine."""
    hidden, head, ids, grad = lora_head(n=300, c=512, v=32003, lora=lora)
    head, hidden, ids, grad = head.cuda(), hidden.cuda(), ids.cuda(), grad.cuda()
    t = 0.7
    x = hidden.clone().requires_grad_(True)
    leaves = [x, head.lora_a, head.lora_b] if lora else [x]
    trainer = head_logprobs(head, x, ids, t, "triton", head_precision=mode)
    ours = [trainer, *torch.autograd.grad(trainer, leaves, grad)]
    with torch.no_grad():
        sampler = logprobs_of(head_logits(head, hidden, mode), ids, t)
        exact = head_logprobs(head, hidden, ids, t, "triton")  # IEEE float32

    def formula(leaves, dtype, tf32):  # the LoRA formula in torch, operands in `dtype`
        x, *ab = leaves
        with grpo_kernels.tf32_matmuls(x.device, tf32):  # forward and backward
            z = (x.to(dtype) @ head.weight.detach().to(dtype).t()).double()
            if ab:
                z = z + 0.5 * ((x.to(dtype) @ ab[0].to(dtype).t()) @ ab[1].to(dtype).t()).double()
            lp = torch.log_softmax(z / t, -1).gather(1, ids[:, None])[:, 0]
            return [lp, *torch.autograd.grad(lp, leaves, grad.double())]

    gold = formula([a.detach().double().requires_grad_(True) for a in leaves], torch.float64, False)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    ref = formula([a.detach().clone().requires_grad_(True) for a in leaves], dtype, True)
    # log-probs: 1.5x torch's error; gradients: 2x, the Triton rule of tests/test_kernels.py
    # (G is stored in the input dtype between the kernel and the GEMMs)
    for i, (got, r, exp) in enumerate(zip(ours, ref, gold)):
        factor = 1.5 if i == 0 else 2.0
        assert rel_err(got, exp) <= factor * rel_err(r, exp) + 1e-6, (
            i,
            rel_err(got, exp),
            rel_err(r, exp),
        )
    assert (sampler - trainer.double()).abs().max() <= BF16_GAP[False][0]
    assert (trainer - exact).abs().max() > 0  # TF32 / bf16 ran, not IEEE float32
