"""The attention arrangement SDPA's selector allows (`grpo.models.sdpa_choice`): each selection
rule with mocked choices on the CPU, the arrangement's output against float64, and the
selector asked once per kind of call, never inside a compiled trace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from grpo.models import sdpa_choice
from grpo.models.decoder import attention, decode_step_attention

MATH, FLASH = SDPBackend.MATH, SDPBackend.FLASH_ATTENTION
CUDNN, EFFICIENT = SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION


def arrangement_of(q, k, mask, enable_gqa) -> str:
    """Which arrangement a selector call (on probe tensors) asks about."""
    if q.shape[2] > 1 and mask is not None and mask.shape[2] == 1:
        return sdpa_choice.FOLD  # (1, H_kv, g, D) queries over a one-row mask
    if enable_gqa:
        return sdpa_choice.GROUPED
    return sdpa_choice.REPEAT if q.shape[1] == k.shape[1] else "plain"


class Selector:
    """A mocked `sdpa_backend`: answers[arrangement] (default MATH), recording each question."""

    def __init__(self, **answers):
        self.answers, self.asked = answers, []

    def __call__(self, q, k, v, mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False):
        name = arrangement_of(q, k, mask, enable_gqa)
        self.asked.append(name)
        return self.answers.get(name, MATH)


@pytest.fixture
def mock(monkeypatch):
    def install(matmul_decode=frozenset(), **answers):
        selector = Selector(**answers)
        monkeypatch.setattr(sdpa_choice, "sdpa_backend", selector)
        monkeypatch.setattr(sdpa_choice, "MATMUL_DECODE", matmul_decode)
        sdpa_choice.clear()
        return selector

    return install


@pytest.fixture
def spy_sdpa(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **kw):
        calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), enable_gqa=enable_gqa))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


HEADS = (4, 2, 16)  # H, H_kv, D


def queries_case(masked: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, (H, H_kv, D), T = 2, HEADS, 9
    S = T + 3 if masked else T
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H_kv, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    keep = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]  # causal, offset
    if masked:
        own = torch.arange(S)[None, :] == torch.arange(S - T, S)[:, None]  # each query's own key
        keep = keep & (torch.rand(S, generator=g) > 0.3) | own
    mask = torch.zeros(B, 1, T, S, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    gold = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) / D**0.5 + mask).softmax(-1)
    gold = gold @ v.repeat_interleave(2, 1)
    return q, k, v, (mask if masked else None), gold


def decode_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    B, (H, H_kv, D), S = 3, HEADS, 12
    q = torch.randn(B, H, 1, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H_kv, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    keep = torch.rand(B, S, generator=g) > 0.3
    keep[:, -1] = True
    mask = torch.zeros(B, 1, 1, S, dtype=torch.float64).masked_fill(
        ~keep[:, None, None], -torch.inf
    )
    gold = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) / D**0.5 + mask).softmax(-1)
    return q, k, v, mask, gold @ v.repeat_interleave(2, 1)


@pytest.mark.parametrize("masked", [True, False], ids=["masked", "causal"])
@pytest.mark.parametrize(
    "answers, want, asked",
    [
        (dict(grouped=CUDNN), sdpa_choice.GROUPED, ["grouped"]),  # cuDNN counts as fused
        (dict(grouped=FLASH), sdpa_choice.GROUPED, ["grouped"]),
        (dict(repeat=EFFICIENT), sdpa_choice.REPEAT, ["grouped", "repeat"]),
        (dict(), sdpa_choice.GROUPED, ["grouped", "repeat"]),  # math: no copy of ours
    ],
    ids=["grouped-cudnn", "grouped-flash", "repeat-efficient", "math"],
)
def test_queries_rules(mock, spy_sdpa, masked, answers, want, asked):
    """T queries: the grouped call where a fused kernel takes it, else K and V repeated where
    one takes that, else the grouped call on the math kernel; the output equals float64."""
    selector = mock(**answers)
    q, k, v, mask, gold = queries_case(masked)
    assert sdpa_choice.choose("queries", "cpu", torch.float64, HEADS, masked, not masked) == want
    assert selector.asked == asked
    y = attention(q, k, v, mask)
    torch.testing.assert_close(y, gold, rtol=0, atol=1e-12)
    (call,) = spy_sdpa
    assert call["k"][1] == (4 if want == sdpa_choice.REPEAT else 2)  # repeated or not
    assert call["enable_gqa"] == (want == sdpa_choice.GROUPED)
    assert selector.asked == asked  # answered once per kind of call, not per call


@pytest.mark.parametrize(
    "answers, want, asked",
    [
        (dict(grouped=CUDNN), sdpa_choice.GROUPED, ["grouped"]),
        (dict(fold=EFFICIENT), sdpa_choice.FOLD, ["grouped", "fold"]),
        (dict(), sdpa_choice.MATMUL, ["grouped", "fold"]),  # never SDPA's math kernel
    ],
    ids=["grouped-cudnn", "fold-efficient", "matmul"],
)
def test_decode_rules(mock, spy_sdpa, answers, want, asked):
    """One query per row: the grouped call, else the folded query heads (`decode_sdpa`), else
    two matmuls; the output equals float64 in each."""
    selector = mock(**answers)
    q, k, v, mask, gold = decode_case()
    assert sdpa_choice.choose("decode", "cpu", torch.float64, HEADS) == want
    assert selector.asked == asked
    torch.testing.assert_close(decode_step_attention(q, k, v, mask), gold, rtol=0, atol=1e-12)
    if want == sdpa_choice.MATMUL:
        assert spy_sdpa == []
    else:
        (call,) = spy_sdpa
        folded = want == sdpa_choice.FOLD
        assert call["q"] == ((3, 2, 2, 16) if folded else (3, 4, 1, 16))
        assert call["k"][1] == 2 and call["enable_gqa"] == (not folded)  # K, V never repeated


def test_matmul_decode_device_types_skip_the_selector(mock):
    """A device type in MATMUL_DECODE (the CPU: two matmuls cost less than its flash kernel for
    one query) decodes with two matmuls without asking; its T-query calls still ask."""
    selector = mock(matmul_decode=frozenset({"cpu"}), grouped=FLASH)
    assert sdpa_choice.choose("decode", "cpu", torch.float32, HEADS) == sdpa_choice.MATMUL
    assert selector.asked == []
    assert sdpa_choice.choose("queries", "cpu", torch.float32, HEADS) == sdpa_choice.GROUPED
    assert selector.asked == ["grouped"]


def test_without_grouped_heads_only_the_plain_call_is_asked(mock):
    selector = mock()
    heads = (4, 4, 16)
    assert sdpa_choice.choose("queries", "cpu", torch.float32, heads) == sdpa_choice.GROUPED
    assert sdpa_choice.choose("decode", "cpu", torch.float32, heads) == sdpa_choice.MATMUL
    assert selector.asked == ["repeat", "repeat"]  # (4 heads over 4: the plain call), once each


def test_the_real_selector_on_this_cpu():
    """Unmocked, a CPU's selector takes every arrangement with its flash kernel: grouped calls
    for T queries (no K/V copy), two matmuls for decode (MATMUL_DECODE)."""
    for dtype in (torch.float32, torch.bfloat16):
        for masked in (True, False):
            got = sdpa_choice.choose("queries", "cpu", dtype, HEADS, masked, not masked)
            assert got == sdpa_choice.GROUPED
        assert sdpa_choice.chosen_backend("queries", "cpu", dtype, HEADS) == FLASH
        assert sdpa_choice.choose("decode", "cpu", dtype, HEADS) == sdpa_choice.MATMUL


def test_forced_arrangements_and_bad_names():
    with sdpa_choice.forced(queries=sdpa_choice.REPEAT, decode=sdpa_choice.FOLD):
        assert sdpa_choice.choose("queries", "cpu", torch.float32, HEADS) == sdpa_choice.REPEAT
        assert sdpa_choice.choose("decode", "cpu", torch.float32, HEADS) == sdpa_choice.FOLD
    assert sdpa_choice.choose("decode", "cpu", torch.float32, HEADS) == sdpa_choice.MATMUL
    with pytest.raises(ValueError, match="decode: 'repeat' is not one of"):
        with sdpa_choice.forced(decode=sdpa_choice.REPEAT):
            pass


def test_a_compiled_trace_reads_the_prepared_answer_without_asking(mock):
    """Inside `torch.compile` nothing asks the selector (it cannot be traced): a prepared
    answer is read as a constant, one graph, no break; before `prepare`, the safe arrangement."""
    selector = mock(fold=EFFICIENT)
    q, k, v, mask, gold = decode_case()
    fn = torch.compile(decode_step_attention, fullgraph=True, backend="eager")
    torch.testing.assert_close(fn(q, k, v, mask), gold, rtol=0, atol=1e-12)
    assert selector.asked == []  # not prepared: MATMUL, no question inside the trace
    torch._dynamo.reset()
    assert sdpa_choice.choose("decode", "cpu", torch.float64, HEADS) == sdpa_choice.FOLD
    asked = list(selector.asked)
    calls = []
    sdpa = F.scaled_dot_product_attention
    fn = torch.compile(decode_step_attention, fullgraph=True, backend="eager")
    try:
        F.scaled_dot_product_attention = lambda *a, **kw: calls.append(1) or sdpa(*a, **kw)
        torch.testing.assert_close(fn(q, k, v, mask), gold, rtol=0, atol=1e-12)
    finally:
        F.scaled_dot_product_attention = sdpa
    assert calls and selector.asked == asked  # the folded SDPA call, traced; nothing asked


def test_prepare_asks_about_every_kind_of_call_a_model_makes(mock, tiny_checkpoints):
    from grpo.models import load_model

    selector = mock(grouped=FLASH)
    model = load_model(tiny_checkpoints("qwen3"))
    sdpa_choice.prepare(model, torch.bfloat16)
    assert selector.asked == ["grouped"] * 3  # decode, masked queries, causal queries
    heads = (
        model.config.num_attention_heads,
        model.config.num_key_value_heads,
        model.config.head_dim,
    )
    assert sdpa_choice.chosen_backend("decode", "cpu", torch.bfloat16, heads) == FLASH
    assert selector.asked == ["grouped"] * 3
