"""Import a user's code: a function from a ``package.module:function`` path (rewards,
algorithm, environments), and plugins: modules that register names when imported.

A plugin is named by ``package.module`` (importing it registers its names) or
``package.module:function`` (imported, then the function is called with no arguments). Plugins
come from three places, all imported before a config is checked, in every process that runs a
command (each torchrun worker runs the same command line):

- the `grpo.plugins` entry-point group of installed packages (every command, once per process);
- ``--plugin package.module`` on the command line (repeatable; every subcommand);
- ``plugins: [package.module]`` in a config (`grpo.config.load_config`; kept in the resolved
  config a run saves, so a resumed run, a pipeline stage or ``grpo eval RUN`` imports them too).

What runs is what is recorded: every plugin loaded in this process (with the version of the
package that provides it) and every registry entry replaced with ``overwrite=True`` (the old
and new ``module:qualname`` and the plugin, or else the module, that replaced it: each
replacement logs one line) go into a run's metadata (`plugin_header`). Under torchrun the ranks
agree, before the process group is joined, that each loaded its plugins: a rank stuck in one is
named with the plugin within GRPO_PLUGIN_TIMEOUT_S, instead of the group's raw timeout.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import functools
import importlib
import importlib.metadata
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from grpo.errors import GrpoError

log = logging.getLogger(__name__)


def import_callable(path: str, label: str) -> Callable[..., Any]:
    """The callable at ``package.module:function``.

    Args:
        path: ``package.module:function``.
        label: what the error messages start with, e.g. ``"reward 'pkg.mod:fn'"``.

    Raises:
        GrpoError: a malformed path, a module that fails to import, a missing attribute, or one
            that is not callable; one line starting with `label`.
    """
    module_name, _, attr = path.rpartition(":")
    if not module_name or not attr:
        raise GrpoError(f"{label}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise GrpoError(
            f"{label}: cannot import module {module_name!r}: {type(e).__name__}: {e}"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise GrpoError(f"{label}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise GrpoError(f"{label}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


PLUGIN_GROUP = "grpo.plugins"  # the entry-point group installed packages declare plugins in
TIMEOUT_ENV = "GRPO_PLUGIN_TIMEOUT_S"  # how long a torchrun rank waits for the others' plugins
DEFAULT_TIMEOUT_S = 600.0  # train.dist_timeout_s's default


@dataclass(frozen=True)
class Plugin:
    """One loaded plugin: its spec, where it was named and the package that provides it."""

    spec: str  # package.module or package.module:function
    source: str  # "entry point 'name'", "plugins[0]", "--plugin[1]"
    dist: str | None = None  # the installed distribution providing it, where one does
    version: str | None = None  # that distribution's version (else the module's __version__)

    @property
    def by(self) -> str:
        """Who it is in a message: ``entry point 'x' of mypkg 1.2.0``, ``plugin 'mod'
        (plugins[0])``."""
        made = f"{self.dist} {self.version}" if self.dist else self.version
        if self.source.startswith("entry point"):
            return f"{self.source} of {made or 'an unknown package'}"
        return f"plugin {self.spec!r} ({self.source}{', ' + made if made else ''})"


@dataclass(frozen=True)
class Replacement:
    """A registry name given another object with ``overwrite=True``."""

    kind: str  # "reward", "advantage estimator", ...
    name: str
    old: str  # module:qualname of what the name meant
    new: str  # module:qualname of what it means now
    by: str  # the plugin that did it (`Plugin.by`), or "module 'pkg.mod'"


# This process's record, like the registries it describes: what was loaded, what was replaced
# (read by `plugin_header`), and the plugin being loaded right now (who a replacement names).
_LOADED: dict[str, Plugin] = {}
_REPLACED: list[Replacement] = []
_ACTIVE: contextvars.ContextVar[Plugin | None] = contextvars.ContextVar("grpo_plugin", default=None)


def load_plugins(specs: Sequence[str] = (), label: str = "plugins") -> None:
    """Import the installed entry-point plugins (once per process), then each of `specs`.

    Under torchrun, before the process group is joined, every rank then waits (at most
    GRPO_PLUGIN_TIMEOUT_S seconds, default 600) until every other rank has loaded its plugins
    too: a rank that hangs in one is named with it in one line, not left to the process
    group's start to time out with a raw `DistStoreError`.

    Args:
        specs: ``package.module`` or ``package.module:function`` names (a function is called
            with no arguments after its module is imported). Each spec is loaded once per
            process: a second request for it is a no-op.
        label: what an error names a spec by, with its index: ``plugins[0]: ...``.

    Raises:
        GrpoError: one line naming the plugin (and its place in `specs`, or its entry point)
            that failed to import or whose function raised; under torchrun, one line naming the
            rank that did not finish loading its plugins in time and the plugin it was in.
    """
    job = _Job.joining()
    # a round per start-up call that loads something (every rank makes the same calls); a
    # repeated request for loaded plugins (a run's saved config read again) waits for nobody
    agree = job is not None and (job.rounds == 0 or any(s not in _LOADED for s in specs))
    load_entry_point_plugins()
    for i, spec in enumerate(specs):
        _load(spec, f"{label}[{i}]")
    if agree:
        job.agree()


@functools.cache
def load_entry_point_plugins() -> tuple[str, ...]:
    """Load every plugin installed packages declare in the `grpo.plugins` entry-point group
    (``[project.entry-points."grpo.plugins"]`` ``name = "package.module"`` or
    ``"package.module:function"``); once per process. Returns the specs loaded."""
    loaded = []
    for ep in sorted(importlib.metadata.entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        spec = f"{ep.module}:{ep.attr}" if ep.attr else ep.module
        dist = getattr(ep, "dist", None)
        name, version = (dist.name, dist.version) if dist is not None else (None, None)
        source = f"entry point {ep.name!r}"
        _load(spec, f"{source} of group {PLUGIN_GROUP!r}", Plugin(spec, source, name, version))
        loaded.append(spec)
    return tuple(loaded)


def loaded_plugins() -> dict[str, Plugin]:
    """The plugins this process loaded, by spec, in load order."""
    return dict(_LOADED)


def replacements() -> list[Replacement]:
    """The registry entries replaced in this process, in order."""
    return list(_REPLACED)


def plugin_header() -> dict[str, str]:
    """What a run records about its plugins in metrics.jsonl (`grpo.run.loop.start_run`):
    ``run/plugins``, JSON ``{spec: {"source", "dist", "version"}}`` of every plugin loaded, and
    ``run/replaced``, a JSON list of ``{"kind", "name", "old", "new", "by"}``, one per
    replacement."""
    plugins = {
        spec: {k: v for k, v in asdict(p).items() if k != "spec"} for spec, p in _LOADED.items()
    }
    return {
        "run/plugins": json.dumps(plugins),
        "run/replaced": json.dumps([asdict(r) for r in _REPLACED]),
    }


def note_replacement(kind: str, name: str, old: object, new: object) -> None:
    """Called by a registry when `name` (of `kind`, e.g. "reward") is registered again with
    ``overwrite=True`` as another object: log one line naming both ``module:qualname`` and who
    replaced it (the plugin being loaded, else the module that called the registry), and record
    it for the run's metadata. Only rank 0 logs it at WARNING (the others at DEBUG)."""
    registry = sys._getframe(1).f_globals.get("__name__")
    replaced = Replacement(
        kind, name, qualified_name(old), qualified_name(new), _responsible(registry)
    )
    _REPLACED.append(replaced)
    level = logging.WARNING if os.environ.get("RANK", "0") == "0" else logging.DEBUG
    log.log(
        level,
        "replaced %s %r: %s -> %s (by %s)",
        kind,
        name,
        replaced.old,
        replaced.new,
        replaced.by,
    )


@contextlib.contextmanager
def no_exit(what: str):
    """Around a call into plug-in code (a rollout strategy, an estimator, a loss, a module's
    `loss`, a log-prob kernel): its `sys.exit` (SystemExit) becomes a GrpoError naming `what`,
    as a reward's does, so the run stops with one line and exit 2, never with exit 0, no
    message and no final weights."""
    try:
        yield
    except SystemExit as e:
        raise GrpoError(
            f"{what} called sys.exit({e.code!r}); plug-in code returns or raises, it does not "
            "end the run"
        ) from None


@contextlib.contextmanager
def named_errors(what: str, builtin: bool = False):
    """Around a call into plug-in code: an exception it raises becomes one GrpoError naming
    `what` (``module 'mine' loss raised ValueError: ...``, the original chained), as a
    registry's plug-ins' do (`grpo.algo.registry.Registry.call`); a built-in's (`builtin`)
    propagates with its traceback (a bug of ours)."""
    try:
        yield
    except GrpoError:
        raise
    except Exception as e:
        if builtin:
            raise
        raise GrpoError(f"{what} raised {type(e).__name__}: {e}") from e


@contextlib.contextmanager
def time_limit(what: str, seconds: float | None, key: str = "train.plugin_timeout_s"):
    """Around a call into plug-in code in the main thread: past `seconds` it is interrupted
    (SIGALRM) with a GrpoError naming `what`, the setting `key` and the rank, instead of a
    hang that prints nothing. Elsewhere (another thread, `seconds` None) it runs unbounded:
    an asynchronous producer thread's wait is the trainer's rollout.async_timeout_s, and
    under torchrun the other ranks' collectives time out at train.dist_timeout_s too."""
    main = threading.current_thread() is threading.main_thread()
    if seconds is None or not main or not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum, frame):
        rank = os.environ.get("RANK", "0")
        raise GrpoError(f"{what} did not return within {key}={seconds:g} s (rank {rank})")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def qualified_name(obj: object) -> str:
    """``module:qualname`` of a function or class (of the function a `functools.partial`
    wraps); ``module:Class instance`` for another object, ``a list`` for a built-in type's (a
    dataset's rows)."""
    fn = obj.func if isinstance(obj, functools.partial) else obj
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        return f"{module}:{qualname}"
    kind = type(fn)
    if kind.__module__ == "builtins":
        return f"a {kind.__name__}"
    return f"{kind.__module__}:{kind.__qualname__} instance"


def _responsible(registry: str | None) -> str:
    """The plugin being loaded, else the module that called the registry (the first frame
    outside `registry`'s module and this one)."""
    active = _ACTIVE.get()
    if active is not None:
        return active.by
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") in (registry, __name__):
        frame = frame.f_back
    module = frame.f_globals.get("__name__", "?") if frame is not None else "?"
    return f"module {module!r}"


def _load(spec: str, label: str, plugin: Plugin | None = None) -> None:
    if not isinstance(spec, str) or not spec.strip(":. "):
        raise GrpoError(
            f"{label}: expected 'package.module' or 'package.module:function', got {spec!r}"
        )
    plugin = plugin or _LOADED.get(spec) or Plugin(spec, label, *_distribution_of(spec))
    _Job.status(label, spec)
    token = _ACTIVE.set(plugin)
    try:
        _activate(spec)
    except _PluginFailure as e:
        raise GrpoError(f"{label}: {e}") from None
    finally:
        _ACTIVE.reset(token)
        _Job.status()
    if spec not in _LOADED:
        if plugin.version is None:  # no package provides it: the module may say
            version = getattr(sys.modules.get(spec.partition(":")[0]), "__version__", None)
            plugin = Plugin(
                plugin.spec,
                plugin.source,
                plugin.dist,
                version if isinstance(version, str) else None,
            )
        _LOADED[spec] = plugin


def _distribution_of(spec: str) -> tuple[str | None, str | None]:
    """(name, version) of the installed distribution providing the top-level package of a
    plugin's module; (None, None) for a module on PYTHONPATH."""
    names = _packages_distributions().get(spec.partition(":")[0].partition(".")[0], [])
    if not names:
        return None, None
    try:
        return names[0], importlib.metadata.version(names[0])
    except importlib.metadata.PackageNotFoundError:
        return names[0], None


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


class _PluginFailure(Exception):
    """A plugin failed; the message says how, without where it was named."""


@functools.cache  # a plugin's function registers names: calling it twice would clash
def _activate(spec: str) -> None:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise _PluginFailure(f"cannot import {module_name!r}: {type(e).__name__}: {e}") from None
    if not attr:
        return
    hook = getattr(module, attr, None)
    if hook is None:
        raise _PluginFailure(f"{spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(hook):
        raise _PluginFailure(f"{spec!r}: {attr!r} is a {type(hook).__name__}, not a function")
    try:
        hook()
    except Exception as e:
        raise _PluginFailure(f"{spec!r} failed: {type(e).__name__}: {e}") from None


# --------------------------------------------------------------------------- torchrun ranks


@dataclass
class _Job:
    """This rank's part in the agreement that every rank loaded its plugins, over torchrun's
    agent store (keys ``grpo/plugins/<restart>/...``): each rank says which plugin it is in
    (``at/<rank>``) and, at the end of a `load_plugins` that loaded something, that it is done
    (``done/<n>/<rank>``); all wait for all. Only before the process group is joined: every
    rank runs the same start-up (the command line, its config), while later loads (a
    rank-local `load_config`) may happen on one rank alone."""

    store: Any
    rank: int
    world: int
    timeout_s: float
    prefix: str
    rounds: int = 0

    @staticmethod
    def joining() -> _Job | None:
        """This process's job when it runs under torchrun and has not joined its group yet."""
        job = _job()
        if job is None:
            return None
        import torch.distributed as td

        return None if td.is_initialized() else job

    @staticmethod
    def status(label: str = "", spec: str = "") -> None:
        """Tell the other ranks which plugin this one is loading ("" between plugins)."""
        job = _Job.joining()
        if job is not None:
            job.store.set(f"{job.prefix}/at/{job.rank}", json.dumps([label, spec]))

    def agree(self) -> None:
        """Say this rank is done; wait for every other rank's done, else raise GrpoError
        naming each rank still loading and the plugin it is in."""
        done = f"{self.prefix}/done/{self.rounds}"
        self.rounds += 1
        self.store.set(f"{done}/{self.rank}", "1")
        keys = {r: f"{done}/{r}" for r in range(self.world) if r != self.rank}
        end = time.monotonic() + self.timeout_s
        while keys:
            keys = {r: k for r, k in keys.items() if not self.store.check([k])}
            if not keys:
                return
            if time.monotonic() >= end:
                break
            time.sleep(0.05)
        stuck = "; ".join(self._where(r) for r in sorted(keys))
        line = (
            f"rank {self.rank} (plugins): stopped: {stuck} within {TIMEOUT_ENV}="
            f"{self.timeout_s:g} s (hung or too slow)"
        )
        _error_file(line)
        raise GrpoError(line)

    def _where(self, rank: int) -> str:
        key = f"{self.prefix}/at/{rank}"
        if not self.store.check([key]):
            return f"rank {rank} did not start loading its plugins"
        label, spec = json.loads(self.store.get(key))
        if not label:
            return f"rank {rank} did not finish loading its plugins"
        return f"rank {rank} did not finish loading plugin {spec!r} ({label})"


def _error_file(line: str) -> None:
    """`line` in torchrun's error file (TORCHELASTIC_ERROR_FILE), which its "Root Cause"
    summary shows for this rank (the format `grpo.run.failures` writes)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    info = {"py_callstack": line, "timestamp": str(int(time.time()))}
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": info}}, f)
    except OSError:
        pass


@functools.cache
def _job() -> _Job | None:
    """The torchrun job this process is a rank of, connected to torchrun's agent store; None
    for a single process, or a job launched without torchrun's agent (its rank 0 hosts the
    store only once it joins the process group)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    timeout_s = _timeout_s()
    import torch.distributed as td

    try:
        address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        wait = datetime.timedelta(seconds=timeout_s)
        store = td.TCPStore(*address, is_master=False, timeout=wait)
    except (KeyError, ValueError, RuntimeError) as e:  # the group's start will say more
        log.debug("plugins: no agreement between ranks (%s: %s)", type(e).__name__, e)
        return None
    prefix = f"grpo/plugins/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return _Job(store, int(os.environ["RANK"]), world, timeout_s, prefix)


def _timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise GrpoError(f"{TIMEOUT_ENV}: expected a number of seconds > 0, got {raw!r}")
    return value
