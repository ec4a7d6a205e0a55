"""The sandbox of the `python` environment (`grpo.envs.python`): run model-written code in a
separate, resource-limited, isolated process.

    run_python("print(48 / 2)").observation()            # -> "24.0"
    run_python("1 / 0").observation()                   # -> "error: ZeroDivisionError: ..."
    run_python("while True: pass", cpu_s=1).limit        # -> "cpu"

Each run is a fresh interpreter (``sys.executable -s -P -u``, running
grpo/envs/_sandbox_child.py; no state carries over between runs; numpy, sympy and whatever else
the interpreter's site-packages hold can be imported) with a minimal environment (PATH,
PYTHONHASHSEED=0, UTF-8 mode, one BLAS/OpenMP thread, HOME and TMPDIR at its work directory: no
tokens or keys from the trainer's environment) and stdin at /dev/null.

It is an ISOLATION boundary on Linux, without root and without system packages (docs/safety.md
lists the escapes tried). The child enters new user, pid, mount, network, ipc and uts
namespaces:

- pid: the code runs as pid 2 under an init of the sandbox's own; nothing outside is visible or
  signalable (not the trainer, not its process group, not ``kill(-1)``'s reach), and when the
  code's process exits, or the run is killed, everything in the namespace dies with it
  (``setsid`` and double forks included);
- mount: a read-only root on a tmpfs holding only /usr, the loader's /lib directories, a few
  /etc files, /dev/null, zero, full, random and urandom, a /proc of its own, the interpreter's
  prefixes and site-packages (read-only), and the work directory (a tmpfs of 16 x
  `max_file_mb`); the run directory, HOME, the checkout and every other path are absent;
- network: no device but a loopback that is down; abstract Unix sockets are per network
  namespace, filesystem ones are absent from the new root;
- user: the code runs as uid 1000 of the namespace, mapped to a uid no one else uses when the
  trainer is root (else to the trainer's own), with no capabilities, an empty bounding set and
  no_new_privs; RLIMIT_NPROC (`max_processes`) counts the sandbox's processes only;
- Landlock where the kernel has it (ABI 1+: writes only in the work directory; 4+: no TCP bind
  or connect; 6+: no abstract Unix socket or signal beyond the sandbox).

`isolation()` probes the layers once per process and reports them as one value (recorded in a
training run's header as ``run/env_isolation``). `require_isolation` (default True) refuses a
run, and the environment at construction, with one line naming the missing layer; with False
the code runs with the resource limits alone where the sandbox cannot be had.

Resource limits, set by the child before it executes the code: RLIMIT_CPU (`cpu_s`; SIGXCPU,
then SIGKILL a second later), RLIMIT_AS (`memory_mb`: allocation fails with MemoryError),
RLIMIT_FSIZE (`max_file_mb`: a larger write fails with EFBIG), RLIMIT_CORE=0, RLIMIT_NOFILE,
RLIMIT_NPROC (`max_processes`).

The parent enforces the wall clock (`timeout_s`): at the deadline it SIGKILLs the run's process
group, the sandbox's init with it; it does the same as soon as the code's own process exits and
when stdout grows far beyond `max_output_chars` (it stops reading and kills, so an endless
``print`` costs neither memory nor time). The process is always reaped. The child reports how
the setup went on a pipe the code never holds, so nothing the code does can fake a layer or a
setup failure.
"""

from __future__ import annotations

import functools
import json
import math
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from grpo.envs._sandbox_child import EXIT_EXCEPTION, EXIT_FILE_SIZE, EXIT_MEMORY
from grpo.errors import GrpoError

_MAX_OPEN_FILES = 64
_STDERR_TAIL = 4096  # bytes of stderr kept (its last line is all the observation uses)
_AFTER_EXIT_S = 0.5  # once the code's process exited: most seconds to wait for its pipes' EOF
_LINE_CHARS = 300  # an error line is cut here
_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
# Layers a run needs before it counts as isolated; "proc" (the sandbox's own /proc) and
# "landlock" are reported but optional.
REQUIRED_LAYERS = (
    "user",
    "pid",
    "mount",
    "network",
    "ipc",
    "capabilities",
    "no_new_privs",
    "nproc",
)


@dataclass(frozen=True)
class PythonResult:
    """How one run ended.

    Attributes:
        output: its stdout, cut at `max_output_chars` (decoded as UTF-8, bad bytes replaced).
        ok: it finished by itself with exit code 0 and its output was not cut.
        error: one line, without the ``error: `` prefix: the exception's last line
            (``ZeroDivisionError: division by zero``), the limit hit (``time limit (5 s)
            exceeded``), ``exit code N``, or ``killed by SIGNAME``; None when it finished.
        limit: which limit ended it: "time", "cpu", "memory", "file" or "output" (stdout grew
            far beyond `max_output_chars` and the run was stopped); None when none did.
        elapsed_s: wall-clock seconds from start to reaped.
        truncated: stdout was longer than `max_output_chars`.
    """

    output: str
    ok: bool
    error: str | None = None
    limit: str | None = None
    elapsed_s: float = 0.0
    truncated: bool = False

    def observation(self) -> str:
        """The text shown to the model: the output, then ``error: output cut at N
        characters`` if it was cut, then ``error: <error>``; ``(no output)`` when all are
        empty."""
        lines = [self.output.rstrip("\n")] if self.output.strip() else []
        if self.truncated:  # a cut output is exactly max_output_chars long
            lines.append(f"error: output cut at {len(self.output)} characters")
        if self.error is not None and self.limit != "output":
            lines.append(f"error: {self.error}")
        return "\n".join(lines) if lines else "(no output)"


def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    cpu_s: int = 5,
    memory_mb: float = 512,
    max_output_chars: int = 1024,
    max_file_mb: float = 1,
    max_processes: int = 16,
    require_isolation: bool = True,
) -> PythonResult:
    """Run a Python program in a fresh, limited, isolated process (see the module docstring).

    Args:
        code: the program's source.
        timeout_s: wall-clock limit of the whole run (interpreter start included); at the
            deadline everything the run started is killed.
        cpu_s: CPU-seconds limit (RLIMIT_CPU) of the code's process (and of each it starts).
        memory_mb: address-space limit (RLIMIT_AS) in MiB; a larger allocation raises
            MemoryError. It bounds virtual memory: the interpreter takes about 20 MiB of it,
            `import numpy` about 100, `import sympy` about 55.
        max_output_chars: stdout beyond this is cut; the run is stopped once stdout passes
            4 bytes per character of it.
        max_file_mb: largest file the code may write (RLIMIT_FSIZE), in MiB; its directory
            holds at most 16 times this in all.
        max_processes: most processes and threads alive in the sandbox at once, its own init
            and the code's process included (RLIMIT_NPROC in the sandbox's user namespace).
        require_isolation: refuse to run (GrpoError) where a required layer of `isolation()`
            is missing; False runs with the resource limits alone there.

    Returns:
        a `PythonResult`.

    Raises:
        GrpoError: a limit that is not positive, or isolation required and not available.
        OSError: the process could not be started (e.g. no processes or memory left).
    """
    check_limits(timeout_s, cpu_s, memory_mb, max_output_chars, max_file_mb, max_processes)
    iso = isolation()
    if require_isolation and not iso.complete:
        raise GrpoError(iso.refusal())
    limits = dict(
        cpu_s=max(1, math.ceil(cpu_s)),
        as_bytes=int(memory_mb * 2**20),
        file_bytes=int(max_file_mb * 2**20),
        nofile=_MAX_OPEN_FILES,
        nproc=max_processes,
        dir_bytes=int(16 * max_file_mb * 2**20),
    )
    start = time.monotonic()
    returncode, out, err, stopped, cpu_used, status = _run(
        code, limits, iso.complete, start + timeout_s, 4 * max_output_chars + 4
    )
    if status.startswith("error ") and iso.complete:  # the code did not run
        if require_isolation:
            raise GrpoError(f"python environment: isolation layer {status[6:]}; {_ESCAPE}")
        returncode, out, err, stopped, cpu_used, status = _run(
            code, limits, False, start + timeout_s, 4 * max_output_chars + 4
        )
    elapsed = time.monotonic() - start
    text = out.decode("utf-8", "replace")
    truncated = len(text) > max_output_chars
    error, limit = _ending(
        returncode,
        stopped,
        cpu_used,
        _last_line(err),
        timeout_s=timeout_s,
        cpu_s=limits["cpu_s"],
        memory_mb=memory_mb,
        max_file_mb=max_file_mb,
        max_output_chars=max_output_chars,
    )
    return PythonResult(
        output=text[:max_output_chars],
        ok=error is None and not truncated,
        error=error,
        limit=limit,
        elapsed_s=elapsed,
        truncated=truncated,
    )


def _run(code: str, limits: dict, isolate: bool, deadline: float, max_out_bytes: int):
    """One child run: (returncode, stdout, stderr tail, stopped, CPU seconds, status line)."""
    with tempfile.TemporaryDirectory(prefix="grpo-python-", ignore_cleanup_errors=True) as root:
        work = os.path.join(root, "work")
        os.mkdir(work)
        os.mkdir(os.path.join(root, "root"))
        path = os.path.join(root, "code.py")
        with open(path, "w", encoding="utf-8", errors="replace") as f:
            f.write(code)
        status_r, status_w = os.pipe()
        cfg = dict(
            limits,
            code=path,
            work=work,
            root=os.path.join(root, "root"),
            isolate=isolate,
            network=True,
            status_fd=status_w,
        )
        try:
            proc = subprocess.Popen(
                [*_python_argv(), json.dumps(cfg)],
                cwd=work,
                env=_child_env(work),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w,),
                start_new_session=True,  # its own process group: pgid == pid
            )
        finally:
            os.close(status_w)
        try:
            try:
                out, err, stopped = _collect(proc, deadline, max_out_bytes)
            finally:
                _kill_group(proc.pid)  # before reaping: a zombie leader keeps the pgid reserved
                _, wait_status, usage = os.wait4(proc.pid, 0)
                proc.stdout.close()
                proc.stderr.close()
            status = _read_status(status_r)
        finally:
            os.close(status_r)
    returncode = os.waitstatus_to_exitcode(wait_status)
    return returncode, out, err, stopped, usage.ru_utime + usage.ru_stime, status


def _read_status(fd: int) -> str:
    """The runner's one status line (written before the code starts; the code never holds the
    pipe), or "" when the runner was stopped before it wrote one."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while b"\n" not in data and len(data) < 65536:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    except BlockingIOError:
        pass
    return data.split(b"\n", 1)[0].decode("utf-8", "replace")


_ESCAPE = "set require_isolation: false (rollout.env_kwargs) to run the code without it"


@dataclass(frozen=True)
class Isolation:
    """The sandbox layers `run_python` gets on this machine (`isolation()`).

    Attributes:
        layers: each layer that applied and how: user ("fresh uid": the code's processes run as
            a uid of their own; "caller's uid": the caller's, without root), pid, mount, proc
            (the sandbox's own /proc; without it the sandbox has none), network, ipc, uts,
            capabilities ("none"), no_new_privs, nproc (the process cap applies), landlock (the
            ABI applied, 0: none).
        error: the first layer that failed and why ("mount: pivot_root: ..."), or None.
    """

    layers: dict
    error: str | None = None

    @property
    def complete(self) -> bool:
        """Every required layer applied."""
        return self.error is None and all(self.layers.get(k) for k in REQUIRED_LAYERS)

    @property
    def missing(self) -> list[str]:
        return [k for k in REQUIRED_LAYERS if not self.layers.get(k)]

    def describe(self) -> str:
        """One line: the layers that applied, then what is missing."""
        if self.error is not None:
            return f"none ({self.error})"
        layers = self.layers
        parts = [f"user namespace ({layers['user']})", "pid", "mount", "network", "ipc", "uts"]
        parts.append("own /proc" if layers.get("proc") else "no /proc")
        parts += ["no capabilities", "no_new_privs", "process cap"]
        abi = layers.get("landlock") or 0
        parts.append(f"landlock ABI {abi}" if abi else "no landlock")
        return ", ".join(parts)

    def refusal(self) -> str:
        """The one-line error of a run that requires isolation where it is missing."""
        what = self.error or ", ".join(self.missing)
        return f"python environment: sandbox layer unavailable: {what}; {_ESCAPE}"

    def as_dict(self) -> dict:
        return {"complete": self.complete, "layers": dict(self.layers), "error": self.error}


@functools.cache
def isolation() -> Isolation:
    """The sandbox layers `run_python`'s processes get on this machine, probed once per process
    by running ``pass`` in a sandbox (on a non-Linux OS, or where user namespaces are off: no
    layer, `error` says why)."""
    if not sys.platform.startswith("linux"):
        return Isolation({}, f"user: not Linux ({sys.platform})")
    limits = dict(
        cpu_s=10,
        as_bytes=1 << 30,
        file_bytes=1 << 20,
        nofile=_MAX_OPEN_FILES,
        nproc=16,
        dir_bytes=1 << 20,
    )
    try:
        returncode, _, err, stopped, _, status = _run(
            "pass", limits, True, time.monotonic() + 30, 4096
        )
    except OSError as e:
        return Isolation({}, f"user: cannot start the probe: {e.strerror}")
    if status.startswith("ok "):
        try:
            layers = json.loads(status[3:])
        except ValueError:
            return Isolation({}, f"probe: unreadable report {status[:80]!r}")
        if not isinstance(layers, dict):
            return Isolation({}, f"probe: unreadable report {status[:80]!r}")
        if returncode != 0:
            why = _last_line(err) or f"exit status {returncode}"
            return Isolation(layers, f"probe: the sandboxed 'pass' failed: {why}")
        return Isolation(layers)
    if status.startswith("error "):
        return Isolation({}, status[6:])
    why = "timed out" if stopped else _last_line(err) or f"exit status {returncode}"
    return Isolation({}, f"probe: {why}")


def _python_argv() -> list[str]:
    # -s: no user site-packages; -P (3.11+): no cwd or script directory on sys.path; -u:
    # unbuffered, so output written before a kill is not lost. Not -I / -E: they would ignore
    # PYTHONHASHSEED, and the environment is ours anyway.
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, "-s", *safe_path, "-u", _RUNNER]


def _child_env(work: str) -> dict[str, str]:
    """The child's whole environment: nothing of the trainer's but PATH."""
    return {
        "PATH": os.environ.get("PATH", os.defpath),
        "PYTHONHASHSEED": "0",
        "PYTHONUTF8": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "HOME": work,
        "TMPDIR": work,
        "LANG": "C.UTF-8",
        # one thread each: thread stacks and arenas count against RLIMIT_AS
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


# Largest accepted value of each limit: beyond these a number is a typo, not a setting (an hour of
# wall or CPU time per call, 64 GiB of address space, ...).
LIMIT_MAX = dict(
    timeout_s=3600,
    cpu_s=3600,
    memory_mb=65536,
    max_output_chars=10_000_000,
    max_file_mb=1024,
    max_processes=4096,
)


def check_limits(
    timeout_s, cpu_s, memory_mb, max_output_chars, max_file_mb, max_processes=16
) -> None:
    """Each limit a positive number up to LIMIT_MAX (the two counts integers); else a
    GrpoError naming it."""
    values = dict(
        timeout_s=timeout_s,
        cpu_s=cpu_s,
        memory_mb=memory_mb,
        max_output_chars=max_output_chars,
        max_file_mb=max_file_mb,
        max_processes=max_processes,
    )
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise GrpoError(f"python environment: {name} must be a number > 0, got {value!r}")
        if not math.isfinite(value) or value > LIMIT_MAX[name]:
            raise GrpoError(
                f"python environment: {name} must be at most {LIMIT_MAX[name]}, got {value!r}"
            )
    for name in ("max_output_chars", "max_processes"):
        if not isinstance(values[name], int):
            raise GrpoError(f"python environment: {name} must be an integer, got {values[name]!r}")


def _collect(proc: subprocess.Popen, deadline: float, max_out_bytes: int):
    """Read the child's stdout and stderr until both close, the deadline, or too much stdout.

    Returns:
        (stdout bytes, the last _STDERR_TAIL bytes of stderr, "time" | "output" | None: why the
        parent stopped the run). The process group is killed as soon as the code's process
        exits, so pipes held by its children close too.
    """
    out, err = bytearray(), bytearray()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    pidfd = _pidfd(proc.pid)
    if pidfd is not None:
        sel.register(pidfd, selectors.EVENT_READ, "exit")
    exited, stopped = False, None

    def read(key) -> None:
        chunk = os.read(key.fd, 65536)
        if not chunk:
            sel.unregister(key.fileobj)
        elif key.data == "out":
            out.extend(chunk)
        else:
            err.extend(chunk)
            del err[:-_STDERR_TAIL]

    try:
        while not exited or any(key.data != "exit" for key in sel.get_map().values()):
            now = time.monotonic()
            if now >= deadline:
                stopped = None if exited else "time"  # exited: an escaped process holds a pipe
                break
            poll = deadline - now if exited or pidfd is not None else min(0.05, deadline - now)
            for key, _ in sel.select(poll):
                if key.data == "exit":
                    sel.unregister(key.fileobj)
                else:
                    read(key)
            if len(out) > max_out_bytes:
                stopped = "output"
                break
            if not exited and _has_exited(proc.pid):
                exited = True
                _kill_group(proc.pid)
                deadline = min(deadline, time.monotonic() + _AFTER_EXIT_S)
        _kill_group(proc.pid)
        while len(out) <= max_out_bytes:  # what was written before the kill
            ready = [k for k, _ in sel.select(0) if k.data != "exit"]
            if not ready:
                break
            for key in ready:
                read(key)
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
    return bytes(out), bytes(err), stopped


def _pidfd(pid: int) -> int | None:
    """A pidfd that becomes readable when `pid` exits (Linux >= 5.3), or None: poll instead."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _has_exited(pid: int) -> bool:
    """Whether `pid` has exited, without reaping it (WNOWAIT keeps its pid and pgid reserved)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _last_line(err: bytes) -> str:
    lines = err.decode("utf-8", "replace").strip().splitlines()
    line = lines[-1].strip() if lines else ""
    return line if len(line) <= _LINE_CHARS else line[: _LINE_CHARS - 3] + "..."


def _ending(
    returncode,
    stopped,
    cpu_used,
    line,
    *,
    timeout_s,
    cpu_s,
    memory_mb,
    max_file_mb,
    max_output_chars,
) -> tuple[str | None, str | None]:
    """(error line, limit) of a finished run: the parent's reason first, then the exit status."""
    if stopped == "output":
        return f"output cut at {max_output_chars} characters", "output"
    if stopped == "time":
        return f"time limit ({timeout_s:g} s) exceeded", "time"
    if returncode == EXIT_MEMORY:
        return f"memory limit ({memory_mb:g} MB) exceeded", "memory"
    if returncode in (EXIT_FILE_SIZE, -signal.SIGXFSZ):
        return f"file size limit ({max_file_mb:g} MB) exceeded", "file"
    if returncode == -signal.SIGXCPU or (returncode == -signal.SIGKILL and cpu_used >= cpu_s):
        return f"CPU time limit ({cpu_s} s) exceeded", "cpu"
    if returncode == EXIT_EXCEPTION:
        return line or "exception", None
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}", None
        except ValueError:
            return f"killed by signal {-returncode}", None
    if returncode > 0:
        return f"exit code {returncode}" + (f" ({line})" if line else ""), None
    return None, None
