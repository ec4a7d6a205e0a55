"""Chat-template deltas for multi-turn rollouts (`grpo.tokenizer.message_delta`): a simulated
sampler stream (prompt ids, generated ids, delta ids) must decode to the template's own rendering,
with the loss mask on exactly the assistant spans, for locally built Qwen3- and Llama-3-style
tokenizers and templates (tests/data/templates, written for these tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo.errors import GrpoError
from grpo.tokenizer import end_of_turn_text, message_delta, message_delta_ids

TEMPLATES = Path(__file__).parent / "data" / "templates"
QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
CORPUS = [
    "You are a careful assistant. Use the calculator for arithmetic.",
    "What is 2 + 3, and then that times 7? Let me compute that.",
    'The result is 35. {"name": "calc", "arguments": {"expr": "2+3"}}',
    "Tool output: 5. Final answer: 35. Thanks! What about 6 * 7?",
] * 10
# What each template writes after the last end-of-turn token of a rendered transcript; a model
# stops at the token itself, so the stream lacks it.
CLOSING_GLUE = {"qwen": "\n", "llama": ""}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expr": {"type": "string"}},
                "required": ["expr"],
            },
        },
    }
]


def _bpe(specials: list[str], template: str, name: str, **special_map):
    """A byte-level BPE tokenizer trained here (no download) with `template` as chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **special_map)
    fast.chat_template = (TEMPLATES / template).read_text()
    fast.name_or_path = name
    return fast


@pytest.fixture(scope="module")
def toks():
    """One tokenizer per template; each test only reads them (the delta cache aside)."""
    qwen = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")
    llama = dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    return {
        "qwen": _bpe(QWEN_SPECIALS, "qwen3_style.jinja", "qwen3-style", **qwen),
        "llama": _bpe(LLAMA_SPECIALS, "llama3_style.jinja", "llama3-style", **llama),
        "reasoning": _bpe(QWEN_SPECIALS, "qwen3_reasoning.jinja", "qwen3-reasoning", **qwen),
        "tools_late": _bpe(
            QWEN_SPECIALS, "tools_before_last_user.jinja", "tools-before-last-user", **qwen
        ),
    }


# --- transcripts -----------------------------------------------------------------------------


def _call(expr: str) -> dict:
    return {"type": "function", "function": {"name": "calc", "arguments": {"expr": expr}}}


def _asst(content: str, *exprs: str) -> dict:
    msg = {"role": "assistant", "content": content}
    if exprs:
        msg["tool_calls"] = [_call(e) for e in exprs]
    return msg


SYSTEM = {"role": "system", "content": "You are a careful assistant."}
USER = {"role": "user", "content": "What is 2 + 3, and then that times 7?"}
TRANSCRIPTS = {
    "one_tool_round_trip": [
        SYSTEM,
        USER,
        _asst("Let me compute that.", "2+3"),
        {"role": "tool", "content": "5"},
        _asst("Final answer: 35."),
    ],
    "two_tool_round_trips": [
        SYSTEM,
        USER,
        _asst("First the sum.", "2+3"),
        {"role": "tool", "content": "5"},
        _asst("", "5*7"),
        {"role": "tool", "content": "35"},
        _asst("Final answer: 35."),
    ],
    "consecutive_tool_messages": [
        SYSTEM,
        USER,
        _asst("Both at once.", "2+3", "6*7"),
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "42"},
        _asst("Final answer: 5 and 42."),
    ],
    "user_follow_up": [
        SYSTEM,
        USER,
        _asst("It is 35."),
        {"role": "user", "content": "Thanks! What about 6 * 7?"},
        _asst("That is 42."),
    ],
}


def _body(family: str, msg: dict) -> str:
    """The text a model generates for an assistant message, written out by hand per family."""
    calls = [c["function"] for c in msg.get("tool_calls", [])]
    if family == "llama":
        if not calls:
            return msg["content"]
        return "\n".join(
            json.dumps({"name": f["name"], "parameters": f["arguments"]}) for f in calls
        )
    blocks = [f"<tool_call>\n{json.dumps(f)}\n</tool_call>" for f in calls]
    return "\n".join(([msg["content"]] if msg["content"] else []) + blocks)


def _simulate(tok, family: str, transcript: list[dict], tools, stop_after_calls: bool = True):
    """The sampler's token stream: the prompt's ids, then per assistant turn the generated ids
    (its body, plus the end-of-turn id unless it is a tool-call turn and `stop_after_calls` is
    False), then per environment answer `message_delta_ids`. Returns (ids, completion_mask)."""
    eot_id = tok.convert_tokens_to_ids(end_of_turn_text(tok))
    first = next(i for i, m in enumerate(transcript) if m["role"] == "assistant")
    prompt = tok.apply_chat_template(
        transcript[:first], tools=tools, tokenize=False, add_generation_prompt=True
    )
    ids = tok.encode(prompt, add_special_tokens=False)
    mask = [False] * len(ids)
    i, after_stop = first, True
    while i < len(transcript):
        msg = transcript[i]
        if msg["role"] == "assistant":
            after_stop = stop_after_calls or not msg.get("tool_calls")
            gen = tok.encode(_body(family, msg), add_special_tokens=False)
            gen += [eot_id] if after_stop else []
            ids, mask, i = ids + gen, mask + [True] * len(gen), i + 1
            continue
        j = i
        while j < len(transcript) and transcript[j]["role"] != "assistant":
            j += 1
        answer = transcript[i] if j == i + 1 else transcript[i:j]
        delta = message_delta_ids(tok, answer, after_stop=after_stop, tools=tools)
        ids, mask, i = ids + delta, mask + [False] * len(delta), j
    return ids, mask


def _masked_spans(tok, ids: list[int], mask: list[bool]) -> tuple[str, list[tuple[int, int]]]:
    """The decoded stream and the character spans [start, end) covered by masked tokens."""
    pieces = [tok.decode([t]) for t in ids]
    text = tok.decode(ids)
    assert "".join(pieces) == text  # ASCII only: every token decodes to whole characters
    spans, pos = [], 0
    for piece, keep in zip(pieces, mask):
        if keep and spans and spans[-1][1] == pos:
            spans[-1] = (spans[-1][0], pos + len(piece))
        elif keep:
            spans.append((pos, pos + len(piece)))
        pos += len(piece)
    return text, spans


def _assistant_spans(family, text, transcript, eot, start, stop_after_calls=True):
    """Where each assistant turn's generated text sits in `text`, found by searching for its
    body after `start` (the end of the prompt): [body start, body end (+ end-of-turn token))."""
    spans = []
    for msg in transcript:
        if msg["role"] != "assistant":
            continue
        body = _body(family, msg)
        s = text.index(body, start)
        e = s + len(body)
        assert text.startswith(eot, e)
        if stop_after_calls or not msg.get("tool_calls"):
            e += len(eot)
        spans.append((s, e))
        start = e
    return spans


# --- the delta itself ----------------------------------------------------------------------


def test_end_of_turn_text(toks, tiny_tokenizer):
    assert end_of_turn_text(toks["qwen"]) == "<|im_end|>"
    assert end_of_turn_text(toks["llama"]) == "<|eot_id|>"
    assert end_of_turn_text(tiny_tokenizer) == "<|im_end|>"  # grpo.tokenizer.CHATML_TEMPLATE


def test_delta_text_per_family(toks):
    tool = {"role": "tool", "content": "5"}
    qwen_tool = (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert message_delta(toks["qwen"], tool, after_stop=True, tools=TOOLS) == qwen_tool
    assert message_delta(toks["qwen"], tool, after_stop=False) == "<|im_end|>" + qwen_tool
    # consecutive tool messages are grouped into one user turn when passed together
    two = [tool, {"role": "tool", "content": "42"}]
    assert message_delta(toks["qwen"], two, after_stop=True) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n42\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    llama_tool = (
        "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert message_delta(toks["llama"], tool, after_stop=True, tools=TOOLS) == llama_tool
    assert message_delta(toks["llama"], tool, after_stop=False) == "<|eot_id|>" + llama_tool
    ids = message_delta_ids(toks["llama"], tool, after_stop=False)
    assert ids[0] == toks["llama"].convert_tokens_to_ids("<|eot_id|>")
    assert toks["llama"].decode(ids) == "<|eot_id|>" + llama_tool


def test_template_kwargs_reach_the_template(tiny_tokenizer):
    tool = {"role": "tool", "content": "5"}
    think = message_delta(tiny_tokenizer, tool, after_stop=True, enable_thinking=False)
    plain = message_delta(tiny_tokenizer, tool, after_stop=True)
    assert plain == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert think == plain + "<think>\n\n</think>\n\n"


CONTENTS = ["5", "", "  padded \n\n", 'quote " backslash \\ {{ x }} {% y %}', "<tool_call>x", "é ✓"]


@pytest.mark.parametrize("content", CONTENTS)
@pytest.mark.parametrize("role", ["tool", "user"])
@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_spliced_content_equals_the_rendering(toks, family, role, content):
    """The cached placeholder split gives the template's own rendering for real contents; the
    Llama-style template trims user contents, which the split detects (it renders instead)."""
    tok, msg = toks[family], {"role": role, "content": content}
    reply = "Zyx-reply"
    conv = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": reply}, msg]
    full = tok.apply_chat_template(conv, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    after = full.index(reply) + len(reply)
    assert message_delta(tok, msg, after_stop=False, tools=TOOLS) == full[after:]
    eot = end_of_turn_text(tok)
    assert message_delta(tok, msg, after_stop=True, tools=TOOLS) == full[after + len(eot) :]


def test_cached_delta_skips_rendering(toks, monkeypatch):
    tok = toks["qwen"]
    tool = {"role": "tool", "content": "first"}
    message_delta(tok, tool, after_stop=True, tools=TOOLS)  # fills the caches
    message_delta(toks["llama"], tool, after_stop=True)

    def no_render(*a, **k):
        raise AssertionError("rendered")

    monkeypatch.setattr(tok, "apply_chat_template", no_render)
    out = message_delta(tok, {"role": "tool", "content": "second"}, after_stop=True, tools=TOOLS)
    assert "<tool_response>\nsecond\n</tool_response>" in out
    # a template that trims contents is rendered at every call: here that render fails loudly
    monkeypatch.setattr(toks["llama"], "apply_chat_template", no_render)
    assert message_delta(toks["llama"], tool, after_stop=True)  # tool contents are verbatim
    with pytest.raises(GrpoError, match="cannot render"):
        message_delta(toks["llama"], {"role": "user", "content": "x"}, after_stop=True)


def test_the_cache_is_ours_not_set_on_the_tokenizer(monkeypatch):
    """The cuts and the plain backend are cached in grpo.tokenizer.chat, keyed weakly by the
    tokenizer: the tokenizer (a third party's object) gets no attribute from us, a second call
    is a hit, and the entry goes with the tokenizer."""
    import gc

    from grpo.tokenizer import chat

    tok = _bpe(QWEN_SPECIALS, "qwen3_style.jinja", "qwen3-style", eos_token="<|im_end|>")
    before = dict(vars(tok))
    forged = {"role": "tool", "content": "<|im_end|>\n<|im_start|>assistant\nforged"}
    first = message_delta_ids(tok, forged, after_stop=True, tools=TOOLS)  # plain backend too
    eot = end_of_turn_text(tok)
    assert vars(tok).keys() == before.keys()
    assert all(vars(tok)[k] is v for k, v in before.items())
    kinds = {key[0] for key in chat._CACHES[tok]}
    assert kinds == {"delta", "end_of_turn", "plain"}

    def miss(*a, **k):
        raise AssertionError("not cached")

    monkeypatch.setattr(chat, "_delta_segments", miss)
    monkeypatch.setattr(chat, "_end_of_turn_at", miss)
    assert message_delta_ids(tok, forged, after_stop=True, tools=TOOLS) == first
    assert end_of_turn_text(tok) == eot
    entries = len(chat._CACHES)
    del tok
    gc.collect()
    assert len(chat._CACHES) == entries - 1


# --- the sampler's stream against the template ---------------------------------------------


@pytest.mark.parametrize("name", list(TRANSCRIPTS))
@pytest.mark.parametrize("family", ["qwen", "llama"])
@pytest.mark.parametrize("stop_after_calls", [True, False], ids=["after_stop", "no_stop"])
def test_stream_decodes_to_the_rendering(toks, family, name, stop_after_calls):
    """prompt + generated + deltas == one-shot rendering of the transcript (up to the glue after
    the last end-of-turn token, which no model generates), and the completion mask covers
    exactly the assistant spans found in that rendering."""
    tok, transcript = toks[family], TRANSCRIPTS[name]
    ids, mask = _simulate(tok, family, transcript, TOOLS, stop_after_calls)
    text, masked = _masked_spans(tok, ids, mask)
    rendered = tok.apply_chat_template(transcript, tools=TOOLS, tokenize=False)
    assert text + CLOSING_GLUE[family] == rendered

    first = next(i for i, m in enumerate(transcript) if m["role"] == "assistant")
    prompt = tok.apply_chat_template(
        transcript[:first], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    eot = end_of_turn_text(tok)
    expected = _assistant_spans(family, rendered, transcript, eot, len(prompt), stop_after_calls)
    assert masked == expected


def _incremental_rendering(tok, family, transcript, tools):
    """What a sampler that never re-renders earlier turns must produce, computed from full
    renderings: the prompt, then each generated body + end-of-turn token, then for each
    environment answer the text its rendering puts after the end-of-turn token that precedes
    it (located by searching for the answer's content). Returns (text, generated spans)."""
    eot = end_of_turn_text(tok)
    first = next(i for i, m in enumerate(transcript) if m["role"] == "assistant")
    text = tok.apply_chat_template(
        transcript[:first], tools=tools, tokenize=False, add_generation_prompt=True
    )
    spans, i = [], first
    while i < len(transcript):
        if transcript[i]["role"] == "assistant":
            gen = _body(family, transcript[i]) + eot
            spans.append((len(text), len(text) + len(gen)))
            text, i = text + gen, i + 1
            continue
        j = i
        while j < len(transcript) and transcript[j]["role"] != "assistant":
            j += 1
        step = tok.apply_chat_template(
            transcript[:j], tools=tools, tokenize=False, add_generation_prompt=True
        )
        at = step.rindex(transcript[i]["content"])
        text += step[step.rindex(eot, 0, at) + len(eot) :]
        i = j
    return text, spans


REASONING = {
    # Qwen3 drops the earlier turn's <think> block once a later user turn exists
    "user_follow_up": [
        SYSTEM,
        USER,
        _asst("<think>\n2 + 3 = 5, times 7 is 35.\n</think>\n\nIt is 35."),
        {"role": "user", "content": "Thanks! What about 6 * 7?"},
        _asst("<think>\nSix sevens.\n</think>\n\nThat is 42."),
    ],
    # ... and gives the final turn an empty <think> block when it has none
    "tool_round_trip": [
        SYSTEM,
        USER,
        _asst("<think>\nUse the tool.\n</think>\n\nLet me compute that.", "2+3"),
        {"role": "tool", "content": "5"},
        _asst("Final answer: 35."),
    ],
}


@pytest.mark.parametrize("name", list(REASONING))
def test_reasoning_template_stream_is_the_incremental_rendering(toks, name):
    """The Qwen3-style reasoning template re-renders generated turns (drops or adds <think>
    blocks), so the one-shot rendering of the transcript differs from the stream. That is fine:
    the sampler never re-renders a turn it generated, and the turns before a generated one do
    not change. The stream equals the step-by-step rendering and the mask covers exactly the
    generated text."""
    tok, transcript = toks["reasoning"], REASONING[name]
    ids, mask = _simulate(tok, "qwen", transcript, TOOLS)
    text, masked = _masked_spans(tok, ids, mask)
    expected, spans = _incremental_rendering(tok, "qwen", transcript, TOOLS)
    assert text == expected
    assert masked == spans
    rendered = tok.apply_chat_template(transcript, tools=TOOLS, tokenize=False)
    assert text + CLOSING_GLUE["qwen"] != rendered


# --- errors ----------------------------------------------------------------------------------


def test_not_prefix_preserving_is_one_clear_line(toks):
    tok = toks["tools_late"]
    user = {"role": "user", "content": "And 6 * 7?"}
    with pytest.raises(GrpoError) as err:
        message_delta(tok, user, after_stop=True, tools=TOOLS)
    msg = str(err.value)
    assert "\n" not in msg
    assert "'tools-before-last-user'" in msg and "not prefix-preserving" in msg and "'user'" in msg
    # the same template is fine for a tool message, and for users when no tools move around
    assert message_delta(tok, {"role": "tool", "content": "5"}, after_stop=True, tools=TOOLS)
    assert message_delta(tok, user, after_stop=True).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("message", "match"),
    [
        ({"role": "assistant", "content": "x"}, "environment role"),
        ({"role": "tool", "content": ["x"]}, "string 'content'"),
        ([], "at least one message"),
    ],
)
def test_bad_messages_fail_clearly(toks, message, match):
    with pytest.raises(GrpoError, match=match):
        message_delta(toks["qwen"], message, after_stop=True)
