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
A schema the engine cannot compile is a 400 naming it, and so is one the engine would accept
but could not finish (`check_schema`): a `$ref` cycle that every instance must follow (no
finite JSON matches it), or a pattern whose nested counted repetitions multiply past
`MAX_NESTED_REPEAT` (the engine's lexer runs out of states mid-string). Should a row still
draw end-of-sequence with its grammar not complete, `Grammars.accepts` says so and the server
answers 500 rather than "stop". Why llguidance: docs/serving.md, "Structured outputs"
(benchmarks/bench_grammar.py).
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
# Nested counted repetitions in a pattern (``(a{1,100}){1,100}``) multiply the states of the
# engine's lazy lexer: measured on llguidance 1.9, a product of 10^4 exhausts it about 100
# characters in, 2,500 did not within 1,000. A single count (``a{1,100000}``) is cheap.
MAX_NESTED_REPEAT = 1000


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


def check_schema(schema, field: str) -> None:
    """Refuse a schema the engine compiles but cannot finish: raises FieldError naming
    `field` when no finite JSON matches it (a `$ref` cycle on every path: ``{"$ref": "#"}``,
    A -> B -> A through required properties), or when a pattern's nested counted repetitions
    multiply past `MAX_NESTED_REPEAT`. Recursion that may stop (a tree whose `children` may be
    empty) passes."""
    try:
        endless = _endless_ref(schema)
        patterns = list(_patterns(schema))
    except RecursionError:  # nested past Python's stack: the engine's own limits decide
        return
    if endless is not None:
        raise FieldError(f"{field}: {endless}", field=field)
    for pattern in patterns:
        product = _nested_repeat(pattern)
        if product > MAX_NESTED_REPEAT:
            raise FieldError(
                f"{field}: the pattern {json.dumps(pattern)[:80]} nests counted repetitions "
                f"whose bounds multiply to {product:.3g} (at most {MAX_NESTED_REPEAT})",
                field=field,
            )


def _endless_ref(root) -> str | None:
    """Why no finite JSON value matches `root` (None when one may): the least fixed point of
    "has a finite instance" over the local `$ref` targets, each rule an over-estimate, so a
    schema is refused only when it is surely endless."""
    refs = {}  # "#/..." -> its target, every local $ref in the document
    for node in _nodes(root):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in refs:
            target = _resolve(root, ref)
            if target is not _MISSING:
                refs[ref] = target
    finite = dict.fromkeys(refs, False)
    changed = True
    while changed:
        changed = False
        for ref, target in refs.items():
            if not finite[ref] and _finite(target, finite):
                finite[ref] = changed = True
    if _finite(root, finite):
        return None
    endless = [r for r, ok in finite.items() if not ok]
    if not endless:
        return "no JSON value matches it"
    first = root.get("$ref") if isinstance(root, dict) and root.get("$ref") in endless else None
    ref = json.dumps(first or endless[0])
    return f"its $ref {ref} recurses on every path: no finite JSON matches it"


_MISSING = object()


def _resolve(root, ref: str):
    """The target of a local JSON-pointer `ref` ("#", "#/$defs/A"), else _MISSING (remote or
    anchor refs, or a pointer to nothing: the engine reports those)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return _MISSING
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _nodes(schema):
    """Every dict in `schema` (depth first)."""
    if isinstance(schema, dict):
        yield schema
        for v in schema.values():
            yield from _nodes(v)
    elif isinstance(schema, list):
        for v in schema:
            yield from _nodes(v)


def _finite(node, finite: dict) -> bool:
    """Whether `node` may have a finite instance, given which `$ref` targets may (`finite`)."""
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and finite.get(ref) is False:
        return False
    all_of = node.get("allOf")
    if isinstance(all_of, list) and not all(_finite(s, finite) for s in all_of):
        return False
    for key in ("anyOf", "oneOf"):
        alts = node.get(key)
        if isinstance(alts, list) and alts and not any(_finite(s, finite) for s in alts):
            return False
    types = node.get("type")
    if types is None and ("properties" in node or "required" in node):
        types = "object"  # as the engine reads it
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or "const" in node or "enum" in node:
        return True
    return any(_finite_type(t, node, finite) for t in types)


def _finite_type(kind, node: dict, finite: dict) -> bool:
    if kind == "object":
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        return all(_finite(props[k], finite) for k in required if isinstance(k, str) and k in props)
    if kind == "array":
        need = node.get("minItems", 0)
        prefix, items = node.get("prefixItems"), node.get("items", True)
        if isinstance(items, list):  # the older tuple form
            prefix, items = items, node.get("additionalItems", True)
        prefix = prefix if isinstance(prefix, list) else []
        need = need if isinstance(need, int) else 0
        firsts = range(min(need, len(prefix) + 1))  # the items beyond are like the last
        return all(_finite(prefix[j] if j < len(prefix) else items, finite) for j in firsts)
    return True


def _patterns(schema):
    """Every regular expression in `schema`: `pattern` values and `patternProperties` keys."""
    for node in _nodes(schema):
        if isinstance(node.get("pattern"), str):
            yield node["pattern"]
        if isinstance(node.get("patternProperties"), dict):
            yield from node["patternProperties"]


_COUNT = re.compile(r"\{(\d{0,12})(,?)(\d{0,12})\}")  # longer counts: not a count here


def _nested_repeat(pattern: str) -> int:
    """The largest product of the upper bounds of counted repetitions nested in one another
    (``((a{1,1000}){1,1000}){1,1000}``: 10^9; ``{m,}`` counts m; a count not inside another,
    or ``*`` / ``+``, counts 1). A scan, not a parser: escapes and classes are skipped."""
    frames = [[]]  # per open group: (product, counted levels) of each atom so far
    worst, i = 1, 0
    while i < len(pattern):
        c = pattern[i]
        atoms = frames[-1]
        m = _COUNT.match(pattern, i) if c == "{" else None
        if m and (m.group(1) or m.group(3)):
            bound = int(m.group(3) or m.group(1)) if m.group(2) else int(m.group(1) or 0)
            if atoms:
                product, levels = atoms[-1]
                atoms[-1] = (product * max(bound, 1), levels + 1)
                if levels >= 1:
                    worst = max(worst, atoms[-1][0])
            i = m.end()
            continue
        if c == "(":
            frames.append([])
        elif c == ")" and len(frames) > 1:
            inner = frames.pop()
            frames[-1].append(max(inner, default=(1, 0)))
        elif c == "\\":
            i += 1
            if pattern[i + 1 : i + 2] == "{":  # \p{L}, \u{..}: one atom
                i = pattern.find("}", i) if "}" in pattern[i:] else len(pattern)
            atoms.append((1, 0))
        elif c == "[":  # a class: up to its closing ] (a ] first in it is a literal)
            j = i + 1 + (pattern[i + 1 : i + 2] == "^")
            j += pattern[j : j + 1] == "]"
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j
            atoms.append((1, 0))
        elif c not in "|*+?^$":
            atoms.append((1, 0))
        i += 1
    return worst


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
        check_schema(schema, field)
        text = json.dumps(schema)  # key order kept: properties come out in the schema's order

        def grammar():
            styled = {**schema, "x-guidance": JSON_STYLE} if isinstance(schema, dict) else schema
            return self._llg.LLMatcher.grammar_from_json_schema(json.dumps(styled))

        return self._compiled(f"{kind}|{int(strict)}|{text}", grammar, field, "schema", schema)

    def tool_call(self, tools: Sequence[dict], name: str | None, close: str) -> Grammar:
        """The rest of a forced tool call (`tool_choice` required, or the function `name`),
        after the prefix the server writes (``<tool_call>\n{"name": "`` / ``...{"name": "N",
        "arguments":``): the function's name (required), the arguments as JSON of its
        `parameters` (strict ones: `strict_schema`; the others: any object), ``}\n`` and
        the `close` tag, then the end of the reply. The wrapper is fixed text; a tag the
        tokenizer keeps as one special token is that token."""
        chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
        _check_strict(tools)
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
        _check_strict(tools)
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

    def _compiled(self, key: str, grammar, field: str, what: str, schema=None) -> Grammar:
        """The cached `Grammar` of `key`, else `grammar()` compiled (and cached); an engine
        error is a FieldError naming `field` (and, for a bad pattern, where in `schema`)."""
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
            elif not start.is_accepting() and self._only_eos(start):
                problem = "no reply matches it (the grammar allows only the end at its start)"
        except Exception as e:  # the engine's own errors (ValueError / RuntimeError)
            problem = e
        if problem is not None:
            regex = _regex_error(problem, schema)
            if regex is not None:
                raise FieldError(f"{field}: {regex}", field=field)
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

    def _only_eos(self, matcher) -> bool:
        """Whether `matcher` allows no token but end-of-sequence next (or none at all)."""
        bits = bytearray(matcher.deep_copy().compute_bitmask())
        if self.eos_id is not None and self.eos_id // 8 < len(bits):
            bits[self.eos_id // 8] &= ~(1 << (self.eos_id % 8)) & 0xFF
        return not any(bits)

    def accepts(self, grammar: Grammar, ids: Sequence[int]) -> bool:
        """Whether the reply `ids` (its stop token left out) is complete under `grammar`: the
        check before a constrained reply is called "stop" (a slow twin of the sampler's
        masks: a matcher that ran out of its limits mid-reply allows only the end)."""
        m = grammar.start.deep_copy()
        return m.consume_tokens(list(ids)) and m.is_accepting()

    def constraint(self, grammars: Sequence[Grammar | None]) -> RowGrammars | None:
        """The `TokenConstraint` of a batch (one entry per row; None: unconstrained), or None
        when no row has a grammar."""
        if not any(g is not None for g in grammars):
            return None
        return RowGrammars(self, grammars)


def _check_strict(tools: Sequence[dict]) -> None:
    """`check_schema` on each strict function's parameters, naming ``tools[i]``."""
    for i, t in enumerate(tools):
        fn = t["function"]
        if fn.get("strict") and fn.get("parameters"):
            check_schema(strict_schema(fn["parameters"]), f"tools[{i}].function.parameters")


def _arguments(fn: dict) -> str:
    """A function's arguments as a JSON schema for the grammar: its `parameters` made strict
    when it is `strict`, else any object."""
    params = fn.get("parameters") or {"type": "object"}
    params = strict_schema(params) if fn.get("strict") else {"type": "object"}
    return json.dumps({**params, "x-guidance": JSON_STYLE})


def _first_line(e) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def _regex_error(e, schema) -> str | None:
    """One line for the engine's regex parse error (None for other errors). The engine's text
    spans lines (``regex parse error:``, the pattern, a caret line, ``error: <reason>``), so its
    first line alone says nothing: this names the pattern (and its place in `schema` when
    found) and the reason, each cut to a bounded length."""
    lines = str(e).strip().splitlines()
    if not lines or not lines[0].startswith("regex parse error"):
        return None
    reasons = [ln.strip()[len("error:") :].strip() for ln in lines if ln.startswith("error:")]
    reason = (reasons[-1] if reasons else "unreadable")[:200]
    shown = lines[1].strip() if len(lines) > 1 else ""  # the pattern as the engine quotes it
    where = _pattern_path(schema, shown) if shown else None
    at = f" at {where[:120]}" if where else ""
    pattern = json.dumps(shown)
    pattern = pattern if len(pattern) <= 80 else pattern[:76] + '..."'
    return f"the pattern{at} {pattern} is not a valid regular expression: {reason}"


def _pattern_path(schema, pattern: str, path: str = "") -> str | None:
    """The dotted place in `schema` of the regex `pattern` (``properties.name.pattern``, or
    ``patternProperties`` and its key), None when not found."""
    try:
        if isinstance(schema, dict):
            if schema.get("pattern") == pattern:
                return f"{path}pattern"
            props = schema.get("patternProperties")
            if isinstance(props, dict) and pattern in props:
                return f"{path}patternProperties"
            items = schema.items()
        elif isinstance(schema, list):
            items = ((str(i), v) for i, v in enumerate(schema))
        else:
            return None
        for k, v in items:
            found = _pattern_path(v, pattern, f"{path}{k}.")
            if found is not None:
                return found
    except RecursionError:  # nested past Python's stack: the pattern alone names it
        return None
    return None


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
