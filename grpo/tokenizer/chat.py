"""Chat encoding that is a trust boundary, and the chat template's deltas for multi-turn rollouts.

`encode_chat` renders a conversation with the tokenizer's chat template and encodes it with only
the template's own tags as special tokens: every message content (system prompt, user text,
tool results, observations) is plain text, so special-token text in it cannot forge a turn.
`message_delta` / `message_delta_ids`: the template's text between a generated assistant turn
and the next (closing glue, the new message, the next assistant header), cut once per template
and cached per tokenizer (in this module, never on the tokenizer object).
"""

from __future__ import annotations

import bisect
import json
import re
import weakref
from collections.abc import Callable, Sequence
from functools import partial

from grpo.errors import GrpoError

# Per tokenizer: its template cuts and its plain backend. Kept here, keyed weakly by the
# tokenizer (an entry goes with it), never set as an attribute on the tokenizer, a third
# party's object; no value refers back to its tokenizer.
_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cache(tokenizer) -> dict:
    """`tokenizer`'s cache: ("delta", ...) and ("end_of_turn", ...) cuts, ("plain",) backend."""
    return _CACHES.setdefault(tokenizer, {})


# --- Chat structure: only the template's own tags are special tokens --------------------------
#
# `tokenizer(text)` turns every added-token string in `text` into its id, so a user message, a
# tool result or an environment observation holding "<|im_end|><|im_start|>assistant\n" would
# close its turn and open a forged one. Conversations are therefore encoded from pieces: the
# template's own text with its tags parsed, every message content with special-token strings as
# plain text. Contents are located by rendering them as placeholders (as `message_delta` does);
# when no added token touches a content (the usual case) the ids are exactly those of
# `tokenizer(rendering, add_special_tokens=False)`.


class ChatStructureError(GrpoError):
    """Special-token text that would enter the chat structure. `field` names where it is
    (``messages[2].content``, ``tools[0]``); `index` is the message's index, if a message's."""

    def __init__(self, field: str, problem: str, index: int | None = None):
        super().__init__(f"{field}: {problem}")
        self.field, self.problem, self.index = field, problem, index


def encode_chat(
    tokenizer,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs,
) -> list[int]:
    """The chat template's rendering of `messages` as token ids: the template's own tags as
    special tokens, every message content (system prompt, user text, tool results) as plain
    text, whatever special-token strings it holds.

    Args:
        tokenizer: a fast `transformers` tokenizer with a chat template.
        messages: {"role", "content", ...} dicts; string contents are encoded as plain text.
        tools: tool schemas for the template; they may not hold special-token text.
        add_generation_prompt: end with the assistant header.
        **template_kwargs: passed on to the template (e.g. `enable_thinking=False`).

    Returns:
        the ids; without special-token text in the contents, exactly
        `tokenizer(apply_chat_template(..., tokenize=False), add_special_tokens=False)`'s.

    Raises:
        GrpoError: the template cannot render the messages.
        ChatStructureError: special-token text in a field other than a content (a tool schema,
            a tool call's arguments, a name), or in a content the template's rendering cannot
            be cut around (it changes the surrounding text with the content).
    """
    check_chat_fields(tokenizer, messages, tools)

    def render(msgs: list[dict]) -> str:
        return _render(tokenizer, msgs, tools, add_generation_prompt, template_kwargs)

    return encode_pieces(tokenizer, _content_pieces(render, messages, tokenizer))


def plain_ids(tokenizer, text: str) -> list[int]:
    """`text` as token ids with its special-token strings as plain text (no added token)."""
    return encode_pieces(tokenizer, [(text, True)])


def check_chat_fields(tokenizer, messages: Sequence[dict], tools: list[dict] | None) -> None:
    """Raise `ChatStructureError` where a field the template renders as structure, not as a
    content (a tool schema, an assistant's tool calls, a name or id), holds an added-token
    string: only contents are encoded as plain text."""
    tags = [t for t in tokenizer.get_added_vocab() if t]
    fields = [(f"tools[{j}]", tool, None) for j, tool in enumerate(tools or [])]
    fields += [
        (f"messages[{i}].{k}", v, i)
        for i, m in enumerate(messages)
        for k, v in m.items()
        if k != "content"
    ]
    for field, value, index in fields:
        tag = _first_tag(tags, json.dumps(value, ensure_ascii=False, default=str))
        if tag is not None:
            raise ChatStructureError(
                field,
                f"holds the special-token text {tag!r}, which the chat "
                "template would render as chat structure (only message "
                "contents are encoded as plain text)",
                index,
            )


def encode_pieces(tokenizer, pieces: Sequence[tuple[str, bool]]) -> list[int]:
    """The ids of the concatenated `(text, is_content)` pieces: special tokens parsed in the
    template's text, contents as plain text.

    When no added token of `tokenizer(text)` overlaps a content, its ids are returned as they
    are (a conversation without special-token text in its contents encodes as it always did).
    Otherwise the text is cut at the template's own tags and each run between two of them
    (contents included) is encoded by the tokenizer's model without its added vocabulary.
    That cut is checked on the template's text alone first: it must give the tokenizer's own
    ids, as it does for byte-level BPE (Qwen, Llama 3), where added tokens split the text before
    the BPE sees it; tokenizers whose added tokens strip the whitespace around them fail the
    check and raise rather than encode differently.

    Raises:
        GrpoError: a content holds special-token text and the tokenizer is not a fast one, or
            fails the check above.
    """
    text = "".join(t for t, _ in pieces)
    spans, pos = [], 0  # character spans of the contents
    for t, is_content in pieces:
        if is_content and t:
            spans.append((pos, pos + len(t)))
        pos += len(t)
    if not spans:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if getattr(tokenizer, "backend_tokenizer", None) is None:  # no offsets: look at the strings
        tags = [t for t in tokenizer.get_added_vocab() if t]
        if not any(tag in text[a:b] for a, b in spans for tag in tags):
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        raise GrpoError(
            f"tokenizer {_name(tokenizer)!r} is not a fast tokenizer: a message "
            "content holding special-token text cannot be encoded as plain "
            "text"
        )
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    added = set(tokenizer.get_added_vocab().values())
    # does an added token overlap a content? spans are sorted and disjoint: one bisect per
    # added token (linear in the conversation, not tokens x messages)
    starts = [a for a, _ in spans]
    overlap = False
    for i, (s, e) in zip(enc["input_ids"], enc["offset_mapping"]):
        if i in added and e > s:
            j = bisect.bisect_right(starts, e - 1) - 1  # the last span starting before e
            if j >= 0 and spans[j][1] > s:
                overlap = True
                break
    if not overlap:
        return list(enc["input_ids"])
    template = "".join(t for t, c in pieces if not c)
    want = tokenizer(template, add_special_tokens=False)["input_ids"]
    if _cut_at_tags(tokenizer, [(template, False)]) != want:
        raise GrpoError(
            f"tokenizer {_name(tokenizer)!r} does not split its text at its added "
            "tokens alone (they strip whitespace, or a prefix space is added), so a "
            "message content holding special-token text cannot be encoded as plain "
            "text"
        )
    return _cut_at_tags(tokenizer, pieces)


def _cut_at_tags(tokenizer, pieces: Sequence[tuple[str, bool]]) -> list[int]:
    """Added tokens in the template's pieces as their ids; every run of text between two of
    them, contents included, encoded by the model alone (`_plain_backend`)."""
    plain = _plain_backend(tokenizer)
    vocab = tokenizer.get_added_vocab()
    longest_first = sorted((t for t in vocab if t), key=len, reverse=True)  # as the tokenizer
    tags = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")
    ids: list[int] = []
    run: list[str] = []

    def flush() -> None:
        if "".join(run):
            ids.extend(plain.encode("".join(run), add_special_tokens=False).ids)
        run.clear()

    for text, is_content in pieces:
        pos = 0
        for m in [] if is_content else tags.finditer(text):
            run.append(text[pos : m.start()])
            flush()
            ids.append(vocab[m.group()])
            pos = m.end()
        run.append(text[pos:])
    flush()
    return ids


def _plain_backend(tokenizer):
    """The tokenizer's normalizer, pre-tokenizer and model with no added vocabulary (a
    `tokenizers.Tokenizer` sharing the model): every string is plain text to it. Its special
    tokens would need `split_special_tokens=True`, which still leaves added tokens that are not
    special (Qwen's `<tool_call>`) whole."""
    from tokenizers import Tokenizer

    cache = _cache(tokenizer)
    if ("plain",) not in cache:
        backend = tokenizer.backend_tokenizer
        plain = Tokenizer(backend.model)
        if backend.normalizer is not None:
            plain.normalizer = backend.normalizer
        if backend.pre_tokenizer is not None:
            plain.pre_tokenizer = backend.pre_tokenizer
        cache[("plain",)] = plain
    return cache[("plain",)]


def _content_pieces(
    render: Callable[[list[dict]], str], messages: list[dict], tokenizer, strict: bool = True
) -> list[tuple[str, bool]]:
    """`render(messages)` as (text, is_content) pieces, each message content (as the template
    wrote it) a content piece.

    Found from one rendering with every non-empty string content replaced by a placeholder.
    When splicing the contents into it does not give the real rendering (the template trims
    or escapes contents), each content is taken from a rendering where only it is real. When
    that fails too (the template's text around a content depends on it), the rendering is one
    template piece if no content holds special-token text or not `strict` (the text alone is
    wanted), and `ChatStructureError` otherwise.
    """
    real = render(messages)
    idx = [i for i, m in enumerate(messages) if isinstance(m.get("content"), str) and m["content"]]
    if not idx:
        return [(real, False)]
    phs = {_CONTENT_PH.format(i): i for i in idx}
    real_at = set(idx)  # a set: `i in idx` made this quadratic in the messages
    dummy = [
        {**m, "content": _CONTENT_PH.format(i)} if i in real_at else m
        for i, m in enumerate(messages)
    ]
    skeleton = render(dummy)
    # one pattern for every placeholder, not an alternation of them: compiling one of 24,000
    # alternatives takes a second in C, holding the GIL (a server's event loop with it)
    gaps = [g for g in _CONTENT_RE.finditer(skeleton) if g.group() in phs]

    def pieces(contents: dict[int, str]) -> list[tuple[str, bool]] | None:
        out, pos = [], 0
        for g in gaps:
            i = phs[g.group()]
            if i not in contents:
                return None
            out += [(skeleton[pos : g.start()], False), (contents[i], True)]
            pos = g.end()
        out.append((skeleton[pos:], False))
        return out if "".join(t for t, _ in out) == real else None

    out = pieces({i: messages[i]["content"] for i in idx})
    if out is not None:
        return out
    written = {}
    where_of: dict[int, list] = {}
    for g in gaps:
        where_of.setdefault(phs[g.group()], []).append(g)
    for i in idx:
        where = where_of.get(i, [])
        if len(where) != 1:
            continue
        head, tail = skeleton[: where[0].start()], skeleton[where[0].end() :]
        one = render([messages[i] if j == i else d for j, d in enumerate(dummy)])
        if one.startswith(head) and one.endswith(tail) and len(one) >= len(head) + len(tail):
            written[i] = one[len(head) : len(one) - len(tail)]
    out = pieces(written)
    if out is not None:
        return out
    tags = [t for t in tokenizer.get_added_vocab() if t] if strict else []
    for i in idx:
        tag = _first_tag(tags, messages[i]["content"])
        if tag is not None:
            raise ChatStructureError(
                f"messages[{i}].content",
                f"holds the special-token text {tag!r}, and the chat template of tokenizer "
                f"{_name(tokenizer)!r} changes the text around this content with it, so the "
                "content cannot be encoded apart as plain text",
                i,
            )
    return [(real, False)]


# --- Multi-turn rollouts: the chat template's delta for an environment message ---------------
#
# The sampler never re-tokenizes earlier turns: after a generated assistant turn it appends the
# ids of the text the chat template puts between the end of that turn and the start of the next
# assistant content. That text is found by rendering a dummy conversation
# [user U, assistant A, *messages] and cutting it right after A (and after the end-of-turn token
# when the model emitted it); message contents become placeholders, so the cut is cached per
# template and the real contents are spliced in at each call.

_USER_PH = "GrpoDummyUserQz"
_ASSISTANT_PH = "GrpoDummyAssistantQz"
_CONTENT_PH = "GrpoDummyContent{}Qz"  # one per appended message; "Qz" ends the index
_CONTENT_RE = re.compile(r"GrpoDummyContent\d+Qz")  # any _CONTENT_PH
# Content that a template rendering contents verbatim reproduces exactly, but that trim, escape,
# tojson or indent would change: the cached cut is used only if splicing it in matches a render.
_PROBE = ' \n  probe "quoted" \\ {{ x }} {% y %} <b>&amp;\ttab\n\n '
_RESERVED = ("conversation", "tools", "tokenize", "add_generation_prompt", "continue_final_message")


def message_delta(
    tokenizer,
    message: dict | list[dict],
    *,
    after_stop: bool,
    tools: list[dict] | None = None,
    **template_kwargs,
) -> str:
    """The chat-template text that follows a generated assistant turn when `message` answers it.

    It runs from the end of the generated turn to where the next assistant turn's content
    begins: the template's closing glue for the assistant turn (ChatML's "\\n" after
    `<|im_end|>`), the rendering of `message` and the generation prompt
    ("<|im_start|>assistant\\n"). With `after_stop=False` the model stopped without emitting the
    end-of-turn token (e.g. right after `</tool_call>`), so the delta starts with that token's
    text too ("<|im_end|>\\n<|im_start|>user\\n<tool_response>..." for Qwen).

    Supported: any template that renders the turns before the generated one the same whatever
    follows, closes assistant turns with an added (special) token, and whose glue after an
    assistant turn does not depend on that turn's content or tool calls (ChatML / Qwen, Llama 3).
    Templates that re-render the generated turn itself (Qwen3 dropping `<think>` blocks of turns
    before the last user message, or adding an empty one to the final turn) are fine: the
    sampler never re-renders a turn it generated. Several environment messages that answer one
    turn (one tool message per tool call) must be passed together as a list: templates that
    group consecutive tool messages into one turn (Qwen's `<tool_response>` blocks) render them
    correctly only together. Not supported: non-string (multimodal) content, templates that
    insist the preceding assistant turn carries matching `tool_calls`, and glue that depends on
    tool calls (Llama 3.1's `<|eom_id|>` after built-in tools).

    Cost: the cut is cached per tokenizer (in this module, not on the tokenizer) and per
    (template, roles and other message keys, after_stop, tools, template kwargs); a call then
    only joins strings. A template that
    rewrites contents (trim, tojson) is detected once and rendered at every call instead.

    Args:
        tokenizer: a `transformers` tokenizer with a chat template.
        message: a non-assistant message {"role": "tool" | "user" | ..., "content": str}, or a
            list of consecutive ones answering the same assistant turn.
        after_stop: whether the generated turn ended with the template's end-of-turn token.
        tools: the tool schemas the conversation was rendered with (they may change the
            template's output, e.g. select a tool-use template).
        **template_kwargs: passed on to the template (e.g. `enable_thinking=False`).

    Returns:
        the delta text; encode it with `message_delta_ids` (`tokenizer(text)` would parse
        special-token text in the message as chat structure).

    Raises:
        GrpoError: when rendering `message` changes the turns before the assistant turn
            (the template is not prefix-preserving for it), or the template cannot render it.
    """
    pieces = _delta_pieces(tokenizer, message, after_stop, tools, template_kwargs, strict=False)
    return "".join(text for text, _ in pieces)


def message_delta_ids(
    tokenizer,
    message: dict | list[dict],
    *,
    after_stop: bool,
    tools: list[dict] | None = None,
    **template_kwargs,
) -> list[int]:
    """`message_delta` as token ids (`encode_pieces`): the template's own tags as special
    tokens, the message contents as plain text. Without special-token text in the contents,
    the ids of `tokenizer(delta, add_special_tokens=False)`; the delta starts after a special
    token, so no BPE merge crosses its start.

    Raises:
        ChatStructureError: special-token text in a field other than a content (a tool schema,
            a message's name), or in a content the template's rendering cannot be cut around.
    """
    messages = [message] if isinstance(message, dict) else list(message)
    pieces = _delta_pieces(tokenizer, messages, after_stop, tools, template_kwargs)
    check_chat_fields(tokenizer, messages, tools)
    return encode_pieces(tokenizer, pieces)


def _delta_pieces(
    tokenizer, message, after_stop, tools, template_kwargs, strict: bool = True
) -> list[tuple[str, bool]]:
    """`message_delta` as (text, is_content) pieces (see `encode_pieces`; `strict` as in
    `_content_pieces`)."""
    messages = [message] if isinstance(message, dict) else list(message)
    _check_env_messages(tokenizer, messages, template_kwargs)
    key = (
        "delta",
        tokenizer.get_chat_template(None, tools),
        _canonical([{k: v for k, v in m.items() if k != "content"} for m in messages]),
        bool(after_stop),
        _canonical(tools),
        _canonical(template_kwargs),
    )
    cache = _cache(tokenizer)
    if key not in cache:
        cache[key] = _delta_segments(tokenizer, messages, after_stop, tools, template_kwargs)
    segments = cache[key]
    if segments is None:  # the template rewrites contents: render these very messages
        render = partial(
            _render_delta, tokenizer, after_stop=after_stop, tools=tools, kwargs=template_kwargs
        )
        return _content_pieces(render, messages, tokenizer, strict)
    out = [(segments[0], False)]
    for m, seg in zip(messages, segments[1:]):
        out += [(m["content"], True), (seg, False)]
    return out


def end_of_turn_text(tokenizer) -> str:
    """The special token the chat template closes assistant turns with ("<|im_end|>", "<|eot_id|>").

    Found by rendering [user, assistant, user] and taking the longest added token that starts
    the text right after the assistant content.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise GrpoError(f"tokenizer {_name(tokenizer)!r} has no chat template")
    key = ("end_of_turn", tokenizer.get_chat_template(None, None))
    cache = _cache(tokenizer)
    if key not in cache:
        conv = [
            {"role": "user", "content": _USER_PH},
            {"role": "assistant", "content": _ASSISTANT_PH},
            {"role": "user", "content": _USER_PH},
        ]
        text = _render(tokenizer, conv, None, False, {})
        end = text.find(_ASSISTANT_PH)
        if end < 0:
            raise GrpoError(
                f"the chat template of tokenizer {_name(tokenizer)!r} does not render an "
                "assistant message's content verbatim"
            )
        cache[key] = _end_of_turn_at(tokenizer, text[end + len(_ASSISTANT_PH) :])
    return cache[key]


def _delta_segments(tokenizer, messages, after_stop, tools, kwargs) -> tuple[str, ...] | None:
    """The delta split around each message's content: len(messages) + 1 literal pieces, or None
    when the template does not render contents verbatim (checked once with `_PROBE`)."""
    phs = [_CONTENT_PH.format(i) for i in range(len(messages))]
    dummy = [{**m, "content": ph} for m, ph in zip(messages, phs)]
    text = _render_delta(tokenizer, dummy, after_stop, tools, kwargs)
    segments, rest = [], text
    for ph in phs:
        if text.count(ph) != 1 or ph not in rest:
            return None  # content dropped, repeated or reordered: render at every call
        head, _, rest = rest.partition(ph)
        segments.append(head)
    segments.append(rest)
    probe = [{**m, "content": _PROBE} for m in messages]
    spliced = segments[0] + "".join(_PROBE + s for s in segments[1:])
    if spliced != _render_delta(tokenizer, probe, after_stop, tools, kwargs):
        return None
    return tuple(segments)


def _render_delta(tokenizer, messages, after_stop, tools, kwargs) -> str:
    """The delta for these exact messages, cut from one rendering of the dummy conversation."""
    head = [{"role": "user", "content": _USER_PH}]
    before = _render(tokenizer, head, tools, False, kwargs)
    turn = {"role": "assistant", "content": _ASSISTANT_PH}
    full = _render(tokenizer, [*head, turn, *messages], tools, True, kwargs)
    if not full.startswith(before):
        roles = "+".join(m["role"] for m in messages)
        raise GrpoError(
            f"the chat template of tokenizer {_name(tokenizer)!r} is not prefix-preserving for a "
            f"{roles!r} message: appending it changes how the earlier turns render, so the "
            "sampler's token stream would not match the template"
        )
    end = full.find(_ASSISTANT_PH, len(before))
    if end < 0:
        raise GrpoError(
            f"the chat template of tokenizer {_name(tokenizer)!r} does not render an assistant "
            "message's content verbatim"
        )
    end += len(_ASSISTANT_PH)
    if after_stop:
        end += len(_end_of_turn_at(tokenizer, full[end:]))
    return full[end:]


def _end_of_turn_at(tokenizer, tail: str) -> str:
    """The longest added (special) token that `tail` starts with."""
    matches = [t for t in tokenizer.get_added_vocab() if t and tail.startswith(t)]
    if not matches:
        raise GrpoError(
            f"the chat template of tokenizer {_name(tokenizer)!r} does not close an assistant "
            f"turn with a special token (it continues with {tail[:40]!r})"
        )
    return max(matches, key=len)


def _render(tokenizer, messages, tools, add_generation_prompt: bool, kwargs) -> str:
    """`apply_chat_template(..., tokenize=False)`, its failures as one-line `GrpoError`s."""
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except Exception as e:
        roles = ", ".join(m["role"] for m in messages)
        detail = " ".join(str(e).split())
        raise GrpoError(
            f"the chat template of tokenizer {_name(tokenizer)!r} cannot render roles "
            f"[{roles}]: {type(e).__name__}: {detail}"
        ) from None


def _check_env_messages(tokenizer, messages: list, kwargs: dict) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise GrpoError(f"tokenizer {_name(tokenizer)!r} has no chat template")
    if not messages:
        raise GrpoError("message_delta needs at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise GrpoError(f"message {i}: expected a dict with a string 'content', got {m!r}")
        if m.get("role") in (None, "assistant"):
            raise GrpoError(
                f"message {i}: role must be an environment role (tool, user, ...), "
                f"got {m.get('role')!r}; assistant turns are generated"
            )
    bad = sorted(set(kwargs) & set(_RESERVED))
    if bad:
        raise GrpoError(f"message_delta sets {bad} itself; do not pass them as template kwargs")


def _first_tag(tags: list[str], text: str) -> str | None:
    """The added-token string of `tags` that occurs first in `text` (None: none does)."""
    return min((t for t in tags if t in text), key=text.index, default=None)


def _canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, default=repr)


def _name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
