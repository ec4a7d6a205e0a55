"""Shared fixtures: a tiny BPE tokenizer and tiny random-init HF checkpoints, built locally."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# rollout.compile: auto would compile each test run's decode step (seconds of C++ per shape);
# the compiled path has its own tests (tests/test_sampler.py), which ask for it explicitly.
os.environ.setdefault("GRPO_COMPILE", "0")
# inductor's cache does not key its CPU kernels on the ISA that ATEN_CPU_CAPABILITY /
# ONEDNN_MAX_CPU_ISA cap: a run capped at AVX2 that loads the kernels an uncapped run built (or
# the reverse) decodes NaN logits or crashes (docs/gpu.md). One cache per setting.
_ISA = "-".join(os.environ.get(k, "native") for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"))
_INDUCTOR_CACHE = Path(tempfile.gettempdir()) / f"torchinductor_grpo_tests_{_ISA}"
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_INDUCTOR_CACHE))

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# -- tiers and durations -----------------------------------------------------------------------
# The default tier (the README's command) must stay under 8 minutes on 2 cores: a default-tier
# test over SLOW_TEST_S is named at the end of the run. GRPO_TEST_DURATIONS=tests/durations.json
# writes each test's seconds (setup + call + teardown) into that file, keeping the entries of
# tests this run did not run (so the default and process tiers, run apart, fill one table).
SLOW_TEST_S = 15.0
_seconds: dict[str, float] = {}
_tiers: dict[str, str] = {}


def tier(item) -> str:
    """The test's tier: "slow", "process" (the second) or "default"."""
    return next((m for m in ("slow", "process") if item.get_closest_marker(m)), "default")


def pytest_runtest_setup(item):
    _tiers[item.nodeid] = tier(item)


def pytest_runtest_logreport(report):
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    slow = sorted(
        ((s, n) for n, s in _seconds.items() if s > SLOW_TEST_S and _tiers.get(n) == "default"),
        reverse=True,
    )
    if slow:
        terminalreporter.write_sep(
            "=",
            f"default-tier tests over {SLOW_TEST_S:.0f} s "
            "(a fixture's cost counts where it is built)",
        )
        for s, n in slow:
            terminalreporter.write_line(f"{s:6.1f} s  {n}")
    if path := os.environ.get("GRPO_TEST_DURATIONS"):
        write_durations(Path(path))


def write_durations(path: Path) -> None:
    """Merge this run's per-test seconds into `path` (JSON: per tier, the tests' total and
    each test's seconds, slowest first), stamped with the CPU and the date."""
    import datetime
    import json
    import platform

    old = json.loads(path.read_text()) if path.is_file() else {"tiers": {}}
    tests = {n: s for t in old["tiers"].values() for n, s in t["tests"].items()}
    tiers = {n: t for t, v in old["tiers"].items() for n in v["tests"]}
    tests.update({n: round(s, 2) for n, s in _seconds.items() if n in _tiers})
    tiers.update(_tiers)
    out = {
        "cpu": _cpu_name() or platform.processor(),
        "cores": os.cpu_count(),
        "updated": datetime.date.today().isoformat(),
        "tiers": {},
    }
    for t in ("default", "process", "slow"):
        mine = sorted(((s, n) for n, s in tests.items() if tiers[n] == t), reverse=True)
        if mine:
            out["tiers"][t] = {
                "tests_s": round(sum(s for s, _ in mine), 1),
                "tests": {n: s for s, n in mine},
            }
    path.write_text(json.dumps(out, indent=1) + "\n")


def _cpu_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from a clean slate: dynamo's recompile limit (8) counts the graphs of
    one code object (`Sampler._decode_step`) across every sampler of the process, so tests
    that compile tiny models of other shapes would otherwise add up to it. The attention
    arrangements SDPA's selector gave are forgotten too (a test may have mocked the selector)."""
    from grpo.models import sdpa_choice  # here: the environment above is set before grpo loads

    yield
    torch._dynamo.reset()
    sdpa_choice.clear()


TOKENIZER_CORPUS = [
    "Tom has 3 apples and buys 5 more. How many apples does Tom have?",
    "Step 1: 3 + 5 = 8\nFinal Answer: 8",
    "A box holds 12 pens. Sara shares them among 4 friends. How many pens each?",
    "Step 1: 12 / 4 = 3\nStep 2: 3 * 2 = 6\nFinal Answer: 6",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many.",
    "The answer is #### 72. Weng earns $12 an hour for babysitting.",
] * 20


def tiny_hf_config(family: str, vocab_size: int = 256, tie: bool | None = None, **over):
    """A transformers config of the STYLE.md tiny shape: L=2, C=64, H=4, H_kv=2."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    kw = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=(family != "llama") if tie is None else tie,
        eos_token_id=2,
        bos_token_id=None,
        pad_token_id=None,
    )
    kw.update(over)
    return cls(**kw)


def make_hf_checkpoint(path: Path, family: str, seed: int = 0, **kw) -> Path:
    """Write a random-init transformers checkpoint of `family` to `path` and return it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(family, **kw)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    with torch.no_grad():  # perturb norms and biases so they are not trivially ones / zeros
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path), safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def rank_pool():
    """Two gloo ranks kept for the session (tests/rank_pool.py), closed at its end."""
    from rank_pool import RankPool  # imported here: subprocesses import this file too

    pool = RankPool()
    pool.start()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """A small ChatML BPE tokenizer (eos `<|im_end|>`, pad `<|endoftext|>`), saved to disk."""
    from grpo.tokenizer import load_tokenizer, train_bpe_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    train_bpe_tokenizer(TOKENIZER_CORPUS, vocab_size=300, out_dir=out)
    return load_tokenizer(out)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Factory: tiny_checkpoints(family, **config overrides) -> checkpoint dir (cached)."""
    cache: dict = {}

    def get(family: str, **kw) -> Path:
        key = (family, repr(sorted(kw.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"ckpt_{family}")
            cache[key] = make_hf_checkpoint(path, family, **kw)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def shared_tiny_model(tmp_path_factory):
    """One tiny random-init Qwen3 checkpoint (grpo.tiny size "ci") for the whole session."""
    from grpo.tiny import make_tiny_model

    path = tmp_path_factory.getbasetemp() / "shared_tiny_model_ci"
    if not (path / "generation_config.json").is_file():  # written last
        make_tiny_model(path, size="ci")
    return path


def tree_digest(path: Path) -> str:
    """Every name and every byte under `path` (what a refused command must not change)."""
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def live_lora(model, targets, std: float = 0.05, seed: int = 0):
    """LoRA r4 on `targets` with non-zero B (normal(0, std)), so the adapter changes outputs."""
    from grpo.lora import apply_lora

    apply_lora(model, rank=4, alpha=8, targets=list(targets), seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_b" in name:
                p.normal_(0, std)
    return model


def update_batch(cfg, rollout, advantages, mask=None, ref_logprobs=None, old_logprobs=None):
    """An `UpdateBatch` of a rollout as the trainer builds it for `cfg` (its counted mask and
    micro-batch plan), with the given advantages ((B,) or (B, T_c)) and log-probs."""
    from grpo.experience.batch import UpdateBatch, counted_mask, micro_batch_plan

    if mask is None:
        mask = counted_mask(rollout, cfg.loss.mask_truncated_completions)
    plan = micro_batch_plan(rollout, cfg.train.micro_batch_size or cfg.train.batch_size)
    return UpdateBatch(rollout, mask, advantages, plan, ref_logprobs, old_logprobs)


@pytest.fixture(scope="session")
def serve_cli():
    """A context manager: `grpo serve ARGV...` through the CLI function in a thread; yields
    its `Running` handle once it answers, shuts it down after and checks it exited 0."""
    import argparse
    import contextlib
    import threading

    from grpo.apps.serve import add_parser

    @contextlib.contextmanager
    def serve(*argv: str):
        parser = argparse.ArgumentParser(prog="grpo")
        add_parser(parser.add_subparsers(dest="command"))
        args = parser.parse_args(["serve", *argv])
        ready, holder = threading.Event(), {}

        def on_ready(running):
            holder["running"] = running
            ready.set()

        args.on_ready = on_ready
        thread = threading.Thread(target=lambda: holder.update(rc=args.func(args)), daemon=True)
        thread.start()
        assert ready.wait(60), "server did not start"
        yield holder["running"]
        holder["running"].shutdown()
        thread.join(30)
        assert holder.get("rc") == 0

    return serve


class NetworkGuard:
    """What `loopback_only` refused: each (address or host name) a connect or a name lookup
    in this process tried outside the loopback interface."""

    def __init__(self):
        self.attempts: list = []


def _is_loopback(host) -> bool:
    import ipaddress

    if host in (None, "localhost", b"localhost"):
        return True
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False


@pytest.fixture
def loopback_only(monkeypatch):
    """The client tests talk to a server on 127.0.0.1 only: a socket connect (any thread of
    this process, sync or asyncio) to an address that is not loopback, or a name lookup of a
    host that is not, is refused (ConnectionRefusedError / gaierror) and fails the test at
    teardown, even where the client swallowed the error (e.g. a background tracing export)."""
    import socket

    guard = NetworkGuard()
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_getaddrinfo = socket.getaddrinfo

    def refuse(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address[0]):
            guard.attempts.append(address)
            raise ConnectionRefusedError(f"test: a connect to {address} (not loopback)")

    def connect(self, address):
        refuse(self, address)
        return real_connect(self, address)

    def connect_ex(self, address):
        refuse(self, address)
        return real_connect_ex(self, address)

    def getaddrinfo(host, *args, **kwargs):
        if not _is_loopback(host):
            guard.attempts.append(host)
            raise socket.gaierror(socket.EAI_NONAME, f"test: a lookup of {host!r} (not loopback)")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield guard
    assert not guard.attempts, f"the test tried to reach beyond loopback: {guard.attempts}"


def post_json(url: str, path: str, payload: dict, timeout: float = 120) -> tuple[int, dict]:
    """POST `payload` as JSON to a test server (`url` = http://host:port) -> (status, body)."""
    import http.client
    import json

    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    conn.request("POST", path, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    return resp.status, data


@pytest.fixture
def lm_eval_tasks(tmp_path, monkeypatch):
    """lm-eval offline (no hub, a private datasets cache) and a folder for task yamls."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    return tasks


def docs_example(marker: str, doc: str = "extending.md") -> str:
    """The ```python block of docs/`doc` that begins with `marker` (a ``# my_pkg/x.py`` line):
    the examples the tests run as written."""
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / doc).read_text()
    [block] = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith(marker)]
    return block


def write_package(root: Path, files: dict[str, str], name: str = "my_pkg") -> Path:
    """`root`/`name`/ as an importable package holding `files` (module file name -> source);
    returns `root` (what PYTHONPATH gets)."""
    (root / name).mkdir(exist_ok=True)
    (root / name / "__init__.py").write_text("")
    for file, source in files.items():
        (root / name / file).write_text(source)
    return root


# a reward with spread in every group (`my_pkg.rewards:length` once written by write_package)
LENGTH_REWARD = "def length(completions, **_):\n    return [len(c) / 10 for c in completions]\n"


def tiny_train_argv(model, *args) -> list[str]:
    """`grpo train`'s arguments for configs/tiny_ci.yaml on `model`: 8 new tokens, the length
    reward of my_pkg/rewards.py (a `write_package` with LENGTH_REWARD), no evaluation, every
    step logged; `args` override on top."""
    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny_ci.yaml"
    return [
        "train",
        "--config",
        str(tiny),
        f"model.path={model}",
        "train.progress=false",
        "data.eval_samples=0",
        "rollout.compile=off",
        "train.log_every=1",
        "rollout.max_new_tokens=8",
        "rewards=[{name: my_pkg.rewards:length}]",
        *args,
    ]


def tiny_train(cwd: Path, model, *args, env=None):
    """`tiny_train_argv`'s `grpo train` as a process in `cwd` (on PYTHONPATH). The
    CompletedProcess (not asserted)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "grpo", *tiny_train_argv(model, *args)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(cwd), **(env or {})}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=full_env, timeout=300)


def tiny_train_here(monkeypatch, cwd: Path, model, *args) -> int:
    """`tiny_train`'s run in this process (the exit code): in `cwd`, first on sys.path with its
    my_pkg, imported afresh (not another test's my_pkg)."""
    import sys

    from grpo.apps import cli

    monkeypatch.chdir(cwd)
    monkeypatch.syspath_prepend(str(cwd))
    for name in [m for m in sys.modules if m == "my_pkg" or m.startswith("my_pkg.")]:
        monkeypatch.delitem(sys.modules, name)
    return cli.main(tiny_train_argv(model, *args))


def torchrun_train(cwd: Path, model, out: str, *overrides, ranks: int = 2) -> list[dict]:
    """`grpo train` of configs/tiny_ci.yaml for 2 steps on `ranks` torchrun ranks in `cwd`
    (on PYTHONPATH), asserted to succeed; the per-step metrics.jsonl records."""
    import json
    import subprocess
    import sys

    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny_ci.yaml"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        "-m",
        "grpo",
        "train",
        "--config",
        str(tiny),
        f"model.path={model}",
        "train.progress=false",
        "data.eval_samples=0",
        "rollout.compile=off",
        "train.save_every=0",
        "train.log_every=1",
        "train.max_steps=2",
        f"train.output_dir={out}",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(cwd)}
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (Path(cwd) / out / "metrics.jsonl").read_text().splitlines()]
    rows = [x for x in rows if "rollout/groups_sampled" in x]
    assert len(rows) == 2
    return rows


def head_rounding(model) -> float:
    """Worst-case gap of a log-prob between two float32 evaluations of the head on the same
    float64 hidden state (other batch shapes round in another order): each logit is a C-term
    float32 dot of the rounded operands, off by at most (C + 2) eps32 sum|h_i w_i| <=
    (C + 2) eps32 |h| |w_v|, with |h| = sqrt(C) after the final RMSNorm (weight ones); the
    log-softmax moves by at most twice the largest logit error."""
    C = model.config.hidden_size
    w = model.lm_head.weight.double().norm(dim=1).max().item()
    norm = model.norm.weight.double().abs().max().item()
    return 2 * (C + 2) * torch.finfo(torch.float32).eps * C**0.5 * norm * w
