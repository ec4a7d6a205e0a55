"""What a decode step asks of the device, proven on a CPU: kernel launches per step (a budget
per layer and a fixed part, at CUDA's code paths and the plain CPU path), host syncs per
rollout, the whole iteration as one graph without syncs, per-row random streams, and decode
weights that draw from the adapted policy.

Launch counts are a property of the code (`grpo.testing.launches`): the numbers a CPU counts
with CUDA's paths forced are what a GPU launches eagerly. Budgets are today's counts; the code
before them took 44 (fp32) and 87 (bf16 autocast + LoRA q/k/v/o) launches per layer, 32 fixed,
and 35 weight casts per layer under autocast.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import head_rounding

from grpo.lora import apply_lora
from grpo.lora.layers import disabled_lora
from grpo.models.config import ModelConfig
from grpo.models.decoder import Decoder
from grpo.precision import Precision
from grpo.rollout import Sampler
from grpo.rollout.sampling import row_uniforms
from grpo.testing.launches import count_ops, cuda_decode_paths, per_decode_step

PROMPTS = [[5 + i + j for j in range(7 + 3 * i)] for i in range(4)]  # 4 widths: left padding


def tiny(layers: int = 2, lora: bool = False, dtype=torch.float32, qk_norm=True) -> Decoder:
    cfg = ModelConfig(
        family="qwen3" if qk_norm else "llama",
        qk_norm=qk_norm,
        num_hidden_layers=layers,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    m = Decoder(cfg)
    m.init_weights(seed=0)
    if lora:
        apply_lora(m, 4, 8, targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=0)
        for mod in m.modules():
            if hasattr(mod, "lora_b"):
                torch.nn.init.normal_(mod.lora_b, std=0.02)  # a live, non-zero adapter
    return m.to(dtype).eval()


TUTORIAL = Precision(torch.float32, torch.bfloat16)  # fp32 weights, bf16 autocast (+ LoRA)


def step_cost(layers, lora, precision, cuda) -> dict:
    """`per_decode_step` of a tiny model's rollout, at CUDA's decode paths or the CPU's."""
    s = Sampler(tiny(layers, lora), precision=precision, pack=False)
    with cuda_decode_paths() if cuda else contextlib.nullcontext():
        return per_decode_step(
            lambda n: s.sample(
                PROMPTS, group_size=8, max_new_tokens=n, temperature=1.0, stop_ids=[], seed=0
            )
        )


# (layout, config) -> (launches per layer, fixed launches, casts per layer)
BUDGETS = {
    ("cuda", "fp32"): (29, 21, 0),
    ("cuda", "tutorial"): (41, 21, 8),
    ("cpu", "fp32"): (41, 21, 0),
    ("cpu", "tutorial"): (59, 21, 14),
}


@pytest.mark.parametrize("layout,config", list(BUDGETS))
def test_launches_per_decode_step_hold_their_budget(layout, config):
    lora, prec = (True, TUTORIAL) if config == "tutorial" else (False, Precision())
    a = step_cost(2, lora, prec, layout == "cuda")
    b = step_cost(3, lora, prec, layout == "cuda")
    per_layer, fixed = b["launches"] - a["launches"], 3 * a["launches"] - 2 * b["launches"]
    casts = b["casts"] - a["casts"]
    want_layer, want_fixed, want_casts = BUDGETS[layout, config]
    print(f"{layout}/{config}: {per_layer} per layer + {fixed} fixed, {casts} casts per layer")
    assert per_layer <= want_layer and fixed <= want_fixed, (per_layer, fixed)
    # no weight is cast per step: what casts remain are activations (the float32 rotary and
    # norm statistics of the precision policy), the same number with or without LoRA
    assert casts <= want_casts
    assert a["syncs"] == 1 / 4  # one "all done?" per sync_every=4 steps, nothing else


@pytest.mark.parametrize("n,k", [(1, 4), (4, 4), (5, 4), (12, 4), (9, 1), (7, 3)])
def test_host_syncs_per_rollout(n, k):
    """floor((n - 1) / k) + 1 host syncs for n steps: the loop's "all done?" every k steps,
    then the trim to the longest row; none in prefill, draws or bookkeeping."""
    s = Sampler(tiny(), sync_every=k)
    c = count_ops(
        lambda: s.sample(
            PROMPTS, group_size=2, max_new_tokens=n, temperature=1.0, stop_ids=[], seed=0
        )
    )
    assert c.syncs == (n - 1) // k + 1


def test_the_whole_iteration_is_one_graph_without_syncs_that_mutates_only_its_state():
    """`Sampler._iteration` (forward, head, draw, stop test, position update) traced with
    fullgraph=True: one graph, no `.item()` / `nonzero` / tensors built from Python values,
    and a call changes the loop state and the KV cache, nothing else (weights, buffers,
    masks)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = tiny(lora=True)
    s = Sampler(model, compile=True, compile_options={"backend": backend})
    kw = dict(group_size=2, max_new_tokens=6, temperature=0.8, top_p=0.9, stop_ids=[3], seed=1)
    eager = Sampler(model).sample(PROMPTS, **kw)
    out = s.sample(PROMPTS, **kw)
    assert torch.equal(out.ids, eager.ids)  # same per-row streams, same tokens
    assert (out.logprobs - eager.logprobs).abs().max().item() <= 1e-5
    iteration = [g for g in graphs if any("index_copy" in str(n.target) for n in g.graph.nodes)]
    assert len(iteration) == 1  # the whole iteration, not forward + eager draw
    calls = [n for n in iteration[0].graph.nodes if n.op in ("call_function", "call_method")]
    names = {getattr(n.target, "__name__", str(n.target)) for n in calls}
    bad = {
        "_local_scalar_dense",
        "item",
        "tolist",
        "nonzero",
        "tensor",
        "as_tensor",
        "scalar_tensor",
        "from_numpy",
    }
    assert not names & bad, names & bad
    assert {"index_copy_", "isin", "searchsorted"} <= names  # the draw and the stop test

    # mutation: run one more iteration by hand on the kept state
    st = next(iter(s._loops.values()))
    (cache,) = s._caches.values()
    kv_mask = torch.ones(st.tokens.shape[0], cache.max_len, dtype=torch.bool)
    kv_mask[:, : out.prompt_width] = out.attention_mask()[:, : out.prompt_width]  # left padding
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.inference_mode():  # back one step: rewrite the last column and cache slot
        st.step.sub_(1)
        st.positions.sub_(1)
        cache.pos_tensor.sub_(1)
        st.last.copy_(st.tokens[:, 4:5])
        drawn = st.tokens[:, 5].clone()
        st.tokens[:, 5] = -1
        state_before = [t.clone() for t in st.tensors()]
        s._compiled_iteration(st, cache, kv_mask, torch.tensor([3]), (0.8, 0, 0.9, 0.0))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert int(st.step) == 6 and torch.equal(st.tokens[:, 5], drawn)  # the same draw again
    changed = [not torch.equal(a, b) for a, b in zip(state_before, st.tensors())]
    assert changed == [True, False, False, True, True, True, False]  # not logprobs, done, u


def test_row_uniforms_are_keyed_by_seed_row_and_step():
    u = row_uniforms(7, 64, 1000)  # (B, T)
    assert u.dtype == torch.float64 and u.shape == (64, 1000)
    assert torch.equal(row_uniforms(7, torch.tensor([5, 40]), 1000), u[[5, 40]])
    assert torch.equal(row_uniforms(7, 64, 10), u[:, :10])  # a longer table extends it
    assert not torch.equal(row_uniforms(8, 64, 1000), u)
    assert not torch.equal(row_uniforms(7 + 2**32, 64, 1000), u)  # the high bits count
    assert len(set(u.flatten().tolist())) == u.numel()
    # uniform on [0, 1): Kolmogorov-Smirnov distance of 64,000 draws, 1.63 / sqrt(n) is p=1%
    x = u.flatten().sort().values
    n = x.numel()
    ks = torch.maximum(torch.arange(1, n + 1) / n - x, x - torch.arange(n) / n).max().item()
    assert ks < 1.63 / n**0.5 and 0 <= x[0] and x[-1] < 1
    # steps and rows are not correlated (|r| of 64,000 pairs < 4.5 sigma)
    assert abs(torch.corrcoef(torch.stack([u[:, 1:].flatten(), u[:, :-1].flatten()]))[0, 1]) < 0.018
    assert abs(torch.corrcoef(torch.stack([u[1:].flatten(), u[:-1].flatten()]))[0, 1]) < 0.018


def test_a_rows_tokens_do_not_depend_on_the_rows_beside_it():
    """A row draws from its own stream: prompt A's two rows sample the same completions alone
    and ahead of other prompts (float64: no batch-dependent rounding of the logits)."""
    model = tiny(dtype=torch.float64)
    s = Sampler(model)
    kw = dict(group_size=2, max_new_tokens=12, temperature=1.0, stop_ids=[], seed=3)
    alone = s.sample(PROMPTS[:1], **kw)
    beside = s.sample(PROMPTS, **kw)
    n = alone.completion_ids.shape[1]
    assert torch.equal(beside.completion_ids[:2, :n], alone.completion_ids)
    # log-probs: the head multiplies in float32 (`model.head_precision`) over other batch
    # shapes; they agree within that rounding's worst case
    gap = (beside.logprobs[:2, :n] - alone.logprobs).abs().max().item()
    assert gap <= head_rounding(model)


@pytest.mark.parametrize("cuda", [False, True])
def test_decode_weights_draw_from_the_adapted_policy(cuda):
    """Under the tutorial's precision (float32 weights, bf16 autocast, LoRA) the sampler
    decodes with bf16 copies made once and stacked q/k/v, base and adapter apart: its
    log-probs equal a fresh training forward with the adapter (within bf16's budget) and not
    the base model's (a small adapter merged into a bf16 base would be rounded away)."""
    model = tiny(lora=True)
    s = Sampler(model, precision=TUTORIAL, pack=False)
    with cuda_decode_paths() if cuda else contextlib.nullcontext():
        r = s.sample(PROMPTS, group_size=2, max_new_tokens=10, temperature=1.0, stop_ids=[], seed=0)
    assert s.decode_weights.copied_bytes > 0

    def recompute():
        with torch.no_grad(), TUTORIAL.autocast("cpu"):
            logits = model(r.ids, attention_mask=r.attention_mask())
        pred = logits[:, r.prompt_width - 1 : -1].float().log_softmax(-1)
        return pred.gather(-1, r.completion_ids[..., None])[..., 0]

    adapted = recompute()
    with disabled_lora(model):
        base = recompute()
    gap = (r.logprobs - adapted).abs().max().item()
    assert gap <= 0.05  # bf16 compute on both sides
    assert (r.logprobs - base).abs().max().item() > 4 * gap


def test_a_compiled_step_attends_over_the_filled_slots_only():
    """The static cache's forwards read `limit` slots, the filled ones rounded up to 64 (the
    host counts them: no sync), not the whole buffer; same logits as over every slot."""
    from grpo.models import KVCache

    model = tiny(dtype=torch.float64)
    cache = KVCache.for_model(model, rows=2, max_len=256, static=True)
    ids = torch.randint(3, 200, (2, 70), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 256, dtype=torch.bool)
    with torch.no_grad():
        model(ids[:, :69], attention_mask=mask, kv_cache=cache)
        whole = model(ids[:, 69:], attention_mask=mask, kv_cache=cache)
        cache.pos_tensor.sub_(1)
        cache.limit = 128
        k, _ = cache.update(0, *(torch.zeros(2, 2, 1, 16, dtype=torch.float64),) * 2)
        assert k.shape[2] == 128
        bounded = model(ids[:, 69:], attention_mask=mask, kv_cache=cache)
    assert torch.allclose(bounded, whole, rtol=0, atol=1e-12)

    seen = []
    s = Sampler(model, compile=True, compile_options={"backend": "eager"})
    real = s._bound
    s._bound = lambda cache, filled: seen.append(filled) or real(cache, filled)
    s.sample(
        [list(range(3, 63))], group_size=2, max_new_tokens=8, temperature=1.0, stop_ids=[], seed=0
    )
    assert seen == list(range(61, 68))  # T_p + t for t = 1 .. 7
    assert next(iter(s._caches.values())).limit is None  # reset after the call


def test_a_compiled_sampler_keeps_its_graphs_as_the_adapter_trains():
    """Under the tutorial's precision the compiled sampler decodes with cast copies refreshed
    in place: an optimizer step on the adapter between rollouts recompiles nothing, and the
    next rollout samples from the updated adapter (= an eager sampler)."""
    model = tiny(lora=True)
    kw = dict(group_size=2, max_new_tokens=5, temperature=1.0, stop_ids=[], seed=4)
    s = Sampler(
        model,
        precision=TUTORIAL,
        pack=False,
        compile=True,
        compile_options={"backend": "aot_eager"},
    )
    s.sample(PROMPTS, **kw)
    s.sample(PROMPTS, **kw)  # the second bucket of nothing: every graph of the call built
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "lora_b"):
                m.lora_b.mul_(3.0)  # in place, as an optimizer step
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = s.sample(PROMPTS, **kw)
    eager = Sampler(model, precision=TUTORIAL, pack=False).sample(PROMPTS, **kw)
    assert torch.equal(out.ids, eager.ids)
    assert (out.logprobs - eager.logprobs).abs().max().item() <= 1e-2  # bf16 compute
