"""The package layout of docs/architecture.md#the-package-layout, held to the code.

Read from the source (nothing imported): every ``import`` of a ``megatron_vlm`` module, at module level or inside a
function, must point down the layer table or stay inside its own package; no two modules import each other, however
long the circle; the package root holds packages and ``__init__.py`` only; and the installed package carries no test
machinery (pytest, ``unittest.mock``, the hub files of the checkout).
"""

from __future__ import annotations

import ast
import configparser
from pathlib import Path

import pytest

pytestmark = pytest.mark.one_lane("3.11", reason="reads source files only: no megatron-core, TE or PyAV")

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "megatron_vlm"
#: docs/architecture.md's table: a package imports only from packages of a lower layer (or from itself)
LAYERS = {"cli": 0, "files": 0, "runtime": 1, "model": 2, "checkpoint": 3, "data": 3, "convert": 4, "eval": 5,
          "training": 6, "launch": 7}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(path: Path, known: dict[str, Path]) -> set[str]:
    """The ``megatron_vlm`` modules ``path`` imports anywhere in its body (``from pkg import mod`` names the module
    when ``mod`` is one)."""
    me = module_name(path)
    here = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("megatron_vlm") and name != me:
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(path, known) for name, path in known.items()}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_import_points_down_the_layers():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(LAYERS), f"packages without a layer (or layers without a package): {packages ^ set(LAYERS)}"
    wrong = []
    for src, targets in graph().items():
        for dst in targets:
            a, b = package_of(src), package_of(dst)
            if b is None:
                wrong.append(f"{src} imports the package root {dst}")
            elif a != b and LAYERS[a] <= LAYERS[b]:
                wrong.append(f"{src} (layer {LAYERS[a]}) imports {dst} (layer {LAYERS[b]})")
    assert not wrong, "imports against docs/architecture.md's layers:\n" + "\n".join(sorted(wrong))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the finder finds one
    found = cycles(graph())
    assert not found, f"modules that import each other (directly or round a circle): {found}"


def test_package_root_holds_packages_only():
    loose = sorted(p.name for p in PACKAGE.iterdir() if p.is_file() and p.name != "__init__.py"
                   and p.suffix == ".py")
    assert not loose, f"modules at the package root (docs/architecture.md#the-package-layout): {loose}"
    assert (PACKAGE / "__init__.py").read_text().strip() == ""


def test_the_installed_package_carries_no_test_machinery():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert cfg["options"]["packages"].strip() == "find:"
    include = [x.strip() for x in cfg["options.packages.find"]["include"].split()]
    from setuptools import find_packages

    found = find_packages(str(ROOT), include=include)
    assert found and all(p == "megatron_vlm" or p.startswith("megatron_vlm.") for p in found), found
    assert "megatron_vlm.testing" not in found
    bad = []
    for name, path in modules().items():
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{name} imports {m}" for m in mods if m.split(".")[0] in ("pytest", "tests")
                    or m.startswith("unittest.mock") or (m == "unittest" and isinstance(node, ast.ImportFrom)
                                                         and any(a.name == "mock" for a in node.names))]
        if "shared/hub" in text:
            bad.append(f"{name} names the checkout's shared/hub")
    assert not bad, bad
