"""The sampler's CPU decode paths: prompts held once per group (`GroupedKVCache`) and the
oneDNN-packed weights (`grpo.rollout.onednn_weights`), each against the plain path it replaces."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from grpo.models import load_model
from grpo.models.decoder import decode_attention, grouped_decode_attention
from grpo.models.kv_cache import GroupedKVCache, KVCache
from grpo.precision import Precision, cpu_packing_missing
from grpo.rollout import Sampler, onednn_weights
from grpo.rollout.prompts import left_pad
from tests.conftest import live_lora
from tests.test_sampler import make_prompts

pytestmark = pytest.mark.skipif(
    not onednn_weights.packing_supported(torch.nn.Linear(2, 2)),
    reason="this torch has no oneDNN linear packing",
)


@pytest.mark.parametrize("G,H,H_kv", [(4, 6, 2), (1, 6, 2), (4, 2, 2), (1, 2, 2)])
def test_grouped_attention_equals_attention_over_the_copied_prompt_float64(G, H, H_kv):
    g = torch.Generator().manual_seed(0)
    P, T_p, S_c, D = 3, 7, 5, 8
    B = P * G
    q = torch.randn(B, H, 1, D, generator=g, dtype=torch.float64)
    k_p, v_p = (torch.randn(P, H_kv, T_p, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, H_kv, S_c, D, generator=g, dtype=torch.float64) for _ in range(2))
    keep = torch.rand(B, T_p + S_c, generator=g) > 0.3  # padding anywhere, one slot kept
    keep[:, -1] = True
    mask = torch.zeros(B, 1, 1, T_p + S_c, dtype=torch.float64).masked_fill(
        ~keep[:, None, None], float("-inf")
    )
    want = decode_attention(
        q,
        torch.cat([k_p.repeat_interleave(G, 0), k], 2),
        torch.cat([v_p.repeat_interleave(G, 0), v], 2),
        mask,
    )
    got = grouped_decode_attention(q, k_p, v_p, k, v, mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)  # float64 throughout


def test_grouped_attention_under_bf16_autocast_rounds_as_the_copied_one():
    """bf16 keys/values, float32 queries, Qwen3-0.6B heads (D=128: the 1/sqrt(D) scale is
    not a power of two): against float64 math the grouped attention's mean error stays within
    5% of `decode_attention`'s over the copied cache. Scaling q in bf16 or adding the two
    partial sums in bf16 (one rounding more each) measured 13% over it."""
    g = torch.Generator().manual_seed(0)
    P, G, H, H_kv, T_p, S_c, D = 4, 8, 16, 8, 96, 32, 128
    q = torch.randn(P * G, H, 1, D, generator=g) * 2
    k_p, v_p = (torch.randn(P, H_kv, T_p, D, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(P * G, H_kv, S_c, D, generator=g).bfloat16() for _ in range(2))
    mask = torch.zeros(P * G, 1, 1, T_p + S_c)
    k_all = torch.cat([k_p.repeat_interleave(G, 0), k], 2)
    v_all = torch.cat([v_p.repeat_interleave(G, 0), v], 2)
    want = decode_attention(q.double(), k_all.double(), v_all.double(), mask.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        copied = decode_attention(q, k_all, v_all, mask)
        grouped = grouped_decode_attention(q, k_p, v_p, k, v, mask)
    assert grouped.dtype == copied.dtype == torch.bfloat16
    err_copied = (copied.double() - want).abs().mean()
    err_grouped = (grouped.double() - want).abs().mean()
    assert err_grouped <= 1.05 * err_copied, (err_grouped, err_copied)


def _decode_both(model, G=3, steps=6):
    """Prefill both layouts, then feed both the same tokens; each step's logits, both ways."""
    cfg = model.config
    prompts = make_prompts((9, 4, 1))
    prompt_ids, prompt_lens, kv_mask = left_pad(prompts, 0, steps, cfg, "cpu")
    T_p = prompt_ids.shape[1]
    kv_mask[:, T_p:] = True
    sampler = Sampler(model, pack=False)
    out = []
    with torch.inference_mode():
        for shared in (False, True):
            logits, cache = sampler.prefill(prompt_ids, kv_mask, G, shared=shared)
            assert isinstance(cache, GroupedKVCache if shared else KVCache)
            pos = prompt_lens.repeat_interleave(G)[:, None].clone()
            mask = kv_mask.repeat_interleave(G, 0)
            seq = [logits]
            g = torch.Generator().manual_seed(1)
            for _ in range(steps):
                tok = torch.randint(3, cfg.vocab_size, (pos.shape[0], 1), generator=g)
                seq.append(sampler.decode(tok, pos, mask, cache))
                pos += 1
            out.append(torch.stack(seq))
    return out


@pytest.mark.filterwarnings("ignore:In CPU autocast")  # float64 runs without autocast
def test_shared_prefill_decodes_as_the_copied_cache(tiny_checkpoints):
    model = load_model(tiny_checkpoints("qwen3")).double()  # float64: only the sum order differs
    copied, shared = _decode_both(model)
    torch.testing.assert_close(shared, copied, rtol=0, atol=1e-10)


def test_one_row_per_prompt_decodes_from_the_prefill_cache_itself(tiny_checkpoints):
    # G = 1 (greedy evaluation): nothing to copy, nothing to share (test_sampler checks those
    # rollouts against `generate`)
    cache = KVCache.for_model(load_model(tiny_checkpoints("qwen3")), rows=2, max_len=4)
    assert cache.repeat_rows(1) is cache


def test_sample_shares_the_prompt_and_samples_as_the_copied_layout(tiny_checkpoints, monkeypatch):
    model = load_model(tiny_checkpoints("qwen3", initializer_range=0.2))
    layouts, real = [], Sampler.prefill

    def prefill(self, *a, shared=False, **kw):
        layouts.append(shared)
        return real(self, *a, shared=shared and not force_copy, **kw)

    monkeypatch.setattr(Sampler, "prefill", prefill)
    s = Sampler(model, pack=False)
    force_copy = False
    shared = _sample(s)
    force_copy = True
    copied = _sample(s)
    assert layouts == [True, True]  # G = 3: sample asks for the shared layout
    assert torch.equal(shared.completion_ids, copied.completion_ids)
    torch.testing.assert_close(shared.logprobs, copied.logprobs, rtol=0, atol=1e-5)


def test_grouped_cache_takes_one_token_per_row_and_its_slots_only(tiny_checkpoints):
    model = load_model(tiny_checkpoints("qwen3"))
    prefix = KVCache.for_model(model, rows=2, max_len=5)
    with torch.inference_mode():
        model(torch.ones(2, 5, dtype=torch.long), kv_cache=prefix)
        cache = GroupedKVCache(prefix, group_size=2, new_slots=2)
        assert (cache.rows, cache.max_len, cache.pos) == (4, 7, 5)
        with pytest.raises(ValueError, match="one token per row"):
            model(torch.ones(4, 2, dtype=torch.long), kv_cache=cache)
        for _ in range(2):
            model(torch.ones(4, 1, dtype=torch.long), kv_cache=cache)
        with pytest.raises(ValueError, match="KV cache overflow"):
            model(torch.ones(4, 1, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match="holds 0 of 5"):
        GroupedKVCache(KVCache.for_model(model, rows=2, max_len=5), 2, 1)


@pytest.fixture
def pack_everything(monkeypatch):
    """The tiny models' layers are far below MIN_NUMEL: pack them all. Returns the list of
    packed matmuls run (their row counts), so a test sees the packed path was taken."""
    monkeypatch.setattr(onednn_weights, "MIN_NUMEL", 0)
    calls, real = [], onednn_weights._packed_linear

    def counted(x, packed, bias):
        calls.append(x.shape[0])
        return real(x, packed, bias)

    monkeypatch.setattr(onednn_weights, "_packed_linear", counted)
    return calls


def _sample(sampler, temperature=1.0):
    return sampler.sample(
        make_prompts(),
        group_size=3,
        max_new_tokens=12,
        temperature=temperature,
        stop_ids=[2],
        seed=0,
    )


@pytest.mark.parametrize("lora", [False, True])
def test_packed_sampler_samples_what_the_plain_one_does(tiny_checkpoints, pack_everything, lora):
    model = load_model(tiny_checkpoints("qwen3", initializer_range=0.2))
    if lora:  # live adapters on the attention projections: the base is packed, B A added
        live_lora(model, ["q_proj", "v_proj", "o_proj"])
    plain, packed = Sampler(model, pack=False), Sampler(model, pack=True)
    for temperature in (0.0, 1.0):
        a = _sample(plain, temperature)
        assert not pack_everything  # the plain sampler never touches the packed copies
        b = _sample(packed, temperature)
        assert pack_everything  # ... the packed one does
        pack_everything.clear()
        assert torch.equal(a.completion_ids, b.completion_ids)
        torch.testing.assert_close(b.logprobs, a.logprobs, rtol=0, atol=1e-5)
    n_linear = sum(isinstance(m, torch.nn.Linear) or hasattr(m, "lora_a") for m in model.modules())
    # every layer but the head (tied to the embedding here: packed apart, in float32)
    assert len(packed.packed._packs) == n_linear - 1 and packed.packed._head is not None
    assert not any("forward" in m.__dict__ or "_packed_base" in m.__dict__
                   for m in model.modules())  # fmt: skip  # uninstalled after the call
    # outside a sampler call the model computes with its own weights, through no packed copy
    pack_everything.clear()
    with torch.no_grad():
        model(torch.ones(1, 3, dtype=torch.long))
    assert not pack_everything


def test_packing_leaves_an_overridden_forward_alone(tiny_checkpoints, pack_everything):
    model = load_model(tiny_checkpoints("qwen3"))
    mlp = model.layers[0].mlp.down_proj
    user = mlp.forward = lambda x: torch.nn.functional.linear(x, mlp.weight, mlp.bias)
    _sample(Sampler(model, pack=True))
    assert mlp.__dict__["forward"] is user


def test_packed_weights_follow_in_place_updates(tiny_checkpoints, pack_everything):
    model = load_model(tiny_checkpoints("qwen3", initializer_range=0.2))
    packed = Sampler(model, pack=True)
    before = _sample(packed, 0.0)
    with torch.no_grad():  # an optimizer step writes in place: the packs must notice
        for name, p in model.named_parameters():
            if name.endswith("proj.weight") or name.endswith("embed_tokens.weight"):
                p.mul_(1.5)
    after, want = _sample(packed, 0.0), _sample(Sampler(model, pack=False), 0.0)
    assert not torch.equal(before.completion_ids, want.completion_ids)  # the update mattered
    assert torch.equal(after.completion_ids, want.completion_ids)
    torch.testing.assert_close(after.logprobs, want.logprobs, rtol=0, atol=1e-5)


@pytest.mark.skipif(
    cpu_packing_missing(torch.bfloat16) is not None,
    reason=f"{cpu_packing_missing(torch.bfloat16)} (the plain path is tested by "
    "test_a_cpu_without_bf16_packing_decodes_plainly)",
)
def test_packed_sampler_under_bf16_autocast(tiny_checkpoints, pack_everything):
    """float32 weights, bf16 autocast (the tutorial's configs): the layers are packed in bf16
    and compute what autocast's bf16 matmuls compute; the head stays float32."""
    model = load_model(tiny_checkpoints("qwen3", initializer_range=0.2))
    precision = Precision(torch.float32, torch.bfloat16)
    plain = Sampler(model, pack=False, precision=precision)
    packed = Sampler(model, pack=True, precision=precision)
    a = _sample(plain, 1.0)
    assert not pack_everything
    b = _sample(packed, 1.0)
    assert pack_everything
    assert {p[2].dtype for p in packed.packed._packs.values()} == {torch.bfloat16}
    assert packed.packed._head[2].dtype == torch.float32
    assert torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(b.logprobs, a.logprobs, rtol=0, atol=1e-5)


def test_auto_packs_only_large_layers_on_an_eager_cpu_sampler(tiny_checkpoints):
    model = load_model(tiny_checkpoints("qwen3"))
    sampler = Sampler(model)  # pack=None: on where supported, eager
    assert sampler.packed is not None
    _sample(sampler)
    assert sampler.packed.packed_bytes == 0  # 64 x 128 layers: below MIN_NUMEL, left plain
    assert Sampler(model, compile=True, compile_options={"backend": "eager"}).packed is None


AVX2_ONLY = textwrap.dedent("""
    import sys, torch
    from grpo.errors import GrpoError
    from grpo.models import load_model
    from grpo.precision import Precision, cpu_packing_missing
    from grpo.rollout import Sampler, onednn_weights
    from tests.test_sampler_layouts import _sample
    onednn_weights.MIN_NUMEL = 0  # every layer is large enough to pack, as at the 0.6B width
    model = load_model(sys.argv[1])
    bf16 = Precision(torch.float32, torch.bfloat16)
    print("missing:", cpu_packing_missing(torch.bfloat16))
    print("line:", bf16.describe("cpu"))
    auto = Sampler(model, precision=bf16)  # pack=None: falls back to the plain path
    print("packed:", auto.packed is not None)
    a, b = _sample(auto, 1.0), _sample(Sampler(model, pack=False, precision=bf16), 1.0)
    print("same:", torch.equal(a.completion_ids, b.completion_ids) and
          torch.equal(a.logprobs, b.logprobs))
    print("float32 packed:", Sampler(model).packed is not None)  # float32 packs on any x86-64
    try:
        Sampler(model, pack=True, precision=bf16)
    except GrpoError as e:
        print("pack=True:", e)
""")


def test_a_cpu_without_bf16_packing_decodes_plainly(tiny_checkpoints):
    """An x86-64 CPU without AVX-512 (bw/vl/dq) or avx_ne_convert cannot pack bf16 weights
    (oneDNN raises in `_reorder_linear_weight`); under bf16 autocast the sampler decodes with
    plain matmuls there, and the run's precision line says why. Forced here by capping oneDNN
    at AVX2 (`ONEDNN_MAX_CPU_ISA`, read once per process: hence a subprocess)."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run(
        [sys.executable, "-c", AVX2_ONLY, str(tiny_checkpoints("qwen3", initializer_range=0.2))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    assert "avx512bw, avx512vl and avx512dq, or avx_ne_convert" in lines["missing"]
    assert lines["line"].endswith(f"CPU decode: plain matmuls ({lines['missing']})")
    assert lines["packed"] == "False" and lines["same"] == "True"
    assert lines["float32 packed"] == "True"
    assert "cannot pack" in lines["pack=True"] and "bfloat16" in lines["pack=True"]


def test_the_precision_line_names_the_cpu_decode_path():
    line = Precision(torch.float32, torch.float32).describe("cpu")
    assert line.endswith("CPU decode: oneDNN-packed weights")
    assert "CPU decode" not in Precision().describe() and "CPU" not in Precision().describe("meta")
