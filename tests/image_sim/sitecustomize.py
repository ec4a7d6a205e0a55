"""A Python that lacks some installed packages, as an offline CUDA image does.

Put this folder first on PYTHONPATH and name the packages in GRPO_HIDE_PACKAGES (comma-
separated top-level import names): each is then importable only from a folder on sys.path
outside site-packages (a carried wheel folder installed with `pip install --target`), as if
site-packages did not hold it. Everything else imports as usual. tests/test_gpu_check.py runs
benchmarks/gpu_check.sh under it.
"""

import importlib.machinery
import os
import sys

HIDDEN = frozenset(filter(None, os.environ.get("GRPO_HIDE_PACKAGES", "").split(",")))


def _carried() -> list[str]:
    return [p for p in sys.path if p and "site-packages" not in p and "dist-packages" not in p]


class HideInstalled(importlib.machinery.PathFinder):
    """sys.path's finder, except that a hidden top-level package is looked for only outside
    site-packages (so `importlib.util.find_spec` answers None where the image has none)."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if path is None and name in HIDDEN:
            path = _carried()
        return super().find_spec(name, path, target)


if HIDDEN:
    sys.meta_path[:] = [
        HideInstalled if f is importlib.machinery.PathFinder else f for f in sys.meta_path
    ]
