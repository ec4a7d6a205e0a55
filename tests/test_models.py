"""Decoder parity with `transformers`, checkpoint round trips, KV cache vs full recompute."""

from __future__ import annotations

import json

import pytest
import torch

from grpo.errors import GrpoError
from grpo.models import Decoder, KVCache, ModelConfig, load_model, save_pretrained

FAMILIES = ["qwen3", "qwen2", "llama"]


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()


def left_padded_batch(V: int, lengths=(17, 9, 1), seed=0):
    """(B, T) ids with rows left-padded to the longest, and the bool attention mask."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(0, V, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, T - n :] = True
        ids[b, : T - n] = 0
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("vocab", [256, 257])
def test_logits_match_transformers(tiny_checkpoints, family, vocab):
    path = tiny_checkpoints(family, vocab_size=vocab)
    ours, ref = load_model(path), hf_model(path)
    ids, mask = left_padded_batch(vocab)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask)
        want = ref(input_ids=ids, attention_mask=mask.long()).logits
    assert got.shape == (3, 17, vocab)
    # Compare real tokens only: padded positions are masked garbage in both.
    assert (got - want)[mask].abs().max().item() <= 1e-5
    # An unpadded single row too (no mask at all).
    with torch.no_grad():
        got1 = ours(ids[:1])
        want1 = ref(input_ids=ids[:1]).logits
    assert (got1 - want1).abs().max().item() <= 1e-5


def test_llama3_rope_scaling_and_untied_match(tiny_checkpoints):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    path = tiny_checkpoints("llama", rope_scaling=scaling, rope_theta=500000.0, tie=False)
    ours, ref = load_model(path), hf_model(path)
    assert not ours.config.tie_word_embeddings and ours.config.rope_scaling is not None
    ids, mask = left_padded_batch(256, lengths=(40, 33))
    with torch.no_grad():
        diff = ours(ids, attention_mask=mask) - ref(input_ids=ids, attention_mask=mask).logits
    assert diff[mask].abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_round_trip(tiny_checkpoints, tmp_path, family):
    path = tiny_checkpoints(family)
    ours = load_model(path)
    save_pretrained(ours, tmp_path / "out")
    original, round_trip = hf_model(path), hf_model(tmp_path / "out")
    ids, mask = left_padded_batch(256)
    with torch.no_grad():
        want = original(input_ids=ids, attention_mask=mask).logits
        got = round_trip(input_ids=ids, attention_mask=mask).logits
        ours_logits = ours(ids, attention_mask=mask)
    assert torch.equal(got, want)  # the same weights, bit for bit
    assert (ours_logits - got)[mask].abs().max().item() <= 1e-5


def test_sharded_checkpoint_loads(tiny_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_checkpoints("qwen3")
    ref = AutoModelForCausalLM.from_pretrained(str(src))
    ref.save_pretrained(str(tmp_path), max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_model(tmp_path)
    ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        diff = ours(ids) - ref(input_ids=ids).logits
    assert diff.abs().max().item() <= 1e-5


def test_return_hidden_times_lm_head_is_logits(tiny_checkpoints):
    model = load_model(tiny_checkpoints("qwen3"))
    ids = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        hidden = model(ids, return_hidden=True)
        assert hidden.shape == (2, 7, 64)
        torch.testing.assert_close(model.lm_head(hidden), model(ids), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_kv_cache_decode_equals_full_recompute(tiny_checkpoints, family):
    model = load_model(tiny_checkpoints(family))
    ids, mask = left_padded_batch(256, lengths=(12, 5))
    new = torch.randint(0, 256, (2, 6))
    full_ids = torch.cat([ids, new], 1)
    full_mask = torch.cat([mask, torch.ones(2, 6, dtype=torch.bool)], 1)
    cache = KVCache.for_model(model, rows=2, max_len=32)
    kv_mask = torch.zeros(2, 32, dtype=torch.bool)
    kv_mask[:, :18] = full_mask
    with torch.no_grad():
        want = model(full_ids, attention_mask=full_mask)
        steps = [model(ids, attention_mask=kv_mask, kv_cache=cache)]
        for t in range(6):  # one token at a time
            steps.append(model(new[:, t : t + 1], attention_mask=kv_mask, kv_cache=cache))
    got = torch.cat(steps, 1)
    assert cache.pos == 18
    assert (got - want)[full_mask].abs().max().item() <= 1e-5


def test_kv_cache_repeat_rows_and_overflow():
    cache = KVCache(num_layers=1, rows=2, num_kv_heads=1, max_len=4, head_dim=2)
    k = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)
    cache.update(0, k, k)
    cache.advance(3)
    rep = cache.repeat_rows(3)
    assert rep.rows == 6 and rep.pos == 3
    assert torch.equal(rep.k[0, 0], rep.k[0, 2]) and torch.equal(rep.k[0, 3], cache.k[0, 1])
    with pytest.raises(ValueError, match="overflow"):
        cache.update(0, k, k)


def test_unsupported_architecture_error_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(GrpoError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(tmp_path)


def test_missing_model_path_is_clear(tmp_path):
    with pytest.raises(GrpoError, match="not a directory or a hub id"):
        load_model(tmp_path / "nope")


def test_from_hf_reads_qwen3_flags(tiny_checkpoints):
    cfg = ModelConfig.from_hf(tiny_checkpoints("qwen3"))
    assert cfg.family == "qwen3" and cfg.qk_norm and not cfg.attention_bias
    assert ModelConfig.from_hf(tiny_checkpoints("qwen2")).attention_bias


def test_gradient_checkpointing_same_grads():
    cfg = ModelConfig(family="qwen3", qk_norm=True)
    torch.manual_seed(0)
    model = Decoder(cfg)
    model.init_weights(seed=0)
    model.train()
    ids = torch.randint(0, 256, (2, 9))
    model(ids).logsumexp(-1).sum().backward()
    g1 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.gradient_checkpointing = True
    model(ids).logsumexp(-1).sum().backward()
    for a, p in zip(g1, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=0, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_on_cuda(tiny_checkpoints, family):
    # The CPU parity batch (left padding, odd V) on the GPU: attention, RoPE and the masks run
    # CUDA kernels on both sides; float32 (TF32 off, torch's default) stays within 1e-5.
    path = tiny_checkpoints(family, vocab_size=257)
    ours, ref = load_model(path, device="cuda"), hf_model(path).cuda()
    ids, mask = (t.cuda() for t in left_padded_batch(257))
    with torch.no_grad():
        got = ours(ids, attention_mask=mask)
        want = ref(input_ids=ids, attention_mask=mask.long()).logits
        got1, want1 = ours(ids[:1]), ref(input_ids=ids[:1]).logits
    assert got.is_cuda and got.dtype == torch.float32 and got.shape == (3, 17, 257)
    assert (got - want)[mask].abs().max().item() <= 1e-5
    assert (got1 - want1).abs().max().item() <= 1e-5


def test_meta_decoder_builds_the_modules_without_running_an_initializer(tiny_checkpoints):
    """`meta_decoder` (what load_model fills): the Decoder's parameters and rotary table,
    shapes only; loading a model runs no meta-tensor kernel, so a fresh process that only
    loads (eval, serve, merge) never imports torch._dynamo (over a second of a cold start)."""
    import subprocess
    import sys

    from grpo.models.decoder import meta_decoder, rope_inv_freq

    path = tiny_checkpoints("qwen3")
    cfg = ModelConfig.from_hf(path)
    meta = meta_decoder(cfg)
    want = {n: p.shape for n, p in Decoder(cfg).named_parameters()}
    assert {n: p.shape for n, p in meta.named_parameters()} == want
    assert all(p.is_meta for p in meta.parameters())
    assert meta.inv_freq.is_meta and meta.inv_freq.shape == rope_inv_freq(cfg).shape
    code = (
        "import sys; from grpo.models import load_model; load_model(sys.argv[1]); "
        "print([m for m in sys.modules if m.startswith('torch._dynamo')][:3])"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"
