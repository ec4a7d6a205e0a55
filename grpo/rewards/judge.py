"""The LLM-judge reward (RLAIF): an OpenAI-compatible chat endpoint grades each completion.

    rewards:
      - name: judge
        weight: 1.0
        kwargs:
          base_url: http://127.0.0.1:8000/v1  # required: the endpoint (grpo serve, vLLM, ...)
          model: my-judge                     # required: the served model name
          template: "..."                     # {question}, {completion}, {reference} fields
          parser: number                      # number | yes_no | package.module:function
          pattern: null                       # parser number: a regex read instead
          scale: [0, 10]                      # optional: [lo, hi] mapped linearly to [0, 1]
          concurrency: 4                      # requests in flight at once
          request_timeout_s: 30               # one attempt
          retries: 2                          # more attempts on transient errors
          total_timeout_s: 120                # one row's judgment, retries and waits included
          backoff_s: 0.5                      # first retry's wait, doubling after
          on_failure: error                   # or a number: the reward of a failed row
          max_tokens: 64                      # sent with the request
          temperature: 0.0                    # sent with the request
          api_key_env: null                   # env var holding a bearer token

Each completion is one POST ``{base_url}/chat/completions`` with a single user message: the
template filled from the row, {question} from the ``question`` column, {reference} from
``ground_truth`` (else ``answer``), {completion} the completion (`DEFAULT_TEMPLATE` asks for a
0-10 score). The reply's text is read by the parser (`score_parser`): ``number`` takes the last
number of the reply that is not a denominator ("Score: 7/10" reads 7), or with ``pattern`` the
last match of that regex (its group 1 when it has one); ``yes_no`` the first whole word yes
(1.0) or no (0.0); ``package.module:function`` is a function text -> float. With ``scale`` a
score s in [lo, hi] becomes (s - lo) / (hi - lo).

A row fails when its request fails after the retries (connection errors, timeouts, HTTP 5xx
and 429 are retried; other HTTP errors are not), when its judgment runs past
``total_timeout_s`` (no retry starts after it, and an attempt running then is cut at it), when
the judge answers a redirect (3xx: never followed, so the API key goes to ``base_url`` only),
when the reply has no text or no score, or when the score lies outside ``scale`` (the judge
did not follow the scale: not clamped). With
``on_failure: error`` the first failure stops the call with one `GrpoError` naming the row, the
URL and the cause; with a number the failed rows get that reward, a warning is logged and
``failures`` counts them. The reward reports (logged as ``rewards/judge/<metric>``):
``failures`` and ``retries`` (`grpo.metrics.Sum`: counts) and ``latency_s``, the mean seconds
of one row's judgment, its retries included.

The whole batch runs under the reward's ``rewards[].timeout_s`` (300 s by default in a config):
raise it for large batches or slow judges. HTTP is the standard library's (urllib, in
``concurrency`` daemon threads), so the reward needs no client package. A call that fails
starts no more requests or retries; threads still working (after that failure, past that
timeout, or at a stop: Ctrl-C or training's second SIGTERM, which leave the call as the
KeyboardInterrupt they are) end on their own, each row within ``total_timeout_s``, and never
hold the process open.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import numbers
import os
import queue
import re
import string
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from grpo.errors import GrpoError
from grpo.metrics import Sum
from grpo.plugins import import_callable
from grpo.rewards.bounds import with_bounds
from grpo.rewards.functions import RewardContext, RewardFn

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = (
    "You are grading an answer to a math problem.\n\n"
    "Problem:\n{question}\n\n"
    "Reference answer: {reference}\n\n"
    "Answer to grade:\n{completion}\n\n"
    "Is the final answer correct and the reasoning sound? Give a score from 0 (wrong or "
    "missing) to 10 (correct, with clear reasoning). Reply with the score only, as "
    '"Score: N".'
)
FIELDS = ("question", "completion", "reference")  # what a template may use
# a number not glued to a word or a decimal point, and not a denominator ("7/10" reads 7)
_NUMBER = re.compile(r"(?<![\w./])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?!\w)")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
MAX_REPLY_BYTES = 4 << 20  # a larger reply body is a failure, not memory spent
RETRY_AFTER_MAX_S = 30.0  # the longest Retry-After header (429 / 503) that is honoured


class _Failure(Exception):
    """One row's judgment failed: the message is the cause, for the error or the warning."""


@dataclass(frozen=True)
class _Outcome:
    """One row's judgment: its reward (None when it failed), the cause, time and retries."""

    value: float | None
    cause: str
    latency_s: float
    retries: int


def make_judge(
    base_url: str | None = None,
    model: str | None = None,
    template: str = DEFAULT_TEMPLATE,
    parser: str = "number",
    pattern: str | None = None,
    scale: Sequence[float] | None = None,
    concurrency: int = 4,
    request_timeout_s: float = 30.0,
    retries: int = 2,
    backoff_s: float = 0.5,
    total_timeout_s: float = 120.0,
    on_failure: str | float = "error",
    max_tokens: int = 64,
    temperature: float = 0.0,
    api_key_env: str | None = None,
) -> RewardFn:
    """A reward that asks an OpenAI-compatible chat endpoint to grade each completion.

    Args:
        base_url: the endpoint's base, ``http(s)://host:port/v1`` (required).
        model: the model name the endpoint serves (required).
        template: the user message, with ``{question}``, ``{completion}`` and ``{reference}``
            fields (any subset).
        parser: ``"number"``, ``"yes_no"`` or ``"package.module:function"`` (`score_parser`).
        pattern: with parser ``"number"``, a regex whose last match is the score.
        scale: ``[lo, hi]``: a score in it maps linearly to [0, 1]; outside it is a failure.
        concurrency: most requests in flight at once (>= 1).
        request_timeout_s: seconds one attempt may take (> 0).
        retries: further attempts after a connection error, a timeout, HTTP 5xx or 429.
        backoff_s: wait before the first retry, doubled before each next one (a 429 or 503's
            ``Retry-After`` header of up to 30 s is waited instead).
        total_timeout_s: seconds one row's judgment may take in all, its attempts and the
            waits between them (> 0): no retry starts (nor waits) past it, and an attempt
            running then is cut at it. The defaults' worst case is 3 x 30 s + 1.5 s of waits.
        on_failure: ``"error"`` (a failed row raises) or the reward a failed row gets.
        max_tokens, temperature: sent with each request.
        api_key_env: the environment variable holding a bearer token (read now).

    Returns:
        ``judge(completions, *, question=None, ground_truth=None, context=None, **columns)
        -> (values, {"failures": Sum, "retries": Sum, "latency_s": float})``, B floats; it
        declares bounds [0, 1] (the failure reward included) when `scale` is given or the
        parser is ``yes_no``.

    Raises:
        GrpoError: a missing or malformed parameter, naming it.
    """
    url = _check_url(base_url) + "/chat/completions"
    if not isinstance(model, str) or not model.strip():
        raise GrpoError(f"judge: model is required: the name the endpoint serves, got {model!r}")
    used = _check_template(template)
    read = score_parser(parser, pattern)
    lo_hi = _check_scale(scale)
    _check_int("concurrency", concurrency, 1)
    _check_int("retries", retries, 0)
    _check_int("max_tokens", max_tokens, 1)
    _check_number("request_timeout_s", request_timeout_s, 0.0, strict=True)
    _check_number("total_timeout_s", total_timeout_s, 0.0, strict=True)
    _check_number("backoff_s", backoff_s, 0.0)
    _check_number("temperature", temperature, 0.0)
    fallback = _check_on_failure(on_failure)
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if api_key_env is not None:
        headers["Authorization"] = f"Bearer {_api_key(api_key_env)}"
    settings = {"model": model, "max_tokens": max_tokens, "temperature": float(temperature)}
    opener = urllib.request.build_opener(_NoRedirect)  # the key goes to base_url only

    def score(reply: str) -> float:
        """The reward of a reply: parsed, checked against the scale, mapped."""
        try:
            s = read(reply)
        except Exception as e:  # a user's parser: its error is the row's cause
            raise _Failure(
                f"parser {parser!r} raised {type(e).__name__}: {e} on {_excerpt(reply)}"
            ) from None
        if s is None:
            raise _Failure(f"no score in the reply {_excerpt(reply)} (parser {parser!r})")
        if not _is_number(s):
            raise _Failure(
                f"parser {parser!r} returned {s!r} for {_excerpt(reply)}; expected a finite number"
            )
        if lo_hi is None:
            return float(s)
        lo, hi = lo_hi
        if not lo <= s <= hi:
            raise _Failure(
                f"score {s:g} is outside scale [{lo:g}, {hi:g}]: the judge did not "
                f"follow the scale (reply {_excerpt(reply)})"
            )
        return (float(s) - lo) / (hi - lo)

    def judge_one(prompt: str, stop: threading.Event) -> _Outcome:
        """One row: POST with retries until `total_timeout_s` (or `stop`), then read the
        score."""
        body = json.dumps({**settings, "messages": [{"role": "user", "content": prompt}]})
        start, attempt = time.monotonic(), 0
        deadline = start + total_timeout_s
        while True:
            left = deadline - time.monotonic()
            cut = left < request_timeout_s  # the total cuts this attempt: its cause says so
            if cut:
                timeout_s, limit = max(left, 1e-3), f"total_timeout_s={total_timeout_s:g}"
            else:
                timeout_s, limit = request_timeout_s, f"request_timeout_s={request_timeout_s:g}"
            try:
                reply = _post(opener, url, body.encode(), headers, timeout_s, limit)
                value = score(reply)
                return _Outcome(value, "", time.monotonic() - start, attempt)
            except _Retryable as e:
                tries = f" after {attempt + 1} attempts" if attempt else ""
                cause = f"POST {url} failed{tries}: {e}"
                wait = e.wait_s if e.wait_s is not None else backoff_s * 2.0 ** min(attempt, 60)
                if attempt < retries and time.monotonic() + wait >= deadline and not cut:
                    cause += (
                        f" (no time left for a retry within total_timeout_s={total_timeout_s:g} s)"
                    )
                if attempt >= retries or time.monotonic() + wait >= deadline:
                    return _Outcome(None, cause, time.monotonic() - start, attempt)
                if stop.wait(wait):  # the call has ended (failed, or was left): no more attempts
                    return _Outcome(None, cause, time.monotonic() - start, attempt)
                attempt += 1
            except _Failure as e:
                cause = f"POST {url}: {e}"
                return _Outcome(None, cause, time.monotonic() - start, attempt)

    def judge(
        completions: list[str],
        *,
        question: Sequence[Any] | None = None,
        ground_truth: Sequence[Any] | None = None,
        context: RewardContext | None = None,
        **columns: Any,
    ) -> tuple[list[float], dict[str, float]]:
        rows = _fields(used, completions, question, ground_truth, columns)
        prompts = [template.format_map(row) for row in rows]
        outcomes: list[_Outcome | None] = [None] * len(prompts)
        done: queue.Queue = queue.Queue()  # (row, _Outcome or the exception of a bug)
        stop = _start_workers(judge_one, prompts, min(concurrency, len(prompts)), done)
        try:
            for _ in prompts:
                row, outcome = done.get()  # a Ctrl-C in the main thread interrupts this wait
                if isinstance(outcome, BaseException):
                    raise outcome
                outcomes[row] = outcome
                if outcome.value is None and fallback is None:  # fail fast
                    raise _row_error(row, completions[row], outcome.cause)
        finally:  # queued rows are dropped; running ones end at their next wait or on their own
            stop.set()
        failed = [row for row, o in enumerate(outcomes) if o.value is None]
        if failed:
            first = failed[0]
            log.warning(
                "judge: %d of %d judgments failed (first: row %d: %s); they get "
                "reward %g (on_failure)",
                len(failed),
                len(outcomes),
                first,
                outcomes[first].cause,
                fallback,
            )
        values = [fallback if o.value is None else o.value for o in outcomes]
        latency = sum(o.latency_s for o in outcomes) / max(1, len(outcomes))
        metrics = {
            "failures": Sum(len(failed)),
            "retries": Sum(sum(o.retries for o in outcomes)),
            "latency_s": latency,
        }
        return values, metrics

    if lo_hi is None and parser != "yes_no":
        return judge
    return with_bounds(judge, min(0.0, fallback or 0.0), max(1.0, fallback or 0.0))


def score_parser(parser: str, pattern: str | None = None) -> Callable[[str], float | None]:
    """The function that reads a score from a judge's reply (None: the reply has none).

    Args:
        parser: ``"number"``: the last number of the reply not glued to a word and not after
            a ``/`` (``"Score: 7/10"`` -> 7.0, ``"8.5"`` -> 8.5, ``"-2"`` -> -2.0), an exponent
            read with it (``"2e1"`` -> 20.0; ``"1e999"`` is not finite: a failure); with
            `pattern`, the last match of that regex instead (its group 1 when it has groups,
            read as a float). ``"yes_no"``: the first whole word "yes" (1.0) or "no" (0.0),
            any case. ``"package.module:function"``: a function ``text -> float`` (returning
            None, or raising, for a reply it cannot read).
        pattern: a regex, with parser ``"number"`` only.

    Raises:
        GrpoError: an unknown parser, a pattern that is not a regex or comes with another
            parser, or a function that cannot be imported.
    """
    if pattern is not None and parser != "number":
        raise GrpoError(f"judge: pattern is read by parser 'number', not {parser!r}")
    if parser == "number":
        if pattern is None:
            return _last_number
        if not isinstance(pattern, str):
            raise GrpoError(f"judge: pattern must be a regex string, got {pattern!r}")
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise GrpoError(f"judge: pattern {pattern!r} is not a valid regex: {e}") from None
        return lambda text: _last_match(regex, text)
    if parser == "yes_no":
        return _yes_no
    if isinstance(parser, str) and ":" in parser:
        return import_callable(parser, f"judge: parser {parser!r}")
    raise GrpoError(
        f"judge: parser must be 'number', 'yes_no' or a 'package.module:function' "
        f"path, got {parser!r}"
    )


def _start_workers(
    judge_one: Callable[[str, threading.Event], _Outcome],
    prompts: list[str],
    n_threads: int,
    done: queue.Queue,
) -> threading.Event:
    """`n_threads` daemon threads judging `prompts` row by row, each putting (row, outcome)
    on `done` (or (row, exception) for an unexpected error). Returns the event that stops
    them: none starts a row, or waits for a retry, after it is set. Daemon threads: one left
    waiting on a hung judge does not keep the process alive (a ThreadPoolExecutor's would)."""
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for row in range(len(prompts)):
        todo.put(row)
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            try:
                row = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((row, judge_one(prompts[row], stop)))
            except BaseException as e:  # a bug: raised in the caller
                done.put((row, e))

    for i in range(n_threads):
        threading.Thread(target=work, name=f"judge-{i}", daemon=True).start()
    return stop


# --------------------------------------------------------------------------- parsers


def _last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    return float(found[-1]) if found else None


def _last_match(regex: re.Pattern, text: str) -> float | None:
    matches = list(regex.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    found = m.group(1) if regex.groups else m.group(0)
    try:
        return float(found)
    except (TypeError, ValueError):  # group 1 did not take part, or is not a number
        return None


def _yes_no(text: str) -> float | None:
    m = _YES_NO.search(text)
    return None if m is None else float(m.group(1).lower() == "yes")


# --------------------------------------------------------------------------- HTTP


class _Retryable(Exception):
    """A transient failure of one attempt; `wait_s` is the server's Retry-After, if any."""

    def __init__(self, cause: str, wait_s: float | None = None):
        super().__init__(cause)
        self.wait_s = wait_s


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects are not followed: a 3xx is an HTTPError (urllib would send the request, its
    Authorization header included, wherever the Location points)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


def _post(
    opener: urllib.request.OpenerDirector,
    url: str,
    body: bytes,
    headers: dict[str, str],
    timeout_s: float,
    limit: str,
) -> str:
    """The text of the reply to one chat-completions request (one attempt of at most
    `timeout_s` seconds; `limit` names the setting that set it, for the cause).

    Raises:
        _Retryable: a connection error, a timeout, HTTP 5xx or 429.
        _Failure: a redirect, another HTTP error, a reply that is not JSON or has no message
            text.
    """
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    deadline = time.monotonic() + timeout_s  # bounds the body too, however slowly it comes
    try:
        with opener.open(request, timeout=timeout_s) as resp:
            data = _read(resp, deadline, limit)
    except _Failure:
        raise
    except urllib.error.HTTPError as e:
        if 300 <= e.code < 400:
            where = _excerpt(e.headers.get("Location") or "", 200)
            raise _Failure(
                f"HTTP {e.code}: the judge redirected to {where}; redirects are not followed "
                "(base_url must be the endpoint itself)"
            ) from None
        cause = f"HTTP {e.code}{_error_detail(e)}"
        if e.code == 429 or e.code >= 500:
            raise _Retryable(cause, _retry_after(e.headers)) from None
        raise _Failure(cause) from None
    except urllib.error.URLError as e:  # connecting, sending
        raise _Retryable(_connection_cause(e.reason, limit)) from None
    except OSError as e:  # waiting for or reading the reply: a timeout, a reset
        raise _Retryable(_connection_cause(e, limit)) from None
    except http.client.HTTPException as e:  # a broken reply (RemoteDisconnected is an OSError)
        raise _Retryable(f"{type(e).__name__}: {e}") from None
    try:
        reply = json.loads(data)
        content = reply["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError, RecursionError):  # nested too deep too
        raise _Failure(
            f"the reply has no choices[0].message.content: "
            f"{_excerpt(data.decode('utf-8', 'replace'))}"
        ) from None
    if not isinstance(content, str):
        raise _Failure(f"the reply's choices[0].message.content is {content!r}, not text")
    return content


def _read(resp: Any, deadline: float, limit: str) -> bytes:
    """The body of `resp`, read by chunks as they come, until `deadline` at the latest."""
    chunks, size = [], 0
    while chunk := resp.read1(65536):
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_REPLY_BYTES:
            raise _Failure(f"the reply is larger than {MAX_REPLY_BYTES >> 20} MiB")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no complete reply within {limit} s")
    return b"".join(chunks)


def _connection_cause(reason: Any, limit: str) -> str:
    """A short cause for a connection error or timeout (`limit`: the setting that timed out)."""
    if isinstance(reason, TimeoutError) or "timed out" in str(reason):
        return f"no complete reply within {limit} s"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused (is the judge server running?)"
    if isinstance(reason, BaseException):
        return f"{type(reason).__name__}: {reason}"
    return str(reason)


def _error_detail(e: urllib.error.HTTPError) -> str:
    """': <message>' of an HTTP error's body (OpenAI's ``{"error": {"message": ...}}`` or the
    text), shortened; empty when there is none."""
    try:
        text = e.read(4096).decode("utf-8", "replace")
    except Exception:
        return ""
    try:
        error = json.loads(text).get("error")
        text = error.get("message", text) if isinstance(error, dict) else str(error or text)
    except (ValueError, AttributeError):
        pass
    return f": {_excerpt(text)}" if text.strip() else ""


def _retry_after(headers: Any) -> float | None:
    """The seconds of a Retry-After header, when it is a number of at most 30 s."""
    try:
        wait = float(headers.get("Retry-After"))
    except (TypeError, ValueError):
        return None
    return wait if 0 <= wait <= RETRY_AFTER_MAX_S else None


# --------------------------------------------------------------------------- checks


def _fields(
    used: frozenset[str],
    completions: list[str],
    question: Sequence[Any] | None,
    ground_truth: Sequence[Any] | None,
    columns: dict[str, Any],
) -> list[dict[str, str]]:
    """Per row, the template's fields as strings; a column the template needs and the rows
    lack, or of the wrong length, is a GrpoError naming it."""
    n = len(completions)
    given = sorted(
        {
            *columns,
            *(["question"] if question is not None else []),
            *(["ground_truth"] if ground_truth is not None else []),
        }
    )
    out: dict[str, Sequence[Any]] = {"completion": completions}
    if "question" in used:
        if question is None:
            raise GrpoError(
                f"judge: the template uses {{question}} and the rows have no "
                f"'question' column (columns: {', '.join(given) or 'none'})"
            )
        out["question"] = question
    if "reference" in used:
        reference = ground_truth if ground_truth is not None else columns.get("answer")
        if reference is None:
            raise GrpoError(
                f"judge: the template uses {{reference}} and the rows have no "
                f"'ground_truth' or 'answer' column (columns: "
                f"{', '.join(given) or 'none'})"
            )
        out["reference"] = reference
    for name, values in out.items():
        if len(values) != n:
            raise GrpoError(
                f"judge: the {name} column has {len(values)} values for {n} completions"
            )
    return [{name: str(values[i]) for name, values in out.items()} for i in range(n)]


def _row_error(row: int, completion: str, cause: str) -> GrpoError:
    """The error of a failed row under on_failure: error (named: `call_reward` passes it on
    without calling the reward again row by row, which would send the requests again)."""
    shown = completion if len(completion) <= 60 else completion[:57] + "..."
    err = GrpoError(
        f"reward 'judge' failed at row {row} (completion {shown!r}): {cause} "
        "(kwargs.on_failure: a number gives failed rows that reward instead)"
    )
    err.reward_name = "judge"
    return err


def _check_url(base_url: Any) -> str:
    if base_url is None:
        raise GrpoError(
            "judge: base_url is required: the judge's OpenAI-compatible endpoint, "
            "e.g. http://127.0.0.1:8000/v1"
        )
    parts = urllib.parse.urlsplit(base_url) if isinstance(base_url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise GrpoError(
            f"judge: base_url must be an http(s):// URL such as "
            f"http://127.0.0.1:8000/v1, got {base_url!r}"
        )
    return base_url.rstrip("/")


def _check_template(template: Any) -> frozenset[str]:
    """The fields `template` uses, checked to be among FIELDS and to render."""
    if not isinstance(template, str) or not template.strip():
        raise GrpoError(f"judge: template must be a non-empty string, got {template!r}")
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
        unknown = sorted(names - set(FIELDS))
        if not unknown:
            template.format(**{f: "x" for f in FIELDS})  # format specs and conversions
    except (ValueError, IndexError, KeyError, AttributeError) as e:
        raise GrpoError(
            f"judge: template is not a valid format string ({e}); write a literal "
            "brace as {{ or }}"
        ) from None
    if unknown:
        raise GrpoError(
            f"judge: template has unknown fields {unknown} (fields: "
            f"{', '.join('{' + f + '}' for f in FIELDS)}; a literal brace: {{{{ "
            "or }})"
        )
    return frozenset(names)


def _check_scale(scale: Any) -> tuple[float, float] | None:
    if scale is None:
        return None
    ok = isinstance(scale, (list, tuple)) and len(scale) == 2 and all(map(_is_number, scale))
    if not ok or not scale[0] < scale[1]:
        raise GrpoError(
            f"judge: scale must be [lo, hi], two finite numbers with lo < hi, got {scale!r}"
        )
    return float(scale[0]), float(scale[1])


def _check_on_failure(value: Any) -> float | None:
    """None for "error", else the reward of a failed row."""
    if value == "error":
        return None
    if not _is_number(value):
        raise GrpoError(
            f"judge: on_failure must be 'error' or a finite number (the reward of a "
            f"failed row), got {value!r}"
        )
    return float(value)


def _check_int(name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise GrpoError(f"judge: {name} must be a whole number >= {lo}, got {value!r}")


def _check_number(name: str, value: Any, lo: float, strict: bool = False) -> None:
    if not _is_number(value) or value < lo or (strict and value == lo):
        raise GrpoError(
            f"judge: {name} must be a finite number {'>' if strict else '>='} {lo:g}, got {value!r}"
        )


def _is_number(value: Any) -> bool:
    """A finite real number (numpy's too), not a bool."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    return ok and math.isfinite(value)


def _api_key(env: Any) -> str:
    if not isinstance(env, str) or not env:
        raise GrpoError(f"judge: api_key_env must name an environment variable, got {env!r}")
    key = os.environ.get(env)
    if not key:
        raise GrpoError(f"judge: api_key_env: the environment variable {env} is not set or empty")
    return key


def _excerpt(text: str, limit: int = 80) -> str:
    """A short quoted view of a reply for messages."""
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")
