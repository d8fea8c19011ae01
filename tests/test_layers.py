"""No library module uses another module's private name (DESIGN.md, Layout).

import-linter (``.importlinter``, run by scripts/test.sh) checks which modules import which; it
cannot see *names*. A ``_name`` is private to its module: using it from another one couples the
two behind the API (``cpu_native._compiler`` from ``__main__`` was one). This test parses every
module of bitscom/ and fails on ``from x import _name`` and on ``module._name`` where ``module``
is a bitscom module imported by name. Dunders (``__version__``) are public.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "bitscom"

# Owned by the compressors/cost rework of issue 32: remove when it lands.
KNOWN = {("bitscom/cost/rounds.py", "casting._CastCompressor")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_of(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, here: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = here.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_module(dotted: str) -> bool:
    """A bitscom module or package (not a class: a subclass may call its base's ``_method``)."""
    path = ROOT.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _uses(text: str, here: str, is_package: bool = False):
    """(text, line) of each private name of another bitscom module used in module ``here``."""
    tree = ast.parse(text)
    modules = {}                 # local name -> bitscom module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(node, here, is_package)
            if not source.startswith("bitscom"):
                continue
            for alias in node.names:
                if _private(alias.name) and source != here:
                    yield f"{source.rsplit('.', 1)[-1]}.{alias.name}", node.lineno
                if _is_module(f"{source}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("bitscom") and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and _private(node.attr)):
            yield f"{node.value.id}.{node.attr}", node.lineno


def test_no_private_names_across_modules():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).as_posix()
        uses = _uses(path.read_text(), _module_of(path), path.name == "__init__.py")
        found += [f"{rel}:{line}: {text}" for text, line in uses if (rel, text) not in KNOWN]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_the_check_sees_a_private_name():
    """The walk above finds each spelling (a check that finds nothing proves nothing)."""
    text = ("from . import cpu_native\nfrom .cpu_native import _cpu_id\nfrom ..comm import _x as y\n"
            "import bitscom.runtime as rt\nx = cpu_native._compiler, rt._rt, _own\n")
    assert sorted(t for t, _ in _uses(text, "bitscom.kernels.probe")) == [
        "comm._x", "cpu_native._compiler", "cpu_native._cpu_id", "rt._rt"]
    assert list(_uses("from ..face import Face\nFace._agree_resumed(None)\n", "bitscom.onebit.base")) == []
