"""A full disk during a sharded (FSDP) checkpoint save: one line per rank, nothing partial left
in checkpoints/, the previous checkpoint intact and resumable. ENOSPC is injected (the real disk
is never filled): a plugin module wraps torch.distributed.checkpoint's file streams so that a
shard file of step 2 fails past its first kilobyte, as a full disk does mid-write."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]

FULL_DISK = '''
import contextlib, errno, os
import torch.distributed.checkpoint.filesystem as fs

_create_stream = fs.FileSystem.create_stream


class _Full:
    """A stream whose device fills up after 1000 bytes."""

    def __init__(self, stream):
        self.stream, self.written = stream, 0

    def write(self, data):
        self.written += len(data)
        if self.written > 1000:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.stream.write(data)

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def _stream(self, path, mode):
    with _create_stream(self, path, mode) as stream:
        hit = "step_000002" in str(path) and str(path).endswith(".safetensors")
        yield _Full(stream) if hit else stream


if os.environ.get("GRPO_TEST_FULL_DISK"):
    fs.FileSystem.create_stream = _stream
'''


@pytest.mark.process
def test_full_disk_during_a_sharded_save(shared_tiny_model, tmp_path):
    (tmp_path / "full_disk.py").write_text(FULL_DISK)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)}
    args = [
        "-m",
        "grpo",
        "train",
        "--config",
        str(REPO / "configs" / "tiny_ci.yaml"),
        f"model.path={shared_tiny_model}",
        "train.output_dir=out",
        "train.max_steps=3",
        "train.save_every=1",
        "train.progress=false",
        "data.eval_samples=0",
        "train.parallel=fsdp",
        "plugins=[full_disk]",
    ]
    r = subprocess.run(
        [*TORCHRUN, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "GRPO_TEST_FULL_DISK": "1"},
    )
    assert r.returncode != 0
    # each rank's line (two processes share the pipe: a line may arrive without its newline
    # before the other's, so the lines are found in the whole text)
    line = r"(?:^|(?<=written stay))grpo train: error: rank \d.*?already written stay"
    ours = re.findall(line, r.stderr, flags=re.M)  # not torchrun's summary, which quotes them
    assert sorted(ours) == [
        f"grpo train: error: rank {rank} (checkpoint, step 2): could not write checkpoint "
        "out/checkpoints/step_000002: No space left on device (rank 0); the checkpoints "
        "already written stay"
        for rank in (0, 1)
    ], r.stderr[-3000:]
    assert not re.search(r'File "[^"]*[/\\]grpo[/\\]', r.stderr), r.stderr[-3000:]  # no traceback
    assert "CheckpointException" not in r.stderr
    ckpts = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000001"]  # no .tmp-*
    assert (ckpts / "latest").read_text().strip() == "step_000001"
    # with room again, the run resumes from step 1 and finishes
    r = subprocess.run(
        [*TORCHRUN, *args, "--resume"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "out" / "final").is_dir()
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_"))[-1] == (
        "step_000003"
    )
