"""The code stays readable in pieces (DESIGN.md, "conventions"); this test reads every module to
hold it, beside `test_layering.py`, which holds the import directions.

It parses (with `ast`, importing nothing) each module under `coordinator/`, `agent/` and
`dtfm/`, and checks:

- no module is over `MAX_LINES` lines;
- no class defines more than `MAX_METHODS` methods in its body (properties included);
- no module reads or calls another module's private names: `from m import _name` where `m`
  is ours, and `x._name` where `x` is not `self` or `cls` and `_name` is not a name the
  module itself defines (a function, class, attribute it assigns, or variable). A leading
  underscore means "this module only"; a collaborator that needs a thing asks for it through
  a public name.

Known exceptions are listed with why; the test also fails when one no longer applies, so the
list only shrinks.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from tests.dtfm.sourcetree import PACKAGES, sources

OURS = (*PACKAGES, "protos")
MAX_LINES = 600
MAX_METHODS = 30
# underscore names that are public API of the standard library (namedtuple's, os._exit)
PUBLIC_UNDERSCORED = frozenset({"_replace", "_asdict", "_fields", "_field_defaults", "_make",
                                "_exit"})
BIG_CLASSES: dict[str, str] = {}
PRIVATE_READS: set[tuple[str, str]] = set()




SOURCES = sources()
TREES = {m: ast.parse(p.read_text(), filename=str(p)) for m, p in SOURCES.items()}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in PUBLIC_UNDERSCORED


def _defined(tree: ast.Module) -> set[str]:
    """Every name a module defines: functions, classes, attributes and variables it assigns,
    parameters."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


@dataclass(frozen=True)
class PrivateRead:
    module: str
    line: int
    name: str
    how: str

    def __str__(self) -> str:
        return f"{self.module} (line {self.line}): {self.how}"


def private_reads(module: str, tree: ast.Module) -> list[PrivateRead]:
    """Where `module` reads or calls another module's private name."""
    own = _defined(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").split(".")[0] in OURS):
            found += [PrivateRead(module, node.lineno, a.name,
                                  f"from {node.module or '.'} import {a.name}")
                      for a in node.names if _is_private(a.name)]
        elif (isinstance(node, ast.Attribute) and _is_private(node.attr)
              and node.attr not in own
              and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(PrivateRead(module, node.lineno, node.attr,
                                     f"{ast.unparse(node.value)}.{node.attr}"))
    return found


def _methods(cls: ast.ClassDef) -> int:
    return sum(isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef) for b in cls.body)


def _classes() -> dict[str, int]:
    return {f"{m}.{node.name}": _methods(node) for m, tree in TREES.items()
            for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def test_the_checks_see_what_they_should() -> None:
    """Guards the test itself: a reader that found nothing would pass every rule."""
    assert len(SOURCES) > 100 and "coordinator.job.machine" in SOURCES
    assert _classes()["coordinator.job.machine.Job"] > 10
    sample = ast.parse("import x\nfrom coordinator.a import _b, c\n"
                       "class K:\n    _mine = 1\n    def f(self, o):\n"
                       "        return self._z, o._y, o._mine, x._w, cls._v, o._replace\n")
    assert sorted(r.how for r in private_reads("m", sample)) == [
        "from coordinator.a import _b", "o._y", "x._w"]


def test_no_module_is_over_the_line_limit() -> None:
    long = {m: n for m, p in SOURCES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, (f"modules over {MAX_LINES} lines (split them by concern): "
                      + ", ".join(f"{m} ({n})" for m, n in sorted(long.items())))


def test_no_class_has_too_many_methods() -> None:
    classes = _classes()
    big = {c: n for c, n in classes.items() if n > MAX_METHODS and c not in BIG_CLASSES}
    assert not big, (f"classes with more than {MAX_METHODS} methods (delegate to "
                     "collaborators): " + ", ".join(f"{c} ({n})" for c, n in sorted(big.items())))
    stale = [c for c in BIG_CLASSES if classes.get(c, 0) <= MAX_METHODS]
    assert not stale, f"no longer over the limit, drop from BIG_CLASSES: {stale}"


def test_no_module_touches_another_modules_private_names() -> None:
    reads = [r for m, tree in TREES.items() for r in private_reads(m, tree)]
    bad = [r for r in reads if (r.module, r.name) not in PRIVATE_READS]
    assert not bad, ("another module's private names read or called (give the owner a public "
                     "name or an interface instead):\n  " + "\n  ".join(map(str, bad)))
    stale = PRIVATE_READS - {(r.module, r.name) for r in reads}
    assert not stale, f"no longer read, drop from PRIVATE_READS: {sorted(stale)}"
