"""Two gloo ranks kept for the whole test session: the "2 ranks equal 1 process" tests run their
per-rank function in them instead of paying a torchrun launch each (three interpreters that
import torch), as torch's `MultiProcContinuousTest` does for its own tests.

    [rank0, rank1] = rank_pool.run("limits_ddp_worker:rank_stats")  # stats(dist) on each rank

Each rank joins the group once (`grpo.distributed.init_distributed`) and keeps it between tasks.
A task that fails or times out stops the pool (its ranks may have left the group's collectives
out of step); the next `run` starts a fresh one.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import time
import traceback
from multiprocessing import get_context, parent_process
from multiprocessing.connection import wait

# after one rank failed, how long the others get to answer before the pool is stopped: a rank
# left waiting in a collective for the failed one would wait for the group's timeout (600 s)
FAILURE_GRACE_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no one listens on now (rank 0 serves the group's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankPool:
    """`world_size` spawned processes that each join one gloo group, then run tasks.

    Args:
        world_size: the number of ranks.
        start_timeout_s: how long the ranks may take to start and join the group.
    """

    def __init__(self, world_size: int = 2, start_timeout_s: float = 120.0):
        self.world_size = world_size
        self.start_timeout_s = start_timeout_s
        self._procs: list = []
        self._conns: list = []
        self._busy = False  # a task was sent and its replies not all read (an interrupted run)

    def start(self) -> None:
        """Start the ranks and wait until each has joined the group (a no-op when running).
        One retry on another free port: the port is free when picked, not always when bound."""
        if self._procs:
            return
        try:
            self._spawn()
        except RuntimeError:
            self._spawn()

    def run(self, target: str, *args, timeout_s: float = 300.0) -> list:
        """Call ``function(dist, *args)`` on every rank, `target` being "module:function"
        (imported in the ranks; tests/ and the repo root are on their sys.path).

        Returns:
            each rank's return value, in rank order (picklable values).

        Raises:
            RuntimeError: a rank raised (the message names it and holds its traceback) or
                died; the pool is stopped.
            TimeoutError: the ranks did not all answer within `timeout_s`; the pool is stopped.
        """
        self.start()
        message = pickle.dumps((target, args))  # one pickle: a bad argument reaches no rank
        self._busy = True
        self._send(message, target)
        values = self._collect(target, timeout_s)
        self._busy = False
        return values

    def close(self, timeout_s: float = 60.0) -> None:
        """Every rank leaves the group (`grpo.distributed.teardown`) and exits; a pool stopped
        in the middle of a task is killed instead."""
        if not self._procs:
            return
        if self._busy:
            self._kill()
            return
        self._send(pickle.dumps(None), "close")
        self._collect("close", timeout_s)
        conns, procs = self._conns, self._procs
        self._conns, self._procs = [], []
        for conn in conns:  # rank 0 serves the group's store: it exits once every rank left
            conn.close()
        for p in procs:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
                p.join()

    def _spawn(self) -> None:
        ctx = get_context("spawn")  # a fresh interpreter: no forked torch threads or state
        port = free_port()
        try:
            self._start_ranks(ctx, port)
        except BaseException:
            self._kill()
            raise
        self._collect("start-up", self.start_timeout_s)

    def _start_ranks(self, ctx, port: int) -> None:
        for rank in range(self.world_size):
            env = {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(rank),
                "OMP_NUM_THREADS": "1",
            }
            ours, theirs = ctx.Pipe()
            # spawn gives the child this process's sys.path (tests/, the repo root) and cwd
            p = ctx.Process(
                target=_serve, args=(theirs, env), name=f"rank_pool-{rank}", daemon=True
            )
            p.start()
            theirs.close()  # the child's end is the child's alone: its exit reads as EOF here
            self._procs.append(p)
            self._conns.append(ours)

    def _collect(self, what: str, timeout_s: float) -> list:
        """Every rank's reply to `what`; on a failure or timeout the pool is stopped first."""
        deadline = time.monotonic() + timeout_s
        replies: dict[int, tuple] = {}
        pending = dict(enumerate(self._conns))
        failed_at = None
        while pending:
            if failed_at is not None:
                deadline = min(deadline, failed_at + FAILURE_GRACE_S)
            ready = wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for rank, conn in list(pending.items()):
                if conn in ready:
                    del pending[rank]
                    try:
                        replies[rank] = conn.recv()
                    except EOFError:
                        self._procs[rank].join(5)
                        code = self._procs[rank].exitcode
                        replies[rank] = ("error", f"the process exited (exit code {code})\n")
                    if replies[rank][0] == "error" and failed_at is None:
                        failed_at = time.monotonic()
        errors = [(r, text) for r, (kind, text) in sorted(replies.items()) if kind == "error"]
        if pending or errors:
            self._kill()
        if errors:
            ranks = ", ".join(str(r) for r, _ in errors)
            silent = f" (rank {', '.join(map(str, pending))} did not answer)" if pending else ""
            details = "".join(f"\n--- rank {r}:\n{text}" for r, text in errors)
            raise RuntimeError(
                f"rank pool: rank {ranks} failed in {what}{silent}; the pool was stopped{details}"
            )
        if pending:
            raise TimeoutError(
                f"rank pool: rank {', '.join(map(str, pending))} did not finish "
                f"{what} within {timeout_s:.0f} s; the pool was stopped"
            )
        return [replies[r][1] for r in range(self.world_size)]

    def _send(self, message: bytes, what: str) -> None:
        """`message` to every rank; a rank that is gone (its pipe closed) stops the pool."""
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(message)
            except OSError:
                self._procs[rank].join(5)
                code = self._procs[rank].exitcode
                self._kill()
                raise RuntimeError(
                    f"rank pool: rank {rank} exited (exit code {code}) before "
                    f"{what}; the pool was stopped"
                ) from None

    def _kill(self) -> None:
        for p in self._procs:
            p.kill()
        for p in self._procs:
            p.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._busy = [], [], False


def _serve(conn, env: dict) -> None:
    """One rank: join the group, then run tasks until told to close (None) or until the test
    process is gone (EOF). Replies are ("ok", value) or ("error", traceback text)."""
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the test process's to handle
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    os.environ.update(env)  # what init_distributed reads, as torchrun sets it
    import torch

    # one thread, as torchrun's ranks run: OMP_NUM_THREADS is read when torch is imported,
    # which the test process's main module, re-imported here by spawn, may have done already
    torch.set_num_threads(1)

    from grpo.distributed import barrier, init_distributed, teardown

    try:
        dist = init_distributed("cpu")
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    seed = torch.initial_seed()  # every task starts from the RNG this rank started with
    conn.send(("ok", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the pool was killed: leave without finalizing a joined group
            _leave(1)
        if message is None:
            break
        reply = _task(dist, seed, *message)
        try:
            conn.send(reply)
        except Exception:  # the value would not pickle
            conn.send(("error", traceback.format_exc()))
    barrier(dist)  # no rank still in a collective when the group goes
    teardown()
    conn.send(("ok", None))
    try:
        conn.recv()  # until the pool closes the pipe: rank 0's store outlives every rank's exit
    except EOFError:
        pass
    _leave(0)


def _leave(code: int) -> None:
    """Exit now: nothing is left to write, and the interpreter's finalization of torch takes
    about a second (and could hang on a group still joined, see grpo.distributed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_with_parent() -> None:
    """End this rank as soon as the test process is gone (killed, or left without `close`),
    even in the middle of a task: no rank outlives it."""
    wait([parent_process().sentinel])
    _leave(1)


def _task(dist, seed: int, target: str, args: tuple) -> tuple:
    """Run one task from the state a fresh rank starts in (RNG, default dtype, grad mode, cwd,
    environment), and leave no garbage behind (DDP reducers hold on to the group)."""
    import gc
    import importlib

    import torch

    cwd, environ = os.getcwd(), dict(os.environ)
    torch.manual_seed(seed)
    try:
        module, _, name = target.partition(":")
        return "ok", getattr(importlib.import_module(module), name)(dist, *args)
    except BaseException:  # SystemExit too: a task must not end its rank
        return "error", traceback.format_exc()
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        gc.collect()
