"""pyproject declares every third-party package dsrun needs at run time
(``pip install dsrun`` must bring it), read from dsrun's own source, and a
torch floor no lower than the newest torch API dsrun calls.

Needed: a package dsrun imports outside an ``except ImportError`` guard
(at module level or inside a function) and outside ``if TYPE_CHECKING``,
and numpy wherever dsrun calls ``.numpy()``: torch's tensor/ndarray bridge
raises "Numpy is not available" without it (checkpoint writes and reads).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
GUARDS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
#: torch APIs (a pattern in dsrun's source) -> the torch release that has them
TORCH_APIS = {
    r"torch\.is_autocast_enabled\(\w": (2, 4),  # the device_type argument
    r"torch\.compiler\.is_compiling\(": (2, 3),
}


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:  # bare except
        return True
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(k, ast.Name) and k.id in GUARDS for k in kinds)


class _Needs(ast.NodeVisitor):
    """Top-level names of unguarded imports, and whether ``.numpy()`` is called."""

    def __init__(self) -> None:
        self.imports: dict[str, int] = {}
        self.numpy_call: int | None = None
        self._guarded = 0

    def visit_Try(self, node: ast.Try) -> None:
        guarded = any(_catches_import_error(h) for h in node.handlers)
        self._guarded += guarded
        for stmt in node.body:
            self.visit(stmt)
        self._guarded -= guarded
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(part)

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
                (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for part in node.orelse:
                self.visit(part)
            return
        self.generic_visit(node)

    def _add(self, name: str, line: int) -> None:
        if not self._guarded:
            self.imports.setdefault(name.split(".")[0], line)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            self._add(node.module, node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Attribute) and node.func.attr == "numpy" \
                and not node.args and self.numpy_call is None:
            self.numpy_call = node.lineno
        self.generic_visit(node)


def needed_packages(package: Path) -> dict[str, str]:
    """Third-party top-level module -> the first place that needs it."""
    stdlib = set(sys.stdlib_module_names)
    needs: dict[str, str] = {}
    for path in sorted(package.rglob("*.py")):
        visitor = _Needs()
        visitor.visit(ast.parse(path.read_text(), str(path)))
        where = path.relative_to(package.parent)
        for name, line in visitor.imports.items():
            if name not in stdlib and name != package.name:
                needs.setdefault(name, f"{where}:{line}")
        if visitor.numpy_call is not None:
            needs.setdefault("numpy", f"{where}:{visitor.numpy_call} (.numpy())")
    return needs


def declared(pyproject: Path) -> set[str]:
    """The distribution names in [project].dependencies, normalised."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return {re.split(r"[\s<>=!~;\[(]", d, maxsplit=1)[0].lower().replace("_", "-")
            for d in deps}


def test_every_package_dsrun_needs_is_a_declared_dependency():
    needs = needed_packages(ROOT / "dsrun")
    missing = {name: where for name, where in needs.items()
               if name.lower().replace("_", "-") not in declared(ROOT / "pyproject.toml")}
    assert not missing, f"used by dsrun but not in pyproject's dependencies: {missing}"


def test_the_walk_sees_guarded_and_unguarded_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import os, torch.nn\n"
        "from pkg import b\n"
        "if TYPE_CHECKING:\n    import typed_only\n"
        "try:\n    import optional_one\nexcept ImportError:\n    pass\n"
        "def f(t):\n    import lazy_needed\n    return t.numpy()\n")
    assert set(needed_packages(pkg)) == {"torch", "lazy_needed", "numpy"}


def torch_floor(pyproject: Path) -> tuple[int, ...]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if re.match(r"torch\b", d)]
    floor = re.search(r">=\s*([\d.]+)", spec)
    assert floor, f"pyproject's {spec!r} has no >= floor"
    return tuple(int(part) for part in floor.group(1).split("."))


def test_the_torch_floor_has_every_torch_api_dsrun_calls():
    source = {p: p.read_text() for p in (ROOT / "dsrun").rglob("*.py")}
    floor = torch_floor(ROOT / "pyproject.toml")
    for pattern, since in TORCH_APIS.items():
        users = [str(p.relative_to(ROOT)) for p, text in source.items()
                 if re.search(pattern, text)]
        if users:
            assert floor >= since, f"{users} call {pattern} (torch {since}); pyproject: {floor}"
