"""TrainState and checkpoints: trainable weights, optimizer, scheduler, RNGs, data position.

A checkpoint is a directory `checkpoints/step_NNNNNN/` written first as a temporary
directory `.tmp-step_NNNNNN-HOST-PID` (only its own process, or any process once that one is
gone, removes it), with a `manifest.json` of its file sizes, fsynced, then renamed into place;
`checkpoints/latest` names the newest one and is replaced atomically. Checkpoints are ordered
by the step number in their name; resume takes the newest that verifies (every file complete
and readable), skipping broken newer ones with a warning. Nothing is unpickled on load
(safetensors, JSON, `weights_only=True`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import socket
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from grpo.distributed import fsdp_units, reshard
from grpo.errors import GrpoError
from grpo.io import (
    FileError,
    load_safetensors,
    read_json,
    safetensors_file,
    save_safetensors,
    torch_load,
    torch_save,
    write_text,
)

log = logging.getLogger(__name__)

CHECKPOINT_FILES = (
    "trainable.safetensors",
    "optimizer.pt",
    "scheduler.pt",
    "state.json",
    "config.json",
)
# An FSDP run's checkpoint holds its tensors as shards instead of trainable.safetensors and
# optimizer.pt: shards/ (every rank's safetensors, written by torch.distributed.checkpoint's
# Hugging Face storage: offsets in each file's header, no pickle) and optimizer_groups.json.
SHARDS = "shards"
SHARDED_FILES = ("optimizer_groups.json", "scheduler.pt", "state.json", "config.json")
_STEP_DIR = re.compile(r"^step_(\d+)$")
# .tmp-step_NNNNNN-HOST-PID (older saves: .tmp-step_NNNNNN-PID); a host name may hold dashes
_TMP_DIR = re.compile(r"^\.tmp-step_\d+-(?:(?P<host>.+)-)?(?P<pid>\d+)$")


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


def checkpoint_tmp(
    run_dir: str | Path, step: int, host: str | None = None, pid: int | None = None
) -> Path:
    """The temporary directory a save of `step` writes before renaming it into place, named
    after its writer (rank 0's host and pid under torchrun) so a stale one can be told apart."""
    host, pid = host or this_host(), pid or os.getpid()
    return Path(run_dir) / "checkpoints" / f".tmp-step_{step:06d}-{host}-{pid}"


def prepare_tmp(tmp: Path) -> None:
    """Create `tmp` (a fresh, empty directory), removing temporary directories of earlier
    saves whose writer is gone."""
    root = tmp.parent
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # ours, or left by a process killed inside a save
        if _tmp_is_removable(stale.name):
            shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()


def save_checkpoint(
    run_dir: str | Path,
    state: TrainState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    config: dict,
    keep_last: int = 2,
    rng_states: list[dict] | None = None,
    sharded: tuple[Path, list[dict]] | None = None,
    extra=None,
) -> Path:
    """Write checkpoints/step_NNNNNN atomically, point `latest` at it, keep the newest K.

    Args:
        rng_states: every rank's `rng_state()` (rank order); default: this process's only.
        sharded: (tmp, param groups) of an FSDP run: every rank has written its shards into
            tmp/shards (`save_shards`), this call writes the rest there and renames it into
            place; default: a new tmp directory, the tensors read from model and optimizer.
        extra: called with the directory being written, to add files of its own (the trained
            modules' states, `grpo.modules.ModuleSet.save`); in the manifest like the rest.

    Returns:
        the checkpoint directory. A failing write raises GrpoError and leaves earlier
        checkpoints and the `latest` pointer untouched.
    """
    root = Path(run_dir) / "checkpoints"
    name = f"step_{state.step:06d}"
    final = root / name
    tmp = sharded[0] if sharded else checkpoint_tmp(run_dir, state.step)
    try:
        if sharded:
            write_text(tmp / "optimizer_groups.json", json.dumps(sharded[1]))
        else:
            prepare_tmp(tmp)
            save_safetensors(trainable_state_dict(model), tmp / "trainable.safetensors")
            torch_save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch_save(scheduler.state_dict(), tmp / "scheduler.pt")
        if extra is not None:
            extra(tmp)
        write_text(
            tmp / "state.json",
            json.dumps({"train_state": asdict(state), "rng": rng_states or [rng_state()]}),
        )
        write_text(tmp / "config.json", json.dumps(config, indent=1))
        sizes = {
            p.relative_to(tmp).as_posix(): p.stat().st_size
            for p in sorted(tmp.rglob("*"))
            if p.is_file()
        }
        write_text(tmp / "manifest.json", json.dumps({"sizes": sizes}))  # written last
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = root / f".latest-{os.getpid()}"
        write_text(pointer, name + "\n")
        with open(pointer, "rb") as f:
            os.fsync(f.fileno())
        os.replace(pointer, root / "latest")
    except (OSError, FileError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        why = getattr(e, "strerror", None) or e
        raise GrpoError(f"could not write checkpoint {final}: {why}") from None
    # Keep the newest K by step number (not by name: step_1000000 sorts before step_999999).
    # Steps above this one belong to a timeline a resume abandoned; the save of that step
    # replaces them.
    older = [p for step, p in list_checkpoints(run_dir) if step <= state.step]
    for old in older[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _sharded_state(model: torch.nn.Module, optimizer) -> tuple[dict, list[dict]]:
    """The trainable weights ("model.NAME") and optimizer states ("optim.NAME.KEY") as one flat
    dict of this rank's tensors (DTensor shards under FSDP, whole tensors otherwise), and the
    optimizer's param groups (parameters by name)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    reshard(model)  # state dicts address the shards (a forward leaves the root gathered)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    flat = {f"model.{n}": t for n, t in get_model_state_dict(model).items() if n in trainable}
    groups: list[dict] = []
    if optimizer is not None:
        osd = get_optimizer_state_dict(model, optimizer)
        for name, st in osd["state"].items():
            flat.update({f"optim.{name}.{k}": v for k, v in st.items()})
        groups = osd["param_groups"]
    return flat, groups


def save_shards(tmp: Path, model: torch.nn.Module, optimizer) -> list[dict]:
    """Every rank writes its shards of the trainable weights and optimizer states into
    tmp/shards (collective: all ranks call it, after rank 0 made `tmp`); returns the param
    groups, which `save_checkpoint(sharded=...)` writes on rank 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    flat, groups = _sharded_state(model, optimizer)
    writer = dcp.HuggingFaceStorageWriter(str(tmp / SHARDS), save_distributed=True)
    try:
        dcp.save(flat, storage_writer=writer, no_dist=not torch.distributed.is_initialized())
    except CheckpointException as e:  # a BaseException, holding each rank's traceback
        raise OSError(save_failure(e)) from None
    return groups


def save_failure(e: BaseException) -> str:
    """One line for a failed save: the first OS error among DCP's per-rank failures ("No space
    left on device (rank 0)"), else the first line of the first failure."""
    failures = getattr(e, "failures", None) or {}
    found = []
    for rank, failure in sorted(failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure  # (exception, traceback)
        while exc is not None:
            if isinstance(exc, OSError) and exc.strerror:
                return f"{exc.strerror} (rank {rank})"
            exc = exc.__cause__ or exc.__context__
        found.append((rank, failure[0] if isinstance(failure, tuple) else failure))
    if found:
        rank, exc = found[0]
        text = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {text[0]} (rank {rank})" if text else type(exc).__name__
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _load_shards(path: Path, model: torch.nn.Module, optimizer) -> None:
    """Read a sharded checkpoint into the model and optimizer, whatever their sharding now:
    each rank reads the slices of its own shards (or whole tensors when unsharded). Collective
    under torchrun."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    flat, _ = _sharded_state(model, optimizer)
    reader = dcp.HuggingFaceStorageReader(str(path / SHARDS))
    dcp.load(flat, storage_reader=reader, no_dist=not torch.distributed.is_initialized())
    weights = {k.removeprefix("model."): v for k, v in flat.items() if k.startswith("model.")}
    set_model_state_dict(model, weights, options=StateDictOptions(strict=False))
    if optimizer is not None:
        state: dict[str, dict] = {}
        for key, v in flat.items():
            if key.startswith("optim."):
                name, _, k = key.removeprefix("optim.").rpartition(".")
                state.setdefault(name, {})[k] = v
        groups = read_json(path / "optimizer_groups.json", "a checkpoint's optimizer groups")
        set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups})


def checkpoint_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A checkpoint's trainable weights as whole tensors (either format), read in this process
    without loading a model: for inspection and tests."""
    path = Path(path)
    if not (path / SHARDS).is_dir():
        return load_safetensors(path / "trainable.safetensors")
    import torch.distributed.checkpoint as dcp

    reader = dcp.HuggingFaceStorageReader(str(path / SHARDS))
    meta = reader.read_metadata().state_dict_metadata
    out = {
        k: torch.zeros(m.size, dtype=m.properties.dtype)
        for k, m in meta.items()
        if k.startswith("model.")
    }
    dcp.load(out, storage_reader=reader, no_dist=True)
    return {k.removeprefix("model."): v for k, v in out.items()}


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, directory) of every `checkpoints/step_N` in the run, by step number."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def verify_checkpoint(path: str | Path) -> str | None:
    """Why the checkpoint cannot be resumed from, or None when it is complete: every file
    present at the size its manifest recorded, the JSON parsed and of this step, the
    safetensors header covering its file, the torch files whole zip archives. Reads no tensor.
    """
    path = Path(path)
    sharded = (path / SHARDS).is_dir()
    missing = [
        n for n in (SHARDED_FILES if sharded else CHECKPOINT_FILES) if not (path / n).is_file()
    ]
    shards = sorted((path / SHARDS).glob("*.safetensors")) if sharded else []
    if sharded and not shards:
        missing.append(f"{SHARDS}/*.safetensors")
    if missing:
        return f"{', '.join(missing)} missing"
    try:
        if (path / "manifest.json").is_file():  # absent in checkpoints of older versions
            sizes = read_json(path / "manifest.json", "a checkpoint manifest").get("sizes", {})
            for name, size in sizes.items():
                f = path / name
                actual = f.stat().st_size if f.is_file() else None
                if actual != size:
                    return f"{name} has {actual} bytes, its manifest says {size} (truncated?)"
        meta = read_json(path / "state.json", "a checkpoint's state.json")
        step = meta["train_state"]["step"]
        if not isinstance(meta["rng"], list) or not meta["rng"]:
            return "state.json holds no RNG states"
        m = _STEP_DIR.match(path.name)
        if m and step != int(m.group(1)):
            return f"state.json is of step {step}"
        read_json(path / "config.json", "a checkpoint's config.json")
        for f in shards or [path / "trainable.safetensors"]:
            with safetensors_file(f) as st:
                st.keys()
        if sharded:
            read_json(path / "optimizer_groups.json", "a checkpoint's optimizer groups")
    except GrpoError as e:
        return str(e)
    except (KeyError, TypeError, AttributeError):
        return "state.json lacks train_state.step or rng"
    for name in ("scheduler.pt",) if sharded else ("optimizer.pt", "scheduler.pt"):
        try:
            zipfile.ZipFile(path / name).close()  # torch.save's format; truncation breaks it
        except (zipfile.BadZipFile, OSError) as e:
            return f"{name} is not a complete torch file ({e})"
    return None


def find_checkpoint(run_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint that verifies, and the newer ones skipped with their reasons.

    The `latest` pointer is not trusted over the directories: a run killed between renaming
    a checkpoint into place and updating `latest` still resumes from that checkpoint.
    """
    skipped = []
    for _, path in reversed(list_checkpoints(run_dir)):
        why = verify_checkpoint(path)
        if why is None:
            return path, skipped
        skipped.append((path, why))
    return None, skipped


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest valid checkpoint (None when the run has none); each newer, broken one is
    named in a warning."""
    path, skipped = find_checkpoint(run_dir)
    for bad, why in skipped:
        log.warning("checkpoint %s skipped: %s", bad, why)
    return path


# --------------------------------------------------------------------------- processes


def this_host() -> str:
    return socket.gethostname()


def _proc_stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (state first), or None where there is no /proc entry."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # the command name may hold spaces


def process_start(pid: int) -> int | None:
    """When the process started (clock ticks since boot; Linux), to tell it from a later
    process given the same pid; None where unknown."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None  # stat field 22


def process_alive(pid: int, host: str | None = None, start: int | None = None) -> bool:
    """Whether process `pid` of `host` (started at `start`, see `process_start`) still runs.
    A process of another host counts as alive: it cannot be checked from here."""
    if host is not None and host != this_host():
        return True
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    fields = _proc_stat(pid)
    if fields is None:
        return True
    if fields[0] == "Z":  # exited, not yet reaped
        return False
    return start is None or process_start(pid) == start


def _tmp_is_removable(name: str) -> bool:
    """A temporary checkpoint directory may go if this process wrote it, or its writer is
    gone; another live process's is left alone."""
    m = _TMP_DIR.match(name)
    if m is None:
        return False
    pid, host = int(m.group("pid")), m.group("host")
    if pid == os.getpid() and host in (None, this_host()):
        return True
    return not process_alive(pid, host)


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer=None, scheduler=None, rank: int = 0
) -> TrainState:
    """Restore trainable weights (and optimizer, scheduler, this rank's RNGs); return the
    TrainState.

    Either format loads into a model sharded or not, on any number of ranks: an FSDP run's
    shards are read slice by slice into whatever each rank holds now (collective under
    torchrun); a whole-tensor checkpoint is copied in (under FSDP each rank keeps its shard).
    """
    path = Path(path)
    try:
        meta = read_json(path / "state.json", "a checkpoint's state.json")
    except (OSError, json.JSONDecodeError) as e:
        raise GrpoError(f"checkpoint {path} is unreadable: {e}") from None
    sharded = bool(fsdp_units(model))
    reshard(model)
    params = dict(model.named_parameters())
    # Onto this rank's device: saved on rank 0's GPU, the states would otherwise all land on
    # cuda:0, every rank's copy filling that one device.
    device = next(iter(params.values())).device if params else torch.device("cpu")
    if (path / SHARDS).is_dir():
        try:
            _load_shards(path, model, optimizer)
        except (RuntimeError, ValueError, KeyError) as e:  # DCP's CheckpointException too
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GrpoError(f"checkpoint {path} does not fit this model: {first}") from None
    else:
        _load_whole(path, model, optimizer, params, device, sharded)
    if scheduler is not None:
        configured = list(scheduler.base_lrs)  # this start's optim.lr
        state = torch_load(path / "scheduler.pt", "a scheduler state", map_location=device)
        scheduler.load_state_dict(state)
        _keep_configured_lr(scheduler, configured, path)
    rngs = meta["rng"]
    if rank >= len(rngs):
        raise GrpoError(
            f"checkpoint {path} holds RNG states of {len(rngs)} ranks; cannot resume rank {rank}"
        )
    set_rng_state(rngs[rank])
    return TrainState(**meta["train_state"])


def _keep_configured_lr(scheduler, configured: list[float], path: Path) -> None:
    """A resumed run trains at its own config's optim.lr: the checkpoint's scheduler and
    optimizer states carry the lr it was saved with, which would silently override a changed
    one (the advice after a non-finite update is to lower it). Said in one line."""
    saved = list(scheduler.base_lrs)
    if saved == configured or not hasattr(scheduler, "lr_lambdas"):
        return
    log.warning(
        "resume: optim.lr %s (this config) replaces the checkpoint's %s (%s)",
        ", ".join(f"{x:g}" for x in configured),
        ", ".join(f"{x:g}" for x in saved),
        path.name,
    )
    scheduler.base_lrs = configured
    step = scheduler.last_epoch
    for group, base, fn in zip(scheduler.optimizer.param_groups, configured, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * fn(step)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def _load_whole(path: Path, model, optimizer, params: dict, device, sharded: bool) -> None:
    """trainable.safetensors and optimizer.pt (a checkpoint of an unsharded run) into the
    model and optimizer; under FSDP each rank keeps its shard of every tensor."""
    try:
        weights = load_safetensors(path / "trainable.safetensors")
    except OSError as e:
        raise GrpoError(f"checkpoint {path} is unreadable: {e}") from None
    for name in weights:
        if name not in params:
            raise GrpoError(f"checkpoint {path}: tensor {name!r} does not fit this model")
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, weights, options=full)
    else:
        with torch.no_grad():
            for name, t in weights.items():
                params[name].copy_(t)
    if optimizer is None:
        return
    state = torch_load(path / "optimizer.pt", "an optimizer state", map_location=device)
    if sharded:  # by position -> by name, which FSDP's loader reads
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        named = _named_optimizer_state(state, model, optimizer)
        set_optimizer_state_dict(model, optimizer, named, options=full)
    else:
        optimizer.load_state_dict(state)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _named_optimizer_state(state: dict, model: torch.nn.Module, optimizer) -> dict:
    """A positional `Optimizer.state_dict` keyed by parameter name instead, the positions read
    from `optimizer` (built over the same parameters in the same groups as the saving run)."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    return {
        "state": {order[i]: v for i, v in state["state"].items()},
        "param_groups": [
            {**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]
        ],
    }
