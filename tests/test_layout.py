"""The house by role (docs/architecture.md): rooms import only rooms below
them, no module imports itself back through others, and no module grows past
MAX_LINES without saying why at its top. Read from the source, not by
importing it, so a circle hidden inside a function counts too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "cgpud"

# Highest first: a room may import itself and any room after it, never one before.
ROOMS = ["cli", "k8s", "daemon", "control", "observe", "containers", "sched", "gpus", "tree", "client", "state", "core",
         "__init__"]
MAX_LINES = 450
REASON = "Longer than"  # the phrase a module over MAX_LINES opens its reason with


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def room(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path, known: dict[str, Path], types: bool = False) -> set[str]:
    """The cgpud modules `path` imports, anywhere in it (TYPE_CHECKING blocks only with `types`)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if not types and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for b in node.body for n in ast.walk(b)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from cgpud.sched import loop` imports the submodule; `from cgpud.sched.loop import X` the module
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [s for s in subs if s in known] + ([node.module] if not all(s in known for s in subs) else [])
        else:
            continue
        for n in names:
            if n.split(".")[0] != "cgpud":
                continue
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != module_name(path):
                out.add(n)
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree)), \
        f"{path}: relative import (the house uses absolute ones: the path says the room)"
    return out


def graph(types: bool = False) -> dict[str, set[str]]:
    known = modules()
    return {m: imports(p, known, types) for m, p in known.items()}


def test_every_module_is_in_a_room():
    assert {room(m) for m in modules()} <= set(ROOMS)


def test_rooms_import_only_rooms_below():
    up = []
    for mod, deps in graph().items():
        for d in deps:
            if room(d) == "__init__":  # cgpud.__version__
                continue
            if ROOMS.index(room(d)) < ROOMS.index(room(mod)):
                up.append(f"{mod} -> {d}")
    assert not up, "imports of a higher room:\n" + "\n".join(sorted(up))


def test_no_import_circle():
    """Type-only imports count here: two modules that name each other's types know each other
    (observe.metrics told an Exposition of each snapshot: now it tells whoever subscribed)."""
    g = graph(types=True)
    state: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                circles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_long_modules_say_why():
    long = []
    for mod, path in modules().items():
        text = path.read_text()
        n = text.count("\n")
        if n > MAX_LINES:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if REASON not in doc:
                long.append(f"{mod}: {n} lines, and its docstring does not say why ('{REASON} …')")
    assert not long, "\n".join(long)


def test_the_checker_sees_a_circle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks above can fail: a made-up package with both faults is caught."""
    pkg = tmp_path / "cgpud"
    (pkg / "core").mkdir(parents=True)
    (pkg / "sched").mkdir()
    for d in (pkg, pkg / "core", pkg / "sched"):
        (d / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("def f():\n    from cgpud.sched import b\n")
    (pkg / "sched" / "b.py").write_text("from cgpud.core import a\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    monkeypatch.setattr(__import__(__name__), "PKG", pkg)
    g = graph()
    assert g["cgpud.core.a"] == {"cgpud.sched.b"} and g["cgpud.sched.b"] == {"cgpud.core.a"}
    with pytest.raises(AssertionError, match="cgpud.core.a -> cgpud.sched.b -> cgpud.core.a"):
        test_no_import_circle()
    with pytest.raises(AssertionError, match="cgpud.core.a -> cgpud.sched.b"):
        test_rooms_import_only_rooms_below()
