"""A failure anywhere in a torchrun job as one line per rank: the rank that failed, its phase
and step, and the cause as that rank saw it; every rank stops, non-zero.

    own failure     this rank's error, as `rank 1 (rollout, step 3): <cause>`
    collective      a peer left or hung: `rank 0: stopped: rank 1 failed (rollout, step 3):
                    <its cause>`, or which rank left without a word, or did not come in time
    signal          SIGTERM (torchrun stopping the job) once a peer reported: this rank's own
                    line, with where it was stuck when it is the rank the others waited for

A rank that fails publishes its line in the job's store (the TCPStore the process group was
built on, key `grpo/failure/<rank>`) before it exits; it leaves the process group to its exit
(`teardown`: destroying it under a peer still in a collective can block). Its peers'
collectives fail only once it has exited, so they find the line there; on CUDA ranks the
collectives they meet at run over gloo (`Dist.cpu_group`), which fails at once, not NCCL.
Each line also goes to torchrun's error file (TORCHELASTIC_ERROR_FILE), which torchrun's "Root
Cause" summary shows. A single process (world size 1) has none of this: its errors are printed
as they are.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from grpo.distributed import (
    CollectiveError,
    Dist,
    JobError,
    RankFailed,
    Where,
    collective_failure,
    elastic_error_file,
    hosts_store,
    job_store,
)
from grpo.errors import GrpoError

log = logging.getLogger(__name__)

KEY = "grpo/failure/{}"
NARROW_S = 2.0  # a stopped rank waits at most this long for the others to say who is missing
LINGER_S = 3.0  # a rank serving the store (no torchrun) keeps it this long for the others
NOTICE_S = 0.5  # a graceful-stop notice waits this long: a failing job prints none
STOPPED_EXIT = 2


@dataclass(frozen=True)
class Report:
    """One rank's published line.

    Attributes:
        rank: who published it.
        failed: its own failure (else it stopped because of another rank).
        where: `Where.label` when it published.
        cause: its error; for a stopped rank, what stopped it ("rank 1 left the job ...").
        blames: the ranks a stopped rank found missing (hung, or gone without a report).
        waited: the timeout a stopped rank gave up after (None: a peer left).
        time: seconds since the epoch.
    """

    rank: int
    failed: bool
    where: str
    cause: str
    blames: tuple[int, ...] = ()
    waited: float | None = None
    time: float = 0.0


class Failures:
    """This rank's part in reporting the job's failures (inert in a single process).

    Args:
        dist: the whole job (global ranks, producer ranks included).
        where: kept current by the training loop.
        command: "grpo train" / "grpo sft": the lines' prefix where this module prints one.
    """

    def __init__(self, dist: Dist, where: Where, command: str):
        self.dist, self.where, self.command = dist, where, command
        self.store = job_store() if dist.enabled else None
        self.failing = False  # on its way out: signals are ignored, its line is coming
        self._published = False
        self._signals: dict = {}
        if self.store is not None:  # a report left by an earlier job on the same store
            with contextlib.suppress(Exception):
                self.store.delete_key(KEY.format(dist.rank))

    @property
    def active(self) -> bool:
        """A job of several ranks (in a single process nothing here does anything)."""
        return self.dist.enabled

    # ------------------------------------------------------------------ the run

    @contextlib.contextmanager
    def reported(self, timeout_s: float):
        """Around the run: this rank's own error gets its rank, phase and step and is
        published; a failed collective becomes the peer's cause (`CollectiveError`); SIGTERM
        after a peer reported stops this rank with its line (`on_signal`).

        Args:
            timeout_s: train.dist_timeout_s, named in a timeout's line.
        """
        if not self.dist.enabled:
            yield
            return
        self._install_signals()
        try:
            yield
        except (JobError, RankFailed) as e:  # one verdict everywhere; a peer's line, relayed
            self.failing = True
            if isinstance(e, RankFailed):
                failed = e.failed_ranks[0] if e.failed_ranks else -1
                self._publish(False, str(e).split(": stopped: ", 1)[-1], blames=(failed,))
            self._error_file(str(e), secondary=isinstance(e, RankFailed))
            raise
        except GrpoError as e:
            self.failing = True
            if hasattr(e, "rank"):  # the job's own end (interrupted, nothing to do, a stall)
                raise
            cause = " ".join(str(e).split())
            self._publish(True, cause)
            e.args = (f"rank {self.dist.rank} ({self.where.label}): {cause}",)
            self._error_file(str(e))
            raise
        except Exception as e:
            self.failing = True
            kind = collective_failure(e)
            if kind is None:  # a bug or a system error: its traceback stays
                self._publish(True, _error_line(e))
                self._error_file(
                    f"rank {self.dist.rank} ({self.where.label}): {_error_line(e)}",
                    callstack=traceback.format_exc(),
                )
                raise
            log.debug("rank %d: collective failed: %s", self.dist.rank, e)
            line = self._stopped(kind, timeout_s, _backend_line(e))
            self._error_file(line, secondary=" stopped: " in line)
            raise CollectiveError(line) from None

    def close(self) -> None:
        """On the way out, after `teardown`: a rank serving the store (no torchrun) keeps it
        until every other rank has reported (at most LINGER_S). The signals' handlers go back;
        a failing rank ignores SIGTERM from here on: it exits with its own code, not killed by
        the SIGTERM torchrun sends once another rank has exited (SIG_IGN, not a handler:
        Python's exit puts the default back for its handlers)."""
        if self._published and self.store is not None and hosts_store(self.dist):
            end = time.monotonic() + LINGER_S
            while time.monotonic() < end and len(self._reports()) < self.dist.world_size:
                time.sleep(0.05)
        for s, handler in self._signals.items():
            failing_term = self.failing and s == signal.SIGTERM
            signal.signal(s, signal.SIG_IGN if failing_term else handler)
        self._signals.clear()

    # ------------------------------------------------------------------ the lines

    def _stopped(self, kind: str, timeout_s: float, detail: str) -> str:
        """This rank's line after its collective failed (`collective_failure`'s kind; `detail`:
        the backend's words), published: a peer's published cause; else, when the backend
        failed otherwise than by a lost peer or a timeout, its words as this rank's failure;
        else the ranks that published nothing, as gone or hung."""
        me = self.dist.rank
        reports = self._reports(narrow=kind != "failed")
        failed = sorted(
            (r for r in reports.values() if r.failed and r.rank != me), key=lambda r: r.time
        )
        if failed:
            root = failed[0]
            cause = f"rank {root.rank} failed ({root.where}): {root.cause}"
            self._publish(False, cause, blames=(root.rank,))
            return f"rank {me}: stopped: {cause}"
        if kind == "failed":
            cause = f"a collective failed: {detail}"
            self._publish(True, cause)
            return f"rank {me} ({self.where.label}): {cause}"
        missing = tuple(r for r in range(self.dist.world_size) if r != me and r not in reports)
        others = sorted((r for r in reports.values() if r.rank != me), key=lambda r: r.time)
        if not missing and others:  # all reported stopping: echo the first one's cause
            cause = others[0].cause
            self._publish(False, cause, blames=others[0].blames, waited=others[0].waited)
            return f"rank {me} ({self.where.label}): stopped: {cause}"
        who = _ranks(missing)
        if kind == "timeout":
            cause = (
                f"{who} did not reach this collective within train.dist_timeout_s="
                f"{timeout_s:g} s (hung or too slow)"
            )
        else:
            cause = (
                f"{who} left the job without a report (killed, os._exit or a crash; "
                "torchrun's summary gives its exit code)"
            )
        waited = timeout_s if kind == "timeout" else None
        self._publish(False, cause, blames=missing, waited=waited)
        return f"rank {me} ({self.where.label}): stopped: {cause}"

    def on_signal(self, signum: int, frame) -> bool:
        """SIGTERM / SIGINT on this rank: True when it is taken care of here. Ignored while the
        rank is leaving already; after another rank reported (torchrun stops the job when one
        rank exits), this rank prints its own line and exits at once (it may be the rank that
        hung: the line says where it was). False otherwise (a graceful stop)."""
        if self.failing:
            return True
        reports = {r: x for r, x in self._reports().items() if r != self.dist.rank}
        if not reports:
            return False
        self.failing = True
        me = self.dist.rank
        failed = sorted((r for r in reports.values() if r.failed), key=lambda r: r.time)
        blaming = sorted((r for r in reports.values() if me in r.blames), key=lambda r: r.time)
        if failed:
            root = failed[0]
            cause = f"rank {root.rank} failed ({root.where}): {root.cause}"
            self._publish(False, cause, blames=(root.rank,))
            line = f"rank {me}: stopped: {cause}"
        elif blaming:
            b = blaming[0]
            what = f"rank {b.rank} lost its connection to it"
            if b.waited is not None:
                what = f"rank {b.rank} timed out waiting for it (train.dist_timeout_s={b.waited:g})"
            cause = f"stopped at {_location(frame)}: {what}"
            self._publish(True, cause)
            line = f"rank {me} ({self.where.label}): {cause}"
        else:
            first = min(reports.values(), key=lambda r: r.time)
            self._publish(False, first.cause, blames=first.blames, waited=first.waited)
            line = f"rank {me} ({self.where.label}): stopped: {first.cause}"
        self._error_file(line, secondary=not blaming or bool(failed))
        _write_line(f"{self.command}: error: {line}")
        os._exit(STOPPED_EXIT)

    def notice_later(self, text: str) -> None:
        """Print a graceful-stop notice shortly, unless the job turns out to be failing by
        then (torchrun sends SIGTERM to every rank once one has exited)."""

        def notice():
            if not self.failing:
                os.write(2, text.encode())

        timer = threading.Timer(NOTICE_S, notice)
        timer.daemon = True
        timer.start()

    # ------------------------------------------------------------------ store, error file

    def _publish(
        self, failed: bool, cause: str, blames: tuple[int, ...] = (), waited: float | None = None
    ) -> None:
        if self.store is None or self._published:
            return
        report = Report(
            self.dist.rank, failed, self.where.label, cause, tuple(blames), waited, time.time()
        )
        try:
            self.store.set(KEY.format(self.dist.rank), json.dumps(asdict(report)))
            self._published = True
        except Exception as e:  # the store is gone (its host died): the line is still printed
            log.debug("rank %d: could not publish its failure: %s", self.dist.rank, e)

    def _reports(self, narrow: bool = False) -> dict[int, Report]:
        """Every rank's published report. `narrow`: while none failed and several ranks are
        silent, wait (at most NARROW_S) for the others, to tell which one is missing."""
        if self.store is None:
            return {}
        end = time.monotonic() + (NARROW_S if narrow else 0.0)
        while True:
            out = {}
            for rank in range(self.dist.world_size):
                try:
                    key = KEY.format(rank)
                    if self.store.check([key]):
                        d = json.loads(self.store.get(key))
                        out[rank] = Report(**{**d, "blames": tuple(d["blames"])})
                except Exception:  # the store is gone, or a report unreadable: none
                    continue
            silent = self.dist.world_size - 1 - sum(1 for r in out if r != self.dist.rank)
            if any(r.failed for r in out.values()) or silent <= 1 or time.monotonic() >= end:
                return out
            time.sleep(0.1)

    def _error_file(self, line: str, callstack: str | None = None, secondary: bool = False):
        """The line in torchrun's error file: its summary shows it for this rank. A rank
        stopped by another dates its report 2 s later, so that torchrun's "Root Cause (first
        observed failure)" is the rank that failed, not one it stopped."""
        path = elastic_error_file()
        if path is None:
            return
        text = f"{self.command}: error: {line}"
        stamp = int(time.time()) + (2 if secondary else 0)
        data = {
            "message": {
                "message": text,
                "extraInfo": {"py_callstack": callstack or text, "timestamp": str(stamp)},
            }
        }
        with contextlib.suppress(OSError):
            Path(path).write_text(json.dumps(data))

    def _install_signals(self) -> None:
        """Until `close`: SIGTERM / SIGINT outside the training loop (start-up, and on the way
        out) go through `on_signal` first, then have their usual effect."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in (signal.SIGTERM, signal.SIGINT):
            self._signals[s] = signal.signal(s, self._on_job_signal)

    def _on_job_signal(self, signum, frame) -> None:
        if self.on_signal(signum, frame):
            return
        previous = self._signals.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default: end the process by the signal
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def _error_line(e: BaseException) -> str:
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _backend_line(e: BaseException, limit: int = 200) -> str:
    """A backend error's first line without its source location ("[.../pair.cc:553] ")."""
    text = str(e).strip()
    first = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else type(e).__name__)
    return first if len(first) <= limit else first[: limit - 3] + "..."


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"one of ranks {', '.join(map(str, ranks))}" if ranks else "another rank"


def _location(frame) -> str:
    """Where this rank was stuck, "reward.py:12 in slow_reward()": the innermost frame of the
    user's code (a reward or environment module, in any thread: a reward with a timeout runs
    in a worker) if there is one, else where the main thread was (outside `threading`)."""
    paths = sysconfig.get_paths()
    grpo_dir = Path(__file__).resolve().parents[1]
    library = tuple(str(Path(p).resolve()) for p in (paths["stdlib"], paths["purelib"], grpo_dir))

    def first(f, keep) -> object:
        while f is not None and not keep(str(Path(f.f_code.co_filename).resolve())):
            f = f.f_back
        return f

    threads = [frame, *(f for t, f in sys._current_frames().items() if t != threading.get_ident())]

    def users(p: str) -> bool:  # not the library, nor a frozen module ("<frozen runpy>")
        return not p.startswith(library) and not Path(p).name.startswith("<")

    user = [u for u in (first(f, users) for f in threads) if u is not None]
    where = user[0] if user else first(frame, lambda p: not p.endswith("threading.py"))
    if where is None:
        return "an unknown place"
    return f"{Path(where.f_code.co_filename).name}:{where.f_lineno} in {where.f_code.co_name}()"


def _write_line(line: str) -> None:
    """One line on stderr from a signal handler (os.write: the interrupted code may hold the
    stream's lock), on a line of its own when a progress bar is open."""
    std = sys.modules.get("tqdm.std")
    bars = getattr(getattr(std, "tqdm", None), "_instances", ())
    os.write(2, (("\n" if bars else "") + line + "\n").encode("utf-8", "replace"))
