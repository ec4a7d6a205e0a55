"""No module of `grpo/` imports in a cycle: the import graph of the package (module-level,
function-level and `if TYPE_CHECKING:` imports alike: a lazy import only hides a cycle, and a
type-only one is still a loop in the design) has no strongly connected component of more than
one module. `import a.b.c` also imports the packages a and a.b (their
__init__), except the importing module's own ancestors, which Python has already started."""

from __future__ import annotations

import ast
from pathlib import Path

GRPO = Path(__file__).resolve().parents[1] / "grpo"


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the grpo modules it imports (nearest existing module of each dotted name)."""
    mods = modules(root)

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    def own_ancestor(m: str, target: str) -> bool:
        return m.startswith(target + ".")

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        tree = ast.parse(path.read_text())
        pkg = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import name` runs pkg's __init__ (an edge to pkg even from inside
                # it when `name` is not a submodule: the name must already be defined)
                names = [base] if any(f"{base}.{a.name}" not in mods for a in node.names) else []
                names += [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
            for name in names:
                if not name.startswith("grpo"):
                    continue
                target = resolve(name)
                parts = target.split(".")
                chain = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
                for t in chain:
                    is_from_base = isinstance(node, ast.ImportFrom) and t == name
                    if t == m or (own_ancestor(m, t) and not is_from_base):
                        continue
                    if t in mods:
                        edges[m].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_finder_sees_a_cycle(tmp_path):
    """The check can fail: a lazy import back into a module that imports it is a cycle."""
    pkg = tmp_path / "grpo"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from grpo.sub.a import f\n")
    (pkg / "sub" / "a.py").write_text("from grpo.sub import b\n\ndef f():\n    pass\n")
    (pkg / "sub" / "b.py").write_text("def g():\n    from grpo.sub.a import f\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from grpo.sub.a import f\n"
    )
    edges = import_graph(pkg)
    assert edges["grpo.sub.b"] == {"grpo.sub.a"}
    assert edges["grpo.c"] == {"grpo.sub", "grpo.sub.a"}  # TYPE_CHECKING imports count
    assert cycles(edges) == [["grpo.sub.a", "grpo.sub.b"]]
    (pkg / "sub" / "b.py").write_text("def g():\n    pass\n")
    assert cycles(import_graph(pkg)) == []
    # a submodule importing a name from its own package's __init__, which imports it back
    (pkg / "sub" / "b.py").write_text("from grpo.sub import f\n")
    assert cycles(import_graph(pkg)) == [["grpo.sub", "grpo.sub.a", "grpo.sub.b"]]
    # a type-only import that closes a loop is a cycle too
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from grpo.c import X\n"
    )
    assert cycles(import_graph(pkg)) == [["grpo.c", "grpo.sub", "grpo.sub.a", "grpo.sub.b"]]


def test_no_module_of_grpo_imports_in_a_cycle():
    edges = import_graph(GRPO)
    assert len(edges) > 50 and edges["grpo.train.grpo"]  # the graph was read
    assert cycles(edges) == []
