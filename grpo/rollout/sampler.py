"""Rollouts: prefill each prompt once, copy its KV rows G times, decode all P*G rows together.

Single turn (`Sampler.sample`) here; multi-turn (`grpo.rollout.multiturn.sample_turns`: after
each model turn an `observe` callback returns the environment's observation as token ids, which
are prefilled into the same KV cache; earlier turns are never re-tokenized or re-run) is built
from the sampler's public steps (`prefill`, `decode`, `hidden_states`, `logits`) and the prompt
helpers of `grpo.rollout.prompts`.

Shapes: P prompts, G completions per prompt (group), B = P*G rows, T_p the padded prompt width,
T_c completion tokens, V vocab. Row b belongs to prompt b // G (a group's rows are adjacent).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from grpo.errors import GrpoError
from grpo.models import sdpa_choice
from grpo.models.kv_cache import GroupedKVCache, KVCache, RowKVCache
from grpo.precision import Precision, cpu_packing_missing, head_logits
from grpo.rollout.decode_weights import DecodeWeights
from grpo.rollout.onednn_weights import PackedLinears, packing_supported
from grpo.rollout.prompts import check_prompts, check_settings, left_pad
from grpo.rollout.refill import RefillState, refill_loop, refill_step
from grpo.rollout.sampling import (
    apply_logit_bias,
    apply_repetition_penalty,
    next_tokens,
    row_uniforms,
    seen_tokens,
)

log = logging.getLogger(__name__)

# A compiled decode step's cache length is rounded up to a multiple of this, so a run whose
# prompt widths vary compiles a few shapes, not one per batch.
SLOT_MULTIPLE = 64


def compile_supported(device: torch.device | str) -> bool:
    """Whether inductor can build a decode step here: Triton on CUDA, a C++ compiler on CPU."""
    if torch.device(device).type == "cuda":
        return True
    return any(shutil.which(c) for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c)


def share_prompt_kv(device: torch.device) -> bool:
    """Whether eager decoding holds each prompt's keys and values once for its G rows
    (`GroupedKVCache`, `grouped_decode_attention`): on the CPU, where the step's own work
    dominates and reading each prompt once pays. Elsewhere (CUDA) the rows get copies and the
    step attends in one fused kernel (`decode_sdpa`): the grouped arrangement costs 12 more
    launches per layer, and a GPU decode step is bound by its launches."""
    return device.type == "cpu"


def resolve_compile(mode: str | bool, device: torch.device | str, multi_turn: bool = False) -> bool:
    """`rollout.compile` -> whether to compile: on / off as given; auto = on CUDA, where inductor
    works (`compile_supported`), for single-turn rollouts, unless the environment variable
    GRPO_COMPILE=0 turns auto off.

    auto stays eager on a CPU, where compiling does not pay in a run (measured on the 2-core
    dev VM, `grpo train` on GSM8K prompts, docs/sampler.md): the compiled step recompiles for
    each new cache-length bucket, 3-15 s each at the tiny shape against a 0.17 s step (6 steps:
    median 1.65 s compiled from a cold inductor cache, 0.33 s warm, 0.17 s eager); at the
    Qwen3-0.6B shape with LoRA the compiled run's steps took 65, 19, 42, 16, 45, 17 s against
    25, 16, 12, 13, 14, 14 s eager (and a compiled decode step is slower per token there: 390
    vs 342 ms at B=32; it attends over every slot of its static cache). On CUDA the
    compiled step replays CUDA graphs (one launch per step instead of ~10 per layer).
    Multi-turn rollouts stay eager under auto: eagerly, ended trajectories leave the batch at
    each turn boundary, and the varying observation lengths would cost recompiles (the tools
    demo's GRPO stage took 94 s compiled vs 50 s eager).
    """
    if mode in (True, "on"):
        return True
    if mode in (False, "off"):
        return False
    if mode != "auto":
        raise GrpoError(f"compile must be auto, on or off, got {mode!r}")
    if multi_turn or torch.device(device).type == "cpu":
        return False
    return os.environ.get("GRPO_COMPILE", "") != "0" and compile_supported(device)


@dataclass
class Rollout:
    """The sampled completions of P prompts x G rows and everything training needs of them.

    Attributes:
        ids: (B, T_p + T_c) prompt (left-padded with pad_id) + completion token ids.
        prompt_lens: (B,) real prompt tokens per row.
        prompt_width: T_p, the padded prompt width (completions start at this column).
        completion_ids: (B, T_c) sampled ids; pad_id after a row's stop token.
        completion_mask: (B, T_c) bool, True on the real tokens of the completion region: up to
            and including the first stop token, nothing after it (multi-turn: model turns and
            observations). Built from lengths, never from pad ids.
        completion_lens: (B,) tokens per completion, the stop token included.
        finished: (B,) bool, True = stopped on a stop id, False = truncated at max_new_tokens.
        logprobs: (B, T_c) float32 log-prob of each sampled token under the distribution it was
            drawn from before truncation: log_softmax(logits / temperature) (temperature 1 when
            greedy); top-k / top-p / min-p are not reflected. 0 where `generated_mask` is False.
        group_size: G.
        generated_mask: (B, T_c) bool, True on the tokens the policy generated (what log-probs
            and the loss count). Always set after construction: left None, it is
            `completion_mask` (single turn: every completion token was generated).

    Multi-turn rollouts (`grpo.rollout.multiturn.sample_turns`) pass `generated_mask` (model
    turns only; `completion_mask` is then also True on observations and False on the holes
    between them: slots a row did not use while others decoded or observed) and also set:
        turn_ids: (B, T_c) long, the turn of each real token (an observation belongs to the
            turn it answers), -1 on holes.
        turn_rewards: B lists of per-turn step rewards from the environment.
        turn_texts: B lists of each model turn's token ids (a final stop id left out).
        infos: B dicts of counters the environment reported (summed over turns).
    """

    ids: torch.Tensor
    prompt_lens: torch.Tensor
    prompt_width: int
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    completion_lens: torch.Tensor
    finished: torch.Tensor
    logprobs: torch.Tensor
    group_size: int
    generated_mask: torch.Tensor | None = None
    turn_ids: torch.Tensor | None = None
    turn_rewards: list[list[float]] | None = None
    turn_texts: list[list[list[int]]] | None = None
    infos: list[dict] | None = None

    def __post_init__(self):
        if self.generated_mask is None:  # single turn: the policy generated every token
            self.generated_mask = self.completion_mask

    @property
    def multi_turn(self) -> bool:
        """Whether this is a multi-turn rollout (observations in the completion region)."""
        return self.turn_ids is not None

    @property
    def prompt_ids(self) -> torch.Tensor:
        """(B, T_p) left-padded prompt ids."""
        return self.ids[:, : self.prompt_width]

    def attention_mask(self) -> torch.Tensor:
        """(B, T_p + T_c) bool mask for a training forward over prompt + completion.

        True on each row's real prompt tokens and on its counted completion tokens; feeding it
        to `Decoder.forward` gives the same rotary positions the sampler used.
        """
        T_p = self.prompt_width
        cols = torch.arange(T_p, device=self.ids.device)
        prompt_mask = cols[None, :] >= (T_p - self.prompt_lens)[:, None]  # (B, T_p)
        return torch.cat([prompt_mask, self.completion_mask], dim=1)

    def decode(self, tokenizer, skip_special_tokens: bool = False) -> list[str]:
        """The completions as text, one per row; a row's stop token is not part of its text.

        Args:
            tokenizer: anything with `decode(list[int], skip_special_tokens=...)`.
            skip_special_tokens: passed on to the tokenizer.

        Returns:
            B strings.
        """
        if self.turn_texts is not None:  # multi-turn: the final model turn's text
            return [
                tokenizer.decode(t[-1] if t else [], skip_special_tokens=skip_special_tokens)
                for t in self.turn_texts
            ]
        texts = []
        rows = zip(
            self.completion_ids.tolist(), self.completion_lens.tolist(), self.finished.tolist()
        )
        for ids, n, stopped in rows:
            keep = n - 1 if stopped else n
            texts.append(tokenizer.decode(ids[:keep], skip_special_tokens=skip_special_tokens))
        return texts

    def transcript(self, tokenizer) -> list[str]:
        """Each row's whole completion region as text: model turns and observations (holes
        left out), special tokens kept."""
        out = []
        for ids, keep in zip(self.completion_ids.tolist(), self.completion_mask.tolist()):
            out.append(tokenizer.decode([i for i, k in zip(ids, keep) if k]))
        return out


ObserveFn = Callable[[int, list[int], bool], "Observation"]


@runtime_checkable
class TokenConstraint(Protocol):
    """Which tokens each row may draw next, e.g. a grammar's (`Sampler.sample(constraint=)`;
    `grpo serve`'s structured outputs). Called once per decode step, on every row of the batch
    (a row that has stopped keeps being called; what it draws is discarded)."""

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) float32 logits -> the same with the tokens each row may not draw at -inf
        (in place or not); a row the constraint does not cover is returned unchanged."""
        ...

    def advance(self, tokens: torch.Tensor) -> None:
        """The (B,) tokens the rows drew (after the step hook), fed back next step."""
        ...


@dataclass
class Observation:
    """What the environment answers to one model turn of one row (see
    `grpo.rollout.multiturn.sample_turns`).

    Attributes:
        ids: token ids to append (the chat template's delta for the observation message and
            the next assistant header); empty when the trajectory ends.
        reward: the step reward of this turn.
        done: the trajectory ends here (no more model turns).
        info: counters to add up over turns (e.g. tool_calls, invalid_calls).
    """

    ids: list[int]
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


class Sampler:
    """Turns prompts into a `Rollout` with one model; holds its (optionally compiled) decode step.

    Build it once and call `sample` many times: with `compile=True` the decode step is
    `torch.compile`d once, here, with static shapes (the KV cache is then a static one, its
    length rounded up to a multiple of SLOT_MULTIPLE), and reused while shapes stay the same
    (a new row count or cache length recompiles).

    Public building blocks, for multi-turn rollouts (`grpo.rollout.multiturn`) and other
    custom loops (with `grpo.rollout.prompts` to validate and left-pad the prompts):

    - `sample`: single-turn rollouts, prompts -> `Rollout`;
    - `prefill`: run P prompts once, for their G rows each (their KV rows copied G times, or
      held once: `shared`);
    - `decode`: one token per row through the model (the compiled step when compiled);
    - `hidden_states`: a chunk of tokens through the model into the cache (observations);
    - `logits`: final hidden states -> float32 logits, as the trainer's head computes them.

    Call them under `torch.inference_mode()` with the model in eval mode, as `sample` does.

    Args:
        model: a `Decoder` (or anything with its forward signature, `config` and `lm_head`).
        compile: compile the decode step with `torch.compile` (inductor needs a C compiler
            on CPU; the prefill stays eager).
        compile_options: extra `torch.compile` keyword arguments (e.g. {"backend":
            "aot_eager"} in tests) over the defaults dynamic=False, fullgraph=True.
        sync_every: check "all rows done?" on the host every this many steps (the only host
            sync of the loop); at most sync_every - 1 steps run after the last row stops.
        fallback: if compiling fails (no working compiler, an unsupported op), warn once and
            decode eagerly instead of raising (`rollout.compile: auto` uses it).

        precision: the run's `Precision` (autocast of the forward passes, KV-cache dtype; the
            head in its `head` precision as in the trainer); default: compute in the
            weights' dtype.
        pack: eager CPU decoding multiplies by oneDNN-packed copies of the large weights
            (`grpo.rollout.onednn_weights`; repacked when the weights change); None = where
            supported and not compiled (a CPU that cannot pack the compute dtype decodes
            plainly); True where it cannot raises `GrpoError`.
        max_rows: decode at most this many rows of a `sample` call at once, refilling the
            slots of finished rows with waiting ones (`grpo.rollout.refill`; calls without
            hooks; compiled as one graph per step when the sampler compiles); 0 = every row
            at once.

    `compile_s` adds up the wall time of the decode calls that compiled a new shape (the
    first call for each row count and cache length, one decode step included): the warm-up
    a run pays, logged per step as `perf/compile_s`.
    """

    def __init__(
        self,
        model,
        *,
        compile: bool = False,
        compile_options: dict | None = None,
        sync_every: int = 4,
        fallback: bool = False,
        precision: Precision | None = None,
        pack: bool | None = None,
        max_rows: int = 0,
    ):
        if sync_every < 1:
            raise GrpoError(f"sync_every must be >= 1, got {sync_every}")
        if max_rows < 0:
            raise GrpoError(f"max_rows must be >= 0 (0 = every row at once), got {max_rows}")
        self.max_rows = max_rows
        self.model = model
        self.precision = precision or Precision.of_model(model)
        self.compile = compile
        self.sync_every = sync_every
        self.fallback = fallback
        self.slot_multiple = SLOT_MULTIPLE if compile else 1
        # the compiled step's decode caches, one per (rows, slots, dtype), kept until
        # `release_caches` so alternating shapes reuse their tensors (and CUDA graphs)
        self._caches: dict[tuple, KVCache] = {}
        self._compiled_shapes: set[tuple] = set()
        self.compile_s = 0.0  # seconds spent in decode calls that compiled a new shape
        self._cuda = model.device.type == "cuda"
        if pack is None:
            pack = not compile and packing_supported(model, self.precision.compute_dtype)
        elif pack and not packing_supported(model, self.precision.compute_dtype):
            raise GrpoError(
                f"Sampler(pack=True): cannot pack {model.device} weights in "
                f"{self.precision.compute_dtype} here "
                f"({cpu_packing_missing(self.precision.compute_dtype) or 'not plain CPU tensors'})"
            )
        self.packed: PackedLinears | None = PackedLinears(model, self.precision) if pack else None
        # the layers not packed: weights cast once per rollout (and q/k/v, gate/up stacked
        # when eager)
        self.decode_weights: DecodeWeights | None = None
        if DecodeWeights.supported(model):
            self.decode_weights = DecodeWeights(model, self.precision, fuse=not compile)
        if compile:
            # Rows and cache slots are dynamic dimensions (`_mark_dynamic`): one graph serves
            # every batch size (dynamic sampling's refills change it) and cache bucket, where
            # static shapes compiled one graph each and hit torch's recompile limit.
            options = {"dynamic": None, "fullgraph": True}
            if self._cuda:  # CUDA graphs: one replay per step instead of ~10 launches per layer
                options["mode"] = "reduce-overhead"
            options.update(compile_options or {})
            self._compiled = torch.compile(self._decode_step, **options)
            # a whole decode iteration of `sample` (forward, head, draw, stop test, position
            # update) as one graph: one CUDA-graph replay per token on CUDA
            self._compiled_iteration = torch.compile(self._iteration, **options)
            self._compiled_refill = torch.compile(self._refill_step, **options)  # max_rows
            self._decode_fn = self._decode_compiled  # `decode` calls it; eager after a fallback
        else:
            self._decode_fn = self._decode_step
        self._loops: dict[tuple, _LoopState] = {}  # the compiled iteration's kept state
        self._iterate_compiled = compile  # `sample` runs whole compiled iterations

    @property
    def kept_cache_bytes(self) -> int:
        """Bytes of the compiled step's decode caches, kept between calls (0 when eager, and
        after `release_caches`): the same tensors every call of a shape, so CUDA graphs replay
        in place. docs/precision.md has the cost at 0.6B."""
        return sum(
            t.numel() * t.element_size()
            for c in self._caches.values()
            for t in [*c.k_layers, *c.v_layers]
        )

    def release_caches(self) -> int:
        """Free the compiled step's decode caches (a trainer calls this after its rollouts,
        so the reference and update passes do not run beside them); returns the bytes freed.
        The next call allocates them again, where the caching allocator usually hands back
        the same blocks."""
        freed = self.kept_cache_bytes
        self._caches.clear()
        self._loops.clear()
        return freed

    def decode(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: KVCache,
    ) -> torch.Tensor:
        """One decode step: each row's token goes through the model, its keys and values are
        written at the cache's next slot, and the logits of the next token come back.

        Runs the compiled step when the sampler was built with `compile=True` (eagerly after a
        `fallback`), else the eager one; both compute the same function.

        Args:
            tokens: (B, 1) long, one token per row.
            position_ids: (B, 1) long, each token's rotary position (a row's real tokens so
                far: holes and left padding take none).
            attention_mask: (B, S) bool over every cache slot, True = attend; the slot being
                written must be True for rows whose token is real.
            cache: the KV cache of the B rows (from `prefill`), S slots; advanced by one.

        Returns:
            (B, V) float32 logits of each row's next token.
        """
        return self._decode_fn(tokens, position_ids, attention_mask, cache)

    def _decode_compiled(self, tokens, position_ids, attention_mask, cache):
        """The compiled step; the first call for each new shape (rows, cache length) is timed
        into `compile_s`. With `fallback`, a failure to compile switches to eager for good
        (the static cache works eagerly too)."""
        _mark_dynamic(tokens, position_ids, attention_mask, cache)
        args = (tokens, position_ids, attention_mask, cache)
        shape = (tokens.shape[0], cache.max_len, cache.dtype)
        return self._run_compiled(self._compiled, self._decode_step, shape, *args)

    def _run_compiled(self, compiled, eager, shape, *args, **kwargs):
        """`compiled(*args)`, its first call for each `shape` timed into `compile_s`; with
        `fallback`, a failure to compile switches this sampler to eager for good and runs
        `eager(*args)` instead."""
        if self._cuda:  # a new step: the previous replay's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        new = shape not in self._compiled_shapes
        if new:  # the attention arrangements, asked of SDPA's selector outside the trace
            sdpa_choice.prepare(self.model, self.precision.compute_dtype)
        t0 = time.perf_counter()
        try:
            out = compiled(*args, **kwargs)
        except Exception as e:  # inductor raises many types; any of them means "cannot compile"
            if not self.fallback:
                raise
            log.warning(
                "compiling the decode step failed (%s: %s); decoding eagerly "
                "(set rollout.compile: off to skip the attempt)",
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
            )
            self._decode_fn = self._decode_step
            self._iterate_compiled = False
            return eager(*args, **kwargs)
        finally:
            if new:  # a first call of a shape: a compile or at least a new CUDA graph
                self.compile_s += time.perf_counter() - t0
        self._compiled_shapes.add(shape)
        return out

    def _decode_step(self, tokens, position_ids, attention_mask, cache) -> torch.Tensor:
        """`decode`'s eager body: (B, 1) ids -> (B, V) float32 logits."""
        with self.precision.autocast(tokens.device):
            hidden = self.model(
                tokens,
                position_ids=position_ids,
                attention_mask=attention_mask,
                kv_cache=cache,
                return_hidden=True,
            )  # (B, 1, C)
        return self.logits(hidden[:, -1])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., C) final hidden states -> (..., V) float32 logits: the head as the trainer
        computes it (`grpo.precision.head_logits`), whatever the forward's autocast."""
        out = self.packed.head(hidden) if self.packed is not None else None  # inside packing()
        return head_logits(self.model.lm_head, hidden, self.precision.head) if out is None else out

    @contextlib.contextmanager
    def packing(self):
        """While inside, the model computes with the decode step's weights: oneDNN-packed
        copies of the large ones (when the sampler packs: `pack`), the others cast once and
        stacked (`grpo.rollout.decode_weights`); `sample` and multi-turn rollouts enter it
        around their forwards."""
        with contextlib.ExitStack() as stack:
            for weights in (self.packed, self.decode_weights):  # packed first: it has priority
                if weights is not None:
                    stack.enter_context(weights.installed())
            yield

    def hidden_states(self, ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """The model's hidden states (return_hidden) under the precision policy: prefill and
        multi-turn observation chunks.

        Args:
            ids: (B, T) token ids.
            **kwargs: passed on to the model's forward (`attention_mask`, `position_ids`,
                `kv_cache`).

        Returns:
            (B, T, C) final hidden states (before the head; `logits` applies it).
        """
        with self.precision.autocast(ids.device):
            return self.model(ids, return_hidden=True, **kwargs)

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        stop_ids: Sequence[int],
        seed: int,
        pad_id: int = 0,
        on_step: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
        logit_bias: torch.Tensor | None = None,
        repetition_penalty: torch.Tensor | None = None,
        constraint: TokenConstraint | None = None,
    ) -> Rollout:
        """Sample `group_size` completions for each prompt; see `grpo.rollout.sample`.

        `on_step(t, tokens) -> tokens` (optional) sees each decode step's (B,) draw and may
        replace it (a server forcing a stop id on rows past their own limit, or aborting); the
        log-probs stay those of the drawn tokens.

        Per-row adjustments of the raw logits (a server's requests; None = off, no cost):
        `repetition_penalty` (B,) on the tokens of each row's prompt and completion so far
        (`apply_repetition_penalty`), then `logit_bias` (B, V) added, then `constraint`'s mask
        (`TokenConstraint`: e.g. a grammar's; tokens it forbids get -inf). Log-probs are then
        those of the adjusted distribution."""
        model = self.model
        cfg = model.config
        prompts = check_prompts(prompts, cfg.vocab_size)
        check_settings(cfg, prompts, group_size, max_new_tokens, temperature, top_k, top_p, min_p)
        dev = model.device
        G = group_size
        prompt_ids, prompt_lens, kv_mask = left_pad(
            prompts, pad_id, max_new_tokens, cfg, dev, self.slot_multiple
        )
        T_p = prompt_ids.shape[1]
        # Completion slots are open from the start: a query never sees a later slot (the causal
        # mask hides it), so no per-step mask update is needed.
        kv_mask[:, T_p:] = True

        prompt_lens = prompt_lens.repeat_interleave(G)  # (B,): row b <- prompt b // G
        B = prompt_lens.shape[0]
        # Each row's own random stream, keyed by (seed, row, step): a row draws the same
        # tokens whatever runs beside it (`row_uniforms`). One (B, T_c) table per rollout.
        hooked = any(x is not None for x in (repetition_penalty, logit_bias, constraint, on_step))
        refill = 0 < self.max_rows < B and not hooked
        # refill: k more steps per row, drawn by a finished row until the next sync frees it
        uniforms = row_uniforms(seed, B, max_new_tokens + self.sync_every * refill, dev)
        sampling = (temperature, top_k, top_p, min_p)

        steps = itertools.count()

        seen = None
        if repetition_penalty is not None:  # (B, V) tokens of each row's prompt, then completion
            real = kv_mask[:, :T_p]  # (P, T_p) False on left padding
            seen = seen_tokens(prompt_ids, real, cfg.vocab_size).repeat_interleave(G, dim=0)

        def draw(logits, t):  # (B, V) at step t -> tokens (B,), logprobs (B,)
            if seen is not None:
                logits = apply_repetition_penalty(logits, seen, repetition_penalty)
            if logit_bias is not None:
                logits = apply_logit_bias(logits, logit_bias)
            if constraint is not None:
                logits = constraint.mask(logits)
            tok, lp = next_tokens(logits, None, *sampling, uniforms=uniforms[:, t])
            tok = tok if on_step is None else on_step(next(steps), tok)
            if seen is not None:
                seen.scatter_(1, tok[:, None], True)  # the token fed back
            if constraint is not None:
                constraint.advance(tok)
            return tok, lp

        stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=dev)
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode(), self.packing():
                # eager: each prompt's KV held once for its G rows (G = 1: nothing to share;
                # at the tiny shape, dispatch-bound, sharing measured 1.08x at 64 new tokens and
                # 0.99x at 512, interleaved in one process)
                shared = not self.compile and G > 1 and share_prompt_kv(dev)
                if refill:  # at most max_rows rows at once, finished ones replaced
                    out = refill_loop(
                        self,
                        prompt_ids,
                        kv_mask[:, :T_p],
                        G,
                        uniforms,
                        sampling,
                        stops,
                        self.max_rows,
                        functools.partial(self._refill, sampling),
                        self._prepare_refill,
                    )
                else:
                    logits, cache = self.prefill(prompt_ids, kv_mask, G, shared=shared)
                    kv_mask = kv_mask.repeat_interleave(G, dim=0)  # (B, max_len)
                    loop = (
                        self._compiled_loop
                        if self.compile and self._iterate_compiled and not hooked
                        else self._decode_loop
                    )
                    try:
                        out = loop(
                            logits,
                            cache,
                            kv_mask,
                            prompt_lens,
                            uniforms,
                            draw,
                            stops,
                            sampling,
                            T_p,
                        )
                    finally:
                        cache.limit = None  # a kept cache: the next call sets its own
        finally:
            model.train(was_training)
        # Inference-mode tensors may not enter autograd later (a training forward embeds the
        # ids), so the outputs leave it as ordinary copies.
        completion_ids, logprobs, done = (t.clone() for t in out)  # (B, T_run) x 2, (B,)

        # Lengths from the first stop of each row (rows that never stopped ran all T_run steps:
        # the loop only ends early once every row has stopped), then the mask from lengths.
        T_run = completion_ids.shape[1]
        first_stop = torch.isin(completion_ids, stops).int().argmax(dim=1)  # (B,) first True
        lens = torch.where(done, first_stop + 1, T_run)  # (B,)
        T_c = int(lens.max())  # trim the steps run after the last row stopped
        completion_mask = torch.arange(T_c, device=dev)[None, :] < lens[:, None]  # (B, T_c)
        completion_ids = completion_ids[:, :T_c].masked_fill(~completion_mask, pad_id)
        logprobs = logprobs[:, :T_c].masked_fill(~completion_mask, 0.0)
        ids = torch.cat([prompt_ids.repeat_interleave(G, dim=0), completion_ids], dim=1)
        return Rollout(
            ids=ids,
            prompt_lens=prompt_lens,
            prompt_width=T_p,
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            completion_lens=lens,
            finished=done,
            logprobs=logprobs,
            group_size=G,
        )

    def prefill(
        self,
        prompt_ids: torch.Tensor,
        kv_mask: torch.Tensor,
        group_size: int,
        shared: bool = False,
    ) -> tuple[torch.Tensor, KVCache | GroupedKVCache]:
        """Run the P prompts once; each prompt's keys and values then serve its G rows.

        Two cache layouts: by default each prompt's KV rows are copied G times into a cache of
        B rows (what multi-turn rollouts and the compiled step use: rows can be selected, and
        chunks of several tokens appended). With `shared` (eager single-turn decoding, what
        `sample` uses when not compiled) the prompts' keys and values stay P rows, read once
        per group by each decode step (`GroupedKVCache`); the rows get their own slots.

        When the sampler compiles, the returned cache is the static B-row one it keeps across
        calls for the compiled step (`kept_cache_bytes`), every slot overwritten here.

        Args:
            prompt_ids: (P, T_p) left-padded prompts (`grpo.rollout.prompts.left_pad`).
            kv_mask: (P, max_len) bool over every cache slot, True on real prompt tokens;
                max_len = T_p + the slots to open after the prompts.
            group_size: G rows per prompt.
            shared: return a `GroupedKVCache` (eager decoding only; one token per forward).

        Returns:
            logits (B, V) float32 of each row's first completion token, and the KV cache of
            B = P*G rows (row b holds prompt b // G) with T_p positions written.
        """
        G = group_size
        model = self.model
        P, max_len = kv_mask.shape
        T_p = prompt_ids.shape[1]
        if shared and self.compile:
            raise GrpoError("prefill(shared=True) is for eager decoding; this sampler compiles")
        cache = KVCache.for_model(
            model,
            rows=P,
            max_len=T_p if shared else max_len,
            static=self.compile,
            dtype=self.precision.kv_dtype,
        )
        hidden = self.hidden_states(prompt_ids, attention_mask=kv_mask, kv_cache=cache)
        logits = self.logits(hidden[:, -1])  # (P, V): the last position only
        if shared:
            return logits.repeat_interleave(G, dim=0), GroupedKVCache(cache, G, max_len - T_p)
        out = self._decode_cache(P * G, max_len) if self.compile else None
        return logits.repeat_interleave(G, dim=0), cache.repeat_rows(G, out=out)

    def _decode_cache(self, rows: int, max_len: int) -> KVCache:
        """The compiled step's B-row cache of this shape, kept across calls (`release_caches`
        frees them): the same tensors every call (marked static on CUDA, so CUDA graphs replay
        in place), also when calls alternate between shapes. Nothing stale survives:
        `repeat_rows(out=...)` overwrites every slot with the prefill's."""
        key = (rows, max_len, self.precision.kv_dtype)
        c = self._caches.get(key)
        if c is None:
            c = KVCache.for_model(
                self.model, rows=rows, max_len=max_len, static=True, dtype=self.precision.kv_dtype
            )
            if self._cuda:  # unguarded: a new cache re-records CUDA graphs, not a recompile
                for t in [*c.k_layers, *c.v_layers, c.pos_tensor]:
                    torch._dynamo.mark_static_address(t, guard=False)
            self._caches[key] = c
        return c

    def _decode_loop(
        self, logits, cache, kv_mask, prompt_lens, uniforms, draw, stops, sampling, T_p
    ):
        """Sample from `logits` (B, V), feed the tokens back, repeat; all rows in one batch.

        Rows that have stopped keep decoding (the batch keeps its shape) but what they draw
        is discarded afterwards: it only ever affects their own row. Eager decoding (and
        compiled forwards with an eager draw, when the call has hooks: a server's penalties,
        biases, constraints or `on_step`): what is fixed for the rollout is built here once,
        not per step (the additive attention mask of eager caches).

        Args:
            logits: (B, V) float32 logits of each row's first completion token.
            cache: the KV cache holding the B rows' prompts.
            kv_mask: (B, max_len) bool attention mask over every cache slot.
            prompt_lens: (B,) real prompt tokens per row (= first rotary position to write).
            uniforms: (B, T) the rows' random numbers; T = max_new_tokens, the step limit.
            draw: ((B, V) logits, step t) -> (tokens (B,), logprobs (B,)).
            stops: (S,) stop ids.
            sampling: (temperature, top_k, top_p, min_p), what `draw` applies.
            T_p: the prompt width (the cache's first completion slot).

        Returns:
            tokens (B, T_run), their logprobs (B, T_run) float32 and done (B,) bool (the row
            drew a stop id); T_run <= max_new_tokens steps were run.
        """
        if not cache.static:  # one query per row sees every slot written so far
            kv_mask = self.decode_mask(kv_mask)
        tok, lp = draw(logits, 0)  # every row draws its own token from the first one on
        tokens, logprobs = [tok], [lp]
        done = torch.isin(tok, stops)  # (B,)
        position_ids = prompt_lens[:, None].clone()  # (B, 1) next rotary position per row
        for t in range(1, uniforms.shape[1]):
            if t % self.sync_every == 0 and bool(done.all()):  # the loop's only host sync
                break
            self._bound(cache, T_p + t)
            logits = self.decode(tok[:, None], position_ids, kv_mask, cache)  # (B, V)
            position_ids += 1
            tok, lp = draw(logits, t)  # (B,), (B,)
            tokens.append(tok)
            logprobs.append(lp)
            done |= torch.isin(tok, stops)
        return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1), done

    def decode_mask(self, kv_mask: torch.Tensor) -> torch.Tensor:
        """(B, S) bool over every cache slot -> the (B, 1, 1, S) additive mask a decode step
        of an eager (dynamic or grouped) cache attends with, built once per rollout in the
        dtype attention runs in: the step's one query sees every slot written so far, so only
        padding and holes are hidden (`Decoder.forward` takes it as it is). Rows are padded to
        a multiple of 8 elements (a view of the first S), as the forward's own masks are."""
        B, S = kv_mask.shape
        S_8 = -(-S // 8) * 8
        out = torch.zeros(B, 1, 1, S_8, dtype=self.precision.compute_dtype, device=kv_mask.device)[
            ..., :S
        ]
        return out.masked_fill_(~kv_mask[:, None, None, :], float("-inf"))

    def _compiled_loop(
        self, logits, cache, kv_mask, prompt_lens, uniforms, draw, stops, sampling, T_p
    ):
        """`_decode_loop` with each iteration after the first one compiled call
        (`_iteration`: forward, head, draw, stop test, position update), its state in tensors
        kept across calls of the same shape (CUDA graphs replay in place); same returns."""
        B, T = uniforms.shape
        st = self._loop_state(B, T, logits.device)
        tok, lp = draw(logits, 0)
        st.reset(tok, lp, torch.isin(tok, stops), prompt_lens, uniforms)
        _mark_dynamic_state(st, kv_mask, cache)  # once: the marks stay on the tensors
        steps = 1
        for t in range(1, T):
            if t % self.sync_every == 0 and bool(st.done.all()):  # the loop's only host sync
                break
            self._bound(cache, T_p + t)
            if self._iterate_compiled:
                self._run_compiled(
                    self._compiled_iteration,
                    self._iteration,
                    ("iteration", B, T, cache.max_len, cache.dtype),
                    st,
                    cache,
                    kv_mask,
                    stops,
                    sampling,
                )
            else:  # a fallback in this call
                self._iteration(st, cache, kv_mask, stops, sampling)
            steps += 1
        return st.tokens[:, :steps], st.logprobs[:, :steps], st.done

    def _bound(self, cache, filled: int) -> None:
        """A static cache's forwards attend over the filled slots (`filled`, counted on the
        host), rounded up to a multiple of SLOT_MULTIPLE: a step's attention costs what is
        filled, and a compiled step sees a handful of lengths (a graph each on CUDA)."""
        if cache.static:
            cache.limit = min(cache.max_len, -(-filled // SLOT_MULTIPLE) * SLOT_MULTIPLE)

    def _refill(self, sampling, st: RefillState, cache: RowKVCache) -> None:
        """One refill decode step (`grpo.rollout.refill`), compiled when the sampler compiles:
        the same S slots every step, so rows coming and going never recompile."""
        if not (self.compile and self._iterate_compiled):
            return self._refill_step(st, cache, sampling)
        shape = ("refill", st.row_of.shape[0], cache.max_len, cache.dtype, cache.limit)
        self._run_compiled(self._compiled_refill, self._refill_step, shape, st, cache, sampling)

    def _prepare_refill(self, st: RefillState, cache: RowKVCache) -> None:
        """Once per refill call, what its compiled steps need of the new tensors: dynamic
        dimensions (the call's rows, columns and cache positions vary between calls) and, on
        CUDA, fixed addresses for what the graph mutates (a new call re-records its CUDA
        graphs, never recompiles)."""
        if not self.compile:
            return
        mark = torch._dynamo.maybe_mark_dynamic
        for t in (st.out_tok, st.out_lp, st.uniforms):
            mark(t, 0)
            mark(t, 1)
        mark(st.mask, 3)
        mark(st.cols, 0)
        for t in (*cache.k_layers, *cache.v_layers):
            mark(t, 2)
        if self._cuda:
            for t in [*st.tensors(), *cache.k_layers, *cache.v_layers, cache.lens]:
                torch._dynamo.mark_static_address(t, guard=False)

    def _refill_step(self, st: RefillState, cache: RowKVCache, sampling) -> None:
        refill_step(self, st, cache, sampling)

    def _loop_state(self, rows: int, steps: int, device) -> _LoopState:
        key = (rows, steps)
        st = self._loops.get(key)
        if st is None:
            st = self._loops[key] = _LoopState.empty(rows, steps, device)
            if self._cuda:  # mutated in place by the graph: fixed addresses, no input copies
                for x in st.tensors():
                    torch._dynamo.mark_static_address(x, guard=False)
        return st

    def _iteration(self, st: _LoopState, cache, kv_mask, stops, sampling) -> None:
        """One decode iteration on device tensors only (no host sync, no Python value that
        changes per step): the last tokens through the model, the next ones drawn with the
        rows' uniforms of this step, written at column `st.step`; stop test, positions and
        the step advanced in place. What `torch.compile` turns into one graph."""
        logits = self._decode_step(st.last, st.positions, kv_mask, cache)  # (B, V)
        u = st.uniforms.index_select(1, st.step)[:, 0]  # (B,) this step's uniforms
        tok, lp = next_tokens(logits, None, *sampling, uniforms=u)
        st.tokens.index_copy_(1, st.step, tok[:, None])
        st.logprobs.index_copy_(1, st.step, lp[:, None])
        st.done |= torch.isin(tok, stops)
        st.last.copy_(tok[:, None])
        st.positions.add_(1)
        st.step.add_(1)


@dataclass
class _LoopState:
    """What one compiled decode iteration reads and writes: B rows, T steps."""

    tokens: torch.Tensor  # (B, T) long, column t = the tokens drawn at step t
    logprobs: torch.Tensor  # (B, T) float32
    done: torch.Tensor  # (B,) bool, the row drew a stop id
    last: torch.Tensor  # (B, 1) long, the tokens to feed next
    positions: torch.Tensor  # (B, 1) long, their rotary positions
    step: torch.Tensor  # (1,) long, the next column
    uniforms: torch.Tensor  # (B, T) float64, the rows' random numbers (`row_uniforms`)

    @classmethod
    def empty(cls, B: int, T: int, device) -> _LoopState:
        z = functools.partial(torch.zeros, device=device)
        return cls(
            z(B, T, dtype=torch.long),
            z(B, T),
            z(B, dtype=torch.bool),
            z(B, 1, dtype=torch.long),
            z(B, 1, dtype=torch.long),
            z(1, dtype=torch.long),
            z(B, T, dtype=torch.float64),
        )

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def reset(self, tok, lp, done, prompt_lens, uniforms) -> None:
        """Step 0's draw in place (column 0), the first positions, this call's uniforms."""
        self.tokens[:, 0] = tok
        self.logprobs[:, 0] = lp
        self.done.copy_(done)
        self.last.copy_(tok[:, None])
        self.positions.copy_(prompt_lens[:, None])
        self.step.fill_(1)
        self.uniforms.copy_(uniforms)


def _mark_dynamic_state(st: _LoopState, kv_mask, cache: KVCache) -> None:
    """The compiled iteration's dynamic dimensions: rows everywhere, cache slots."""
    mark = torch._dynamo.maybe_mark_dynamic
    for t in (st.tokens, st.logprobs, st.done, st.last, st.positions, st.uniforms, kv_mask):
        mark(t, 0)
    mark(kv_mask, 1)
    for t in (*cache.k_layers, *cache.v_layers):
        mark(t, 0)
        mark(t, 2)


def _mark_dynamic(tokens, position_ids, attention_mask, cache: KVCache) -> None:
    """Rows (dim 0 of every input) and cache slots (the mask's dim 1, the keys' and values'
    dim 2) as dynamic dimensions of the compiled decode step. `maybe_`: a dimension the trace
    specializes anyway (one row) compiles one more graph instead of failing."""
    mark = torch._dynamo.maybe_mark_dynamic
    for t in (tokens, position_ids, attention_mask):
        mark(t, 0)
    mark(attention_mask, 1)
    for t in (*cache.k_layers, *cache.v_layers):
        mark(t, 0)
        mark(t, 2)


def sample(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    stop_ids: Sequence[int],
    seed: int,
    pad_id: int = 0,
    compile: bool = False,
) -> Rollout:
    """Sample `group_size` completions for each of P prompts (one-shot; see `Sampler`).

    The P prompts are left-padded and prefilled once; each prompt's KV rows are copied G
    times and all B = P*G rows decode together with a static KV cache. Each row draws its own
    tokens, from the first one on, from its own random stream keyed by `seed`, the row and the
    step (`row_uniforms`: same seed, same rollout, bit for bit). A row that emits a stop id
    stops there: its later tokens are pad_id, masked out, with log-prob 0. The loop ends when
    every row has stopped or after `max_new_tokens`. The model runs in eval mode under
    torch.inference_mode (its mode is restored); the returned tensors are ordinary ones that
    training can use.

    Args:
        model: a `Decoder`.
        prompts: P token-id lists (unpadded, each non-empty).
        group_size: G completions per prompt.
        max_new_tokens: completion length limit; prompt + completion must fit in the model's
            max_position_embeddings.
        temperature: 0 = greedy (arg-max), else the softmax temperature.
        top_k: keep the k most likely tokens (0 = off).
        top_p: nucleus sampling mass (1.0 = off).
        min_p: keep tokens with p >= min_p * p_max (0 = off).
        stop_ids: token ids that end a completion (the stop token counts in the mask).
        seed: keys the rows' random streams (`row_uniforms`).
        pad_id: the id of left padding and of tokens after a stop (never used to build masks).
        compile: `torch.compile` the decode step. To reuse the compiled step across calls,
            hold a `Sampler(model, compile=True)` instead of calling this function.

    Returns:
        a `Rollout` with B = P*G rows; row b belongs to prompt b // G.
    """
    return Sampler(model, compile=compile).sample(
        prompts,
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        stop_ids=stop_ids,
        seed=seed,
        pad_id=pad_id,
    )
