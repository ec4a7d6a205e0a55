"""The engine behind `grpo serve`: a bounded queue of generation jobs that one worker thread
batches into `Sampler.sample` calls; per-job token limits, stop strings and streamed text.

Batching. The worker takes the oldest waiting job and waits for company until
`batch_window_ms` after the later of its arrival and the end of the previous call (or until
the batch is full): every waiting job with the same sampling settings (all greedy jobs share
one key; sampled jobs share one when temperature, top_p and top_k are equal) joins, oldest
first, while the batch stays within `max_batch_rows` rows (prompts x n) and the model's
context (longest prompt + largest max_tokens). The batch decodes to its largest max_tokens;
a row that reaches its own limit, or whose text hits a stop string, is switched to a stop id
(its later tokens are dropped), so the sampler's loop ends as soon as every job is done.

Seeds. The sampler draws every row of a call from one generator, so a row's randomness
depends on its batch. A sampled job *with* a seed therefore runs alone, in its own call
seeded with it: the same job and seed give the same completions, bit for bit, whatever else
the server is doing (same hardware and software). Jobs without a seed are batched and drawn
from the server's seed sequence (not reproducible). Greedy jobs ignore the seed and batch.

Streaming. When a batch holds a streaming job or stop strings, each decode step's tokens go
to the host (one sync per step; other batches decode without it) and are detokenized
incrementally (a window of the last tokens, as text-generation-inference does), so text
reaches the client while the batch decodes. The final text of every choice is a full decode
of its counted tokens; a stream ends with whatever that adds to what was sent.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from grpo.apps.serving.text import Detokenizer, find_stop, held_back
from grpo.envs.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from grpo.errors import GrpoError
from grpo.rollout import Sampler
from grpo.rollout.sampling import logit_bias_tensor
from grpo.settings import between, check_value

log = logging.getLogger(__name__)
TOOL_TAGS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)


class Unavailable(GrpoError):
    """The engine refuses new work (HTTP 503): the queue is full or the server is stopping."""


class _Aborted(Exception):
    """Raised inside the decode loop to stop the running batch at shutdown."""


@dataclass(frozen=True)
class SamplingParams:
    """One job's generation settings (validated by the HTTP layer).

    Attributes:
        max_tokens: completion tokens per choice, the stop token included.
        temperature: 0 = greedy.
        top_p, top_k: nucleus mass (1 = off) and top-k (0 = off).
        n: completions per prompt.
        seed: None = the server's seed sequence (batched); else the job runs alone.
        stop: strings that end a completion (not part of its text).
        min_p: keep tokens with p >= min_p * p_max (0 = off; part of the batch key).
        logit_bias: (token id, bias) pairs added to the row's logits (per row, batched).
        repetition_penalty: HF's penalty on the row's prompt and generated ids (1 = off;
            per row, batched).
        grammar: a structured output's compiled grammar (`structured.Grammar`): the rows'
            tokens are masked to it (per row, batched with unconstrained rows).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    grammar: object | None = None

    def batch_key(self) -> tuple | None:
        """Jobs with equal keys may share a sampler call; None = run alone."""
        if self.temperature == 0:
            return ("greedy",)  # top_p / top_k / seed play no part in an arg-max
        if self.seed is not None:
            return None
        return ("sample", self.temperature, self.top_p, self.top_k, self.min_p)


@dataclass
class Choice:
    """One completion: `index` = prompt index * n + k (the OpenAI numbering).

    Attributes:
        tokens: completion tokens counted (a stop token included; a stop string's tokens up to
            the one that completed it).
        logprob: their summed log-prob under the sampling distribution (see `Rollout`).
        token_ids: the counted tokens (per-token log-probs are computed from them on request).
    """

    index: int
    text: str
    finish_reason: str  # "stop" | "length"
    tokens: int
    logprob: float
    token_ids: list[int] = field(default_factory=list)


@dataclass(eq=False)  # identity: two equal requests are still two jobs
class Job:
    """One request: P_j prompts x n completions with one set of `SamplingParams`.

    `notify(event)` is called from the worker thread: ("delta", choice_index, text) while a
    streaming job decodes, then ("done",) once `result` or `error` is set.

    Attributes:
        prompts: token ids of each prompt (non-empty, each fits the context with max_tokens).
        params: the settings.
        stream: send ("delta", ...) events.
        notify: the event callback (must not block).
        result: the choices, in index order, when done.
        error: (HTTP status, message) when the job failed.
        seed: the seed of the sampler call that ran the job.
        cancelled: set by the HTTP layer when the client went away; the job's rows stop.
        ignored: unknown top-level request fields that were accepted and not used.
        top_logprobs: the request asked for its tokens' log-probs, with this many alternatives
            at each (None: it did not).
    """

    prompts: list[list[int]]
    params: SamplingParams
    stream: bool = False
    notify: Callable[[tuple], None] = lambda event: None
    result: list[Choice] | None = None
    error: tuple[int, str] | None = None
    seed: int | None = None
    cancelled: bool = False
    ignored: tuple[str, ...] = ()
    top_logprobs: int | None = None
    arrival: float = field(default_factory=time.monotonic)

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.params.n

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


@dataclass
class _Row:
    """Where a batch row goes, and the host-side state of its text."""

    job: Job
    index: int  # the choice index within its job
    prompt: list[int]
    detok: Detokenizer | None = None
    sent: int = 0  # characters already streamed
    done: bool = False
    stop_step: int | None = None  # the step whose token completed a stop string


class Engine:
    """Jobs in, batched sampler calls on one worker thread, choices out.

    Args:
        model: a `Decoder` (in eval mode; the sampler keeps it so).
        tokenizer: its tokenizer (decode; pad id).
        stop_ids: ids that end a completion.
        max_queue: jobs waiting (not yet in a batch) before `submit` raises `Unavailable`.
        max_batch_rows: rows (prompts x n) in one sampler call; a job may not exceed it.
        batch_window_ms: how long the oldest waiting job waits for others to join it.
        seed: the first seed of the server's sequence (jobs without a seed).
    """

    def __init__(
        self,
        model,
        tokenizer,
        stop_ids: Sequence[int],
        *,
        max_queue: int = 64,
        max_batch_rows: int = 32,
        batch_window_ms: float = 5.0,
        seed: int = 0,
    ):
        check_value("max_queue", max_queue, between(0))
        check_value("max_batch_rows", max_batch_rows, between(1))
        check_value("batch_window_ms", batch_window_ms, between(0))
        if not stop_ids:
            raise GrpoError("stop_ids must name at least one token id")
        self.sampler = Sampler(model)
        self.tokenizer = tokenizer
        self.stop_ids = sorted(set(stop_ids))
        self.context = model.config.max_position_embeddings
        self.vocab_size = model.config.vocab_size
        self.grammars = None  # structured outputs' engine, made by the first request asking
        self.max_queue = max_queue
        self.max_batch_rows = max_batch_rows
        self.window = batch_window_ms / 1e3
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else 0
        # tool-call tags the tokenizer marks special (the tiny tokenizers do; Qwen3's does not)
        # stay in the text: the tool-call parser reads them
        special = set(getattr(tokenizer, "all_special_tokens", ()))
        self._keep = {tokenizer.convert_tokens_to_ids(t): t for t in TOOL_TAGS if t in special}
        self.lock = threading.Lock()  # held around each sampler call
        self.calls = 0  # sampler calls so far
        self.running: list[Job] = []
        self._rows: list[_Row] = []  # the running batch's rows (`active_rows`)
        self._pending: deque[Job] = deque()
        self._cond = threading.Condition()
        self._accepting = True
        self._closed = False
        self._abort = False
        self._seeds = itertools.count(seed)
        self._last_end = 0.0  # when the previous sampler call returned
        self._thread = threading.Thread(target=self._work, name="grpo-serve-engine", daemon=True)

    def decode(self, ids: list[int]) -> str:
        """Text of completion tokens: special tokens left out, tool-call tags kept."""
        decode = self.tokenizer.decode
        if not self._keep or self._keep.keys().isdisjoint(ids):
            return decode(ids, skip_special_tokens=True)
        parts, start = [], 0
        for i, t in enumerate(ids):
            if t in self._keep:
                parts += [decode(ids[start:i], skip_special_tokens=True), self._keep[t]]
                start = i + 1
        parts.append(decode(ids[start:], skip_special_tokens=True))
        return "".join(parts)

    @property
    def active_rows(self) -> int:
        """Rows of the running batch still generating for their client (a row is freed when
        it stops, reaches its limit, or its streaming client disconnects). Exact for batches
        that sync each step (streams, stop strings); other batches count every row."""
        return sum(not r.done for r in self._rows)

    @property
    def queued(self) -> int:
        """Jobs waiting for a batch."""
        return len(self._pending)

    @property
    def accepting(self) -> bool:
        """False once `drain`, `abort` or `close` was called."""
        return self._accepting

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job`; raises `Unavailable` when the queue is full or the engine is stopping."""
        if job.rows > self.max_batch_rows:
            raise GrpoError(f"{job.rows} rows (prompts x n) > max_batch_rows={self.max_batch_rows}")
        for i, prompt in enumerate(job.prompts):
            if not prompt or len(prompt) + job.params.max_tokens > self.context:
                raise GrpoError(
                    f"prompt {i} has {len(prompt)} tokens; with max_tokens="
                    f"{job.params.max_tokens} it needs {len(prompt) + job.params.max_tokens} "
                    f"positions > the model's context of {self.context}"
                    if prompt
                    else f"prompt {i} is empty"
                )
        with self._cond:
            if not self._accepting:
                raise Unavailable("the server is shutting down")
            if len(self._pending) >= self.max_queue:
                raise Unavailable("server busy: the request queue is full, retry later")
            self._pending.append(job)
            self._cond.notify_all()

    def drain(self) -> None:
        """Refuse new jobs from now on; the queued and running ones still run."""
        with self._cond:
            self._accepting = False

    def abort(self) -> None:
        """Stop at once: `close` stops waiting and the running batch ends at its next step."""
        with self._cond:
            self._accepting = False
            self._abort = True
            self._cond.notify_all()

    def close(self, timeout: float = 30.0) -> None:
        """Stop: refuse new jobs, let the queued and running ones finish for up to `timeout`
        seconds, then fail what is left with 503 (the running batch stops at its next step)
        and join the worker."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._accepting = False
            while (self._pending or self.running) and not self._abort:
                if time.monotonic() >= deadline:
                    break
                self._cond.wait(max(0.0, min(0.1, deadline - time.monotonic())))
            self._closed = True
            self._abort = True
            left = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        for job in left:
            self._fail(job, 503, "the server is shutting down")
        if self._thread.is_alive():
            self._thread.join()

    # -- worker --------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                with self.lock:
                    self._run(batch)
            finally:
                with self._cond:
                    self.running, self._rows = [], []
                    self._last_end = time.monotonic()
                    self._cond.notify_all()

    def _next_batch(self) -> list[Job] | None:
        """Wait for a job and its batching window; take the batch out of the queue."""
        with self._cond:
            while True:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return None
                first = self._pending[0]
                # the window opens at the later of the oldest arrival and the end of the
                # previous call, so clients answered by that call can rejoin this one
                deadline = max(first.arrival, self._last_end) + self.window
                while not self._closed and self._pending and self._pending[0] is first:
                    batch = self._select(first)
                    left = deadline - time.monotonic()
                    if left <= 0 or sum(j.rows for j in batch) >= self.max_batch_rows:
                        break
                    self._cond.wait(left)
                if self._closed:
                    return None
                if self._pending and self._pending[0] is first:
                    batch = self._select(first)
                    for job in batch:
                        self._pending.remove(job)
                    self.running = batch
                    return batch

    def _select(self, first: Job) -> list[Job]:
        """`first` plus the waiting jobs that may share its call, oldest first."""
        key = first.params.batch_key()
        batch = [first]
        if key is None:
            return batch
        rows = first.rows
        longest = max(len(p) for p in first.prompts)
        most = first.params.max_tokens
        for job in itertools.islice(self._pending, 1, None):
            if job.params.batch_key() != key or rows + job.rows > self.max_batch_rows:
                continue
            lo = max(longest, *(len(p) for p in job.prompts))
            mt = max(most, job.params.max_tokens)
            if lo + mt > self.context:  # the batch's cache must hold every row
                continue
            batch.append(job)
            rows, longest, most = rows + job.rows, lo, mt
        return batch

    def _fail(self, job: Job, status: int, message: str) -> None:
        job.error = (status, message)
        job.notify(("done",))

    def _run(self, batch: list[Job]) -> None:
        """One sampler call for `batch`; every job ends with a result or an error."""
        try:
            rollout, rows = self._sample(batch)
        except _Aborted:
            for job in batch:
                self._fail(job, 503, "the server is shutting down")
            return
        except GrpoError as e:  # validation should have caught it; the message is the user's
            for job in batch:
                self._fail(job, 400, str(e))
            return
        except Exception as e:
            log.exception("generation failed")
            for job in batch:
                self._fail(job, 500, f"internal error: {type(e).__name__}: {e}")
            return
        self._finish(batch, rollout, rows)

    def _sample(self, batch: list[Job]):
        """The sampler call: rows laid out job by job, prompt by prompt, k = 0..n-1."""
        p = batch[0].params
        same_n = all(j.params.n == p.n for j in batch)
        G = p.n if same_n else 1  # one prefill per prompt when every job asks the same n
        rows = [
            _Row(job, i * job.params.n + k, prompt)
            for job in batch
            for i, prompt in enumerate(job.prompts)
            for k in range(job.params.n)
        ]
        prompts = [r.prompt for r in rows[::G]]
        max_new = max(j.params.max_tokens for j in batch)
        seed = p.seed if p.seed is not None and p.batch_key() is None else next(self._seeds)
        for job in batch:
            job.seed = seed
        self.calls += 1
        self._rows = rows
        rollout = self.sampler.sample(
            prompts,
            group_size=G,
            max_new_tokens=max_new,
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            min_p=p.min_p,
            stop_ids=self.stop_ids,
            seed=seed,
            pad_id=self.pad_id,
            on_step=self._step_hook(rows, max_new),
            **self._adjust(rows),
        )
        return rollout, rows

    def _adjust(self, rows: list[_Row]) -> dict:
        """The sampler's per-row `logit_bias` (B, V) and `repetition_penalty` (B,), only for
        batches where some row asks for them (others sample as before, at no cost)."""
        out = {}
        dev = self.sampler.model.device
        if any(r.job.params.logit_bias for r in rows):
            V = self.sampler.model.config.vocab_size
            out["logit_bias"] = logit_bias_tensor(
                [dict(r.job.params.logit_bias) for r in rows], V, dev
            )
        if any(r.job.params.repetition_penalty != 1.0 for r in rows):
            penalty = [r.job.params.repetition_penalty for r in rows]
            out["repetition_penalty"] = torch.tensor(penalty, device=dev)  # (B,)
        if any(r.job.params.grammar is not None for r in rows):
            out["constraint"] = self.grammars.constraint([r.job.params.grammar for r in rows])
        return out

    def _step_hook(self, rows: list[_Row], max_new: int):
        """The per-step hook of a batch: limits, stop strings, streaming, cancel, abort."""
        limits = [r.job.params.max_tokens for r in rows]
        host = any(r.job.stream or r.job.params.stop for r in rows)
        if not host and min(limits) == max_new:
            return lambda t, tok: self._check_abort(tok)
        dev = self.sampler.model.device
        limit_t = torch.tensor(limits, device=dev)  # (B,) a row's first step past its budget
        stop_id = self.stop_ids[0]
        stop_set = set(self.stop_ids)
        for r in rows:  # only rows whose text is watched: streamed, or with stop strings
            if r.job.stream or r.job.params.stop:
                r.detok = Detokenizer(self.decode)

        def hook(t: int, tok: torch.Tensor) -> torch.Tensor:
            self._check_abort(tok)
            tok = torch.where(limit_t <= t, stop_id, tok)  # (B,) rows past their budget stop
            if not host:
                return tok
            ids = tok.tolist()  # the host sync of a streamed / stop-string batch
            changed = False
            for b, (r, token) in enumerate(zip(rows, ids)):
                if r.done:
                    continue
                if r.job.cancelled:  # the client went away: stop the row next step
                    r.done, limits[b], changed = True, min(limits[b], t + 1), True
                    continue
                if token in stop_set:  # its own stop id, or its budget ran out (above)
                    r.done = True
                    continue
                if r.detok is None:
                    continue
                old = len(r.detok.text)
                r.detok.push(token)
                stops = r.job.params.stop
                cut = -1
                if stops:  # a stop string can begin up to len(stop) - 1 characters back
                    cut = find_stop(r.detok.text, stops, max(0, old - max(map(len, stops)) + 1))
                if cut >= 0:
                    r.done, r.stop_step = True, t
                    limits[b] = t + 1  # the next step draws a stop id for this row
                    changed = True
                if r.job.stream:
                    end = cut if cut >= 0 else len(r.detok.text) - held_back(r.detok.text, stops)
                    if end > r.sent:
                        r.job.notify(("delta", r.index, r.detok.text[r.sent : end]))
                        r.sent = end
            if changed:
                limit_t.copy_(torch.tensor(limits))
            return tok

        return hook

    def _check_abort(self, tok: torch.Tensor) -> torch.Tensor:
        if self._abort:
            raise _Aborted
        return tok

    def _finish(self, batch: list[Job], rollout, rows: list[_Row]) -> None:
        """Cut each row to its own limit / stop; deliver every job's choices."""
        lens = rollout.completion_lens.tolist()
        finished = rollout.finished.tolist()
        ids_all = rollout.completion_ids.tolist()
        logprobs = rollout.logprobs
        choices: dict[int, list[Choice]] = {id(j): [] for j in batch}
        broken: dict[int, int] = {}  # job -> a choice its grammar left incomplete
        for b, r in enumerate(rows):
            p = r.job.params
            n_real, ids = lens[b], ids_all[b]
            if r.stop_step is not None:  # a stop string ended it
                count, keep, reason = r.stop_step + 1, r.stop_step + 1, "stop"
            elif finished[b] and n_real <= p.max_tokens:  # drew a stop id within its budget
                count, keep, reason = n_real, n_real - 1, "stop"
                if p.grammar is not None and not self.grammars.accepts(p.grammar, ids[:keep]):
                    broken.setdefault(id(r.job), r.index)  # "stop" would promise valid JSON
            else:
                count = keep = min(n_real, p.max_tokens)
                reason = "length"
            text = self.decode(ids[:keep])
            cut = find_stop(text, p.stop) if p.stop else -1
            if cut >= 0:
                text, reason = text[:cut], "stop"
            logprob = float(logprobs[b, :count].sum())
            choices[id(r.job)].append(Choice(r.index, text, reason, count, logprob, ids[:count]))
            if r.job.stream:
                sent = r.detok.text[: r.sent] if r.detok else ""
                if text.startswith(sent) and len(text) > len(sent):
                    r.job.notify(("delta", r.index, text[len(sent) :]))
                elif not text.startswith(sent):
                    log.warning("streamed text of choice %d differs from its full decode", r.index)
        for job in batch:
            if id(job) in broken:
                index = broken[id(job)]
                log.error("choice %d stopped before its grammar was complete: answered 500", index)
                why = "the grammar engine ended choice %d before its structured output was complete"
                self._fail(job, 500, why % index)
                continue
            job.result = sorted(choices[id(job)], key=lambda c: c.index)
            job.notify(("done",))
