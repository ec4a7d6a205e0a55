"""The file boundary (grpo/io.py): a broken file the library reads is one line naming the file
and what was expected; BOM-prefixed text just works; a full disk (a real tmpfs, or
RLIMIT_FSIZE where mounting is not permitted) is one line naming the file, and a checkpoint save
it interrupts leaves the previous checkpoint intact."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo.apps import cli
from grpo.data.gsm8k import load_gsm8k
from grpo.errors import GrpoError
from grpo.io import FileError, read_json, read_text, torch_load
from grpo.lora import apply_lora, load_adapter, save_adapter
from grpo.models import load_model
from grpo.run.state import TrainState, load_checkpoint, save_checkpoint

REPO = Path(__file__).resolve().parents[1]
TINY_CI = str(REPO / "configs" / "tiny_ci.yaml")


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


def cli_error(argv: list[str], capsys) -> str:
    code = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def model_copy(shared_tiny_model, tmp_path) -> Path:
    return Path(shutil.copytree(shared_tiny_model, tmp_path / "model"))


# ----------------------------------------------------------------- weights and config.json


def test_corrupt_and_truncated_weights_name_the_file(model_copy, tmp_path, capsys):
    weights = model_copy / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])  # a copy cut short
    with pytest.raises(FileError) as e:
        load_model(model_copy)
    assert one_line(e).startswith(f"{weights}: is corrupt or truncated (")
    assert one_line(e).endswith("; expected a safetensors file")
    weights.write_bytes(b"\xff" * 8 + b"{not a header")  # garbage
    with pytest.raises(FileError, match="is corrupt or truncated.*expected a safetensors file"):
        load_model(model_copy)
    weights.unlink()
    with pytest.raises(GrpoError, match="no safetensors weights in"):
        load_model(model_copy)
    weights.write_bytes(good[:-100])  # through the CLI: one line, exit 2, before any output
    argv = [
        "train",
        "--config",
        TINY_CI,
        f"model.path={model_copy}",
        f"train.output_dir={tmp_path}/run",
        "train.progress=false",
    ]
    err = cli_error(argv, capsys)
    assert str(weights) in err and "expected a safetensors file" in err
    assert not (tmp_path / "run").exists()


def test_malformed_config_json_and_shape_mismatch(model_copy):
    config = model_copy / "config.json"
    good = json.loads(config.read_text())
    config.write_text('{"hidden_size": 64,\n "vocab_size": }')
    with pytest.raises(FileError) as e:
        load_model(model_copy)
    assert one_line(e) == (
        f"{config}: invalid JSON at line 2, column 16 (Expecting value); "
        "expected a Hugging Face config.json"
    )
    config.write_text("[1, 2]")
    with pytest.raises(GrpoError, match=r"config.json: holds a list; expected an object"):
        load_model(model_copy)
    config.write_text(json.dumps({k: v for k, v in good.items() if k != "hidden_size"}))
    with pytest.raises(GrpoError) as e:
        load_model(model_copy)
    assert one_line(e) == (
        f"{config}: field 'hidden_size' must be a positive integer, got None "
        "(a Hugging Face config.json)"
    )
    # a config.json that does not describe the weights beside it
    config.write_text(json.dumps({**good, "intermediate_size": good["intermediate_size"] + 8}))
    with pytest.raises(GrpoError) as e:
        load_model(model_copy)
    n, c = good["intermediate_size"], good["hidden_size"]
    assert one_line(e) == (
        f"{model_copy / 'model.safetensors'}: model.layers.0.mlp.down_proj.weight has shape "
        f"({c}, {n}), expected ({c}, {n + 8}) (from {config})"
    )
    config.write_bytes(b"\xef\xbb\xbf" + json.dumps(good).encode())  # a BOM: just works
    assert load_model(model_copy).config.hidden_size == c


def test_adapter_files(model_copy, tmp_path):
    model = load_model(model_copy)
    apply_lora(model, rank=2, alpha=4, targets=["q_proj"])
    adapter = save_adapter(model, tmp_path / "adapter")
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(FileError) as e:
        load_adapter(load_model(model_copy), adapter)
    assert one_line(e).startswith(f"{weights}: is corrupt or truncated")
    head = b'{"r": 2, "note": "caf'
    (adapter / "adapter_config.json").write_bytes(head + b'\xe9"}')
    with pytest.raises(FileError) as e:
        load_adapter(load_model(model_copy), adapter)
    assert one_line(e) == (
        f"{adapter / 'adapter_config.json'}: not UTF-8 text (byte 0xe9 on line 1, offset "
        f"{len(head)}); expected a PEFT adapter_config.json"
    )


def test_torch_load_is_weights_only_and_names_the_file(tmp_path):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpt = save_checkpoint(tmp_path, TrainState(step=1), model, opt, sched, {})
    good = (ckpt / "optimizer.pt").read_bytes()
    (ckpt / "optimizer.pt").write_bytes(good[: len(good) // 2])
    with pytest.raises(FileError) as e:
        load_checkpoint(ckpt, model, opt, sched)
    assert one_line(e).startswith(f"{ckpt / 'optimizer.pt'}: is corrupt or truncated (")
    assert one_line(e).endswith("expected an optimizer state")
    unsafe = tmp_path / "unsafe.pt"
    torch.save({"when": datetime.date(2024, 1, 1)}, unsafe)  # needs unpickling code
    with pytest.raises(FileError) as e:
        torch_load(unsafe, "a scheduler state")
    assert one_line(e) == (
        f"{unsafe}: holds objects other than tensors and plain containers (refused: "
        "weights_only); expected a scheduler state"
    )
    with pytest.raises(FileError, match="state.json: invalid JSON at line 1"):
        (ckpt / "state.json").write_text("{")
        load_checkpoint(ckpt, model)


def test_resume_loads_optimizer_state_onto_the_parameters_device(tmp_path, monkeypatch):
    """Under torchrun each rank must map the optimizer state (saved on rank 0's GPU) onto its own
    device. A `meta` model stands in for a rank whose parameters live elsewhere than where the
    state was saved (cpu): torch.load must put the tensors it returns there, weights_only."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()  # exp_avg, exp_avg_sq, step: tensors in the saved state
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpt = save_checkpoint(tmp_path, TrainState(step=1), model, opt, sched, {})
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        out = real_load(*args, **kwargs)
        calls.append((Path(args[0]).name, kwargs, out))
        return out

    monkeypatch.setattr(torch, "load", spy)
    other = torch.nn.Linear(4, 4, device="meta")
    other_opt = torch.optim.AdamW(other.parameters())
    other_sched = torch.optim.lr_scheduler.LambdaLR(other_opt, lambda s: 1.0)
    assert load_checkpoint(ckpt, other, other_opt, other_sched).step == 1
    assert [name for name, _, _ in calls] == ["optimizer.pt", "scheduler.pt"]
    for _, kwargs, _ in calls:
        assert kwargs["weights_only"] is True
        assert kwargs.get("map_location") == torch.device("meta"), kwargs
    state = calls[0][2]["state"]
    devices = {t.device.type for s in state.values() for t in s.values()}
    assert devices == {"meta"}, devices


# ----------------------------------------------------------------- text: data, metrics, ...

ROWS = [{"question": "Ünïcode 2+2?", "answer": "#### 4"}, {"question": "3*3?", "answer": "#### 9"}]
BOM = b"\xef\xbb\xbf"


def test_bom_prefixed_data_just_works(tmp_path):
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ROWS).encode()
    (tmp_path / "plain.jsonl").write_bytes(lines)
    (tmp_path / "bom.jsonl").write_bytes(BOM + lines)
    (tmp_path / "bom.json").write_bytes(BOM + json.dumps(ROWS).encode())
    csv_text = "question,answer\n" + "".join(f'"{r["question"]}","{r["answer"]}"\n' for r in ROWS)
    (tmp_path / "bom.csv").write_bytes(BOM + csv_text.encode())
    (tmp_path / "plain.csv").write_bytes(csv_text.encode())
    for name in ("plain.jsonl", "bom.jsonl", "bom.json", "bom.csv", "plain.csv"):
        rows = load_gsm8k("train", source=str(tmp_path / name)).to_list()
        assert [{k: r[k] for k in ("question", "answer")} for r in rows] == ROWS, name
    (tmp_path / "dir").mkdir()  # a directory's split file, csv among the candidates
    shutil.copy(tmp_path / "bom.csv", tmp_path / "dir" / "test.csv")
    rows = load_gsm8k("test[:1]", source=str(tmp_path / "dir")).to_list()
    assert [r["question"] for r in rows] == [ROWS[0]["question"]]


def test_non_utf8_data_is_one_line_naming_file_and_line(tmp_path, shared_tiny_model, capsys):
    data = tmp_path / "latin1.jsonl"
    first = json.dumps(ROWS[1]).encode() + b"\n"
    data.write_bytes(first + '{"question": "café?", "answer": "#### 1"}\n'.encode("latin-1"))
    offset = len(first) + len(b'{"question": "caf')
    expected = (
        f"{data}: not UTF-8 text (byte 0xe9 on line 2, offset {offset}); "
        "expected UTF-8 JSON lines with question and answer"
    )
    with pytest.raises(FileError) as e:
        load_gsm8k("train", source=str(data))
    assert one_line(e) == expected
    err = cli_error(
        [
            "train",
            "--config",
            TINY_CI,
            f"model.path={shared_tiny_model}",
            f"data.dataset={data}",
            f"train.output_dir={tmp_path}/run",
            "train.progress=false",
        ],
        capsys,
    )
    assert err == f"grpo train: error: {expected}"
    csv_file = tmp_path / "latin1.csv"
    csv_file.write_bytes("question,answer\ncafé?,#### 1\n".encode("latin-1"))
    with pytest.raises(FileError, match=r"latin1.csv: not UTF-8 text \(byte 0xe9 on line 2"):
        load_gsm8k("train", source=str(csv_file))
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("question,answer\n1+1?,#### 2,extra\n")
    with pytest.raises(GrpoError, match="ragged.csv: line 2 has more fields than the header"):
        load_gsm8k("train", source=str(ragged))


def test_metrics_config_tokenizer_and_sweep_files(tmp_path, model_copy):
    from grpo.apps.sweep import run_sweep
    from grpo.config import load_config
    from grpo.metrics import read_metrics
    from grpo.tokenizer import load_tokenizer

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(BOM + b'{"step": 1, "train/loss": 0.5}\n{"step": 2, "train/lo')
    assert read_metrics(metrics) == [{"step": 1, "train/loss": 0.5}]  # BOM and a torn tail
    metrics.write_bytes(b'{"step": 1}\n{"step": 2, "x": "\xff"}\n')
    with pytest.raises(FileError, match=r"metrics.jsonl: not UTF-8 text \(byte 0xff on line 2"):
        read_metrics(metrics)
    config = tmp_path / "c.yaml"
    config.write_bytes(b"model:\n  path: m\noptim:\n  lr: 1.0e-3  # \xb5s\n")
    with pytest.raises(FileError, match=r"c.yaml: not UTF-8 text .*; expected a YAML config"):
        load_config(config)
    config.write_bytes(BOM + b"model:\n  path: m\noptim:\n  lr: 1.0e-3\n")
    assert load_config(config).optim.lr == 1e-3
    tok_config = model_copy / "tokenizer_config.json"
    tok_config.write_text(tok_config.read_text()[:-20])
    with pytest.raises(FileError) as e:
        load_tokenizer(model_copy)
    assert one_line(e).startswith(f"{tok_config}: invalid JSON at line ")
    assert one_line(e).endswith("expected a tokenizer file (tokenizer_config.json)")
    record = tmp_path / "sweep" / "trial_000" / "trial.json"
    record.parent.mkdir(parents=True)
    record.write_text('{"trial": 0, "params": ')  # cut short
    with pytest.raises(FileError) as e:
        run_sweep(
            TINY_CI,
            {"optim.lr": [1e-3]},
            out_dir=tmp_path / "sweep",
            overrides=["model.path=m"],
            resume=True,
        )
    assert one_line(e) == (
        f"{record}: invalid JSON at line 1, column 24 (Expecting value); "
        "expected a sweep trial record (trial.json)"
    )
    with pytest.raises(FileError, match=r"x.json: no such file; expected a thing"):
        read_json(record.with_name("x.json"), "a thing")
    with pytest.raises(FileError, match=r"trial_000: is a directory; expected UTF-8 text"):
        read_text(record.parent)


def test_eval_out_directory_fails_before_the_evaluation(
    shared_tiny_model, tmp_path, monkeypatch, capsys
):
    import grpo.eval
    import grpo.models

    def never(*a, **k):
        raise AssertionError("work started before --out was checked")

    monkeypatch.setattr(grpo.eval, "evaluate", never)
    monkeypatch.setattr(grpo.models, "load_model", never)
    monkeypatch.setattr("grpo.tokenizer.load_tokenizer", never)
    base = ["eval", "--model", str(shared_tiny_model), "--max-samples", "1"]
    err = cli_error([*base, "--out", str(tmp_path)], capsys)
    assert err == f"grpo eval: error: --out {tmp_path}: is a directory; expected a file path"
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "r.json"
    err = cli_error([*base, "--out", str(out)], capsys)
    assert err == f"grpo eval: error: --out {out}: {out.parent} is a file, not a directory"


# ----------------------------------------------------------------- a full disk, for real

FULL_DISK_SCRIPT = r"""
import errno, json, os, resource, signal, sys
from pathlib import Path
import torch
from grpo import io as gio
from grpo.errors import GrpoError
from grpo.lora import merge_command
from grpo.metrics import MetricLogger
from grpo.models import load_model, save_pretrained
from grpo.run.state import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint

mode, disk, model_dir, adapter_dir = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
FSIZE = resource.getrlimit(resource.RLIMIT_FSIZE)
filler = disk / "filler"

def fill():
    if mode == "tmpfs":  # write until the filesystem has no page left
        with open(filler, "wb", buffering=0) as f:
            while True:
                try:
                    f.write(b"\0" * 4096)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    return
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, FSIZE[1]))

def unfill():
    if mode == "tmpfs":
        filler.unlink()
    else:
        resource.setrlimit(resource.RLIMIT_FSIZE, FSIZE)

out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except GrpoError as e:
        out[name] = str(e)

torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
opt = torch.optim.AdamW(model.parameters())
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
run = disk / "run"
save_checkpoint(run, TrainState(step=1), model, opt, sched, {"step": 1})
step1 = model.weight.detach().clone()
gio.write_json(disk / "note.json", {"version": 1})
logger = MetricLogger(disk / "logs")
(disk / "merged").mkdir()
(disk / "merged" / "old.txt").write_text("an earlier merge")
big = load_model(model_dir)

fill()
with torch.no_grad():
    model.weight.add_(1.0)
attempt("checkpoint", lambda: save_checkpoint(run, TrainState(step=2), model, opt, sched, {}))
out["entries"] = sorted(os.listdir(run / "checkpoints"))
out["latest"] = latest_checkpoint(run).name
fresh = torch.nn.Linear(4, 4)
out["step1_loaded"] = load_checkpoint(latest_checkpoint(run), fresh).step
out["step1_equal"] = bool(torch.equal(fresh.weight, step1))
attempt("torch_save", lambda: gio.torch_save(opt.state_dict(), disk / "opt.pt"))
attempt("safetensors", lambda: gio.save_safetensors({"w": torch.zeros(64)}, disk / "w.safetensors"))
attempt("write_json", lambda: gio.write_json(disk / "note.json", {"version": 2, "pad": "x" * 99}))
out["note"] = (disk / "note.json").read_text()
attempt("metrics", lambda: logger.log(1, {f"train/m{i}": float(i) for i in range(8)}, stdout=False))
attempt("save_pretrained", lambda: save_pretrained(big, disk / "export"))
attempt("merge", lambda: merge_command(model_dir, adapter_dir, disk / "merged", overwrite=True))
out["merged"] = sorted(os.listdir(disk / "merged"))
out["leftovers"] = sorted(p for p in os.listdir(disk) if p.startswith("."))
unfill()
attempt("recovered", lambda: save_checkpoint(run, TrainState(step=3), model, opt, sched, {}))
out["latest_after"] = latest_checkpoint(run).name
print(json.dumps(out))
"""


def mount_tmpfs(path: Path) -> bool:
    """Mount a 1 MiB tmpfs at `path`; False where that is not permitted (or no `mount`)."""
    path.mkdir()
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


@pytest.mark.parametrize("mode", ["tmpfs", "rlimit"])
def test_full_disk_is_one_line_and_keeps_the_previous_checkpoint(mode, model_copy, tmp_path):
    """tmpfs: a real 1 MiB filesystem, filled; where mounting is not permitted (no root or no
    CAP_SYS_ADMIN) the same script runs under RLIMIT_FSIZE, whose EFBIG comes from the same
    write paths (Python, safetensors' Rust writer, torch's zip writer), so it never skips."""
    model = load_model(model_copy)
    apply_lora(model, rank=2, alpha=4, targets=["q_proj"])
    adapter = save_adapter(model, tmp_path / "adapter")
    disk = tmp_path / "disk"
    mounted = mode == "tmpfs" and mount_tmpfs(disk)
    if not mounted:
        mode = "rlimit"
        disk.mkdir(exist_ok=True)
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                FULL_DISK_SCRIPT,
                mode,
                str(disk),
                str(model_copy),
                str(adapter),
            ],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
        )
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    why = "no space left on device (ENOSPC)" if mode == "tmpfs" else "(EFBIG)"
    # every failed write: one line naming the file and the cause
    assert out["checkpoint"].startswith(f"could not write checkpoint {disk}/run/checkpoints/")
    assert "trainable.safetensors" in out["checkpoint"] and why in out["checkpoint"]
    assert out["torch_save"].startswith(f"could not write {disk / 'opt.pt'}: ")
    assert out["safetensors"].startswith(f"could not write {disk / 'w.safetensors'}: ")
    assert out["write_json"].startswith(f"could not write {disk / 'note.json'}: ")
    assert out["metrics"].startswith(f"could not write {disk / 'logs' / 'metrics.jsonl'}: ")
    assert out["save_pretrained"].startswith(f"could not write {disk / 'export'}/")
    assert out["merge"].startswith(f"could not write {disk}/.merged.merge-tmp-")
    for name in (
        "checkpoint",
        "torch_save",
        "safetensors",
        "write_json",
        "metrics",
        "save_pretrained",
        "merge",
    ):
        assert why in out[name] and "\n" not in out[name], (name, out[name])
    # nothing saved before was lost, nothing half-written was left
    assert out["entries"] == ["latest", "step_000001"] and out["latest"] == "step_000001"
    assert out["step1_loaded"] == 1 and out["step1_equal"]
    assert json.loads(out["note"]) == {"version": 1}
    assert out["merged"] == ["old.txt"] and out["leftovers"] == []
    # with space again, saving works
    assert out["recovered"] == "ok" and out["latest_after"] == "step_000003"
