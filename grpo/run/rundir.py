"""The run directory contract (docs/safety.md): one run at a time per directory (a lock file
naming pid, host and start time; a stale one is taken over with a warning); a fresh run only in
an unused directory unless `overwrite`; resume only from the newest valid checkpoint and only
with a compatible config; nothing written to the directory before every input is checked. Also
the run's signals: SIGTERM / SIGINT stop training at the next step boundary, after a checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import shlex
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from grpo.config import Config, config_to_dict, save_config
from grpo.distributed import Dist, JobError, gather_objects
from grpo.errors import GrpoError
from grpo.io import read_json
from grpo.metrics import read_metrics
from grpo.plugins import loaded_plugins
from grpo.run.cluster import check_job
from grpo.run.state import (
    find_checkpoint,
    list_checkpoints,
    process_alive,
    process_start,
    this_host,
)

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
# What a run writes into its directory: `overwrite` removes these and nothing else (a user's
# own files beside them stay).
RUN_OUTPUTS = (
    "checkpoints",
    "final",
    ".final.tmp",
    "metrics.jsonl",
    "metrics.jsonl.tmp",
    "config.yaml",
    "config.resume.yaml",
    "tensorboard",
    "wandb",
    "curves.png",
)
# Keys of `resume_conflicts` that name files or directories: compared as paths.
_PATH_KEYS = {"model.path", "model.tokenizer", "model.adapter", "lora.adapter", "data.source"}


class TrainingInterrupted(GrpoError):
    """SIGTERM / SIGINT stopped training at a step boundary after saving a checkpoint.

    The CLI prints the message (how to resume) once, on rank 0, and exits 128 + the signal
    number (143 for SIGTERM, 130 for SIGINT)."""

    cli_prefix = ""  # the CLI line reads "grpo train: interrupted by ...", not "error: ..."

    def __init__(self, message: str, signum: int, rank: int = 0):
        super().__init__(message)
        self.exit_code = 128 + signum
        self.rank = rank


class NothingToDo(GrpoError):
    """`--resume` of a run that already reached its last step and wrote final/: nothing is
    loaded or written; the CLI prints the message as one line (rank 0) and exits 0."""

    cli_prefix = ""
    exit_code = 0

    def __init__(self, message: str, rank: int = 0):
        super().__init__(message)
        self.rank = rank


def check_resume_step(run_dir: Path, ckpt: Path, steps: int, limit: str, rank: int = 0) -> None:
    """A resumed run's checkpoint against the run's length `steps` (`limit` names the setting,
    e.g. "train.max_steps=4"): below it the run continues; at it without final/ (killed between
    the last checkpoint and the final save) it writes final/; at it with final/ there is
    nothing to do (`NothingToDo`); past it is an error (the run cannot go back)."""
    step = int(ckpt.name.removeprefix("step_"))
    if step > steps:
        error = GrpoError(
            f"--resume: the run is at step {step} ({ckpt}), past {limit}; a resumed run cannot "
            f"go back: raise the limit above {step} to continue it, or start afresh with "
            "--overwrite or another train.output_dir"
        )
        error.rank = rank  # every rank raises it; the CLI prints rank 0's
        raise error
    final = run_dir / "final"
    if step == steps and final.exists():
        raise NothingToDo(
            f"nothing to do: the run already reached {limit} (weights in {final}); raise it to "
            "train further",
            rank,
        )


# --------------------------------------------------------------------------- the lock


def read_lock(path: Path) -> dict | None:
    """The lock's record (pid, host, started, proc_start, token); {} when unreadable, None
    when there is no lock."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        info = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return info if isinstance(info, dict) else {}


LOCK_HEARTBEAT_S = 30.0  # the holder renews its lock's mtime this often (`RunLock`)
LOCK_STALE_S = 300.0  # a lock of another host not renewed for this long: its run is gone


def lock_is_live(info: dict, path: Path) -> bool:
    """Whether the process holding the lock may still run. A process of this host is asked
    directly; one of another host (a multi-node job on a shared filesystem) cannot be, so its
    lock is live while its holder renews it (mtime within LOCK_STALE_S); an unreadable lock
    counts as live for a minute (it may be being written), then as stale."""
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return False
    if not isinstance(info.get("pid"), int):
        return age < 60
    host = info.get("host")
    if host is not None and host != this_host():
        return age < LOCK_STALE_S
    return process_alive(info["pid"], host, info.get("proc_start"))


def _holder(info: dict) -> str:
    if not isinstance(info.get("pid"), int):
        return "an unreadable lock"
    return f"pid {info['pid']} on {info.get('host')}, started {info.get('started')}"


def _renew(path: Path, token: str, stop: threading.Event, every_s: float) -> None:
    """Touch our lock every `every_s` seconds until `stop` (or until it is no longer ours)."""
    while not stop.wait(every_s):
        held = read_lock(path)
        if not held or held.get("token") != token:
            return
        with contextlib.suppress(OSError):
            os.utime(path)


def _in_use(run_dir: Path, info: dict) -> GrpoError:
    return GrpoError(
        f"{run_dir} is in use by another run ({_holder(info)}); wait for it to end, or delete "
        f"{run_dir / LOCK_FILE} if that process is gone"
    )


@contextlib.contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """Serialize lock checks on this host (flock on the directory; a no-op where unsupported),
    so that two processes cannot both find a lock stale and both take it."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def _create_exclusive(path: Path, text: str) -> None:
    """Create `path` holding `text`; FileExistsError if it exists. A hard link of a complete
    temporary file, so a reader sees the whole record or no file."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_text(text)
    try:
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:  # a filesystem without hard links: O_EXCL (briefly empty to readers)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(text)
    finally:
        tmp.unlink(missing_ok=True)


@dataclass
class RunLock:
    """This process's hold on a run directory (rank 0's, under torchrun)."""

    path: Path
    token: str  # tells our lock from one a later run took over after we were presumed dead
    stop: threading.Event = field(default_factory=threading.Event, repr=False)

    @classmethod
    def acquire(cls, run_dir: Path, heartbeat_s: float = LOCK_HEARTBEAT_S) -> RunLock:
        """Take `run_dir`'s lock; refuse (GrpoError) while a live process holds it, take over
        (with a warning) one whose process is gone. A thread renews the lock's mtime every
        `heartbeat_s` seconds until `release`, so that other hosts see it live."""
        path = run_dir / LOCK_FILE
        token = uuid.uuid4().hex
        record = {
            "pid": os.getpid(),
            "host": this_host(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "proc_start": process_start(os.getpid()),
            "token": token,
        }
        with _exclusive(run_dir):
            held = read_lock(path)
            if held is not None:
                if lock_is_live(held, path):
                    raise _in_use(run_dir, held)
                log.warning(
                    "%s: taking over the stale lock of %s (that process is gone)",
                    run_dir,
                    _holder(held),
                )
                path.unlink(missing_ok=True)
            try:
                _create_exclusive(path, json.dumps(record))
            except FileExistsError:  # another host took it between our check and our link
                raise _in_use(run_dir, read_lock(path) or {}) from None
        lock = cls(path, token)
        threading.Thread(
            target=_renew,
            args=(path, token, lock.stop, heartbeat_s),
            name="grpo-run-lock",
            daemon=True,
        ).start()
        return lock

    def release(self) -> None:
        """Stop renewing; remove the lock if it is still ours."""
        self.stop.set()
        held = read_lock(self.path)
        if held and held.get("token") == self.token:
            self.path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- directory state


def earlier_run(run_dir: Path) -> str | None:
    """What in `run_dir` belongs to an earlier run, in words, or None when a fresh run may
    start there (a missing or empty directory, or one with only a config of a failed start)."""
    parts = []
    if (run_dir / "final").exists():
        parts.append("a finished run (final/)")
    steps = list_checkpoints(run_dir)
    if steps:
        parts.append(f"checkpoints up to step {steps[-1][0]}")
    if not parts and (run_dir / "metrics.jsonl").exists():
        parts.append("the metrics.jsonl of an earlier run")
    return " and ".join(parts) or None


def auto_start(cfg: Config, overwrite: bool = False) -> tuple[bool, bool, str]:
    """`--resume auto`: how this start goes on in cfg.train.output_dir, read-only, as
    (resume, overwrite, what it chose in words). A directory holding checkpoints resumes from
    the newest valid one (refused as a `--resume` is, e.g. on a config that changes what it
    trained); a missing or empty one starts; one the same job left before its first
    checkpoint (its config.yaml is this resolved config) starts again over it; anything else
    is refused as a fresh start is."""
    if overwrite:
        raise GrpoError("--resume auto and --overwrite exclude each other")
    run_dir = Path(cfg.train.output_dir)
    steps = list_checkpoints(run_dir)
    if steps:
        return True, False, f"resuming (checkpoints up to step {steps[-1][0]} in {run_dir})"
    used = earlier_run(run_dir)
    if used is None:
        return False, False, f"starting ({run_dir} holds no earlier run)"
    if not (run_dir / "final").exists() and _same_config(run_dir / "config.yaml", cfg):
        return False, True, f"starting again over this config's earlier start in {run_dir}"
    return False, False, f"starting ({run_dir} holds {used})"  # refused by check_run_dir


def _same_config(path: Path, cfg: Config) -> bool:
    """Whether the config file a start wrote at `path` is `cfg`, resolved alike."""
    import yaml

    try:
        saved = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return json.dumps(saved, sort_keys=True) == json.dumps(config_to_dict(cfg), sort_keys=True)


def clear_run_outputs(run_dir: Path) -> list[str]:
    """Remove what a run writes (RUN_OUTPUTS) from `run_dir`; returns the names removed."""
    removed = []
    for name in RUN_OUTPUTS:
        p = run_dir / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
        else:
            continue
        removed.append(name)
    return removed


_MISSING = object()


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return _MISSING
        d = d[part]
    return d


def _same(key: str, old, new) -> bool:
    if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):
        return list(old) == list(new)
    if key in _PATH_KEYS and isinstance(old, str) and isinstance(new, str) and old != new:
        a, b = Path(old), Path(new)  # one directory spelled two ways is the same model
        return a.exists() and b.exists() and a.resolve() == b.resolve()
    return old == new


def resume_conflicts(saved: dict, new: dict, kind: str) -> list[str]:
    """The incompatible changes between a checkpoint's config and a resumed run's, each as
    "key (old -> new)": the model (path, tokenizer, merged adapter), the LoRA shape (enabled,
    rank, alpha, targets, starting adapter), the group size and trained modules (GRPO: a PPO
    run whose critic was removed or re-initialised is not the run it resumes), the reward
    model's pad id (`grpo rm`) and the dataset (name, split, size, and the source / generator
    settings that pick its rows).

    Args:
        saved: the checkpoint's config.json; keys it lacks (an older format) are not compared.
        new: `config_to_dict` of the resumed run's config.
        kind: "train" (GRPO), "sft" or "rm".
    """
    keys = ["model.path", "model.tokenizer", "model.adapter", "lora.enabled"]
    if _get(saved, "lora.enabled") is not False and _get(new, "lora.enabled"):
        keys += ["lora.rank", "lora.alpha", "lora.targets", "lora.adapter"]
    if kind == "train":  # the modules trained beside the policy: their states are saved too
        keys += ["rollout.group_size", "modules"]
    if kind == "rm":  # the padding the scored position is found by
        keys.append("rm.pad_token_id")
    keys += ["data.dataset", "data.split", "data.max_samples"]
    dataset = _get(new, "data.dataset")
    if dataset == "minimath":
        keys += ["data.difficulty", "data.seed"]
    elif dataset == "gsm8k":
        keys.append("data.source")
    out = []
    for key in keys:
        old, now = _get(saved, key), _get(new, key)
        if old is not _MISSING and not _same(key, old, now):
            out.append(f"{key} ({old!r} -> {now!r})")
    return out


# What a resumed GRPO run may change of its algorithm: honoured from the next step on (the
# weights and optimizer state carry over), but no longer the run it was, so said.
ALGORITHM_KEYS = (
    "loss.advantage",
    "loss.advantage_kwargs",
    "loss.policy_loss",
    "loss.policy_loss_kwargs",
    "loss.kl_estimator",
)


def algorithm_changes(saved: dict, new: dict, kind: str) -> list[str]:
    """The algorithm's changes between a checkpoint's config and a resumed GRPO run's, each as
    "key (old -> new)": the advantage estimator, the policy loss and the KL estimator, with
    their kwargs (`ALGORITHM_KEYS`). Empty for SFT and `grpo rm`, and for keys the saved
    config lacks (an older format)."""
    if kind != "train":
        return []
    out = []
    for key in ALGORITHM_KEYS:
        old, now = _get(saved, key), _get(new, key)
        if old is not _MISSING and not _same(key, old, now):
            out.append(f"{key} ({old!r} -> {now!r})")
    return out


def plugin_changes(saved: dict, now: dict) -> list[str]:
    """How the plugins of a run's earlier start (`saved`, its ``run/plugins`` record: spec ->
    {"version": ...}) differ from this start's (`now`, the same form), each as "'spec' 1.0
    added", "'spec' removed" or "'spec' 1.0 -> 1.1"; empty when the same."""

    def versions(plugins: dict) -> dict[str, str | None]:
        return {k: v.get("version") if isinstance(v, dict) else None for k, v in plugins.items()}

    old, new = versions(saved), versions(now)
    out = []
    for spec in [*old, *(k for k in new if k not in old)]:
        if spec not in new:
            out.append(" ".join(filter(None, (repr(spec), old[spec], "removed"))))
        elif spec not in old:
            out.append(" ".join(filter(None, (repr(spec), new[spec], "added"))))
        elif old[spec] != new[spec]:
            out.append(f"{spec!r} {old[spec] or 'no version'} -> {new[spec] or 'no version'}")
    return out


def warn_plugin_changes(run_dir: Path, ckpt: Path) -> None:
    """Warn (one line) when the plugins loaded now differ from those of the start that saved
    `ckpt`: the last ``run/plugins`` record at or before its step in metrics.jsonl (a start
    writes it with its first record; `grpo.run.loop.start_run`). Runs without that record, or
    whose metrics cannot be read, are not compared."""
    path = run_dir / "metrics.jsonl"
    step = int(ckpt.name.removeprefix("step_"))
    try:
        rows = read_metrics(path) if path.is_file() else []
    except GrpoError:
        return
    earlier = [r for r in rows if r.get("step", 0) <= step and "run/plugins" in r]
    if not earlier:
        return
    try:
        saved = json.loads(earlier[-1]["run/plugins"])
    except (TypeError, json.JSONDecodeError):
        return
    now = {spec: {"version": p.version} for spec, p in loaded_plugins().items()}
    changes = plugin_changes(saved if isinstance(saved, dict) else {}, now)
    if changes:
        log.warning(
            "--resume: the plugins differ from those of the start that saved %s "
            "(metrics.jsonl, step %s): %s; the names they register may run other code "
            "now",
            ckpt.name,
            earlier[-1].get("step"),
            "; ".join(changes),
        )


def check_run_dir(
    cfg: Config, kind: str, resume: bool, overwrite: bool, world_size: int = 1
) -> Path | None:
    """The read-only checks of a start in cfg.train.output_dir (nothing is written).

    Returns:
        the checkpoint to resume from (None for a fresh run). Raises GrpoError (one line) when
        the directory is locked by a live run; when a fresh run (neither resume nor overwrite)
        would mix with an earlier run's checkpoints, final weights or metrics; when resume finds
        no valid checkpoint, a config that changes what the checkpoint trained, or a checkpoint
        saved by fewer ranks than `world_size` (the ranks that train now).
    """
    run_dir = Path(cfg.train.output_dir)
    if resume and overwrite:
        raise GrpoError(
            "--resume and --overwrite exclude each other: continue the run, or replace it"
        )
    held = read_lock(run_dir / LOCK_FILE)
    if held is not None and lock_is_live(held, run_dir / LOCK_FILE):
        raise _in_use(run_dir, held)
    if not resume:
        used = earlier_run(run_dir)
        if used and not overwrite:
            how = "continue it with --resume, replace" if list_checkpoints(run_dir) else "replace"
            raise GrpoError(
                f"train.output_dir {run_dir} holds {used}; {how} it with "
                "--overwrite, or choose another train.output_dir"
            )
        return None
    ckpt, skipped = find_checkpoint(run_dir)
    for path, why in skipped:
        log.warning("checkpoint %s skipped: %s", path, why)
    if ckpt is None:
        if skipped:
            path, why = skipped[0]
            raise GrpoError(
                f"--resume: no valid checkpoint in {run_dir / 'checkpoints'} "
                f"(newest {path.name}: {why})"
            )
        raise GrpoError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}")
    if skipped:
        log.warning(
            "resuming from %s instead of the newer, broken %s",
            ckpt.name,
            ", ".join(p.name for p, _ in skipped),
        )
    saved = read_json(ckpt / "config.json", "the run config a checkpoint was saved with")
    conflicts = resume_conflicts(
        saved if isinstance(saved, dict) else {}, config_to_dict(cfg), kind
    )
    if conflicts:
        raise GrpoError(
            f"--resume: the config changes {', '.join(conflicts)} from checkpoint {ckpt}; a "
            "resumed run keeps its model, LoRA shape, group size, trained modules and data "
            "(start afresh with --overwrite or another train.output_dir)"
        )
    saved_ranks = len(read_json(ckpt / "state.json", "a checkpoint's state.json").get("rng", []))
    if world_size > saved_ranks >= 1:  # one RNG state per rank that saved it
        ranks = f"{saved_ranks} rank" + ("s" if saved_ranks > 1 else "")
        raise GrpoError(
            f"--resume: checkpoint {ckpt} was saved by a job of {ranks}, this job has "
            f"{world_size}: it resumes on at most {ranks} (it holds one RNG state per rank); "
            f"relaunch with --nproc_per_node={saved_ranks}"
            + (" or without torchrun" if saved_ranks == 1 else "")
            + ", or start afresh in another train.output_dir"
        )
    _check_global_batch(ckpt, saved, saved_ranks, cfg.train.batch_size, world_size)
    warn_plugin_changes(run_dir, ckpt)
    return ckpt


def resume_changes(cfg: Config, ckpt: Path, kind: str) -> tuple[str, ...]:
    """`algorithm_changes` of resuming `ckpt` with `cfg`, warned in one line (the run's
    ``run/start`` record lists them too: `RunDir.start`)."""
    saved = read_json(ckpt / "config.json", "the run config a checkpoint was saved with")
    changes = algorithm_changes(saved if isinstance(saved, dict) else {}, config_to_dict(cfg), kind)
    if changes:
        log.warning(
            "--resume: the config changes the algorithm from checkpoint %s: %s; the run goes "
            "on with the new one from its next step (recorded in run/start)",
            ckpt,
            ", ".join(changes),
        )
    return tuple(changes)


def _check_global_batch(
    ckpt: Path, saved: dict, saved_ranks: int, batch_size: int, world_size: int
) -> None:
    """On another number of ranks, train.batch_size (per rank) must keep the checkpoint's
    global batch: a run saved by 2 ranks and resumed on 1 would otherwise halve it silently."""
    train = saved.get("train") if isinstance(saved, dict) else None
    before = train.get("batch_size") if isinstance(train, dict) else None
    if not isinstance(before, int) or saved_ranks < 1 or saved_ranks == world_size:
        return
    kept, now = before * saved_ranks, batch_size * world_size
    if kept == now:
        return
    ranks = f"{world_size} rank" + ("s" if world_size > 1 else "")
    fix = (
        f"set train.batch_size={kept // world_size} to keep it, or "
        if kept % world_size == 0
        else ""
    )
    raise GrpoError(
        f"--resume: checkpoint {ckpt} was saved by {saved_ranks} ranks at train.batch_size="
        f"{before} per rank (a global batch of {kept}); on {ranks} train.batch_size={batch_size}"
        f" makes a global batch of {now}: {fix}relaunch with --nproc_per_node={saved_ranks}"
    )


# --------------------------------------------------------------------------- signals


class StopSignal:
    """SIGTERM / SIGINT during training: remembered, acted on at the next step boundary (a
    checkpoint, then TrainingInterrupted). A second signal stops at once (KeyboardInterrupt).
    Handlers can only be set from the main thread; elsewhere signals keep their handlers."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, failures=None):
        self.signum = 0
        self._previous: dict = {}
        self.failures = failures  # under torchrun: a signal after another rank failed stops now

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.failures is not None and self.failures.on_signal(signum, frame):
            return  # the job is failing: this rank reports and leaves (grpo/run/failures.py)
        if self.signum:
            self.restore()
            raise KeyboardInterrupt
        self.signum = signum
        notice = (
            f"\n{signal.Signals(signum).name}: stopping after this step (a checkpoint is "
            "saved); send it again to stop at once\n"
        )
        if self.failures is not None:  # torchrun also signals every rank once one has failed
            self.failures.notice_later(notice)
        else:  # os.write, not logging: a signal handler may run while logging holds its lock
            os.write(2, notice.encode())

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


# --------------------------------------------------------------------------- one start


@dataclass
class RunDir:
    """One start of a run in `path`: what it resumes from and, once claimed, its lock and
    signal handlers (released by `close`)."""

    path: Path
    kind: str  # "train" (GRPO) | "sft" | "rm": the `grpo` command that resumes it
    resume: bool
    overwrite: bool
    checkpoint: Path | None  # what a resumed run restores (verified by rank 0)
    stop: StopSignal = field(default_factory=StopSignal)
    lock: RunLock | None = None
    auto: str | None = None  # with --resume auto: what it chose, in words (run/start)
    changes: tuple[str, ...] = ()  # a resume's algorithm changes (`resume_changes`), rank 0

    @property
    def start(self) -> str:
        """How this start began, for the run header (``run/start``)."""
        how = (
            f"resumed from {self.checkpoint.name}"
            if self.checkpoint is not None
            else ("fresh, over an earlier run" if self.overwrite else "fresh")
        )
        if self.changes:
            how += f", changing {', '.join(self.changes)}"
        return f"{how} (--resume auto: {self.auto})" if self.auto else how

    @property
    def config_file(self) -> Path:
        return self.path / ("config.resume.yaml" if self.resume else "config.yaml")

    def claim(self, cfg: Config, dist: Dist) -> None:
        """With every input checked: take the lock, check the directory again under it (a run
        may have started or ended meanwhile), clear an earlier run (overwrite), write the
        config, and catch SIGTERM / SIGINT. Rank 0 writes; every rank learns its verdict."""
        error = None
        if dist.is_main:
            try:
                self._claim(cfg)
            except GrpoError as e:
                error = e
        verdict = gather_objects(None if error is None else str(error), dist)[0]
        if verdict is not None and dist.enabled:  # one line, rank 0's; every rank exits 2
            raise JobError(verdict, dist.rank)
        if error is not None:
            raise error
        self.stop.install()

    def _claim(self, cfg: Config) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self.lock = RunLock.acquire(self.path)
        except OSError as e:
            raise GrpoError(f"train.output_dir {self.path}: {e.strerror or e}") from None
        try:
            if not self.resume:
                used = earlier_run(self.path)
                if used and not self.overwrite:
                    raise GrpoError(
                        f"train.output_dir {self.path} holds {used} (written since this start "
                        "was checked); continue it with --resume or replace it with --overwrite"
                    )
                removed = clear_run_outputs(self.path) if self.overwrite else []
                if removed:
                    log.warning(
                        "--overwrite: removed the earlier run's %s from %s",
                        ", ".join(removed),
                        self.path,
                    )
            save_config(cfg, self.config_file)
        except OSError as e:
            self.close()
            raise GrpoError(
                f"train.output_dir {self.path}: {e.strerror or e} ({e.filename})"
            ) from None
        except BaseException:
            self.close()
            raise

    def resume_command(self, dist: Dist) -> str:
        """The command that continues this run (its resolved config, --resume)."""
        flag = "--resume auto" if self.auto else "--resume"
        cmd = f"grpo {self.kind} --config {shlex.quote(str(self.config_file))} {flag}"
        world = int(os.environ.get("WORLD_SIZE", dist.world_size))  # the job, producers too
        if world <= 1:
            return cmd
        if os.environ.get("LOCAL_WORLD_SIZE") == str(world):  # one node
            return f"torchrun --standalone --nproc_per_node={world} -m {cmd}"
        return f"torchrun <the same options> -m {cmd}"

    def close(self) -> None:
        """Give the signals their handlers back and release the lock."""
        self.stop.restore()
        if self.lock is not None:
            self.lock.release()
            self.lock = None


@contextlib.contextmanager
def run_directory(
    cfg: Config, kind: str, resume: bool | str, overwrite: bool, dist: Dist, failures=None
) -> Iterator[RunDir]:
    """Check a start in cfg.train.output_dir (read-only, before any model is loaded); the
    block trains; on leaving it, however it ends, the lock and signal handlers are released.

    Args:
        kind: "train" (GRPO), "sft" or "rm".
        resume: continue from the newest valid checkpoint (refused on incompatible config);
            "auto": continue if the directory holds a checkpoint, else start (`auto_start`).
        overwrite: start afresh in a used directory; its earlier run's outputs are removed
            only when the run is claimed, after every input has been checked.
        dist: rank 0 checks; every rank gets its verdict and the checkpoint.
        failures: the job's `grpo.run.failures.Failures` (torchrun): a signal after another
            rank failed stops this one at once; leaving by an error marks this rank failing.
    """
    try:  # a job over several nodes: the same code and config, one shared output directory
        check_job(cfg, dist)
    except GrpoError as e:  # decided alike on every rank: rank 0 prints it
        raise JobError(str(e), dist.rank) from None
    error, ckpt, auto, changes = None, None, None, ()
    if dist.is_main:
        try:
            if resume == "auto":
                resume, overwrite, auto = auto_start(cfg, overwrite)
                log.info("--resume auto: %s", auto)
            ckpt = check_run_dir(cfg, kind, bool(resume), overwrite, dist.world_size)
            changes = resume_changes(cfg, ckpt, kind) if ckpt is not None else ()
        except GrpoError as e:
            error = e
    verdict = (None if error is None else str(error), ckpt, bool(resume), overwrite, auto)
    message, ckpt, resume, overwrite, auto = gather_objects(verdict, dist)[0]
    if message is not None and dist.enabled:  # one line, rank 0's; every rank exits 2
        raise JobError(message, dist.rank)
    if error is not None:
        raise error
    if ckpt is not None and (kind == "train" or cfg.train.epochs is None):  # SFT epochs: later
        limit = f"train.max_steps={cfg.train.max_steps}"
        check_resume_step(Path(cfg.train.output_dir), ckpt, cfg.train.max_steps, limit, dist.rank)
    stop = StopSignal(failures)
    path = Path(cfg.train.output_dir)
    rundir = RunDir(path, kind, resume, overwrite, ckpt, stop, auto=auto, changes=changes)
    try:
        yield rundir
    except BaseException:
        if failures is not None:  # on its way out: from here on signals are ignored
            failures.failing = True
        raise
    finally:
        rundir.close()
