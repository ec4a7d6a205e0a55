"""The sampler: greedy parity with `transformers`, cache vs recompute, log-probs vs recompute,
per-row sampling, stop handling, determinism, errors, and the compiled decode step."""

from __future__ import annotations

import pytest
import torch

from grpo.errors import GrpoError
from grpo.models import KVCache, load_model
from grpo.rollout import Rollout, Sampler, sample

# Unequal prompt lengths so that the batch is left-padded (T_p = 13).
PROMPT_LENS = (13, 5, 1, 9)


def make_prompts(lengths=PROMPT_LENS, V=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (n,), generator=g).tolist() for n in lengths]


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoints):
    return load_model(tiny_checkpoints("qwen3"))


def hf_greedy(hf, r: Rollout, max_new_tokens: int, eos: int | None):
    """transformers generate(do_sample=False) on the rollout's left-padded prompts."""
    prompt_mask = r.attention_mask()[:, : r.prompt_width]
    out = hf.generate(
        input_ids=r.prompt_ids,
        attention_mask=prompt_mask.long(),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[:, r.prompt_width :]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_matches_transformers_generate(tiny_checkpoints, family):
    # initializer_range=0.2: peaked logits, so greedy sequences vary instead of repeating.
    path = tiny_checkpoints(family, initializer_range=0.2)
    ours, hf = load_model(path), hf_model(path)
    prompts = make_prompts()
    r = sample(ours, prompts, group_size=1, max_new_tokens=32, temperature=0, stop_ids=[], seed=0)
    assert r.prompt_width == 13 and r.completion_ids.shape == (4, 32)
    assert all(len(set(row)) > 5 for row in r.completion_ids.tolist())  # not a trivial repeat
    assert torch.equal(r.completion_ids, hf_greedy(hf, r, 32, eos=None))
    assert not r.finished.any() and r.completion_lens.tolist() == [32] * 4

    # With a stop id that row 0 emits at step 10: rows stop at their own first stop token and
    # are padded after it, exactly as generate pads finished rows.
    stop = r.completion_ids[0, 10].item()
    rs = sample(
        ours, prompts, group_size=2, max_new_tokens=32, temperature=0, stop_ids=[stop], seed=0
    )
    want = hf_greedy(hf, r, 32, eos=stop)
    got = rs.completion_ids[::2]  # greedy: both rows of a group are identical
    assert torch.equal(rs.completion_ids[1::2], got)
    assert torch.equal(got, want[:, : got.shape[1]])
    assert (want[:, got.shape[1] :] == 0).all()
    first = (r.completion_ids == stop).int().argmax(1)
    assert rs.finished[0] and rs.completion_lens[0] == first[0] + 1


def test_static_cache_decode_equals_full_recompute(qwen3):
    # Left-padded prefill then one token at a time through a static cache (fixed shapes: every
    # step attends over all 32 slots) vs one forward over the whole sequence without a cache.
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :7] = False
    new = torch.randint(0, 256, (2, 6), generator=g)
    full_ids = torch.cat([ids, new], 1)
    full_mask = torch.cat([mask, torch.ones(2, 6, dtype=torch.bool)], 1)
    cache = KVCache.for_model(qwen3, rows=2, max_len=32, static=True)
    kv_mask = torch.zeros(2, 32, dtype=torch.bool)
    kv_mask[:, :18] = full_mask
    with torch.no_grad():
        want = qwen3(full_ids, attention_mask=full_mask)
        steps = [qwen3(ids, attention_mask=kv_mask, kv_cache=cache)]
        for t in range(6):
            steps.append(qwen3(new[:, t : t + 1], attention_mask=kv_mask, kv_cache=cache))
    got = torch.cat(steps, 1)
    assert cache.pos == 18
    assert (got - want)[full_mask].abs().max().item() <= 1e-5
    rep = cache.repeat_rows(3)
    assert rep.static and rep.pos == 18 and rep.rows == 6


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9)])
def test_logprobs_equal_a_fresh_forward(qwen3, temperature, top_k, top_p):
    # Ten stop ids: some rows stop early, others run to the limit.
    r = sample(
        qwen3,
        make_prompts(),
        group_size=3,
        max_new_tokens=24,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop_ids=range(3, 13),
        seed=0,
    )
    assert r.finished.any() and not r.finished.all()
    with torch.no_grad():
        logits = qwen3(r.ids, attention_mask=r.attention_mask())  # (B, T_p + T_c, V)
    T_p = r.prompt_width
    # logits at position t predict token t + 1: completion token j is predicted at T_p - 1 + j
    pred = (logits[:, T_p - 1 : -1].float() / temperature).log_softmax(-1)
    want = pred.gather(-1, r.completion_ids[..., None])[..., 0]  # (B, T_c)
    m = r.completion_mask
    assert (r.logprobs - want)[m].abs().max().item() <= 1e-5
    assert (r.logprobs[~m] == 0).all() and r.logprobs.dtype == torch.float32


def test_same_seed_is_bitwise_identical_and_groups_sample_their_own_first_token(qwen3):
    kw = dict(group_size=8, max_new_tokens=8, stop_ids=[2])
    a = sample(qwen3, make_prompts((6, 3)), seed=7, **kw)
    b = sample(qwen3, make_prompts((6, 3)), seed=7, **kw)
    for field in ("ids", "completion_mask", "completion_lens", "finished", "logprobs"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert not torch.equal(a.ids, sample(qwen3, make_prompts((6, 3)), seed=8, **kw).ids)
    # Row b belongs to prompt b // G: the prompt is repeated within a group ...
    assert (
        torch.equal(a.prompt_ids[0], a.prompt_ids[7])
        and a.prompt_lens.tolist() == [6] * 8 + [3] * 8
    )
    # ... but each row draws its own first token (a broadcast first token makes these equal).
    first = a.completion_ids[:, 0].view(2, 8)
    assert all(len(set(group.tolist())) > 4 for group in first)


def test_stop_rows_stop_and_masks_come_from_lengths(qwen3):
    # pad_id is a stop id (pad == eos): the mask must still count each row's stop token.
    r = sample(
        qwen3,
        make_prompts(),
        group_size=4,
        max_new_tokens=20,
        stop_ids=[0] + list(range(3, 23)),
        seed=3,
        pad_id=0,
    )
    stops = set([0] + list(range(3, 23)))
    B, T_c = r.completion_ids.shape
    assert B == 16 and r.ids.shape == (16, 13 + T_c) and T_c == int(r.completion_lens.max())
    for b in range(B):
        n, row = r.completion_lens[b].item(), r.completion_ids[b].tolist()
        assert r.completion_mask[b].tolist() == [True] * n + [False] * (T_c - n)
        assert not stops & set(row[: n - 1])  # no stop before the last counted token
        if r.finished[b]:
            assert row[n - 1] in stops and row[n:] == [0] * (T_c - n)
        else:
            assert n == 20
    assert r.finished.sum() >= 4 and (~r.finished).sum() >= 1
    # Every token a stop id: all rows stop at their first token and the loop ends at once.
    one = sample(
        qwen3, make_prompts(), group_size=2, max_new_tokens=20, stop_ids=range(256), seed=0
    )
    assert one.completion_ids.shape == (8, 1) and one.finished.all()
    assert one.completion_mask.all() and one.completion_lens.tolist() == [1] * 8


def test_attention_mask_and_decode(tiny_checkpoints, tiny_tokenizer):
    tok = tiny_tokenizer
    model = load_model(tiny_checkpoints("qwen3", vocab_size=len(tok)))
    prompts = [tok.encode("Tom has 3 apples."), tok.encode("Step 1: 3 + 5 = 8\nFinal")]
    stop_ids = [tok.eos_token_id] + list(range(100, 160))
    r = sample(model, prompts, group_size=2, max_new_tokens=12, stop_ids=stop_ids, seed=0)
    mask = r.attention_mask()
    T_p = r.prompt_width
    assert mask.dtype == torch.bool and mask.shape == r.ids.shape
    assert mask[:, :T_p].sum(1).tolist() == r.prompt_lens.tolist()
    assert mask[:, T_p - 1].all() and torch.equal(mask[:, T_p:], r.completion_mask)
    texts = r.decode(tok)
    assert len(texts) == 4 and r.finished.any()
    for b, text in enumerate(texts):
        n = r.completion_lens[b].item() - int(r.finished[b])  # the stop token is not text
        assert text == tok.decode(r.completion_ids[b, :n].tolist())


def test_model_mode_is_restored_and_outputs_can_enter_autograd(qwen3):
    qwen3.train()
    try:
        r = sample(qwen3, make_prompts(), group_size=1, max_new_tokens=3, stop_ids=[], seed=0)
        assert qwen3.training and not r.logprobs.requires_grad
        # sampled under inference_mode, returned as ordinary tensors: a training forward works
        assert not any(t.is_inference() for t in (r.ids, r.completion_mask, r.logprobs))
        qwen3(r.ids, attention_mask=r.attention_mask()).sum().backward()
    finally:
        qwen3.zero_grad(set_to_none=True)
        qwen3.eval()


def test_errors_are_clear(qwen3):
    ok = dict(group_size=2, max_new_tokens=4, stop_ids=[2], seed=0)
    # tiny config: max_position_embeddings = 256
    with pytest.raises(GrpoError, match="max_new_tokens=256 does not fit"):
        sample(qwen3, [[1, 2]], **{**ok, "max_new_tokens": 256})
    with pytest.raises(GrpoError, match="prompt 1 has 250 tokens.*max_position_embeddings=256"):
        sample(qwen3, [[1, 2], [5] * 250], **{**ok, "max_new_tokens": 10})
    with pytest.raises(GrpoError, match="prompt 1 is empty"):
        sample(qwen3, [[1], []], **ok)
    with pytest.raises(GrpoError, match=r"prompt 0 has token ids outside \[0, 256\)"):
        sample(qwen3, [[1, 300]], **ok)
    with pytest.raises(GrpoError, match="non-empty list"):
        sample(qwen3, [], **ok)
    for field, value in [
        ("top_p", 0.0),
        ("top_k", -1),
        ("min_p", 1.5),
        ("temperature", -1.0),
        ("group_size", 0),
        ("pad_id", 256),
    ]:
        with pytest.raises(GrpoError, match=field):
            sample(qwen3, [[1, 2]], **{**ok, field: value})


def check_compiled_matches_eager(model, compile_options):
    kw = dict(group_size=2, max_new_tokens=6, temperature=0.9, top_k=50, stop_ids=[2], seed=5)
    prompts = make_prompts((7, 3))
    eager = Sampler(model).sample(prompts, **kw)
    sampler = Sampler(model, compile=True, compile_options=compile_options)
    compiled = sampler.sample(prompts, **kw)
    assert torch.equal(compiled.ids, eager.ids)
    assert (compiled.logprobs - eager.logprobs).abs().max().item() <= 1e-5
    wider = make_prompts((9, 4), seed=1)  # another prompt width, same cache-length bucket
    with torch._dynamo.config.patch(error_on_recompile=True):  # no recompile for either
        again = sampler.sample(prompts, **{**kw, "seed": 6})
        other = sampler.sample(wider, **kw)
    assert again.ids.shape == compiled.ids.shape
    assert torch.equal(other.ids, Sampler(model).sample(wider, **kw).ids)


def test_resolve_compile_auto_follows_the_machine(monkeypatch, tmp_path):
    from grpo.rollout.sampler import compile_supported, resolve_compile

    assert resolve_compile("on", "cpu") and resolve_compile(True, "cpu")
    assert not resolve_compile("off", "cpu") and not resolve_compile(False, "cpu")
    monkeypatch.delenv("GRPO_COMPILE", raising=False)  # the suite's conftest sets it
    assert not resolve_compile("auto", "cpu")  # per-shape compiles cost more than they save
    assert resolve_compile("auto", "cuda") == compile_supported("cuda")
    monkeypatch.setenv("GRPO_COMPILE", "0")
    assert not resolve_compile("auto", "cuda")
    monkeypatch.delenv("GRPO_COMPILE")
    assert not resolve_compile("auto", "cuda", multi_turn=True)  # eager: compaction, no recompiles
    assert resolve_compile("on", "cpu", multi_turn=True)
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler on the PATH: compile_supported
    monkeypatch.delenv("CXX", raising=False)  # says no on a CPU (still yes on CUDA: Triton)
    assert not compile_supported("cpu") and compile_supported("cuda")
    with pytest.raises(GrpoError, match="auto, on or off"):
        resolve_compile("yes", "cpu")


def test_compile_failure_falls_back_to_eager_only_when_asked(qwen3, caplog):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("no C++ compiler")

    kw = dict(group_size=2, max_new_tokens=5, temperature=1.0, stop_ids=[], seed=3)
    prompts = make_prompts((6, 2))
    eager = Sampler(qwen3).sample(prompts, **kw)
    sampler = Sampler(
        qwen3, compile=True, compile_options={"backend": broken_backend}, fallback=True
    )
    with caplog.at_level("WARNING", logger="grpo.rollout.sampler"):
        out = sampler.sample(prompts, **kw)
    assert torch.equal(out.ids, eager.ids)
    assert (out.logprobs - eager.logprobs).abs().max().item() <= 1e-6
    assert sum("decoding eagerly" in r.getMessage() for r in caplog.records) == 1
    strict = Sampler(qwen3, compile=True, compile_options={"backend": broken_backend})
    with pytest.raises(Exception, match="no C\\+\\+ compiler"):
        strict.sample(prompts, **kw)


def test_a_failure_after_the_first_call_of_a_shape_falls_back_too(qwen3, caplog):
    """A compiled call of a shape already seen (a guard that fails and recompiles, a replay
    that breaks) goes through the same fallback as the first call of a shape."""
    kw = dict(group_size=2, max_new_tokens=5, temperature=1.0, stop_ids=[], seed=3)
    prompts = make_prompts((6, 2))
    eager = Sampler(qwen3).sample(prompts, **kw)
    sampler = Sampler(qwen3, compile=True, compile_options={"backend": "eager"}, fallback=True)
    sampler.sample(prompts, **kw)  # every shape of this call seen

    def broken(*args):
        raise RuntimeError("recompiling failed")

    sampler._compiled = sampler._compiled_iteration = broken  # `decode`'s and `sample`'s
    with caplog.at_level("WARNING", logger="grpo.rollout.sampler"):
        out = sampler.sample(prompts, **kw)
    assert torch.equal(out.ids, eager.ids)
    assert sum("decoding eagerly" in r.getMessage() for r in caplog.records) == 1


def test_compiled_decode_step_traces_as_one_static_graph(qwen3):
    # fullgraph=True, dynamic=False through dynamo + AOT autograd (the graph inductor gets,
    # with the in-place cache writes functionalized), without paying for C++ codegen.
    check_compiled_matches_eager(qwen3, {"backend": "aot_eager"})


@pytest.mark.process  # a variant of the aot_eager test above: the C++ codegen's cost
def test_compiled_decode_step_with_inductor_matches_eager(qwen3):
    # The real backend: inductor compiles C++ on CPU (about 30 s with gcc).
    check_compiled_matches_eager(qwen3, None)


def test_compiled_sampler_reuses_its_decode_caches(qwen3):
    """The compiled step sees the same cache tensors call after call (what CUDA graphs need),
    also when calls alternate between shapes (another batch size, then the first again):
    repeat_rows copies the prefill into them in place, every slot, so a later call with other
    prompts still equals eager decoding. `release_caches` frees them all."""
    kw = dict(group_size=3, max_new_tokens=5, temperature=1.0, stop_ids=[], seed=2)
    sampler = Sampler(qwen3, compile=True, compile_options={"backend": "aot_eager"})
    sampler.sample(make_prompts((8, 2)), **kw)
    (cache,) = sampler._caches.values()
    ptrs = [t.data_ptr() for t in cache.k_layers + cache.v_layers]
    sampler.sample(make_prompts((8,)), **kw)  # 3 rows, not 6: a cache of its own
    assert len(sampler._caches) == 2
    other = make_prompts((5, 6), seed=3)
    out = sampler.sample(other, **kw)
    assert [t.data_ptr() for t in cache.k_layers + cache.v_layers] == ptrs
    eager = Sampler(qwen3).sample(other, **kw)
    assert torch.equal(out.ids, eager.ids)
    assert (out.logprobs - eager.logprobs).abs().max().item() <= 1e-5
    kept = sampler.kept_cache_bytes
    assert kept == 2 * 9 * sum(t.numel() * t.element_size() for t in cache.k_layers) // 6
    assert sampler.release_caches() == kept and sampler.kept_cache_bytes == 0


def test_compiled_decode_keeps_few_graphs_over_batch_sizes_and_cache_buckets(qwen3, caplog):
    """Dynamic sampling's refills change the batch size, prompt lengths the cache bucket: over
    9 batch sizes in 1..128 x 3 cache buckets the compiled step builds at most 8 graphs (rows
    and slots are dynamic dimensions; static shapes built one each and, at torch's recompile
    limit, `compile: on` raised and `auto` went eager for good). Both stay compiled here."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    # auto (fallback=True): a failure would switch to eager where `on` raises; neither happens
    sampler = Sampler(qwen3, compile=True, compile_options={"backend": "eager"}, fallback=True)
    for T_p in (10, 70, 140):  # cache buckets of 64, 128 and 192 slots
        prompt = make_prompts((T_p,))[0]
        for B in (1, 2, 3, 5, 8, 17, 33, 64, 128):
            sampler.sample(
                [prompt] * B, group_size=1, max_new_tokens=3, temperature=1.0, stop_ids=[], seed=0
            )
    assert counters["stats"]["unique_graphs"] <= 8, dict(counters["stats"])
    assert sampler._decode_fn == sampler._decode_compiled  # never fell back to eager
    assert len(sampler._compiled_shapes) == 27
    assert not [r for r in caplog.records if "decoding eagerly" in r.getMessage()]


def test_repeat_rows_into_a_buffer_equals_a_new_cache(qwen3):
    c = KVCache.for_model(qwen3, rows=2, max_len=7, static=True)
    for k, v in zip(c.k_layers, c.v_layers):
        k.normal_()
        v.normal_()
    c.pos_tensor.fill_(4)
    fresh = c.repeat_rows(3)
    buf = KVCache.for_model(qwen3, rows=6, max_len=7, static=True)
    for t in buf.k_layers + buf.v_layers:
        t.fill_(float("nan"))  # stale contents must all be overwritten
    into = c.repeat_rows(3, out=buf)
    assert into is buf and int(buf.pos_tensor) == 4
    assert torch.equal(into.k, fresh.k) and torch.equal(into.v, fresh.v)
    with pytest.raises(ValueError, match="wrong shape"):
        c.repeat_rows(2, out=buf)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@needs_cuda
def test_greedy_matches_transformers_generate_on_cuda(tiny_checkpoints):
    # The CPU parity test on the GPU: prefill, cache, positions and the argmax on CUDA tensors.
    path = tiny_checkpoints("qwen3", initializer_range=0.2)
    ours, hf = load_model(path, device="cuda"), hf_model(path).cuda()
    r = sample(
        ours, make_prompts(), group_size=1, max_new_tokens=32, temperature=0, stop_ids=[], seed=0
    )
    assert r.ids.is_cuda and r.completion_ids.shape == (4, 32)
    assert all(len(set(row)) > 5 for row in r.completion_ids.tolist())  # not a trivial repeat
    assert torch.equal(r.completion_ids, hf_greedy(hf, r, 32, eos=None))


@pytest.mark.cuda
@needs_cuda
def test_logprobs_equal_a_fresh_forward_on_cuda(tiny_checkpoints):
    # Sampled on the device generator with top-k / top-p; some rows stop early.
    model = load_model(tiny_checkpoints("qwen3"), device="cuda")
    r = sample(
        model,
        make_prompts(),
        group_size=3,
        max_new_tokens=24,
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        stop_ids=range(3, 13),
        seed=0,
    )
    assert r.logprobs.is_cuda and r.finished.any() and not r.finished.all()
    with torch.no_grad():
        logits = model(r.ids, attention_mask=r.attention_mask())  # (B, T_p + T_c, V)
    T_p = r.prompt_width
    pred = (logits[:, T_p - 1 : -1].float() / 0.7).log_softmax(-1)
    want = pred.gather(-1, r.completion_ids[..., None])[..., 0]  # (B, T_c)
    assert (r.logprobs - want)[r.completion_mask].abs().max().item() <= 1e-5


@pytest.mark.cuda
@needs_cuda
def test_compiled_decode_step_matches_eager_on_cuda(tiny_checkpoints):
    # inductor's Triton kernels under CUDA graphs (mode reduce-overhead) vs the eager step:
    # same tokens, log-probs within 1e-5, no recompile for another prompt width.
    check_compiled_matches_eager(load_model(tiny_checkpoints("qwen3"), device="cuda"), None)
