"""The python environment as a trust boundary: code a hostile model writes cannot reach the
trainer or the host (docs/safety.md).

Every case runs `run_python` inside a stand-in trainer (tests/sandbox_trainer.py, its own
session) and checks that it survives and still answers. Each escape is aimed only at what the
test itself creates: the stand-in, a sleeper standing for every other process, a socket, a
directory, a throwaway venv; no case signals anything else (never ``kill -1``: where isolation
failed it would reach every process the user can signal). Where the OS cannot provide a layer,
the cases are skipped with `isolation()`'s reason.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from grpo.envs.python import PythonEnv
from grpo.envs.sandbox import REQUIRED_LAYERS, isolation, run_python
from grpo.errors import GrpoError

ROOT = Path(__file__).resolve().parents[1]
ISO = isolation()
needs_isolation = pytest.mark.skipif(
    not ISO.complete, reason=f"the sandbox is not available here: {ISO.error or ISO.missing}"
)
LIMITS = dict(timeout_s=5.0, cpu_s=3, memory_mb=256)


class StandIn:
    """A stand-in trainer process: `ask` sends code, returns the run's result (None: no answer
    in time, i.e. the trainer died or was stopped)."""

    def __init__(self, python: str = sys.executable, env: dict | None = None):
        env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.proc = subprocess.Popen(
            [python, str(ROOT / "tests" / "sandbox_trainer.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # a process group of its own: the only one a case reaches
        )
        assert self._line(60) == {"ready": True}, "the stand-in trainer did not start"

    def _line(self, timeout_s: float):
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def ask(self, code: str, timeout_s: float = 20.0, **kwargs) -> dict | None:
        request = json.dumps({"code": code, "kwargs": {**LIMITS, **kwargs}})
        try:
            self.proc.stdin.write(request.encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return None
        return self._line(timeout_s)

    def state(self) -> str:
        """The process state letter (R, S, T: stopped, Z: dead), "gone" once reaped."""
        if self.proc.poll() is not None:
            return "gone"
        try:
            return Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "gone"

    def assert_survived(self) -> None:
        assert self.state() in ("R", "S", "D"), f"the trainer is {self.state()}"
        assert self.ask("print('still here')", timeout_s=20)["output"] == "still here\n"

    def close(self) -> None:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


@pytest.fixture
def trainer():
    standin = StandIn()
    yield standin
    standin.close()


@pytest.fixture
def sleeper():
    """A process standing for every other process on the machine."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def token() -> str:
    return f"grpo-test-{uuid.uuid4().hex[:12]}"


def processes_with(mark: str) -> list[int]:
    """Host pids of live processes whose command line holds `mark`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark.encode() in (entry / "cmdline").read_bytes():
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(entry.name))
        except (OSError, IndexError):
            pass
    return pids


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# ---------------------------------------------------------------------- the layers


@needs_isolation
def test_isolation_reports_every_layer():
    """On Linux with user namespaces (this machine) every required layer applies; the report is
    one structured value and one line."""
    assert ISO.error is None and ISO.missing == []
    assert set(REQUIRED_LAYERS) <= set(ISO.layers)
    assert ISO.layers["capabilities"] == "none" and ISO.layers["nproc"] == 16
    assert ISO.as_dict()["complete"] is True
    line = ISO.describe()
    assert "pid" in line and "mount" in line and "network" in line and "\n" not in line


@needs_isolation
def test_inside_the_sandbox():
    """What the code sees: pid 2 under an init of its own, an unprivileged uid, no capabilities,
    no new privileges, a read-only root holding the interpreter and nothing of the caller's."""
    code = (
        "import os, sys\n"
        "status = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines()"
        " if ':\\t' in l)\n"
        "print(os.getpid(), os.getppid(), os.getuid(), status['CapEff'].strip(),"
        " status['CapBnd'].strip(), status['NoNewPrivs'].strip())\n"
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        "print(os.path.exists(sys.executable), os.path.exists(os.path.expanduser('~/.ssh')))\n"
        f"print(os.path.exists({str(ROOT)!r}))\n"
        "try:\n    open('/usr/grpo-test', 'w')\nexcept OSError as e:\n    print(e.errno)\n"
    )
    r = run_python(code, **LIMITS)
    assert r.ok, r
    ids, pids, seen, repo, errno = r.output.splitlines()
    pid, ppid, uid, cap_eff, cap_bnd, nnp = ids.split()
    assert (pid, ppid, uid, nnp) == ("2", "1", "1000", "1")
    assert int(cap_eff, 16) == 0 and int(cap_bnd, 16) == 0
    assert pids == "[1, 2]"  # only its init and itself
    assert seen == "True False" and repo == "False"
    assert errno == "30"  # EROFS


@needs_isolation
def test_isolation_required_by_default(monkeypatch):
    """Where a layer is missing, a run and the environment refuse with one line naming the layer
    and the escape; require_isolation=False runs the code with the resource limits alone."""
    from grpo.envs import python, sandbox

    broken = sandbox.Isolation({**ISO.layers, "mount": False})
    monkeypatch.setattr(sandbox, "isolation", lambda: broken)  # what run_python asks
    monkeypatch.setattr(python, "isolation", lambda: broken)  # what PythonEnv asks
    for make in (lambda: run_python("print(1)"), lambda: PythonEnv()):
        with pytest.raises(GrpoError) as e:
            make()
        assert "mount" in str(e.value) and "require_isolation: false" in str(e.value)
        assert "\n" not in str(e.value)
    r = run_python("print(1)", require_isolation=False)
    assert r.ok and r.output == "1\n"
    assert PythonEnv(require_isolation=False).answer([("print(2)", None)]).observation == "2"


# ---------------------------------------------------------------------- the trainer survives


@needs_isolation
@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.kill(os.getppid(), 9)",
        "import os\nos.killpg(os.getpgid(os.getppid()), 9)",
        "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)",
        "import os\nos.kill(TRAINER, 9)",
        "import os, signal\nos.kill(TRAINER, signal.SIGSTOP)",
    ],
    ids=["kill-parent", "killpg-parent", "stop-parent", "kill-pid", "stop-pid"],
)
def test_code_cannot_signal_the_trainer(trainer, code):
    trainer.ask(code.replace("TRAINER", str(trainer.proc.pid)), timeout_s=10)
    time.sleep(0.2)
    trainer.assert_survived()


@needs_isolation
def test_code_cannot_signal_other_processes(trainer, sleeper):
    r = trainer.ask(f"import os\nos.kill({sleeper.pid}, 9)\nprint('sent')")
    time.sleep(0.2)
    assert sleeper.poll() is None, "the code killed a process outside the sandbox"
    assert "sent" not in r["output"] and r["error"].startswith("ProcessLookupError")
    trainer.assert_survived()


# ---------------------------------------------------------------------- sockets


@needs_isolation
def test_no_unix_socket_reaches_outside(trainer, tmp_path):
    """A filesystem socket and an abstract one, both opened here and listening: the code reaches
    neither."""
    path = tmp_path / "s"
    abstract = "\0" + token()
    servers = []
    for address in (str(path), abstract):
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(address)
        server.listen(4)
        server.setblocking(False)
        servers.append(server)
    try:
        for address in (str(path), abstract):
            code = (
                "import socket\ns = socket.socket(socket.AF_UNIX)\n"
                f"s.connect({address!r})\nprint('connected')"
            )
            r = trainer.ask(code)
            assert "connected" not in r["output"] and not r["ok"], (address, r)
        for server in servers:
            with pytest.raises(BlockingIOError):
                server.accept()  # no connection ever arrived
    finally:
        for server in servers:
            server.close()
    trainer.assert_survived()


@needs_isolation
def test_no_network_but_a_dead_loopback(trainer):
    """A TCP server on the host's loopback (opened here) is unreachable: the sandbox's own
    loopback is down and Landlock, where present, refuses TCP connect."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)\nprint('in')"
        r = trainer.ask(code)
        assert not r["ok"] and "in" not in r["output"]
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()
    trainer.assert_survived()


# ---------------------------------------------------------------------- files


@needs_isolation
def test_files_outside_are_neither_read_nor_written(trainer, tmp_path):
    outside = tmp_path / "run"
    outside.mkdir()
    outside.chmod(0o777)
    (outside / "secret").write_text("hunter2")
    code = (
        f"d = {str(outside)!r}\n"
        "for name, action in (('read', lambda: print(open(d + '/secret').read())),\n"
        "                     ('write', lambda: open(d + '/written', 'w').write('x'))):\n"
        "    try:\n        action()\n        print(name, 'ok')\n"
        "    except OSError as e:\n        print(name, type(e).__name__)\n"
    )
    r = trainer.ask(code)
    assert "hunter2" not in r["output"], r
    assert r["output"].splitlines() == ["read FileNotFoundError", "write FileNotFoundError"]
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]
    trainer.assert_survived()


@needs_isolation
def test_no_pth_into_the_interpreters_site_packages(tmp_path):
    """The code's interpreter is the trainer's: a .pth it wrote into site-packages would run in
    every later interpreter, the trainer's included. A throwaway venv stands for it."""
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
        check=True,
        timeout=120,
    )
    standin = StandIn(python=str(venv / "bin" / "python"))
    try:
        code = (
            "import site, sys\nsp = site.getsitepackages()[0]\nprint(sys.prefix)\n"
            "open(sp + '/grpo_test_evil.pth', 'w').write('import os\\n')\n"
        )
        r = standin.ask(code)
        assert r["output"].strip() == str(venv)  # the venv's interpreter ran the code
        assert r["error"].startswith("OSError: [Errno 30]"), r  # read-only file system
        assert list(venv.rglob("grpo_test_evil.pth")) == []
        standin.assert_survived()
    finally:
        standin.close()


# ---------------------------------------------------------------------- processes


@needs_isolation
def test_setsid_does_not_outlive_the_run(trainer, tmp_path):
    """A process that leaves the code's session and process group, writes its pid to a file made
    here where it can, and sleeps: gone when the run ends."""
    mark, pid_file = token(), tmp_path / "pid"
    pid_file.touch()
    pid_file.chmod(0o666)
    code = (
        "import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        try:\n            open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "        except OSError:\n            pass\n"
        f"        os.execv('/bin/sleep', [{mark!r}, '30'])\n"
        "    os._exit(0)\nimport time\ntime.sleep(0.5)\nprint('done')"
    )
    try:
        r = trainer.ask(code)
        assert r["output"] == "done\n"
        time.sleep(0.3)
        assert processes_with(mark) == [], "a process outlived the run"
        trainer.assert_survived()
    finally:
        kill_all(processes_with(mark))
        written = pid_file.read_text().strip()
        if written.isdigit():
            kill_all([int(written)])


@needs_isolation
def test_fork_loop_is_capped(trainer):
    """At most 32 children, each sleeping at most 5 s: the process cap stops the loop."""
    mark = token()
    code = (
        "import os\nn = 0\nfor _ in range(32):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n"
        f"        os.execv('/bin/sleep', [{mark!r}, '5'])\n    n += 1\nprint(n)"
    )
    try:
        r = trainer.ask(code, max_processes=8)
        assert int(r["output"]) == 8 - 2, r  # the sandbox's init and the code's process count
        time.sleep(0.3)
        assert processes_with(mark) == []
        trainer.assert_survived()
    finally:
        kill_all(processes_with(mark))


def _others_can_read(path: Path) -> bool:
    """Whether a user with no relation to the file's owner can read `path` (every directory
    above it searchable by others, the file readable by others)."""
    parts = [path, *path.parents]
    return bool(path.stat().st_mode & 0o004) and all(p.stat().st_mode & 0o001 for p in parts[1:])


def _unprivileged_python() -> str | None:
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        real = Path(candidate).resolve() if Path(candidate).exists() else None
        if real is not None and _others_can_read(real):
            return str(real)
    return None


RUNNER = ROOT / "grpo" / "envs" / "_sandbox_child.py"
NOBODY = (
    os.geteuid() == 0
    and shutil.which("setpriv") is not None
    and _unprivileged_python() is not None
    and _others_can_read(RUNNER)
)


@needs_isolation
@pytest.mark.skipif(
    not NOBODY,
    reason="needs root to become nobody, setpriv, and a python3 "
    "and a checkout that others can read",
)
def test_the_sandbox_without_root():
    """The same layers for a caller without root (here: nobody, through setpriv): the code's
    uid maps to the caller's own, and the process cap still stops a fork loop."""
    runner, python, setpriv = RUNNER, _unprivileged_python(), shutil.which("setpriv")
    with tempfile.TemporaryDirectory(prefix="grpo-test-") as tmp:  # pytest's is root's only
        tmp_path = Path(tmp)
        tmp_path.chmod(0o755)
        run_unprivileged(setpriv, python, runner, tmp_path)


def run_unprivileged(setpriv: str, python: str, runner: Path, tmp_path: Path) -> None:
    for name in ("work", "root"):
        (tmp_path / name).mkdir(mode=0o777)
        (tmp_path / name).chmod(0o777)
    code = tmp_path / "code.py"
    code.write_text(
        "import os\nprint(os.getuid(), os.getpid())\nn = 0\nfor _ in range(16):\n"
        "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n        import time\n        time.sleep(2)\n        os._exit(0)\n"
        "    n += 1\nprint(n)\n"
    )
    code.chmod(0o644)
    status_r, status_w = os.pipe()
    cfg = dict(
        code=str(code),
        cpu_s=5,
        as_bytes=256 << 20,
        file_bytes=1 << 20,
        nofile=64,
        nproc=8,
        dir_bytes=1 << 20,
        work=str(tmp_path / "work"),
        root=str(tmp_path / "root"),
        isolate=True,
        status_fd=status_w,
    )
    try:
        r = subprocess.run(
            [
                setpriv,
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                python,
                "-s",
                "-u",
                str(runner),
                json.dumps(cfg),
            ],
            pass_fds=(status_w,),
            capture_output=True,
            timeout=60,
            cwd=tmp_path / "work",
            env={"PATH": os.environ.get("PATH", os.defpath)},
            start_new_session=True,
        )
    finally:
        os.close(status_w)
    status = os.read(status_r, 65536).decode()
    os.close(status_r)
    assert status.startswith("ok "), (status, r.stderr.decode()[-500:])
    layers = json.loads(status[3:])
    assert layers["user"] == "caller's uid"
    assert all(layers[k] for k in REQUIRED_LAYERS)
    uid_pid, forked = r.stdout.decode().splitlines()
    assert uid_pid == "1000 2" and r.returncode == 0
    assert int(forked) < 8  # the cap counts the sandbox's own processes (2 or 3) too


def test_a_run_refuses_to_start_without_the_sandbox(
    shared_tiny_model, tmp_path, monkeypatch, capsys
):
    """`grpo train` with the python environment on a machine missing a layer: one line naming
    it and the escape, exit 2, before the model loads and before anything is written."""
    from grpo.apps import cli
    from grpo.envs import python, sandbox

    broken = sandbox.Isolation({}, "user: unshare: Operation not permitted")
    monkeypatch.setattr(python, "isolation", lambda: broken)  # what PythonEnv asks
    out = tmp_path / "run"
    args = [
        "train",
        "--config",
        str(ROOT / "configs" / "gsm8k_qwen3_0.6b_tools.yaml"),
        f"model.path={shared_tiny_model}",
        f"data.source={ROOT / 'tests/data/gsm8k'}",
        "data.split=test",
        f"train.output_dir={out}",
        "train.max_steps=1",
        "train.progress=false",
        "rollout.max_new_tokens=12",
        "eval.max_new_tokens=8",
        "rollout.max_obs_tokens=16",
        "rollout.max_total_tokens=64",
    ]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "grpo train: error: python environment: sandbox layer unavailable: user: "
        "unshare: Operation not permitted; set require_isolation: false "
        "(rollout.env_kwargs) to run the code without it"
    ], err
    assert not out.exists()
