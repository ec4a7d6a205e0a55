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
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from collections.abc import Callable, Sequence
from typing import Any

from grpo.errors import GrpoError


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


def load_plugins(specs: Sequence[str] = (), label: str = "plugins") -> None:
    """Import the installed entry-point plugins (once per process), then each of `specs`.

    Args:
        specs: ``package.module`` or ``package.module:function`` names (a function is called
            with no arguments after its module is imported). Each spec is loaded once per
            process: a second request for it is a no-op.
        label: what an error names a spec by, with its index: ``plugins[0]: ...``.

    Raises:
        GrpoError: one line naming the plugin (and its place in `specs`, or its entry point)
            that failed to import or whose function raised.
    """
    load_entry_point_plugins()
    for i, spec in enumerate(specs):
        _load(spec, f"{label}[{i}]")


@functools.cache
def load_entry_point_plugins() -> tuple[str, ...]:
    """Load every plugin installed packages declare in the `grpo.plugins` entry-point group
    (``[project.entry-points."grpo.plugins"]`` ``name = "package.module"`` or
    ``"package.module:function"``); once per process. Returns the specs loaded."""
    loaded = []
    for ep in sorted(importlib.metadata.entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        spec = f"{ep.module}:{ep.attr}" if ep.attr else ep.module
        _load(spec, f"entry point {ep.name!r} of group {PLUGIN_GROUP!r}")
        loaded.append(spec)
    return tuple(loaded)


def _load(spec: str, label: str) -> None:
    if not isinstance(spec, str) or not spec.strip(":. "):
        raise GrpoError(f"{label}: expected 'package.module' or 'package.module:function', "
                        f"got {spec!r}")  # fmt: skip
    try:
        _activate(spec)
    except _PluginFailure as e:
        raise GrpoError(f"{label}: {e}") from None


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
