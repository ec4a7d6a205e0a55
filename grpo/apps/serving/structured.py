"""Structured outputs for `grpo serve`: a request's `response_format` compiled by a grammar
engine (llguidance) into a grammar over the model's vocabulary, enforced token by token in the
batched sampler (`grpo.rollout.TokenConstraint`): at each decode step a constrained row's
logits get -inf on every token the grammar does not allow next, so the reply is JSON of the
schema by construction. Constrained and unconstrained requests share one batch; rows without a
grammar are not touched.

    formats = Grammars(tokenizer, vocab_size)
    grammar = formats.compile("json_schema", schema, strict=True)   # cached by the schema's text
    constraint = formats.constraint([grammar, None, grammar])       # one entry per batch row

`response_format`:
    {"type": "text"}: no constraint.
    {"type": "json_object"}: a JSON object (any keys).
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}:
        JSON valid under the schema. `strict: true` also refuses properties the schema does not
        name (OpenAI's strict mode: ``additionalProperties: false`` where it is not given).

The JSON is written as `json.dumps` writes it (``{"a": 1, "b": [2]}``), its properties in the
schema's order (the engine fixes the order). Once the grammar is complete only the
end-of-sequence token may follow, so a reply that ends with `finish_reason: "stop"` parses
and validates; one cut by `max_tokens` reports "length" (its text is a prefix of such JSON).
A schema the engine cannot compile is a 400 naming it. Why llguidance: docs/serving.md,
"Structured outputs" (benchmarks/bench_grammar.py).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from grpo.settings import FieldError

# JSON as `json.dumps` writes it (one line, ", " and ": "), what models read and write most: no
# other white space, so a model cannot spend its budget on it.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 64  # compiled grammars kept (by schema text); least recently used go first


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled response format: a matcher in its start state (each row gets a copy) and the
    text it was compiled from."""

    key: str
    start: object


def strict_schema(schema):
    """OpenAI's strict mode: every object schema without ``additionalProperties`` gets
    ``false`` (a copy; the rest unchanged)."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class Grammars:
    """The grammar engine for one tokenizer: compiles response formats (cached by their text)
    and makes the per-batch `TokenConstraint`.

    Args:
        tokenizer: the served model's Hugging Face tokenizer (its eos token ends a reply).
        vocab_size: the model's vocabulary (logits width; may exceed the tokenizer's).
    """

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self._llg, self._lt = llguidance, llguidance.torch
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self._hf_tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.vocab_size = vocab_size
        self._executor = llguidance.LLExecutor()
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(
        self,
        kind: str,
        schema: dict | None = None,
        strict: bool = False,
        field: str = "response_format",
    ) -> Grammar:
        """The grammar of `kind` ("json_object", or "json_schema" with `schema`); raises
        FieldError naming `field` when the engine cannot compile the schema."""
        if kind == "json_object":
            schema, strict = {"type": "object"}, False
        if strict:
            schema = strict_schema(schema)
        text = json.dumps(schema)  # key order kept: properties come out in the schema's order

        def grammar():
            styled = {**schema, "x-guidance": JSON_STYLE} if isinstance(schema, dict) else schema
            return self._llg.LLMatcher.grammar_from_json_schema(json.dumps(styled))

        return self._compiled(f"{kind}|{int(strict)}|{text}", grammar, field, "schema")

    def tool_call(self, tools: Sequence[dict], name: str | None, close: str) -> Grammar:
        """The rest of a forced tool call (`tool_choice` required, or the function `name`),
        after the prefix the server writes (``<tool_call>\n{"name": "`` / ``...{"name": "N",
        "arguments":``): the function's name (required), the arguments as JSON of its
        `parameters` (strict ones: `strict_schema`; the others: any object), ``}\n`` and
        the `close` tag, then the end of the reply. The wrapper is fixed text; a tag the
        tokenizer keeps as one special token is that token."""
        chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
        rules, alts = [], []
        for i, fn in enumerate(chosen):
            head = "" if name is not None else json.dumps(fn["name"] + '", "arguments":')
            alts.append(f'{head} " " a{i} "}}\\n" {self._tag(close)}'.strip())  # "}\n" CLOSE
            rules.append(f"a{i}: %json {_arguments(fn)}")
        lark = "start: " + " | ".join(alts) + "\n" + "\n".join(rules) + "\n"
        grammar = lambda: self._llg.LLMatcher.grammar_from_lark(lark)  # noqa: E731
        return self._compiled(f"tool_call|{lark}", grammar, "tools", "parameters")

    def tool_calls(self, tools: Sequence[dict], parallel: bool, open: str, close: str) -> Grammar:
        """A reply under `tool_choice` auto with strict functions: any text, in which every
        tool call (from the `open` tag on) is ``<tool_call>\n{"name": N, "arguments": A}\n
        </tool_call>`` with N a listed function and A JSON of its parameters (strict ones:
        `strict_schema`; the others: any object), the format the chat template renders; text
        may follow a call. Without `parallel` at most one call. Text that is not a call never
        holds the `open` tag, so every call the reply begins is one the server can parse."""
        fns = [t["function"] for t in tools]
        alts = " | ".join(f"f{i}" for i in range(len(fns)))
        rules = [f"call: head ({alts})"]
        for i, fn in enumerate(fns):
            head = json.dumps(f'\n{{"name": {json.dumps(fn["name"])}, "arguments": ')
            rules.append(f'f{i}: {head} a{i} "}}\\n" {self._tag(close)}')
            rules.append(f"a{i}: %json {_arguments(fn)}")
        tag = self._tag(open)
        if tag.startswith("<["):  # one special token: text cannot spell it
            rules += [f"head: TEXT? {tag}", "TEXT: /(?s:.+)/", "REST: /(?s:.*)/"]
        else:  # the shortest text ending in the tag; the last text without it
            pattern = re.escape(open)
            rules += [
                f"head[lazy]: /(?s:.*){pattern}/",
                f"REST: /(?s:.*)/ & ~/(?s:.*){pattern}(?s:.*)/",
            ]
        lark = f"start: call{'*' if parallel else '?'} REST\n" + "\n".join(rules) + "\n"
        grammar = lambda: self._llg.LLMatcher.grammar_from_lark(lark)  # noqa: E731
        return self._compiled(f"tool_calls|{lark}", grammar, "tools", "parameters")

    def _tag(self, tag: str) -> str:
        """A chat-format tag in lark: its token (``<[id]>``) when the tokenizer keeps it as one
        special token, else the text."""
        tok = self._hf_tokenizer
        tid = tok.convert_tokens_to_ids(tag)
        if tag in getattr(tok, "all_special_tokens", ()) and isinstance(tid, int):
            return f"<[{tid}]>"
        return json.dumps(tag)

    def _compiled(self, key: str, grammar, field: str, what: str) -> Grammar:
        """The cached `Grammar` of `key`, else `grammar()` compiled (and cached); an engine
        error is a FieldError naming `field`."""
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        problem = None
        try:
            start = self._llg.LLMatcher(self._tokenizer, grammar(), log_level=0)
            if start.is_error():
                problem = start.get_error()
        except Exception as e:  # the engine's own errors (ValueError / RuntimeError)
            problem = e
        if problem is not None:
            raise FieldError(
                f"{field}: the grammar engine cannot compile this {what}: {_first_line(problem)}",
                field=field,
            )
        out = Grammar(key, start)
        with self._lock:
            self._cache[key] = out
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return out

    def constraint(self, grammars: Sequence[Grammar | None]) -> RowGrammars | None:
        """The `TokenConstraint` of a batch (one entry per row; None: unconstrained), or None
        when no row has a grammar."""
        if not any(g is not None for g in grammars):
            return None
        return RowGrammars(self, grammars)


def _arguments(fn: dict) -> str:
    """A function's arguments as a JSON schema for the grammar: its `parameters` made strict
    when it is `strict`, else any object."""
    params = fn.get("parameters") or {"type": "object"}
    params = strict_schema(params) if fn.get("strict") else {"type": "object"}
    return json.dumps({**params, "x-guidance": JSON_STYLE})


def _first_line(e) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


class RowGrammars:
    """One batch's grammar matchers (`grpo.rollout.TokenConstraint`): per constrained row a
    matcher that masks its logits and reads the token it drew. A row leaves the constraint
    once it drew the end-of-sequence token, or a token its grammar refused (the stop the
    server forces at the row's `max_tokens`).

    Each step fills the rows' bitmasks (one row after another; with a large vocabulary and
    several rows on the engine's thread pool), unpacks them where the logits are and sets
    the refused tokens to -inf. Measured (docs/serving.md): a worker thread that filled the
    next masks during the forward lost more to the GIL than it overlapped, and the engine's
    pool at a 384-token vocabulary cost more than it saved."""

    PARALLEL_VOCAB = 32768  # fill on the engine's pool from this vocabulary size up

    def __init__(self, engine: Grammars, grammars: Sequence[Grammar | None]):
        self._lt, self._executor, self._eos = engine._lt, engine._executor, engine.eos_id
        self._matchers = {b: g.start.deep_copy() for b, g in enumerate(grammars) if g is not None}
        self._bitmask = self._lt.allocate_token_bitmask(len(grammars), engine.vocab_size)
        self._bitmask.fill_(-1)  # every token allowed: the rows without a grammar
        self._vocab = engine.vocab_size
        self._shifts = None

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._matchers:
            return logits
        rows = [(m, b) for b, m in self._matchers.items()]
        if len(rows) > 1 and self._vocab >= self.PARALLEL_VOCAB:
            self._lt.fill_next_token_bitmask_par(self._executor, rows, self._bitmask)
        else:
            for m, b in rows:
                self._lt.fill_next_token_bitmask(m, self._bitmask, b)
        if logits.device.type == "cpu":  # token i: word i // 32, bit i % 32 (little-endian)
            bits = np.unpackbits(self._bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
            refused = torch.from_numpy(bits[:, : self._vocab] == 0)
        else:  # the packed words go to the device, unpacked there
            if self._shifts is None or self._shifts.device != logits.device:
                self._shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
            words = self._bitmask.to(logits.device, non_blocking=True)
            bits = (words[:, :, None] >> self._shifts) & 1  # (B, V / 32, 32)
            refused = bits.view(words.shape[0], -1)[:, : self._vocab] == 0
        return logits.float().masked_fill(refused, float("-inf"))

    def advance(self, tokens: torch.Tensor) -> None:
        if not self._matchers:
            return
        ids = tokens.tolist()
        for b, m in list(self._matchers.items()):
            if ids[b] == self._eos or not m.consume_token(ids[b]):
                del self._matchers[b]
                self._bitmask[b].fill_(-1)
