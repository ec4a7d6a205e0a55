"""TrainState and checkpoints: trainable weights, optimizer, scheduler, RNGs, data position.

A checkpoint is a directory `checkpoints/step_NNNNNN/` written first as a temporary
directory, fsynced, then renamed into place; `checkpoints/latest` names the newest one and is
replaced atomically. Nothing is unpickled on load (safetensors, JSON, `weights_only=True`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from grpo.errors import GrpoError


@dataclass
class TrainState:
    """Where a run is: optimizer steps taken and the data position."""

    step: int = 0  # training steps completed (GRPO: rollout batches; SFT: optimizer steps)
    epoch: int = 0  # passes over the training data started
    data_index: int = 0  # next position in this epoch's shuffled order


def rng_state() -> dict:
    """Every RNG a run draws from: python, numpy, torch CPU (and CUDA when present)."""
    py = random.getstate()
    npy = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npy[0], npy[1].tolist(), int(npy[2]), int(npy[3]), float(npy[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad
    }


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    run_dir: str | Path,
    state: TrainState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    config: dict,
    keep_last: int = 2,
    rng_states: list[dict] | None = None,
) -> Path:
    """Write checkpoints/step_NNNNNN atomically, point `latest` at it, keep the newest K.

    Args:
        rng_states: every rank's `rng_state()` (rank order); default: this process's only.

    Returns:
        the checkpoint directory. A failing write raises GrpoError and leaves earlier
        checkpoints and the `latest` pointer untouched.
    """
    root = Path(run_dir) / "checkpoints"
    name = f"step_{state.step:06d}"
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):  # left by a run killed inside a save
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        save_file(trainable_state_dict(model), str(tmp / "trainable.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "state.json").write_text(
            json.dumps({"train_state": asdict(state), "rng": rng_states or [rng_state()]})
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = root / f".latest-{os.getpid()}"
        pointer.write_text(name + "\n")
        with open(pointer, "rb") as f:
            os.fsync(f.fileno())
        os.replace(pointer, root / "latest")
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise GrpoError(f"could not write checkpoint {final}: {e.strerror or e}") from None
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in steps[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint `latest` names, or None when the run has none."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if (path / "state.json").is_file() else None


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer=None, scheduler=None, rank: int = 0
) -> TrainState:
    """Restore trainable weights (and optimizer, scheduler, this rank's RNGs); return the
    TrainState."""
    path = Path(path)
    try:
        weights = load_file(str(path / "trainable.safetensors"))
        meta = json.loads((path / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise GrpoError(f"checkpoint {path} is unreadable: {e}") from None
    params = dict(model.named_parameters())
    for name, t in weights.items():
        if name not in params:
            raise GrpoError(f"checkpoint {path}: tensor {name!r} does not fit this model")
        with torch.no_grad():
            params[name].copy_(t)
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rngs = meta["rng"]
    if rank >= len(rngs):
        raise GrpoError(
            f"checkpoint {path} holds RNG states of {len(rngs)} ranks; cannot resume rank {rank}"
        )
    set_rng_state(rngs[rank])
    return TrainState(**meta["train_state"])
