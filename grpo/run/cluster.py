"""What goes wrong only when a job spans several nodes, refused at the start of a torchrun job
before the run directory is read or written (`grpo.run.rundir.run_directory` calls
`check_job`):

- ranks that run different code or another config: every rank's resolved config and a hash of
  the source files of the installed packages (`source_hash`: grpo and grpo_kernels; their
  version string never changes between commits) are compared with rank 0's, and the first
  field that differs is named;
- a train.output_dir that is not one directory for every rank (not on a shared filesystem, or
  a relative path read in different working directories): rank 0 writes a probe file beside
  it (in its parent, never inside the run directory) that every rank must read back, so that
  each node does not write checkpoints a later resume would not find.

A single process (no torchrun) checks nothing here.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import uuid
from pathlib import Path

from grpo.config import Config, config_to_dict
from grpo.distributed import Dist, gather_objects
from grpo.errors import GrpoError
from grpo.run.state import this_host


@functools.cache
def source_hash() -> str:
    """`hash_sources` of the installed grpo and grpo_kernels packages: two ranks agree on it
    when they run the same code (once per process)."""
    import grpo
    import grpo_kernels

    return hash_sources(
        {p.__name__: Path(p.__file__).resolve().parent for p in (grpo, grpo_kernels)}
    )


def hash_sources(roots: dict[str, Path]) -> str:
    """sha256 (16 hex digits) over each root's .py files: name/relative path and bytes, in
    path order."""
    h = hashlib.sha256()
    for name, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            h.update(f"{name}/{path.relative_to(root).as_posix()}\0".encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def first_difference(a, b, prefix: str = "") -> str | None:
    """The first dotted field (in a's order, then b's extra keys) where two plain config dicts
    differ; None when they are equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            where = f"{prefix}.{key}" if prefix else str(key)
            if key not in a or key not in b:
                return where
            found = first_difference(a[key], b[key], where)
            if found is not None:
                return found
        return None
    return None if json.dumps(a) == json.dumps(b) else (prefix or "(the config)")


def check_job(cfg: Config, dist: Dist) -> None:
    """Refuse, on every rank alike, a job whose ranks run different code or config, or do not
    share train.output_dir (module docstring). Collective; nothing when `dist` is one
    process."""
    if not dist.enabled:
        return
    # a digest of each rank's config first; the configs themselves only when one differs
    config = config_to_dict(cfg)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    views = gather_objects((this_host(), source_hash(), digest), dist)
    host0, code0, digest0 = views[0]
    for rank, (host, code, _) in enumerate(views):
        if code != code0:
            raise GrpoError(
                f"rank {rank} ({host}) runs other code than rank 0 ({host0}): the installed "
                f"grpo sources differ (hash {code} vs {code0}); install the same commit on "
                "every node"
            )
    if any(d != digest0 for _, _, d in views):  # every rank sees it: all gather the configs
        configs = gather_objects(config, dist)
        for rank, ((host, _, _), other) in enumerate(zip(views, configs)):
            field = first_difference(configs[0], other)
            if field is not None:
                raise GrpoError(
                    f"rank {rank} ({host}) has another config than rank 0 ({host0}): {field} "
                    "differs; start every node with the same config and overrides"
                )
    check_shared_output_dir(Path(cfg.train.output_dir), dist)


def check_shared_output_dir(run_dir: Path, dist: Dist) -> None:
    """Rank 0 writes a probe file in the parent of `run_dir` (made if missing), every rank
    reads it back at its own `run_dir`, rank 0 removes it; a rank that does not find it
    refuses the job, naming train.output_dir, the rank and its host."""
    probe = run_dir.parent / f".{run_dir.name}.grpo-probe-{uuid.uuid4().hex}"
    token, error = None, None
    if dist.is_main:
        token = uuid.uuid4().hex
        try:
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            probe.write_text(token)
        except OSError as e:
            error = f"train.output_dir {run_dir}: cannot write in {run_dir.parent}: {e.strerror}"
    error, token, name = gather_objects((error, token, probe.name), dist)[0]
    if error is not None:
        raise GrpoError(error)
    try:
        seen = (run_dir.parent / name).read_text() == token
    except OSError:
        seen = False
    where = gather_objects((seen, this_host(), str(run_dir.resolve())), dist)
    if dist.is_main:
        try:
            os.unlink(probe)
        except OSError:
            pass
    blind = [(rank, host, path) for rank, (ok, host, path) in enumerate(where) if not ok]
    if blind:
        rank, host, path = blind[0]
        raise GrpoError(
            f"train.output_dir {run_dir} is not one directory for every rank: rank {rank} "
            f"({host}, {path}) does not see what rank 0 ({where[0][1]}, {where[0][2]}) wrote "
            "there; put it on a filesystem every node mounts at the same path, as an absolute "
            "path (docs/distributed.md, On a cluster)"
        )
