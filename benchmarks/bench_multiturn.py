"""Multi-turn rollouts: our one-KV-cache continuation vs re-prefilling the conversation each turn.

    python -m benchmarks.bench_multiturn --sizes tiny,qwen3-0.6b --turns 2,4,8   # recorded run
    python -m benchmarks.bench_multiturn --sizes tiny --turns 2,4,8 --turn-len 32 \
        --name multiturn_cpu_tiny_turn32                                     # longer turns
    python -m benchmarks.bench_multiturn --sizes qwen3-0.6b --turns 4 --prompts 4 \
        --name multiturn_cpu_qwen_B8_4turns                                  # B = 8 rows
    python -m benchmarks.bench_multiturn --sizes tiny --turns 2 --repeats 3 --out-dir /tmp/b

Two ways to run the same T-turn conversations (model turn, observation, model turn, ...):

- `ours`: `grpo.rollout.multiturn.sample_turns`. The P prompts are prefilled once (KV rows
  copied G times), each observation is prefilled into the same cache, earlier turns are never
  run again.
- `baseline`: the generate-per-turn loop of frameworks that call a single-turn generator:
  turn 1 is `Sampler.sample(prompts, group_size=G)`; every later turn re-prefills each row's
  whole conversation (prompt + earlier turns + observations) with `Sampler.sample(convs,
  group_size=1)` (after turn 1 every row is its own conversation: sampled rows diverge), then
  appends the observation. Same sampler code, so the difference is only the re-prefill.

The work is made identical: same random-init model (`benchmarks.models.CASES` shapes, our
`Decoder.init_weights(seed=0)`), same prompts and observation ids, greedy decoding
(temperature 0), a stop id no row can sample (the vocab size), so every turn runs exactly
`turn_len` tokens, and one `observe` callback for both that answers a fixed `obs_len`-token
observation and `done` after the last turn. Before timing, both must give exactly the same
token stream per row (turns and observations; the first mismatch is printed otherwise).

Timing: `harness.measure_interleaved` (ours and baseline alternate every repeat). Columns:
`median_s` / `p20_s` / `p80_s` wall seconds per rollout of all B rows; `tok_per_s` =
generated tokens (B * turns * turn_len) / median; `fwd_tokens` = token positions run through
the model (prefills + decode steps), the work each side does; `peak_mib` = resident memory
the call adds at its peak (harness); `cpu_s` = median process CPU seconds (all threads);
`speedup` = baseline median / ours median, `speedup_cpu` the same for CPU time (steadier when
other jobs share the cores); `target` the issue's goal (>= 1.5x at 4 turns).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial

import torch

from benchmarks.harness import add_output_args, comma_list, measure_interleaved, write_results
from benchmarks.models import CASES
from grpo.models import Decoder, ModelConfig
from grpo.rollout import Sampler
from grpo.rollout.multiturn import sample_turns
from grpo.rollout.sampler import Observation

# Per-size defaults (CLI flags override): P prompts x G rows, lengths in tokens, timing rounds,
# torch threads (0 = torch's default). The tiny model runs on one thread (bench_sampler: at its
# shapes OpenMP fork/join costs more than it saves); the 0.6B shape on all of them. The 0.6B
# shape is sized so that 2, 4 and 8 turns fit in a few minutes on a 2-core CPU.
SIZES = {
    "tiny": dict(
        prompts=4,
        group_size=2,
        prompt_len=100,
        turn_len=16,
        obs_len=16,
        warmup=2,
        repeats=10,
        threads=1,
    ),
    "qwen3-0.6b": dict(
        prompts=2,
        group_size=2,
        prompt_len=100,
        turn_len=16,
        obs_len=16,
        warmup=0,
        repeats=2,
        threads=0,
    ),
}
TARGET_TURNS, TARGET = 4, 1.5
COLUMNS = [
    "size",
    "turns",
    "impl",
    "B",
    "threads",
    "median_s",
    "p20_s",
    "p80_s",
    "tok_per_s",
    "fwd_tokens",
    "peak_mib",
    "cpu_s",
    "speedup",
    "speedup_cpu",
    "target",
    "streams_equal",
]


@dataclass(frozen=True)
class Workload:
    """One multi-turn rollout to run both ways.

    Attributes:
        prompts: P token-id lists, all `prompt_len` long (no padding on either side).
        group_size: G rows per prompt; B = P*G.
        turns: model turns per conversation.
        turn_len: tokens each model turn generates (no stop id can occur).
        obs_ids: the observation appended after every model turn but the last.
        stop_id: an id outside the vocabulary, so no turn ends early.
    """

    prompts: list[list[int]]
    group_size: int
    turns: int
    turn_len: int
    obs_ids: list[int]
    stop_id: int

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.group_size

    def observer(self):
        """A fresh `observe(row, turn_ids, stopped)`: the fixed observation, `done` after the
        last turn (it counts each row's turns, so build one per rollout)."""
        seen = [0] * self.rows

        def observe(row: int, turn_ids: list[int], stopped: bool) -> Observation:
            seen[row] += 1
            if seen[row] >= self.turns:
                return Observation(ids=[], done=True)
            return Observation(ids=list(self.obs_ids))

        return observe

    def fwd_tokens(self, impl: str) -> int:
        """Token positions each side runs through the model (prefill + decode steps)."""
        P, B, T_p = len(self.prompts), self.rows, len(self.prompts[0])
        N, O, K = self.turn_len, len(self.obs_ids), self.turns
        if impl == "ours":  # every generated token is fed back, observations prefilled once
            return P * T_p + B * K * N + B * (K - 1) * O
        # turn k re-prefills the conversation so far; a turn's last token is never fed back
        return P * T_p + B * (N - 1) + sum(B * (T_p + k * (N + O) + N - 1) for k in range(1, K))


def build_workload(
    vocab_size: int,
    *,
    prompts: int,
    group_size: int,
    prompt_len: int,
    turns: int,
    turn_len: int,
    obs_len: int,
    seed: int = 0,
) -> Workload:
    """Random prompts and observation ids in [2, V) from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab_size, (prompts * prompt_len + obs_len,), generator=gen).tolist()
    return Workload(
        prompts=[ids[i * prompt_len : (i + 1) * prompt_len] for i in range(prompts)],
        group_size=group_size,
        turns=turns,
        turn_len=turn_len,
        obs_ids=ids[prompts * prompt_len :],
        stop_id=vocab_size,
    )


def build_model(size: str, min_vocab: int = 0) -> Decoder:
    """A random-init float32 `Decoder` of the `benchmarks.models.CASES[size]` shape (with at least
    `min_vocab` tokens: a tokenizer's, when its text is encoded)."""
    hf = dict(
        CASES[size]["config"],
        model_type="qwen3",
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    )
    hf["vocab_size"] = max(hf["vocab_size"], min_vocab)
    model = Decoder(ModelConfig.from_hf(hf))
    model.init_weights(seed=0)
    return model.eval()


def run_ours(sampler: Sampler, w: Workload) -> list[list[int]]:
    """`sample_turns` over one KV cache -> B token streams (turns and observations)."""
    N, O, K = w.turn_len, len(w.obs_ids), w.turns
    r = sample_turns(
        sampler,
        w.prompts,
        group_size=w.group_size,
        observe=w.observer(),
        max_new_tokens=N,
        max_turns=K,
        max_total_tokens=K * N + (K - 1) * O,
        stop_ids=[w.stop_id],
        temperature=0.0,
        seed=0,
    )
    return [ids[keep].tolist() for ids, keep in zip(r.completion_ids, r.completion_mask)]


def run_baseline(sampler: Sampler, w: Workload) -> list[list[int]]:
    """Generate-per-turn: re-prefill every row's whole conversation each turn -> B streams."""
    G, N = w.group_size, w.turn_len
    observe = w.observer()
    first = sampler.sample(
        w.prompts, group_size=G, max_new_tokens=N, temperature=0.0, stop_ids=[w.stop_id], seed=0
    )
    turn_ids = first.completion_ids.tolist()  # (B, N): rows of a group are separate from here on
    convs = [list(w.prompts[b // G]) + ids for b, ids in enumerate(turn_ids)]
    for turn in range(1, w.turns + 1):
        for b, conv in enumerate(convs):
            conv.extend(observe(b, turn_ids[b], False).ids)
        if turn == w.turns:
            break
        r = sampler.sample(
            convs,
            group_size=1,
            max_new_tokens=N,
            temperature=0.0,
            stop_ids=[w.stop_id],
            seed=turn,
        )
        turn_ids = r.completion_ids.tolist()  # (B, N)
        for conv, ids in zip(convs, turn_ids):
            conv.extend(ids)
    return [conv[len(w.prompts[b // G]) :] for b, conv in enumerate(convs)]


def first_mismatch(ours: list[list[int]], baseline: list[list[int]], w: Workload) -> str | None:
    """None if the streams are equal, else one line locating the first difference."""
    if len(ours) != len(baseline):
        return f"row count: ours {len(ours)}, baseline {len(baseline)}"
    span = w.turn_len + len(w.obs_ids)  # one model turn + its observation
    for b, (a, c) in enumerate(zip(ours, baseline)):
        for i, (x, y) in enumerate(zip(a, c)):
            if x != y:
                kind = "model turn" if i % span < w.turn_len else "observation"
                return (
                    f"row {b}, stream position {i} (turn {i // span + 1}, {kind}): ours {x}, "
                    f"baseline {y}; ours {a[max(0, i - 3) : i + 4]} vs baseline "
                    f"{c[max(0, i - 3) : i + 4]}"
                )
        if len(a) != len(c):
            return f"row {b}: ours has {len(a)} tokens, baseline {len(c)}"
    expected = w.turns * w.turn_len + (w.turns - 1) * len(w.obs_ids)
    if any(len(a) != expected for a in ours):
        return f"stream length {len(ours[0])}, expected {expected}"
    return None


def check_streams(sampler: Sampler, w: Workload) -> str | None:
    """The correctness check before timing: both paths, greedy, token for token."""
    return first_mismatch(run_ours(sampler, w), run_baseline(sampler, w), w)


def with_cpu_time(fn, out: list):
    """`fn` that also appends its process CPU time (seconds, all threads) to `out`."""

    def timed():
        t0 = time.process_time()
        result = fn()
        out.append(time.process_time() - t0)
        return result

    return timed


def run_size(size: str, turns_list: list[int], args) -> list[dict]:
    """Build the model once, then check and time every turn count; two rows per count."""
    spec = {
        k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in SIZES[size].items()
    }
    threads = spec["threads"] or args.default_threads
    torch.set_num_threads(threads)
    model = build_model(size)
    sampler = Sampler(model)
    rows = []
    for turns in turns_list:
        w = build_workload(
            model.config.vocab_size,
            prompts=spec["prompts"],
            group_size=spec["group_size"],
            prompt_len=spec["prompt_len"],
            turns=turns,
            turn_len=spec["turn_len"],
            obs_len=spec["obs_len"],
        )
        mismatch = check_streams(sampler, w)
        if mismatch is not None:
            print(f"[{size}, {turns} turns] streams differ: {mismatch}", file=sys.stderr)
            raise SystemExit(1)
        print(f"[{size}, {turns} turns] greedy streams equal; timing", flush=True)
        cpu = {"baseline": [], "ours": []}  # process CPU seconds per call, warm-up included
        fns = {"baseline": partial(run_baseline, sampler, w), "ours": partial(run_ours, sampler, w)}
        t = measure_interleaved(
            {impl: with_cpu_time(fn, cpu[impl]) for impl, fn in fns.items()},
            warmup=spec["warmup"],
            repeats=spec["repeats"],
        )
        cpu = {impl: statistics.median(v[spec["warmup"] :]) for impl, v in cpu.items()}
        generated = w.rows * turns * w.turn_len
        for impl in ("baseline", "ours"):
            m = t[impl]
            rows.append(
                {
                    "size": size,
                    "turns": turns,
                    "impl": impl,
                    "B": w.rows,
                    "threads": threads,
                    "median_s": m.median_ms / 1e3,
                    "p20_s": m.p20_ms / 1e3,
                    "p80_s": m.p80_ms / 1e3,
                    "tok_per_s": generated / (m.median_ms / 1e3),
                    "fwd_tokens": w.fwd_tokens(impl),
                    "peak_mib": m.peak_mem_mib,
                    "cpu_s": cpu[impl],
                    "streams_equal": True,
                    "P": len(w.prompts),
                    "G": w.group_size,
                    "prompt_len": spec["prompt_len"],
                    "turn_len": w.turn_len,
                    "obs_len": len(w.obs_ids),
                    "generated_tokens": generated,
                    "warmup": spec["warmup"],
                    "repeats": spec["repeats"],
                    "times_s": [x / 1e3 for x in m.times_ms],
                }
            )
        rows[-1]["speedup"] = t["baseline"].median_ms / t["ours"].median_ms
        rows[-1]["speedup_cpu"] = cpu["baseline"] / cpu["ours"]
        rows[-1]["target"] = TARGET if turns == TARGET_TURNS else None
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,qwen3-0.6b", help=f"of {list(SIZES)}")
    parser.add_argument("--turns", default="2,4,8", help="comma-separated turn counts")
    for flag, doc in [
        ("prompts", "P"),
        ("group-size", "G"),
        ("prompt-len", "prompt tokens"),
        ("turn-len", "tokens per model turn"),
        ("obs-len", "tokens per observation"),
        ("warmup", "untimed calls per side"),
        ("repeats", "timed calls per side"),
        ("threads", "torch threads (0 = torch's default)"),
    ]:
        parser.add_argument(f"--{flag}", type=int, default=None, help=f"{doc} (default: per size)")
    add_output_args(parser, "multiturn_cpu")
    args = parser.parse_args(argv)
    sizes = comma_list(parser, "--sizes", args.sizes, SIZES)
    try:
        turns_list = [int(t) for t in args.turns.split(",") if t]
    except ValueError:
        parser.error(f"--turns must be comma-separated integers, got {args.turns!r}")
    if not turns_list or min(turns_list) < 1:
        parser.error(f"--turns must be integers >= 1, got {args.turns!r}")
    args.default_threads = torch.get_num_threads()

    load_before = [round(x, 2) for x in os.getloadavg()]
    rows = [row for size in sizes for row in run_size(size, turns_list, args)]
    load_after = [round(x, 2) for x in os.getloadavg()]
    meta = {
        "command": " ".join(["python -m benchmarks.bench_multiturn", *argv]),
        "setup": "float32, greedy, stop id never sampled (every turn runs turn_len tokens), "
        "fixed observation ids; P, G, lengths, warmup/repeats per row in the JSON; baseline "
        "and ours interleaved repeat by repeat",
        "baseline": "turn 1 Sampler.sample(prompts, G); turn k > 1 Sampler.sample(B "
        "conversations so far, group_size=1): the whole conversation is re-prefilled",
        "ours": "multiturn.sample_turns: one KV cache, observations prefilled into it",
        "speedup": "baseline median_s / ours median_s (speedup_cpu: the same for cpu_s)",
        "loadavg_before (1/5/15 min)": load_before,
        "loadavg_after (1/5/15 min)": load_after,
    }
    write_results(args.name, rows, COLUMNS, out_dir=args.out_dir, meta=meta)


if __name__ == "__main__":
    main(sys.argv[1:])
