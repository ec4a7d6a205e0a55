"""Import a user's function from a ``package.module:function`` path (rewards, algorithm)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
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
