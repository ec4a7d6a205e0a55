"""The prepared GPU check: one driver process, steps in order of value, a running deadline.

    bash benchmarks/gpu_check.sh            # the main plan, results under $OUT (runs/gpu_check)
    bash benchmarks/gpu_check.sh more       # the second command: what the main plan leaves out
    DRY_RUN=1 OUT=/tmp/gpu_dry bash benchmarks/gpu_check.sh   # the same steps on the CPU

A GPU comes rarely and for one command of at most 10 minutes on a cold machine, compiles
included. So the check:

- runs its in-process steps in this one process (one CUDA initialisation; pytest and the
  `grpo train` runs are subprocesses), in the order of `PLANS` (most valuable first);
- keeps a running deadline (`--budget-s`): a step whose estimate exceeds the time left is
  skipped with its reason, not started and killed; a step that overruns the time left anyway is
  stopped by a watchdog that records it and exits (124), every finished result already on disk;
- appends every measurement to `$OUT/results.jsonl` as one JSON object per line, flushed and
  fsynced (each benchmark row as the benchmark writes it, `benchmarks.harness.RESULT_HOOKS`;
  each test as pytest reports it), and rewrites `$OUT/gpu_summary.md` and
  `$OUT/gpu_results.tar.gz` after every step;
- runs tests by node id with `-v -rA`, so names and assertion texts come back;
- archives the inductor and Triton caches as `$OUT/caches/<key>.tar.gz` (key: GPU, torch,
  triton, host ISA), which a later run carries back in `.gpu_cache/` and unpacks first.

Estimates are the first run's real durations on an H200 (2026-12-04, `gpu_summary.md` of that
run): process start and CUDA initialisation 5-9 s, a tiny-model or 0.6B-checkpoint step 10-19 s,
the whole log-prob benchmark 23 s; compiles of the 28-layer decode step are not measured yet
(estimated at a minute each).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 560.0  # of a 600 s command: interpreter start before, the last archive after
RESERVE_S = 10.0  # kept back from every step for the summary and the cache archive
CACHE_LIMIT_MIB = 60  # an archive a later run can carry (64 MiB with the tree)
# the decode step's model: bench_sampler's shapes (tiny for the dry run), Qwen3's flags
QWEN3_FLAGS = dict(
    family="qwen3",
    qk_norm=True,
    rope_theta=1e6,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    eos_token_id=1,
    pad_token_id=0,
)
# The CUDA tests that failed or were cut off on the first run (docs/gpu.md), by node id.
KNOWN_FAILING = [
    "tests/test_kernels.py::test_triton_cuda_bf16_entropy_grad_within_error_budget",
    "tests/test_head_precision.py::test_cuda_head_precision_against_float64",
    "tests/test_sampler.py::test_compiled_decode_step_matches_eager_on_cuda",
]


@dataclass
class Step:
    """One step: `run(check)` records its measurements; `gpu_s` / `dry_s` its estimates."""

    name: str
    gpu_s: float
    dry_s: float
    run: Callable[[Check], None]
    what: str = ""


class Results:
    """Measurements as JSON lines: appended one at a time, flushed and fsynced, so a kill at
    any moment leaves every finished line readable."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def append(self, record: dict) -> None:
        line = json.dumps(record, default=str) + "\n"
        with self._lock, open(self.path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    @staticmethod
    def read(path: Path) -> list[dict]:
        """Every complete record (a line torn by a kill is left out)."""
        out = []
        for line in Path(path).read_text().splitlines() if Path(path).exists() else []:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out


class Check:
    """The running check: the deadline, the results, the folders, the subprocesses."""

    def __init__(self, out: Path, dry: bool, budget_s: float, reserve_s: float = RESERVE_S):
        self.out, self.dry = Path(out), dry
        self.budget_s, self.reserve_s = budget_s, reserve_s
        self.t0 = time.monotonic()
        self.res = self.out / "results"  # benchmark JSON / Markdown, JUnit XML
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check_work."))
        self.res.mkdir(parents=True, exist_ok=True)
        self.results = Results(self.out / "results.jsonl")
        self.log = open(self.out / "gpu_check.log", "a", buffering=1)
        self.step = "-"
        self.device = "cpu" if dry else "cuda"
        self._seen: dict[str, int] = {}  # benchmark name -> rows already recorded
        self.children: set[subprocess.Popen] = set()  # killed with the check on an overrun
        self.keep_caches = False  # archive the compile caches after a plan (`main` sets it)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def record(self, **fields) -> None:
        rec = {"step": self.step, "t_s": round(time.monotonic() - self.t0, 1), **fields}
        self.results.append(rec)
        self.say(json.dumps(rec, default=str)[:400])

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    def benchmark_rows(self, name: str, rows: list[dict]) -> None:
        """`benchmarks.harness.RESULT_HOOKS`: each new row of a benchmark's table, once."""
        for row in rows[self._seen.get(name, 0) :]:
            self.record(kind="row", table=name, **row)
        self._seen[name] = len(rows)

    def run_cmd(self, cmd: list[str], timeout: float, on_line=None) -> tuple[int, str]:
        """Run `cmd` in its own process group with output streamed to the log (and `on_line`),
        killed with its children after `timeout` s: (exit code, 124 on a timeout; last lines)."""
        self.say("$ " + " ".join(cmd)[:600])
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        tail: list[str] = []
        timer = threading.Timer(max(1.0, timeout), _kill_group, (proc,))
        timer.start()
        self.children.add(proc)
        try:
            for line in proc.stdout:
                line = line.rstrip("\n")
                self.log.write(line + "\n")
                tail = (tail + [line])[-40:]
                if on_line is not None:
                    on_line(line)
            code = proc.wait()
        finally:
            timed_out = not timer.is_alive() and proc.returncode not in (0, None)
            timer.cancel()
            self.children.discard(proc)
        return (124 if timed_out else code), "\n".join(tail)

    def pytest(self, args: list[str], junit: str) -> None:
        """pytest with -v -rA: a record per test as it finishes, then each failure's message
        from the JUnit XML; raises if pytest fails."""
        outcome = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")

        def on_line(line):
            m = outcome.match(line)
            if m:
                self.record(kind="test", test=m.group(1), outcome=m.group(2))

        xml = self.res / junit
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            *args,
            "-v",
            "-rA",
            "-p",
            "no:cacheprovider",
            f"--junitxml={xml}",
        ]
        code, tail = self.run_cmd(cmd, self.left() - self.reserve_s, on_line)
        for failure in junit_failures(xml):
            self.record(kind="failure", **failure)
        if code not in (0, 5):  # 5: nothing collected (a dry run's deselected tests)
            raise RuntimeError(f"pytest exited {code}: {tail.splitlines()[-1] if tail else ''}")

    def close(self) -> None:
        self.log.close()
        shutil.rmtree(self.work, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass


def junit_failures(xml: Path) -> list[dict]:
    """{test, outcome, message} of every failed or errored test in a JUnit XML file."""
    import xml.etree.ElementTree as ET

    if not xml.exists():
        return []
    out = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        for tag in ("failure", "error"):
            for node in case.findall(tag):
                name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
                text = (node.get("message") or "") + "\n" + (node.text or "")
                out.append({"test": name, "outcome": tag, "message": text.strip()[-3000:]})
    return out


def run_plan(check: Check, steps: list[Step]) -> int:
    """Each step in order, or its skip when its estimate exceeds the time left; the summary
    rewritten after each. Returns the number of steps that failed."""
    failed = 0
    for step in steps:
        check.step = step.name
        estimate = step.dry_s if check.dry else step.gpu_s
        left = check.left() - check.reserve_s
        if estimate > left:
            check.record(
                status="skipped",
                reason=f"estimate {estimate:.0f} s > {left:.0f} s left",
                estimate_s=estimate,
            )
            continue
        check.record(status="started", estimate_s=estimate, left_s=round(left), what=step.what)
        watchdog = threading.Timer(left, _overrun, (check, step.name))
        watchdog.daemon = True
        t0 = time.monotonic()
        watchdog.start()
        try:
            step.run(check)
            status, extra = "ok", {}
        except Exception as e:  # a failed step is recorded; the next one runs
            check.say(traceback.format_exc())
            status, extra = "failed", {"error": f"{type(e).__name__}: {e}"[:2000]}
            failed += 1
        finally:
            watchdog.cancel()
        check.record(status=status, seconds=round(time.monotonic() - t0, 1), **extra)
        write_summary(check)
    check.step = "-"
    if check.keep_caches:
        archive_caches(check)
    write_summary(check)
    return failed


def _overrun(check: Check, name: str) -> None:
    """The watchdog: a step ran past the time left. Record it, pack what is there, exit."""
    check.step = name
    for proc in list(check.children):
        _kill_group(proc)
    check.record(status="killed", reason="ran past the time left (the watchdog stopped it)")
    write_summary(check)
    os._exit(124)


def write_summary(check: Check) -> None:
    """`gpu_summary.md` (steps, then every measurement grouped by table) and
    `gpu_results.tar.gz` (results.jsonl, the log, every result file), replaced atomically."""
    recs = Results.read(check.results.path)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    lines = [
        f"# gpu_check ({'dry' if check.dry else 'gpu'}) {stamp}, git {_git_sha()}",
        "",
        "| step | status | estimate_s | seconds | note |",
        "|---|---|---|---|---|",
    ]
    for r in recs:
        if "status" in r and r["status"] != "started":
            est = next(
                (
                    x.get("estimate_s")
                    for x in recs
                    if x.get("step") == r["step"] and "estimate_s" in x
                ),
                "",
            )
            note = r.get("reason") or r.get("error") or ""
            lines.append(
                f"| {r['step']} | {r['status']} | {est} | {r.get('seconds', '')} | "
                f"{str(note).replace('|', '/')[:200]} |"
            )
    tests = [r for r in recs if r.get("kind") == "test"]
    if tests:
        lines += ["", "## tests", "", "| test | outcome |", "|---|---|"]
        lines += [f"| {r['test']} | {r['outcome']} |" for r in tests]
    for r in recs:
        if r.get("kind") == "failure":
            lines += ["", f"### {r['test']}", "", "```", r["message"], "```"]
    other = [r for r in recs if r.get("kind") == "measure"]
    for r in other:
        fields = {k: v for k, v in r.items() if k not in ("kind", "t_s")}
        lines.append("- " + ", ".join(f"{k}={v}" for k, v in fields.items()))
    for md in sorted(check.res.glob("*.md"), key=lambda p: p.stat().st_mtime):
        lines += ["", md.read_text().replace("\n# ", "\n## ", 1).replace("# ", "## ", 1)]
    tmp = check.out / "gpu_summary.md.part"
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(check.out / "gpu_summary.md")
    part = check.out / "gpu_results.tar.gz.part"
    with tarfile.open(part, "w:gz") as tar:
        for p in [check.results.path, check.out / "gpu_check.log", *sorted(check.res.iterdir())]:
            if p.exists():
                tar.add(p, arcname=p.name)
    part.replace(check.out / "gpu_results.tar.gz")


def _git_sha() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True, capture_output=True
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        return "unknown"


# --------------------------------------------------------------------------- caches


def host_isa() -> str:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    for name, flag in (("amx", " amx_tile"), ("avx512", " avx512f"), ("avx2", " avx2")):
        if flag in flags:
            return name
    return platform.machine()


def cache_key() -> str:
    """GPU kind, torch, triton and host ISA: what decides whether a compiled kernel is reusable."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    try:
        import triton

        tri = triton.__version__
    except ImportError:
        tri = "none"
    key = f"{gpu}-torch{torch.__version__}-triton{tri}-{host_isa()}"
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", key)


def cache_dirs() -> dict[str, Path]:
    return {
        name: Path(os.environ[var])
        for name, var in (("inductor", "TORCHINDUCTOR_CACHE_DIR"), ("triton", "TRITON_CACHE_DIR"))
        if os.environ.get(var)
    }


def restore_caches(check: Check, carried: Path) -> None:
    """Unpack a carried archive of this key (`.gpu_cache/<key>.tar.gz`) into the cache dirs."""
    archive = carried / f"{cache_key()}.tar.gz"
    dirs = cache_dirs()
    if not archive.exists() or not dirs:
        check.record(kind="measure", caches="none carried", key=cache_key())
        return
    with tarfile.open(archive) as tar:
        for name, path in dirs.items():
            members = [m for m in tar.getmembers() if m.name.startswith(name + "/")]
            for m in members:
                m.name = m.name[len(name) + 1 :]
            path.mkdir(parents=True, exist_ok=True)
            tar.extractall(path, members=members, filter="data")
    check.record(kind="measure", caches="restored", archive=str(archive))


def archive_caches(check: Check) -> None:
    """The inductor and Triton caches as one archive under `$OUT/caches/`, if it fits."""
    dirs = {n: p for n, p in cache_dirs().items() if p.exists()}
    if not dirs:
        return
    (check.out / "caches").mkdir(exist_ok=True)
    target = check.out / "caches" / f"{cache_key()}.tar.gz"
    part = target.with_suffix(".part")
    with tarfile.open(part, "w:gz") as tar:
        for name, path in dirs.items():
            tar.add(path, arcname=name)
    mib = part.stat().st_size / 2**20
    if mib > CACHE_LIMIT_MIB:
        part.unlink()
        check.record(kind="measure", caches=f"not kept: {mib:.0f} MiB > {CACHE_LIMIT_MIB} MiB")
        return
    part.replace(target)
    check.record(kind="measure", caches="archived", archive=target.name, mib=round(mib, 1))


# --------------------------------------------------------------------------- steps


def step_env(check: Check) -> None:
    """Versions, the device, and the attention kernel SDPA's selector gives each kind of call
    the decoder makes at the Qwen3-0.6B heads (`grpo.models.sdpa_choice`)."""
    import importlib.metadata as md
    import importlib.util

    import torch

    from grpo.models import sdpa_choice

    versions = {
        m: (md.version(d) if importlib.util.find_spec(m) else "MISSING")
        for m, d in [
            ("triton", "triton"),
            ("transformers", "transformers"),
            ("safetensors", "safetensors"),
            ("datasets", "datasets"),
            ("liger_kernel", "liger-kernel"),
        ]
    }
    gpu = {}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        gpu = dict(gpu=p.name, sms=p.multi_processor_count, gib=round(p.total_memory / 2**30))
    check.record(
        kind="measure",
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        isa=host_isa(),
        **versions,
        **gpu,
    )
    heads = (16, 8, 128)
    for dtype in (torch.bfloat16, torch.float32):
        for kind, masked, causal in (
            ("decode", True, False),
            ("queries", True, False),
            ("queries", False, True),
        ):
            arrangement = sdpa_choice.choose(kind, check.device, dtype, heads, masked, causal)
            backend = sdpa_choice.chosen_backend(kind, check.device, dtype, heads, masked, causal)
            kernel = "two matmuls" if arrangement == sdpa_choice.MATMUL else backend.name
            check.record(
                kind="measure",
                attention=kind,
                masked=masked,
                dtype=str(dtype),
                arrangement=arrangement,
                kernel=kernel,
            )


def step_decode(check: Check) -> None:
    """The decode step at B=32 (4 prompts x 8), eager vs compiled: compile time, graphs,
    ms per step, and whether the compiled tokens equal eager's (greedy)."""
    import torch
    from torch._dynamo.utils import counters

    from benchmarks.models import CASES
    from grpo.models.config import ModelConfig
    from grpo.models.decoder import Decoder
    from grpo.rollout.sampler import Sampler

    dev = torch.device(check.device)
    shape = CASES["tiny" if check.dry else "qwen3-0.6b"]["config"]
    cfg = ModelConfig(**QWEN3_FLAGS, **shape)
    dtype = torch.float32 if check.dry else torch.bfloat16
    with torch.device(dev):
        model = Decoder(cfg)
    model.init_weights(seed=0)
    model = model.to(dtype).eval()
    P, G, T_p, N = 4, 8, (16 if check.dry else 128), (8 if check.dry else 64)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, cfg.vocab_size, (P, T_p), generator=g).tolist()

    def sample(sampler):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        r = sampler.sample(
            prompts, group_size=G, max_new_tokens=N, temperature=0.0, stop_ids=[1], seed=0
        )
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t, r

    base = dict(kind="measure", B=P * G, prompt=T_p, new_tokens=N, dtype=str(dtype))
    eager = Sampler(model, compile=False)
    sample(eager)  # warm-up
    times, ref = zip(*[sample(eager) for _ in range(3)])
    check.record(**base, mode="eager", ms_per_step=1e3 * sorted(times)[1] / N)
    counters.clear()
    compiled = Sampler(model, compile=True)
    first, _ = sample(compiled)
    check.record(
        **base,
        mode="compiled",
        first_call_s=round(first, 1),
        compile_s=round(compiled.compile_s, 1),
        graphs=counters["stats"]["unique_graphs"],
    )
    times, outs = zip(*[sample(compiled) for _ in range(3)])
    same = (outs[-1].completion_ids == ref[-1].completion_ids).all(dim=1).float().mean().item()
    check.record(
        **base,
        mode="compiled",
        ms_per_step=1e3 * sorted(times)[1] / N,
        graphs=counters["stats"]["unique_graphs"],
        recompiles=counters["stats"].get("recompiles", 0),
        rows_equal_to_eager=same,
    )


def step_known_failing(check: Check) -> None:
    """The CUDA tests the first run failed or cut off, by name (a CPU dry run skips them)."""
    check.pytest(KNOWN_FAILING, "pytest_known_failing.xml")


def step_cuda_rest(check: Check) -> None:
    """Every other `-m cuda` test."""
    files = sorted(
        {
            str(p.relative_to(REPO))
            for p in (REPO / "tests").glob("test_*.py")
            if "pytest.mark.cuda" in p.read_text()
        }
    )
    deselect = [a for node in KNOWN_FAILING for a in ("--deselect", node)]
    check.pytest(["-m", "cuda", *files, *deselect], "pytest_cuda_rest.xml")


def bench(module: str, *argv: str) -> Callable[[Check], None]:
    """A step that runs `python -m benchmarks.<module> argv...` in this process."""

    def run(check: Check) -> None:
        import importlib

        mod = importlib.import_module(f"benchmarks.{module}")
        names = dict(
            dev=check.device,
            out=check.res,
            size="ci" if check.dry else "qwen3-0.6b",
            tag="dry" if check.dry else "gpu",
        )
        args = [a.format(**names) for a in argv]
        code = mod.main(args)
        if code:
            raise RuntimeError(f"benchmarks.{module} returned {code}")

    return run


STEP_DRY = [
    "--prompts",
    "2",
    "--group-size",
    "2",
    "--max-new-tokens",
    "8",
    "--micro-batch-size",
    "4",
    "--repeats",
    "1",
]
STEP_GPU = [
    "--prompts",
    "4",
    "--group-size",
    "8",
    "--max-new-tokens",
    "64",
    "--micro-batch-size",
    "16",
    "--repeats",
    "2",
]
TUTORIAL_LORA = [
    "--lora-targets",
    "q_proj,k_proj,v_proj,o_proj",
    "--set",
    "model.dtype=float32",
    "--set",
    "model.autocast_bf16=true",
]


def grpo_step(check: Check) -> None:
    common = [
        "--sizes",
        "{size}",
        "--device",
        "{dev}",
        "--out-dir",
        "{out}",
        *(STEP_DRY if check.dry else STEP_GPU),
    ]
    bench(
        "bench_step",
        *common,
        "--modes",
        "lora",
        *TUTORIAL_LORA,
        "--rollout-compile",
        "on",
        "--name",
        "step_{tag}_{size}_lora_qkvo",
    )(check)
    if check.keep_caches:  # a compile's kernels kept even if the full run is cut off
        archive_caches(check)
    bench(
        "bench_step",
        *common,
        "--modes",
        "full",
        "--rollout-compile",
        "on",
        "--name",
        "step_{tag}_{size}_full",
    )(check)


def packing(check: Check) -> None:
    pack = (
        [
            "--prompts",
            "2",
            "--group-size",
            "2",
            "--max-new-tokens",
            "32",
            "--micro-batch-size",
            "4",
            "--repeats",
            "1",
        ]
        if check.dry
        else [
            "--prompts",
            "4",
            "--group-size",
            "8",
            "--max-new-tokens",
            "256",
            "--micro-batch-size",
            "16",
            "--repeats",
            "3",
        ]
    )
    bench(
        "bench_step",
        "--lengths",
        "gsm8k,uniform",
        "--modes",
        "lora",
        "--sizes",
        "{size}",
        "--device",
        "{dev}",
        "--data",
        "gsm8k-test",
        *pack,
        "--name",
        "packing_{tag}_{size}",
        "--out-dir",
        "{out}",
    )(check)


def parity(check: Check) -> None:
    extra = ["--sizes", "tiny", "--seq-len", "32", "--new-tokens", "8"] if check.dry else []
    bench(
        "gpu_parity", "--device", "{dev}", *extra, "--name", "parity_{tag}", "--out-dir", "{out}"
    )(check)


MAIN = [
    Step("env", 10, 20, step_env, "versions, device, the attention kernel each call gets"),
    Step("decode", 150, 120, step_decode, "decode step B=32, eager vs compiled"),
    Step("known-failing", 60, 120, step_known_failing, "the tests that failed, by name"),
    Step(
        "grpo-step",
        200,
        150,
        grpo_step,
        "GRPO step at the 0.6B shape, compiled rollouts: "
        "LoRA q/k/v/o (tutorial precision), then full",
    ),
    Step("packing", 60, 60, packing, "padded vs packed passes at the GSM8K spread (LoRA)"),
    Step("cuda-rest", 90, 120, step_cuda_rest, "every other -m cuda test"),
    Step("parity", 40, 60, parity, "decoder and greedy vs transformers, tiny and 0.6B"),
]


def one_rank_train(
    check: Check, name: str, config: str, overrides: list[str], accept: str, parallel: str | None
) -> None:
    """`grpo train --config config overrides...` under `torchrun --standalone` with one rank (a
    process group even on one GPU: NCCL, gloo on the dry run), summarized by
    `benchmarks.gpu_run` as `<name>_<gpu|dry>`; `parallel` the mode its metrics must name."""
    from benchmarks import gpu_run

    run_dir = check.work / name
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    cmd = [
        *torchrun,
        "-m",
        "grpo",
        "train",
        "--config",
        config,
        f"model.device={check.device}",
        f"train.output_dir={run_dir}",
        *overrides,
    ]
    code, tail = check.run_cmd(cmd, check.left() - check.reserve_s)
    if code:
        raise RuntimeError(f"grpo train exited {code}: {tail.splitlines()[-1:]}")
    backend = "gloo" if check.dry else "nccl"
    args = [
        "--name",
        f"{name}_{'dry' if check.dry else 'gpu'}",
        "--out-dir",
        str(check.res),
        "--metrics",
        str(run_dir / "metrics.jsonl"),
        "--accept",
        accept,
    ]
    if parallel is not None:
        args += ["--parallel", f"{parallel} over 1 rank ({backend})"]
    if gpu_run.main(args):
        raise RuntimeError(f"{name}: a number missed its bound (see its table)")


def tutorial_run(name: str, *extra: str, accept: str = "1e-2") -> Callable[[Check], None]:
    """The tutorial's GRPO config as written at the 0.6B shape (random init, context 2048),
    a few steps on the repo's GSM8K test split, one rank."""

    def run(check: Check) -> None:
        size, steps, new = ("ci", 2, 8) if check.dry else ("qwen3-0.6b", 4, 128)
        model = check.work / "tutorial" / size
        if not model.exists():
            from benchmarks.models import make_checkpoint

            model = make_checkpoint(check.work / "tutorial", size)
            cfg = json.loads((model / "config.json").read_text())
            cfg["max_position_embeddings"] = 2048
            (model / "config.json").write_text(json.dumps(cfg))
        overrides = [
            f"model.path={model}",
            "model.adapter=null",
            "data.source=tests/data/gsm8k",
            "data.split=test",
            "data.max_samples=64",
            "data.eval_samples=0",
            f"rollout.max_new_tokens={new}",
            "rollout.compile=off",
            f"train.max_steps={steps}",
            "train.log_every=1",
            *extra,
        ]
        one_rank_train(
            check,
            name,
            "configs/gsm8k_qwen3_0.6b_grpo.yaml",
            overrides,
            accept,
            None if accept == "inf" else "ddp",
        )

    return run


def tiny_parallel(mode: str, steps: int) -> Callable[[Check], None]:
    """configs/tiny_ci.yaml on the tiny model, `train.parallel=mode`, one rank."""

    def run(check: Check) -> None:
        model = check.work / "tiny-model"
        if not model.exists():
            tiny = [sys.executable, "-m", "grpo", "tiny-model", "--out", str(model)]
            code, _ = check.run_cmd(tiny, check.left())
            if code:
                raise RuntimeError(f"tiny-model exited {code}")
        overrides = [
            f"model.path={model}",
            f"train.max_steps={steps}",
            f"train.parallel={mode}",
            f"train.save_every={steps}",
        ]
        one_rank_train(check, f"grpo_{mode}", "configs/tiny_ci.yaml", overrides, "1e-4", mode)

    return run


def sampler_throughput(check: Check) -> None:
    args = (
        [
            "--cases",
            "tiny",
            "--dtype",
            "float32",
            "--prompt-len",
            "16",
            "--new-tokens",
            "8",
            "--batches",
            "2x2",
            "--rounds",
            "2",
        ]
        if check.dry
        else [
            "--cases",
            "qwen3-0.6b",
            "--dtype",
            "bfloat16",
            "--batches",
            "4x8,16x8",
            "--compile",
            "qwen3-0.6b",
            "--rounds",
            "3",
        ]
    )
    bench(
        "bench_sampler",
        *args,
        "--device",
        "{dev}",
        "--warmup",
        "1",
        "--hf-caches",
        "dynamic,static",
        "--name",
        "sampler_{tag}",
        "--out-dir",
        "{out}",
    )(check)


def decode_attention(check: Check) -> None:
    shape = "8x256" if check.dry else "128x1280"
    bench(
        "bench_sampler",
        "--cases",
        "none",
        "--device",
        "{dev}",
        "--dtype",
        "bfloat16",
        "--decode-attention",
        shape,
        "--name",
        "sampler_{tag}",
        "--out-dir",
        "{out}",
    )(check)


def logprobs(check: Check) -> None:
    args = (
        ["--dtype", "float32", "--quick", "--shapes", "256x64x1024"]
        if check.dry
        else ["--dtype", "bfloat16", "--shapes", "16384x1024x151936"]
    )
    bench(
        "bench_logprobs",
        "--device",
        "{dev}",
        *args,
        "--impls",
        "naive,chunked,liger,triton",
        "--name",
        "logprobs_{tag}_main",
        "--out-dir",
        "{out}",
    )(check)


def precision(check: Check) -> None:
    bench(
        "bench_precision",
        "--size",
        "{size}",
        "--device",
        "{dev}",
        "--no-compile",
        "--name",
        "precision_{tag}_{size}",
        "--out-dir",
        "{out}",
    )(check)


MORE = [
    Step("grpo-ddp", 60, 120, tiny_parallel("ddp", 20), "tiny GRPO, DDP over one NCCL rank"),
    Step("grpo-fsdp", 45, 120, tiny_parallel("fsdp", 5), "tiny GRPO, FSDP2 over one NCCL rank"),
    Step(
        "tutorial-grpo",
        120,
        150,
        tutorial_run("grpo_tutorial"),
        "the tutorial config at the 0.6B shape, 4 steps, torchrun",
    ),
    Step(
        "tutorial-async",
        90,
        150,
        tutorial_run(
            "grpo_tutorial_async", "rollout.async=on", "rollout.max_staleness=1", accept="inf"
        ),
        "the same with async rollouts",
    ),
    Step("decode-attention", 20, 30, decode_attention, "decode attention per arrangement"),
    Step("sampler", 120, 90, sampler_throughput, "sampler vs generate, B=32/128, bf16"),
    Step("logprobs", 35, 60, logprobs, "log-prob kernels vs naive, chunked, Liger"),
    Step("precision", 40, 90, precision, "sampler vs trainer, bf16 vs float32 log-probs"),
]
PLANS = {"main": MAIN, "more": MORE}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("plan", nargs="?", default="main", choices=sorted(PLANS))
    p.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_check"))
    p.add_argument(
        "--dry-run",
        action="store_true",
        default=os.environ.get("DRY_RUN") == "1",
        help="the CPU: tiny shapes, the cuda tests skip (env DRY_RUN=1)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"seconds for the whole plan (default {BUDGET_S:.0f}; dry run 3600)",
    )
    p.add_argument("--steps", default=None, help="comma list: only these steps of the plan")
    p.add_argument(
        "--caches-from",
        default=".gpu_cache",
        help="folder of cache archives a previous run returned",
    )
    args = p.parse_args(argv)
    budget = args.budget_s or (3600.0 if args.dry_run else BUDGET_S)
    steps = PLANS[args.plan]
    if args.steps:
        wanted = args.steps.split(",")
        unknown = sorted(set(wanted) - {s.name for s in steps})
        if unknown:
            p.error(f"--steps: {unknown} not in plan {args.plan}: {[s.name for s in steps]}")
        steps = [s for s in steps if s.name in wanted]
    check = Check(Path(args.out), args.dry_run, budget)
    check.keep_caches = True
    from benchmarks import harness

    harness.RESULT_HOOKS.append(check.benchmark_rows)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            check.record(status="failed", error="no CUDA device (DRY_RUN=1 runs on the CPU)")
            return 1
    check.step = "caches"
    restore_caches(check, REPO / args.caches_from)
    failed = run_plan(check, steps)
    check.say(
        f"=== done: {failed} of {len(steps)} steps failed; {check.out}/gpu_summary.md, "
        f"{check.out}/results.jsonl, {check.out}/gpu_results.tar.gz"
    )
    check.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
