"""The two layers: the core (`grpo.*` outside `grpo/apps/`) never imports the applications
(`grpo.apps`: CLI, pipeline, sweep, serve, tool, demo, plot), and the entry points reach them.
The conformance kit (`grpo/testing/`) is optional, on top of the core: the core never imports
it (nor pytest), and it imports no app."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GRPO = REPO / "grpo"
APPS = GRPO / "apps"
# `python -m grpo` is the CLI's launcher, not part of the core
LAUNCHERS = {GRPO / "__main__.py"}
KIT = GRPO / "testing"  # the conformance kit: optional, built on the core, not part of it


def core_files() -> list[Path]:
    files = sorted(
        p
        for p in GRPO.rglob("*.py")
        if APPS not in p.parents and KIT not in p.parents and p not in LAUNCHERS
    )
    assert len(files) > 40, files  # the scan does see the core
    return files


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) for every import in `source` (the text of `module`), lazy ones inside
    functions included; `from X import y` yields X and X.y (y may be a submodule), relative
    imports resolved."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(source, module)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *filter(None, [base])])
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def is_app(module: str) -> bool:
    return module == "grpo.apps" or module.startswith("grpo.apps.")


def is_kit(module: str) -> bool:
    return module == "grpo.testing" or module.startswith("grpo.testing.")


def test_imported_modules_sees_every_spelling():
    src = (
        "import grpo.apps.cli\nfrom grpo import apps\nfrom grpo.apps.serving import Engine\n"
        "def f():\n    from ..apps import tool\n    from . import batch\n"
    )
    found = [m for _, m in imported_modules(src, "grpo.train.probe")]
    assert [m for m in found if is_app(m)] == [
        "grpo.apps.cli",
        "grpo.apps",
        "grpo.apps.serving",
        "grpo.apps.serving.Engine",
        "grpo.apps",
        "grpo.apps.tool",
    ]
    assert "grpo.train.batch" in found


def test_the_core_never_imports_the_apps():
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in core_files()
        for line, module in imported_modules(
            path.read_text(), module_name(path), path.name == "__init__.py"
        )
        if is_app(module)
    ]
    assert not bad, bad


def imports_of(files: list[Path], package: str) -> list[str]:
    """ "path:line imports module" for every import of `package` (or a module in it) by
    `files`, lazy ones included."""
    return [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in files
        for line, module in imported_modules(
            path.read_text(), module_name(path), path.name == "__init__.py"
        )
        if module == package or module.startswith(package + ".")
    ]


def test_the_models_never_import_the_algorithm():
    """grpo/models/ (the decoder, its caches, packing of rows for it) sits under grpo/algo/ (the
    loss math): no module of it imports grpo.algo, lazily or not."""
    files = sorted((GRPO / "models").rglob("*.py"))
    assert len(files) > 5, files
    bad = imports_of(files, "grpo.algo")
    assert not bad, bad


def test_only_the_recipes_live_in_train_and_nothing_imports_them():
    """grpo/train/ holds the recipes alone (grpo, sft, rm); what they use (the rollout
    machinery in grpo/experience/, the trained modules in grpo/modules/, the run in grpo/run/)
    never imports a recipe, lazily or not: a researcher reads a recipe top-down."""
    recipes = sorted(p.stem for p in (GRPO / "train").glob("*.py") if p.stem != "__init__")
    assert recipes == ["grpo", "rm", "sft"], recipes
    files = [p for d in ("experience", "modules", "run") for p in sorted((GRPO / d).rglob("*.py"))]
    assert len(files) > 20, files
    bad = imports_of(files, "grpo.train")
    assert not bad, bad


def test_the_config_imports_no_registry():
    """grpo/config.py holds types and ranges: it imports nothing of the registries' packages
    (grpo_kernels, grpo.algo, grpo.train) nor the models, lazily or not, and no private name
    of grpo.settings; the names a config gives are checked by grpo/checks.py."""
    path = GRPO / "config.py"
    banned = (
        "grpo_kernels",
        "grpo.algo",
        "grpo.train",
        "grpo.experience",
        "grpo.modules",
        "grpo.models",
    )
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for line, module in imported_modules(path.read_text(), module_name(path))
        if any(module == b or module.startswith(b + ".") for b in banned)
        or module.startswith("grpo.settings._")
    ]
    assert not bad, bad
    planted = "def f():\n    import grpo_kernels\n    from grpo.settings import _build\n"
    found = [m for _, m in imported_modules(planted, "grpo.config")]
    assert "grpo_kernels" in found and "grpo.settings._build" in found  # the scan sees them


def test_the_core_never_imports_the_kit_and_the_kit_no_app():
    scans = [(core_files(), is_kit), (sorted(KIT.rglob("*.py")), is_app)]
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for files, forbidden in scans
        for path in files
        for line, module in imported_modules(
            path.read_text(), module_name(path), path.name == "__init__.py"
        )
        if forbidden(module)
    ]
    assert not bad, bad


def test_importing_every_core_module_loads_no_app():
    modules = [module_name(p) for p in core_files()]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[:2] in (['grpo', 'apps'],\n"
        "             ['grpo', 'testing']) or m.split('.')[0] in ('pytest', '_pytest')))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_entry_points_reach_the_cli():
    import grpo.__main__
    from grpo.apps import cli

    scripts = (REPO / "pyproject.toml").read_text().split("[project.scripts]", 1)[1]
    assert re.match(r'\s*grpo = "grpo\.apps\.cli:main"\n', scripts), scripts[:80]
    assert grpo.__main__.main is cli.main


def test_no_file_imports_a_top_level_kernels_package():
    """The import name `kernels` is Hugging Face's (transformers >= 5.25 requires it); ours is
    `grpo_kernels` (kernels/grpo_kernels/). No file of the repo imports `kernels`, lazily or in
    a script string, and kernels/ itself is a source root, not a package."""
    assert not (REPO / "kernels" / "__init__.py").exists()
    assert (REPO / "kernels" / "grpo_kernels" / "__init__.py").exists()
    bad = []
    for path in sorted(REPO.rglob("*.py")):
        if ".git" in path.parts:
            continue
        text = path.read_text()
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        for line, name in imported_modules(text, module, path.name == "__init__.py"):
            if name == "kernels" or name.startswith("kernels."):
                bad.append(f"{path.relative_to(REPO)}:{line}")
        # and scripts run in subprocesses, which are strings to the parser
        bad += [
            f"{path.relative_to(REPO)}: {line.strip()}"
            for line in text.splitlines()
            if re.match(r"\s*\"?(import kernels\b|from kernels[. ])", line)
        ]
    assert not bad, bad


def test_import_kernels_in_the_repo_root_loads_no_file_of_the_repo():
    """From the repo root (where `python -m ...` puts the root on sys.path), `kernels` is
    Hugging Face's package where it is installed, else at most a namespace portion of our
    source root: never a module file of this repo."""
    code = (
        "import importlib.util as u, sys\n"
        "s = u.find_spec('kernels')\n"
        "print('NONE' if s is None else (s.origin or 'NAMESPACE'))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    origin = r.stdout.strip()
    assert r.returncode == 0, r.stderr
    assert origin in ("NONE", "NAMESPACE") or not origin.startswith(str(REPO)), origin
