"""Grammar engines for structured outputs: the per-step cost of a token mask, against the
decode step it is added to.

    python -m benchmarks.bench_grammar                       # both engines, both shapes
    python -m benchmarks.bench_grammar --shapes tiny --batches 1,8

For each tokenizer shape, each engine (xgrammar, llguidance) and each batch B, B matchers of
one JSON schema (an object with a string, an integer, a number, an array of strings, an enum
and a nested object; `additionalProperties: false`) walk the tokens of a valid instance. A
step is what `grpo serve` adds to a decode step of a batch whose B rows are all constrained:
fill the B rows' bitmask, apply it to the (B, V) float32 logits, advance each matcher by its
token. Columns: `mask_ms` (median step), `p90_ms`; `decode_ms`: our sampler's decode step of
the same shape at B (random init, float32, KV cache, measured here as the difference of two
generation lengths, so prefill drops out); `overhead` = mask / decode; `constrained_x` =
decode / (decode + mask), the throughput ratio the mask alone leaves (the issue's goal: >=
0.8); `compile_ms`: compiling the schema (cached by its text afterwards).

Shapes: `tiny` (the ci model, a 384-token BPE) and `qwen3-0.6b` (the 0.6B architecture with a
151,646-token byte-level BPE trained here on Python sources of the installed packages, as a
stand-in for Qwen3's own vocabulary, which this machine cannot download; the mask's cost
grows with the vocabulary's size and the trie of its tokens, not with what the tokens mean).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import add_output_args, comma_list, write_results

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "kind": {"enum": ["person", "robot", "other"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "score", "tags", "kind", "address"],
    "additionalProperties": False,
}
INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "score": 9.75,
    "tags": ["mathematics", "poetry", "engines"],
    "kind": "person",
    "address": {"city": "London", "zip": "W1"},
}
COLUMNS = [
    "shape",
    "vocab",
    "engine",
    "batch",
    "steps",
    "mask_ms",
    "p90_ms",
    "decode_ms",
    "overhead",
    "constrained_x",
    "compile_ms",
]
SHAPES = ("tiny", "qwen3-0.6b")
ENGINES = ("xgrammar", "llguidance", "llguidance-par")


def big_tokenizer(vocab: int, cache: Path):
    """A byte-level BPE of `vocab` tokens trained on the installed packages' Python sources
    (cached in `cache`)."""
    from grpo.tokenizer import load_tokenizer, train_bpe_tokenizer

    if (cache / "tokenizer.json").is_file():
        return load_tokenizer(cache)
    roots = [Path(p) for p in sys.path if p.endswith("site-packages")]
    files = sorted(f for r in roots for f in r.rglob("*.py"))

    def texts():
        total = 0
        for f in files:
            try:
                t = f.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            total += len(t)
            yield t
            if total > 60e6:
                return

    train_bpe_tokenizer(texts(), vocab, out_dir=cache, split_digits=False)
    return load_tokenizer(cache)


def tiny_tokenizer():
    from grpo.tiny import minimath_corpus
    from grpo.tokenizer import train_bpe_tokenizer

    return train_bpe_tokenizer(minimath_corpus() + [json.dumps(INSTANCE)] * 10, 384)


class XGrammar:
    def __init__(self, tok, vocab_size: int):
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tok, vocab_size=vocab_size, stop_token_ids=[tok.eos_token_id]
        )
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.vocab_size = vocab_size

    separators = (", ", ": ")  # what its grammar writes without free white space

    def compile(self, schema: str):
        return self.compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)

    def matchers(self, compiled, n: int):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def bitmask(self, n: int):
        return self.xgr.allocate_token_bitmask(n, self.vocab_size)

    def step(self, matchers, bitmask, logits, tokens):
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)
        for m, t in zip(matchers, tokens):
            assert m.accept_token(t), "xgrammar refused a token of the valid instance"


class LLGuidance:
    parallel = False  # one matcher after the other, in this thread

    def __init__(self, tok, vocab_size: int):
        import llguidance as llg
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llg, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size)
        self.executor = llg.LLExecutor()
        self.vocab_size = vocab_size

    separators = (", ", ": ")

    def compile(self, schema: str):
        from grpo.apps.serving.structured import JSON_STYLE

        styled = json.dumps({**json.loads(schema), "x-guidance": JSON_STYLE})
        grammar = self.llg.LLMatcher.grammar_from_json_schema(styled)
        self.llg.LLMatcher(self.tokenizer, grammar)  # compiles (lazily, the lexer up front)
        return grammar

    def matchers(self, grammar, n: int):
        return [self.llg.LLMatcher(self.tokenizer, grammar) for _ in range(n)]

    def bitmask(self, n: int):
        return self.lt.allocate_token_bitmask(n, self.vocab_size)

    def step(self, matchers, bitmask, logits, tokens):
        if self.parallel:
            rows = [(m, i) for i, m in enumerate(matchers)]
            self.lt.fill_next_token_bitmask_par(self.executor, rows, bitmask)
        else:
            for i, m in enumerate(matchers):
                self.lt.fill_next_token_bitmask(m, bitmask, i)
        self.lt.apply_token_bitmask_inplace(logits, bitmask)
        for m, t in zip(matchers, tokens):
            assert m.consume_token(t), f"llguidance refused a token: {m.get_error()}"


class LLGuidancePar(LLGuidance):
    parallel = True  # the rows' masks on llguidance's thread pool (`fill_next_token_bitmask_par`)


IMPLS = {"xgrammar": XGrammar, "llguidance": LLGuidance, "llguidance-par": LLGuidancePar}


def decode_ms(shape: str, vocab: int, batch: int, model_dir: Path) -> float:
    """Our sampler's decode step at `batch`: (time of 24 new tokens - time of 8) / 16."""
    from benchmarks.models import CASES
    from grpo.models import load_model
    from grpo.rollout import Sampler

    if not (model_dir / "model.safetensors").is_file():
        from grpo.models import Decoder, ModelConfig, save_pretrained

        config = dict(CASES["tiny" if shape == "tiny" else "qwen3-0.6b"]["config"])
        config["vocab_size"] = vocab
        cfg = ModelConfig(
            family="qwen3",
            max_position_embeddings=512,
            tie_word_embeddings=True,
            qk_norm=True,
            eos_token_id=0,
            **config,
        )
        model = Decoder(cfg)
        model.init_weights(std=0.02, seed=0)
        save_pretrained(model, model_dir)
    sampler = Sampler(load_model(model_dir, device="cpu"))
    prompts = [[5 + (i % 7)] * 16 for i in range(batch)]

    def run(n: int) -> float:
        t = time.perf_counter()
        sampler.sample(
            prompts, group_size=1, max_new_tokens=n, temperature=1.0, stop_ids=[vocab + 10], seed=0
        )
        return time.perf_counter() - t

    run(4)  # warm-up
    long = min(run(24) for _ in range(2))
    short = min(run(8) for _ in range(2))
    return (long - short) / 16 * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument(
        "--cache",
        default=str(Path(tempfile.gettempdir()) / "grpo-bench-grammar"),
        help="where the big tokenizer and random-init models are kept",
    )
    add_output_args(parser, "grammar_cpu")
    a = parser.parse_args(argv)
    shapes = comma_list(parser, "--shapes", a.shapes, SHAPES)
    engines = comma_list(parser, "--engines", a.engines, ENGINES)
    batches = [int(b) for b in a.batches.split(",")]
    cache = Path(a.cache)
    schema = json.dumps(SCHEMA)
    rows = []
    for shape in shapes:
        tok = tiny_tokenizer() if shape == "tiny" else big_tokenizer(151646, cache / "bpe151k")
        vocab = len(tok)
        decode = {b: decode_ms(shape, vocab, b, cache / f"model-{shape}-{vocab}") for b in batches}
        for engine in engines:
            impl = IMPLS[engine](tok, vocab)
            text = json.dumps(INSTANCE, separators=impl.separators)
            ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            t = time.perf_counter()
            compiled = impl.compile(schema)
            compile_ms = (time.perf_counter() - t) * 1e3
            for b in batches:
                matchers = impl.matchers(compiled, b)
                bitmask = impl.bitmask(b)
                logits = torch.zeros(b, vocab)
                times = []
                for token in ids:
                    t = time.perf_counter()
                    impl.step(matchers, bitmask, logits, [token] * b)
                    times.append((time.perf_counter() - t) * 1e3)
                mask = statistics.median(times)
                d = decode[b]
                rows.append(
                    {
                        "shape": shape,
                        "vocab": vocab,
                        "engine": engine,
                        "batch": b,
                        "steps": len(ids),
                        "mask_ms": round(mask, 3),
                        "p90_ms": round(sorted(times)[int(0.9 * (len(times) - 1))], 3),
                        "decode_ms": round(d, 2),
                        "overhead": round(mask / d, 3),
                        "constrained_x": round(d / (d + mask), 3),
                        "compile_ms": round(compile_ms, 1),
                    }
                )
                print(rows[-1], flush=True)
    meta = {
        "schema": SCHEMA,
        "instance": INSTANCE,
        "torch_threads": torch.get_num_threads(),
        "command": "python -m benchmarks.bench_grammar " + " ".join(argv or sys.argv[1:]),
    }
    write_results(a.name, rows, COLUMNS, out_dir=a.out_dir, meta=meta)


if __name__ == "__main__":
    main()
