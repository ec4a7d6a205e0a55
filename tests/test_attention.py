"""Attention arranged for CUDA's fused SDPA kernels (`grpo.models.decoder.attention`) equals a
float64 attention written out, on every path that reaches it: no padding (is_causal, no mask),
a left-padded batch, KV-cache chunks at an offset, the static cache of the compiled decode step
and the shared-prefix training forward; under bf16 autocast it stays within the error of the
previous arrangement (mask + enable_gqa). Gradient checkpointing of the shared-prefix passes
gives the same gradients and keeps less for backward. On CUDA the training forward and a padded
prefill run on kernels that SDPA's selector calls fused (flash, memory-efficient or cuDNN; never
the math fallback)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import live_lora

from grpo.algo import logprobs as logprobs_mod
from grpo.algo.logprobs import shared_prefix_hidden
from grpo.models import KVCache, load_model, sdpa_choice
from grpo.models import decoder as decoder_mod
from grpo.models.decoder import (
    attention,
    decode_attention,
    decode_sdpa,
    decode_step_attention,
    rotate_half,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

P, G, W, T_C = 2, 2, 9, 8  # prompts, group size, prompt width T_p, completion width T_c
PROMPT_LENS, COMPLETION_LENS = (9, 4), (8, 5, 8, 1)  # rows 0-1 share prompt 0, rows 2-3 prompt 1


def grouped_batch(V: int = 256, seed: int = 0):
    """(B, T_p + T_c) ids of B = P*G rows and their bool attention mask: left-padded prompts
    of lengths 9 and 4 (T_p = 9), each repeated to its group's G rows, then right-padded
    completions of lengths 8, 5, 8, 1 (T = 17)."""
    g = torch.Generator().manual_seed(seed)
    B = P * G
    ids = torch.randint(4, V, (B, W + T_C), generator=g)
    mask = torch.zeros(B, W + T_C, dtype=torch.bool)
    for p, n in enumerate(PROMPT_LENS):
        rows = slice(p * G, p * G + G)
        ids[rows, :W] = ids[p * G, :W]  # one prompt per group
        mask[rows, W - n : W] = True
    for b, n in enumerate(COMPLETION_LENS):
        mask[b, W : W + n] = True
    return ids.masked_fill(~mask, 0), mask


def naive_hidden(ref, ids, attention_mask):
    """Final-norm hidden states (B, T, C) of whole rows through `ref` (a float64 copy of the
    decoder), attention written out: positions counted over the mask, softmax(q k^T / sqrt(D))
    over earlier real keys (and the query's own), kv heads repeated to the query heads."""
    B, T = ids.shape
    real = attention_mask.bool()
    pos = (real.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
    freqs = pos[..., None].double() * ref.inv_freq.double()  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, D)
    cos, sin = emb.cos(), emb.sin()
    i = torch.arange(T)
    keep = ((i[None, :] <= i[:, None])[None] & real[:, None, :]) | torch.eye(T, dtype=torch.bool)
    x = ref.embed_tokens(ids)  # (B, T, C)
    for block in ref.layers:
        a = block.self_attn
        h = block.input_layernorm(x)
        q = a.q_proj(h).view(B, T, a.H, a.D)
        k = a.k_proj(h).view(B, T, a.H_kv, a.D)
        v = a.v_proj(h).view(B, T, a.H_kv, a.D)
        if a.q_norm is not None:
            q, k = a.q_norm(q), a.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(a.H // a.H_kv, dim=1)  # (B, H, T, D)
        v = v.repeat_interleave(a.H // a.H_kv, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(a.D)  # (B, H, T, T)
        y = scores.masked_fill(~keep[:, None], float("-inf")).softmax(-1) @ v
        x = x + a.o_proj(y.transpose(1, 2).reshape(B, T, a.H * a.D))
        x = x + block.mlp(block.post_attention_layernorm(x))
    return ref.norm(x)


def old_attention(q, k, v, mask):
    """The arrangement before: one SDPA call with an additive mask and enable_gqa (the
    same-dtype torch reference of the bf16 budget)."""
    if mask is None:
        T, S = q.shape[2], k.shape[2]
        causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
        mask = torch.zeros(T, S, dtype=q.dtype, device=q.device).masked_fill(~causal, -math.inf)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
    )


# --------------------------------------------------------------------------- the paths


def cache_for(model, rows: int, max_len: int, static: bool = False) -> KVCache:
    """A cache in the dtype attention reads (autocast's when on: `Precision.kv_dtype`)."""
    dtype = decoder_mod.compute_dtype(model.embed_tokens.weight)
    return KVCache.for_model(model, rows=rows, max_len=max_len, static=static, dtype=dtype)


def run_plain(model, ids, mask):
    return model(ids, return_hidden=True)  # attention_mask None: is_causal, no mask


def run_padded(model, ids, mask):
    return model(ids, attention_mask=mask, return_hidden=True)


def run_cache(model, ids, mask):
    """Prefill 9 columns, then the other 8 as one chunk at offset 9 (T = 8 queries over S =
    17 keys: the sampler's multi-turn observation chunk)."""
    cache = cache_for(model, rows=ids.shape[0], max_len=ids.shape[1])
    first = model(ids[:, :9], attention_mask=mask, kv_cache=cache, return_hidden=True)
    second = model(ids[:, 9:], attention_mask=mask, kv_cache=cache, return_hidden=True)
    return torch.cat([first, second], dim=1)


def run_static(model, ids, mask):
    """The compiled sampler's cache (eagerly): 20 slots (not a multiple of 8), keys over all of
    them; prefill 9 columns, a 3-token chunk, then one token at a time (the decode step)."""
    B, T = ids.shape
    cache = cache_for(model, rows=B, max_len=20, static=True)
    slots = torch.cat([mask, torch.ones(B, 20 - T, dtype=torch.bool)], dim=1)  # open ahead
    outs, start = [], 0
    for width in [9, 3] + [1] * (T - 12):
        chunk = ids[:, start : start + width]
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, start : start + width]
        outs.append(
            model(chunk, position_ids=pos, attention_mask=slots, kv_cache=cache, return_hidden=True)
        )
        start += width
    return torch.cat(outs, dim=1)


def run_shared(model, ids, mask):
    return shared_prefix_hidden(model, ids, mask, W, G)  # (B, 1 + T_c, C): positions W-1 ...


PATHS = {
    "plain": run_plain,
    "padded": run_padded,
    "cache": run_cache,
    "static": run_static,
    "shared": run_shared,
}


def path_case(name, model, autocast: bool = False):
    """(hidden of path `name` [under bf16 autocast], the float64 reference's hidden, bool
    (B, T') positions to compare: the real tokens)."""
    ids, mask = grouped_batch()
    if name == "plain":
        ids, mask = ids[:2].clamp(min=4), torch.ones(2, ids.shape[1], dtype=torch.bool)
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        want = naive_hidden(ref, ids, mask)
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            got = PATHS[name](model, ids, mask)
    if name == "shared":
        want, mask = want[:, W - 1 :], mask[:, W - 1 :]
    return got, want, mask


def max_err(got, want, mask):
    return (got.double() - want)[mask].abs().max().item()


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_paths_match_float64_attention(tiny_checkpoints, path, family):
    model = load_model(tiny_checkpoints(family)).eval()
    got, want, mask = path_case(path, model)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert max_err(got, want, mask) <= 1e-5


@pytest.mark.parametrize("path", list(PATHS))
def test_paths_under_bf16_autocast_within_budget(tiny_checkpoints, path, monkeypatch):
    """bf16 autocast with float32 weights (q, k, v arrive in mixed dtypes): the error against
    float64 is at most 2x that of the previous arrangement under the same autocast."""
    model = load_model(tiny_checkpoints("qwen3")).eval()
    ours, want, mask = path_case(path, model, autocast=True)
    monkeypatch.setattr(decoder_mod, "attention", old_attention)
    before, _, _ = path_case(path, model, autocast=True)
    err, err_before = max_err(ours, want, mask), max_err(before, want, mask)
    assert torch.isfinite(ours[mask]).all()
    assert 0 < err <= 2 * err_before, (err, err_before)


def test_mask_only_where_needed(tiny_checkpoints, monkeypatch):
    """No mask without padding or offset (flash can run); otherwise one mask, built once per
    forward in the attention dtype, its rows 8-element aligned (no copy per layer in
    memory-efficient attention's `preprocess_mask`)."""
    seen = []

    def spy(q, k, v, mask):
        seen.append(mask)
        return attention(q, k, v, mask)

    monkeypatch.setattr(decoder_mod, "attention", spy)
    model = load_model(tiny_checkpoints("qwen3")).eval()
    ids, mask = grouped_batch()
    with torch.no_grad():
        model(ids)
        assert len(seen) == 2 and all(m is None for m in seen)  # one call per layer
        seen.clear()
        model(ids, attention_mask=mask)
        assert seen[0] is seen[1] and seen[0].shape == (4, 1, 17, 17)
        assert seen[0].dtype == torch.float32 and seen[0].stride(2) % 8 == 0
        seen.clear()
        with torch.autocast("cpu", torch.bfloat16):
            model(ids, attention_mask=mask)
        assert seen[0].dtype == torch.bfloat16


@pytest.mark.parametrize("arrangement", [sdpa_choice.GROUPED, sdpa_choice.REPEAT])
@pytest.mark.parametrize("H_kv", [1, 2, 4])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_function_matches_float64(H_kv, masked, arrangement):
    """`attention` on its own, forward and input gradients: causal (S = T) or masked (S = T + 5
    keys, random padding; every query keeps its own key), GQA or not, float32; with the KV
    heads repeated (memory-efficient attention's arrangement) and grouped."""
    g = torch.Generator().manual_seed(H_kv)
    B, H, T, D = 2, 4, 17, 16
    S = T + 5 if masked else T
    q = torch.randn(B, H, T, D, generator=g, requires_grad=True)
    k = torch.randn(B, H_kv, S, D, generator=g, requires_grad=True)
    v = torch.randn(B, H_kv, S, D, generator=g, requires_grad=True)
    q_pos = torch.arange(S - T, S)
    keep = (torch.arange(S)[None, :] <= q_pos[:, None])[None].expand(B, T, S)  # (B, T, S)
    if masked:
        keep = keep & (torch.rand(B, 1, S, generator=g) > 0.3)
        keep = keep | (torch.arange(S)[None, :] == q_pos[:, None])
    mask = torch.zeros(B, 1, T, S).masked_fill(~keep[:, None], float("-inf")) if masked else None
    w = torch.randn(B, H, T, D, generator=g)
    with sdpa_choice.forced(queries=arrangement):
        y = attention(q, k, v, mask)
    (y * w).sum().backward()
    grads = [t.grad for t in (q, k, v)]

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    r = H // H_kv
    scores = q64 @ k64.repeat_interleave(r, 1).transpose(-1, -2) / math.sqrt(D)
    y64 = scores.masked_fill(~keep[:, None], float("-inf")).softmax(-1)
    y64 = y64 @ v64.repeat_interleave(r, 1)
    (y64 * w.double()).sum().backward()
    assert (y.double() - y64).abs().max().item() <= 1e-5
    for got, t in zip(grads, (q64, k64, v64)):
        assert (got.double() - t.grad).abs().max().item() <= 1e-5


def test_padded_training_gradients_match_float64(tiny_checkpoints):
    """The training forward (left padding, mask path) backpropagates what float64 does."""
    model = load_model(tiny_checkpoints("qwen3")).train()
    ref = copy.deepcopy(model).double()
    ids, mask = grouped_batch()
    weights = (
        torch.randn(
            *ids.shape, model.config.hidden_size, generator=torch.Generator().manual_seed(1)
        )
        * mask[..., None]
    )
    (model(ids, attention_mask=mask, return_hidden=True) * weights).sum().backward()
    (naive_hidden(ref, ids, mask) * weights.double()).sum().backward()
    for (n, p), p64 in zip(model.named_parameters(), ref.parameters()):
        scale = p64.grad.abs().max().clamp(min=1e-12)
        assert ((p.grad.double() - p64.grad).abs().max() / scale).item() <= 1e-5, n


# --------------------------------------------------------------------------- checkpointing


def hidden_grads(model, ids, mask, shared: bool, checkpointed: bool):
    """Gradients of a fixed linear function of the hidden states at positions T_p - 1 ..."""
    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing = checkpointed
    if shared:
        hidden = shared_prefix_hidden(model, ids, mask, W, G)
    else:
        hidden = model(ids, attention_mask=mask, return_hidden=True)[:, W - 1 :]
    weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(2))
    (hidden * weights * mask[:, W - 1 :, None]).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True])
def test_checkpointed_shared_prefix_gradients_equal(tiny_checkpoints, lora):
    """Shared prefix checkpointed == shared prefix not checkpointed == full rows (1e-5
    relative): the recompute reads the same prefix keys/values."""
    model = load_model(tiny_checkpoints("qwen3"))
    if lora:
        live_lora(model, ["q_proj", "k_proj", "v_proj", "down_proj"], std=0.05, seed=0)
    model.train()
    ids, mask = grouped_batch()
    full = hidden_grads(model, ids, mask, shared=False, checkpointed=False)
    assert full
    for checkpointed in (False, True):
        shared = hidden_grads(model, ids, mask, shared=True, checkpointed=checkpointed)
        assert shared.keys() == full.keys()
        for n in full:
            scale = full[n].abs().max().clamp(min=1e-12)
            assert ((shared[n] - full[n]).abs().max() / scale).item() <= 1e-5, (checkpointed, n)


def saved_for_backward(fn, params):
    """(fn's output, {storage: bytes} of what autograd keeps for backward, parameters left
    out). Checkpointed blocks keep their inputs (counted: checkpoint saves them through the
    same hooks) instead of their insides (recomputed; not counted)."""
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, kept


def test_checkpointed_shared_prefix_keeps_less(tiny_checkpoints, monkeypatch):
    """Bytes kept from forward to backward by the shared-prefix passes, checkpointed vs not,
    on longer rows (P=2, G=4, T_p=48, T_c=64). Checkpointed, the prompts' per-layer keys and
    values are also kept, by reference (the completion pass's cache), not through the hooks:
    they are added."""
    records = []

    class SpyRecord(logprobs_mod._RecordKV):
        def __init__(self, num_layers):
            super().__init__(num_layers)
            records.append(self)

    monkeypatch.setattr(logprobs_mod, "_RecordKV", SpyRecord)
    model = load_model(tiny_checkpoints("qwen3")).train()
    params = list(model.parameters())
    P_, G_, T_p, T_c = 2, 4, 48, 64
    ids = torch.randint(4, 256, (P_ * G_, T_p + T_c), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(P_ * G_, T_p + T_c, dtype=torch.bool)
    mask[G_:, :10] = False  # the second group's prompt is left-padded
    kept = {}
    for checkpointed in (False, True):
        model.gradient_checkpointing = checkpointed
        out, storages = saved_for_backward(
            lambda: shared_prefix_hidden(model, ids, mask, T_p, G_), params
        )
        if checkpointed:  # + the prompts' keys and values, held by the completion pass's cache
            prefix = {
                t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in records[-1].k + records[-1].v
            }
            assert sum(prefix.values()) == 2 * 2 * P_ * 2 * T_p * 16 * 4  # L,k|v,P,H_kv,T_p,D,fp32
            storages = storages | prefix
        kept[checkpointed] = sum(storages.values())
        out.square().sum().backward()  # the checkpointed graph still backpropagates
    assert kept[True] < kept[False] / 4, kept


# --------------------------------------------------------------------------- CUDA

HEADS = [(4, 2, 16), (16, 8, 128)]  # (H, H_kv, D): the tiny fixture, Qwen3-0.6B's attention


def check_fused_kernels_only(tiny_checkpoints, device, precision, heads):
    """Training forward + backward (no padding, left padding, shared prefix, checkpointed
    shared prefix) and a padded prefill into a KV cache: SDPA's selector puts every call the
    decoder makes on a fused kernel (flash, memory-efficient or cuDNN), never the math
    fallback. float32 also equals the math kernel's result to 1e-5 (TF32 is off by default)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels_used = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        kernels_used.append(sdpa_choice.sdpa_backend(*args, **kwargs))
        return sdpa(*args, **kwargs)

    H, H_kv, D = heads
    path = tiny_checkpoints("qwen3", num_attention_heads=H, num_key_value_heads=H_kv, head_dim=D)
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    model = load_model(path, dtype=dtype, device=device).train()
    ids, mask = (t.to(device) for t in grouped_batch())
    autocast = torch.autocast(device, torch.bfloat16, enabled=precision == "bf16-autocast")

    def run_all():
        model.zero_grad(set_to_none=True)
        outs = [
            model(ids, return_hidden=True),
            model(ids, attention_mask=mask, return_hidden=True),
            shared_prefix_hidden(model, ids, mask, W, G),
        ]
        model.gradient_checkpointing = True
        outs.append(shared_prefix_hidden(model, ids, mask, W, G))
        model.gradient_checkpointing = False
        sum(o.float().square().mean() for o in outs).backward()
        with torch.no_grad():
            cache = cache_for(model, rows=4, max_len=24)
            outs.append(model(ids, attention_mask=mask, kv_cache=cache, return_hidden=True))
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return [o.detach() for o in outs], grads

    F.scaled_dot_product_attention = spy
    try:
        with autocast:
            fused, fused_grads = run_all()
    finally:
        F.scaled_dot_product_attention = sdpa
    assert kernels_used and all(k in sdpa_choice.FUSED for k in kernels_used), kernels_used
    assert all(torch.isfinite(o).all() for o in fused) and fused_grads
    if precision == "float32":
        with sdpa_kernel([SDPBackend.MATH]):
            math_outs, math_grads = run_all()
        for a, b in zip(fused, math_outs):
            assert (a - b).abs().max().item() <= 1e-5
        for a, b in zip(fused_grads, math_grads):
            assert ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item() <= 1e-5


def cuda_fused_eligible(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **_):
    """Whether CUDA's flash or memory-efficient SDPA kernel takes this call (the constraints
    of aten/src/ATen/native/transformers/cuda/sdp_utils.cpp that the decoder can hit): flash
    takes no mask, 16-bit only, GQA allowed, is_causal only for T == S; memory-efficient takes
    float32 too and any mask of q's dtype, but no GQA. A mask whose strides are not multiples
    of 8 is copied per call (`preprocess_mask`), which the decoder avoids."""
    gqa = q.shape[1] != k.shape[1]
    flash = (
        attn_mask is None
        and q.dtype in (torch.float16, torch.bfloat16)
        and (not is_causal or q.shape[2] == k.shape[2])
        and (enable_gqa or not gqa)
    )
    aligned = attn_mask is None or (
        attn_mask.dtype == q.dtype
        and attn_mask.stride(-1) == 1
        and all(s % 8 == 0 for s in attn_mask.stride()[:-1])
    )
    efficient = not gqa and aligned and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    return q.dtype == k.dtype == v.dtype and q.shape[-1] % 8 == 0 and (flash or efficient)


def flash_or_efficient_selector(
    q, k, v, mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False
):
    """SDPA's selector as a CUDA build without cuDNN attention answers (`cuda_fused_eligible`'s
    rules): flash where it takes the call, else memory-efficient, else the math kernel."""
    from torch.nn.attention import SDPBackend

    kw = dict(attn_mask=mask, is_causal=is_causal, enable_gqa=enable_gqa)
    if not cuda_fused_eligible(q, k, v, **kw):
        return SDPBackend.MATH
    if mask is None and q.dtype != torch.float32 and (enable_gqa or q.shape[1] == k.shape[1]):
        return SDPBackend.FLASH_ATTENTION
    return SDPBackend.EFFICIENT_ATTENTION


@pytest.mark.parametrize("precision", ["float32", "bf16-autocast", "bfloat16"])
def test_every_sdpa_call_fits_a_fused_cuda_kernel(tiny_checkpoints, precision, monkeypatch):
    """On CPU, with SDPA's selector answering as a CUDA build with flash and memory-efficient
    attention only: every SDPA call of the training forward (no padding, left padding, shared
    prefix), a cache chunk at an offset and a static-cache prefill, and every decode step, meets
    those kernels' CUDA constraints (`cuda_fused_eligible`)."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(cuda_fused_eligible(*args, **kwargs))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    # a selector that knows flash and memory-efficient attention only (no cuDNN), and a decode
    # step that asks it as CUDA's does
    monkeypatch.setattr(sdpa_choice, "sdpa_backend", flash_or_efficient_selector)
    monkeypatch.setattr(sdpa_choice, "MATMUL_DECODE", frozenset())
    sdpa_choice.clear()
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    model = load_model(tiny_checkpoints("qwen3"), dtype=dtype).train()
    ids, mask = grouped_batch()
    with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-autocast"):
        for path in PATHS.values():
            path(model, ids, mask)
    assert len(calls) >= 12 + 5 * 2 and all(calls), calls  # the static path's 5 decode steps


def decode_case(dtype, heads=(16, 8, 128), B=6, S=40, seed=0):
    """One decode step's q (B, H, 1, D), k, v (B, H_kv, S, D) and an additive padding mask
    (B, 1, 1, S) with row strides of a multiple of 8 (as the decoder builds it)."""
    H, H_kv, D = heads
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, 1, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H_kv, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    keep = torch.rand(B, S, generator=g) > 0.3
    keep[:, -1] = True
    mask = torch.zeros(B, 1, 1, -(-S // 8) * 8, dtype=dtype)[..., :S]
    mask.masked_fill_(~keep[:, None, None], float("-inf"))
    return q, k, v, mask


def test_decode_sdpa_is_decode_attention_float64():
    """The CUDA decode step's attention (`decode_sdpa`: the query heads of a kv head as its
    queries) computes what `decode_attention` does, grouped-query heads included."""
    for heads in [(16, 8, 128), (4, 2, 16), (4, 4, 16)]:
        q, k, v, mask = decode_case(torch.float64, heads)
        want = decode_attention(q, k, v, mask)
        torch.testing.assert_close(decode_sdpa(q, k, v, mask), want, rtol=0, atol=1e-12)


def test_decode_sdpa_under_bf16_is_within_decode_attentions_error():
    """bf16 keys, values, queries and mask (the compiled CUDA step under autocast): against
    float64 math the fused path's mean error is within 10% of `decode_attention`'s."""
    q, k, v, mask64 = decode_case(torch.float64)
    want = decode_attention(q, k, v, mask64)
    _, _, _, mask = decode_case(torch.bfloat16)
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    err_fused = (decode_sdpa(qb, kb, vb, mask).double() - want).abs().mean()
    err_plain = (decode_attention(qb, kb, vb, mask).double() - want).abs().mean()
    assert err_fused <= 1.1 * err_plain, (err_fused, err_plain)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_decode_step_runs_a_fused_kernel(dtype):
    """At the Qwen3-0.6B heads, the decode step's attention gets an SDPA arrangement whose
    kernel SDPA's selector makes a fused one (cuDNN included), not two matmuls nor the math
    fallback, and equals float64 math."""
    q, k, v, mask = decode_case(dtype, B=16, S=256)
    want = decode_attention(q, k, v, decode_case(torch.float64, B=16, S=256)[3])
    cuda = [t.to("cuda", dtype) for t in (q, k, v)] + [mask.cuda()]
    heads = (16, 8, 128)
    arrangement = sdpa_choice.choose("decode", cuda[0].device, dtype, heads)
    backend = sdpa_choice.chosen_backend("decode", cuda[0].device, dtype, heads)
    assert arrangement != sdpa_choice.MATMUL and backend in sdpa_choice.FUSED, (
        arrangement,
        backend,
    )
    got = decode_step_attention(*cuda)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.double().cpu() - want).abs().max().item() <= tol


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("precision", ["float32", "bf16-autocast", "bfloat16"])
def test_cuda_runs_fused_kernels_only(tiny_checkpoints, precision, heads):
    check_fused_kernels_only(tiny_checkpoints, "cuda", precision, heads)


@pytest.mark.parametrize("precision", ["float32", "bf16-autocast"])
def test_fused_kernels_check_runs_on_cpu(tiny_checkpoints, precision):
    """The CUDA check's own code, on CPU (whose flash kernel takes every case: this proves
    nothing about CUDA's kernels, only that the check runs and float32 matches math)."""
    check_fused_kernels_only(tiny_checkpoints, "cpu", precision, HEADS[0])
