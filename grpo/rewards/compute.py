"""Call reward functions on a batch, isolated from each other, and check what they return.

A reward function returns one value per completion: a float (the sequence reward), or, for
process rewards, a list of floats with one value per completion token (the trainer passes
``completion_lengths`` and ``completion_ids`` columns to align them).

Isolation: every call gets its own deep copy of the completions and columns, so a function that
mutates its inputs cannot change what the next function (or the trainer) sees. A function that
raises, calls ``sys.exit`` (SystemExit), raises KeyboardInterrupt itself, returns the wrong
number of values, a value that is not a finite float, or a value outside the bounds the function
declares (`grpo.rewards.bounds`; a per-token reward: its row's sum) is a `GrpoError` naming the
function and, where one can be found, the row. A real Ctrl-C still interrupts: in the main thread a
SIGINT (or a SIGTERM whose handler raises KeyboardInterrupt, as training's second one does)
that arrives during the call is told apart from a KeyboardInterrupt raised by the function's
own code, and only the latter becomes an error; elsewhere (a worker thread never
receives signals) every KeyboardInterrupt is the function's.

Timeout (``timeout_s``; off for a bare function, 300 s for a config's ``rewards[]``): the call
runs in a daemon worker thread and the caller waits at most that long; a function still
running then is a `GrpoError` naming it and the limit. Python cannot stop a thread, so the
worker is abandoned and keeps running until the function returns on its own (being a daemon it
does not keep the process alive). Thread-local state does not follow the call into the worker
except torch's grad mode, which is copied; a function that must run in the main thread (one
that sets signal handlers) needs ``timeout_s: null``.
"""

from __future__ import annotations

import copy
import math
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from grpo.errors import GrpoError, SignalStop
from grpo.metrics import split_metrics
from grpo.rewards.bounds import outside, reward_bounds
from grpo.rewards.functions import RewardContext, RewardFn, wants_context

# After a batch call fails, rows are retried one at a time to name the failing row; that retry
# is bounded in rows and in wall time (each retry call runs in a worker thread under the time
# left) so that a slow or hanging function cannot multiply the wait for the error.
RETRY_ROWS = 64
RETRY_SECONDS = 5.0


def reward_name(fn: RewardFn) -> str:
    """The name a reward is logged under: ``.name``, else ``__name__``, else its type."""
    return getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__


def reward_keys(fns_with_weights: Sequence[tuple[RewardFn, float]]) -> list[str]:
    """The ``per_fn`` key of each reward, in order: its `reward_name`, a repeated one with
    ``_2``, ``_3``... (what `compute_rewards` returns and ``rewards/<key>`` logs)."""
    keys: list[str] = []
    for fn, _ in fns_with_weights:
        name = base = reward_name(fn)
        k = 1
        while name in keys:
            k += 1
            name = f"{base}_{k}"
        keys.append(name)
    return keys


def call_reward(
    name: str,
    fn: RewardFn,
    completions: list[str],
    columns: dict[str, Any],
    token_lengths: Sequence[int] | None = None,
    timeout_s: float | None = None,
    context: RewardContext | None = None,
    metrics: dict[str, float] | None = None,
) -> list[float | list[float]]:
    """Call one reward function on its own copy of the inputs and check what it returned.

    Args:
        name: the name used in error messages.
        fn: ``fn(completions, **columns) -> list[float]`` (or per-token lists).
        completions: B completion texts.
        columns: per-row columns (lists of length B) and any extra keyword arguments.
        token_lengths: B completion lengths in tokens; when given, a row's value may be a list
            of that many floats (token-level rewards). Without it only floats are accepted.
        timeout_s: fail when the call takes longer than this many seconds (None: no limit).
        context: passed as ``context=`` to a function that declares that parameter
            (`grpo.rewards.functions.wants_context`); None: an empty `RewardContext`.
        metrics: when given, gets the metrics the function reported (it returned
            ``(values, {"name": scalar})``) as ``rewards/<name>/<metric>``; a scalar typed
            `grpo.metrics.Sum` / `Max` / `Min` keeps its type (its reduction over ranks).

    Returns:
        B floats (or per-token lists of floats).

    Raises:
        GrpoError: naming `name` (and the first bad row): the function raised, exited, timed
            out, or returned the wrong type, length, a non-finite value or one outside the
            bounds it declares.
        KeyboardInterrupt: a real Ctrl-C (SIGINT), or a SIGTERM whose handler raised it (a
            second one in training), during the call.
    """
    if "context" in columns and wants_context(fn):
        raise _error(
            name,
            "declares a `context` parameter and the rows have a column named "
            "'context': rename the column (data) or the parameter",
        )
    try:
        values = _guarded_call(fn, completions, columns, timeout_s, context)
    except _Timeout:
        raise _error(
            name,
            f"did not return within its timeout_s={timeout_s:g} s (rewards[].timeout_s); it "
            "was left running in a background thread",
        ) from None
    except (KeyboardInterrupt, SignalStop):  # a real Ctrl-C / SIGTERM: the run stops
        raise
    except BaseException as e:  # SystemExit too: a reward must not end the process
        if getattr(e, "caller_stop", False):  # raised in this thread while it waited: a stop
            raise
        if getattr(e, "reward_name", None):  # already checked and named (a nested reward)
            raise
        row = _first_failing_row(fn, completions, columns, timeout_s, context)
        where = "" if row is None else f" at row {row} ({_preview(completions[row])})"
        what, detail = _describe(e)
        if timeout_s is not None and "main thread" in str(e):  # signal.signal, outside it
            detail += (
                " (under rewards[].timeout_s the function runs in a worker thread; "
                "timeout_s: null runs it in the caller's)"
            )
        raise _error(name, f"{what}{where}{detail}") from e
    try:
        values, reported = split_metrics(values, f"reward function {name!r}")
    except GrpoError as e:
        e.reward_name = name  # named already: an enclosing reward does not rewrap it
        raise
    if metrics is not None:
        metrics.update({f"rewards/{name}/{k}": v for k, v in reported.items()})
    values = _as_list(values)
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise _error(name, f"returned {type(values).__name__}, expected a list of floats")
    if len(values) != len(completions):
        raise _error(name, f"returned {len(values)} values for {len(completions)} completions")
    out: list[float | list[float]] = []
    for row, value in enumerate(values):
        value = _as_list(value)
        if isinstance(value, (list, tuple)):
            out.append(_token_values(name, value, row, completions, token_lengths))
            continue
        number = _finite_float(value)
        if number is None:
            raise _error(
                name,
                f"returned {value!r} at row {row} ({_preview(completions[row])}); "
                "expected a finite float",
            )
        out.append(number)
    _check_bounds(name, fn, out, completions)
    return out


def _check_bounds(name: str, fn: RewardFn, values: list, completions: list[str]) -> None:
    """Every row's value (a per-token reward: its sum) within the bounds `fn` declares: a
    declared bound the trainer relies on (a solved task, `grpo.run.health`) is never wrong."""
    bounds = reward_bounds(fn)
    if bounds is None:
        return
    for row, value in enumerate(values):
        total = sum(value) if isinstance(value, list) else value
        if outside(total, bounds):
            lo, hi = bounds
            raise _error(
                name,
                f"returned {total!r} at row {row} ({_preview(completions[row])}), outside the "
                f"bounds it declares [{lo:g}, {hi:g}] (grpo.rewards.bounds)",
            )


def compute_rewards(
    fns_with_weights: Sequence[tuple[RewardFn, float]],
    completions: list[str],
    columns: dict[str, Any],
    token_width: int | None = None,
    context: RewardContext | None = None,
    metrics: dict[str, float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted reward r = sum_k w_k * reward_k(completions, **columns), and each part.

    Each function is called on its own copy of `completions` and `columns` (see `call_reward`),
    under its ``timeout_s`` when it has one (a `NamedReward` from a spec with ``timeout_s``).

    Args:
        fns_with_weights: (reward function, weight) pairs, e.g. from `build_rewards`; none
            (`rewards: []`): every total 0.
        completions: B completion texts.
        columns: per-row dataset columns (``ground_truth``, ...) and ``completion_lengths``.
        token_width: T_c; when given (with ``completion_lengths``), functions may return
            per-token lists and the total is token-level.
        context: what functions that declare a ``context`` parameter receive (the step, the
            completion budget, truncation, the tokenizer, the device).
        metrics: when given, gets what the functions reported (`call_reward`).

    Returns:
        total: (B,) float32, the weighted sum; or (B, T_c) when some function returned
            per-token values: those at their tokens, sequence rewards on the row's last token.
        per_fn: name -> (B,) float32 unweighted rewards (per-token ones summed over the row);
            a repeated name gets ``_2``, ``_3``...

    Raises:
        GrpoError: a function raised, exited, timed out, returned the wrong type or length, or
            a non-finite value.
    """
    B = len(completions)
    if not fns_with_weights:  # `rewards: []`: the empty sum (an estimator that reads none)
        return torch.zeros(B), {}
    lengths = columns.get("completion_lengths") if token_width is not None else None
    total = torch.zeros(B, dtype=torch.float64)  # (B,)
    tokens = None  # (B, T_c) float64 per-token parts, once a function returns them
    per_fn: dict[str, torch.Tensor] = {}
    for (fn, weight), name in zip(fns_with_weights, reward_keys(fns_with_weights)):
        timeout_s = getattr(fn, "timeout_s", None)
        values = call_reward(name, fn, completions, columns, lengths, timeout_s, context, metrics)
        row_sums = []
        for row, v in enumerate(values):
            if isinstance(v, list):
                if tokens is None:
                    tokens = torch.zeros(B, token_width, dtype=torch.float64)
                tokens[row, : len(v)] += float(weight) * torch.tensor(v, dtype=torch.float64)
                row_sums.append(sum(v))
            else:
                total[row] += float(weight) * v
                row_sums.append(v)
        per_fn[name] = torch.tensor(row_sums, dtype=torch.float64).float()  # (B,)
    if tokens is None:
        return total.float(), per_fn
    last = (torch.tensor(lengths) - 1).clamp(min=0)  # (B,) sequence rewards' token
    tokens[torch.arange(B), last] += total
    return tokens.float(), per_fn


# --------------------------------------------------------------------------- the guarded call


class _Timeout(Exception):
    """The call did not return within its timeout (the worker thread is abandoned)."""


class _OwnInterrupt(Exception):
    """A KeyboardInterrupt the reward function raised itself (no SIGINT / SIGTERM arrived)."""


def _guarded_call(
    fn: RewardFn,
    completions: list[str],
    columns: dict[str, Any],
    timeout_s: float | None,
    context: RewardContext | None = None,
) -> Any:
    """`fn` on fresh copies of the inputs, in this thread or (with `timeout_s`) a worker.

    Raises:
        KeyboardInterrupt: only for a real SIGINT (or a SIGTERM whose handler raised it)
            during the call.
        _OwnInterrupt: the function raised KeyboardInterrupt itself.
        _Timeout: still running after `timeout_s` seconds.
        BaseException: whatever else the function raised (SystemExit included).
    """
    completions, columns = list(completions), _fresh(columns)
    if wants_context(fn):  # not copied: it holds the tokenizer (its fields are read-only)
        columns["context"] = context if context is not None else RewardContext()
    with _signal_watch() as interrupted:
        try:
            if timeout_s is None:
                return fn(completions, **columns)
            return _call_in_worker(fn, completions, columns, timeout_s)
        except KeyboardInterrupt as e:
            if interrupted() or getattr(e, "caller_stop", False):
                raise
            raise _OwnInterrupt() from e


def _call_in_worker(
    fn: RewardFn, completions: list[str], columns: dict[str, Any], timeout_s: float
) -> Any:
    """`fn` in a daemon thread, waited for at most `timeout_s` seconds (then abandoned)."""
    box: dict[str, Any] = {}
    grad = torch.is_grad_enabled()  # thread-local: copied so the worker computes like the caller

    def work() -> None:
        try:
            with torch.set_grad_enabled(grad):
                box["value"] = fn(completions, **columns)
        except BaseException as e:  # handed to the caller, which names it
            box["error"] = e

    worker = threading.Thread(target=work, name=f"reward-{reward_name(fn)}", daemon=True)
    worker.start()
    try:
        worker.join(timeout_s)  # a Ctrl-C interrupts this wait in the main thread
    except (KeyboardInterrupt, SystemExit) as e:  # a signal's handler raised it in this thread
        e.caller_stop = True  # the caller's stop, never the function's error
        raise
    if worker.is_alive():
        raise _Timeout()
    if "error" in box:
        error = box["error"]
        if isinstance(error, KeyboardInterrupt):  # signals never reach a worker thread
            raise _OwnInterrupt() from error
        raise error
    return box["value"]


@contextmanager
def _signal_watch() -> Iterator[Any]:
    """Yields a function telling whether a SIGINT or SIGTERM arrived inside the block.

    In the main thread (the only one Python delivers signals to) the handlers of both are
    wrapped for the duration: each records the signal, then does what the previous handler did
    (a Ctrl-C's KeyboardInterrupt; the trainer's `StopSignal` raising KeyboardInterrupt on a
    second SIGTERM; the default's end of the process). Elsewhere, or where the handler was not
    installed from Python or ignores the signal, nothing is wrapped (no such signal can surface
    as a KeyboardInterrupt there).
    """
    hit = [False]
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(s)
            if handler is not None and handler != signal.SIG_IGN:
                previous[s] = handler

    def handler(signum, frame):
        hit[0] = True
        before = previous[signum]
        if callable(before):
            before(signum, frame)
        else:  # the default action: end the process
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    for s in previous:
        signal.signal(s, handler)
    try:
        yield lambda: hit[0]
    finally:
        for s, before in previous.items():
            signal.signal(s, before)


def _fresh(columns: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of the columns; a value that cannot be copied (a lock, a model handle) is
    passed as it is."""
    try:
        return copy.deepcopy(columns)
    except Exception:
        out = {}
        for key, value in columns.items():
            try:
                out[key] = copy.deepcopy(value)
            except Exception:
                out[key] = value
        return out


def _describe(e: BaseException) -> tuple[str, str]:
    """(what the function did, detail) for an error message; the row goes between them."""
    if isinstance(e, SystemExit):
        return "raised SystemExit", f": sys.exit({e.code!r}) inside a reward; return the values"
    if isinstance(e, _OwnInterrupt):
        return "raised KeyboardInterrupt", ": raised by the function itself, not a Ctrl-C"
    return f"raised {type(e).__name__}", f": {e}"


# --------------------------------------------------------------------------- value checks


def _as_list(value: Any) -> Any:
    """A tensor or numpy array of one or more dimensions as a (nested) list; else as it is."""
    is_array = isinstance(value, torch.Tensor) or type(value).__module__ == "numpy"
    if is_array and getattr(value, "ndim", 0) >= 1:
        return value.tolist()
    return value


def _finite_float(value: Any) -> float | None:
    """`value` as a finite float; None for anything else (strings included: a number written
    as text is a bug in the function, not a reward)."""
    if isinstance(value, (str, bytes)):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _token_values(name, value, row, completions, token_lengths) -> list[float]:
    """A row's per-token reward list, checked: one finite float per completion token."""
    if token_lengths is None:
        raise _error(
            name,
            f"returned a list at row {row}; per-token rewards need the trainer "
            "(expected one float per completion)",
        )
    if len(value) != int(token_lengths[row]):
        raise _error(
            name,
            f"returned {len(value)} per-token values at row {row} for a completion of "
            f"{int(token_lengths[row])} tokens",
        )
    out = []
    for v in value:
        number = _finite_float(v)
        if number is None:
            raise _error(name, f"returned a non-finite per-token value {v!r} at row {row}")
        out.append(number)
    return out


def _first_failing_row(
    fn: RewardFn,
    completions: list[str],
    columns: dict[str, Any],
    timeout_s: float | None,
    context: RewardContext | None = None,
) -> int | None:
    """The first row on which `fn`, called on that row alone, fails; None when no row or every
    tried row does (the problem is then the batch, e.g. a missing column, not a row).

    Bounded: at most RETRY_ROWS rows and RETRY_SECONDS of wall time in all, every call under
    the time left (and `timeout_s`), so a slow or hanging function cannot stall the error.
    """
    n = len(completions)
    if n < 2:
        return 0 if n == 1 else None
    first_fail, any_pass = None, False
    deadline = time.monotonic() + RETRY_SECONDS
    for row in range(min(n, RETRY_ROWS)):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        one = {k: v[row : row + 1] if _is_per_row(v, n) else v for k, v in columns.items()}
        limit = left if timeout_s is None else min(left, timeout_s)
        try:
            at = context.select(slice(row, row + 1)) if context is not None else None
            _guarded_call(fn, completions[row : row + 1], one, limit, at)
            any_pass = True
        except (KeyboardInterrupt, SignalStop):
            raise
        except _Timeout:
            break
        except BaseException as e:
            if getattr(e, "caller_stop", False):
                raise
            first_fail = row if first_fail is None else first_fail
        if first_fail is not None and any_pass:
            return first_fail
    return None


def _is_per_row(value: Any, n: int) -> bool:
    """True for a column holding one value per row (a list, tuple or tensor of length n)."""
    return isinstance(value, (list, tuple, torch.Tensor)) and len(value) == n


def _preview(text: str, limit: int = 60) -> str:
    """A short quoted view of a completion for error messages."""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"completion {text!r}"


def _error(name: str, what: str) -> GrpoError:
    """A GrpoError about reward `name`, marked so that an enclosing reward does not rewrap it."""
    err = GrpoError(f"reward function {name!r} {what}")
    err.reward_name = name
    return err
