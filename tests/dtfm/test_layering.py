"""Dependencies point one way (DESIGN.md, "Layout"); this test reads every import to hold it.

It parses (with `ast`, importing nothing) each module under `dtfm/`, `coordinator/` and
`agent/`, and checks:

- `dtfm.core` imports nothing of ours but `dtfm.core` and the generated `protos.dtfm.v1`
  messages (`*_pb2`, not the `*_pb2_grpc` services), and never torch or grpc;
- `dtfm` imports nothing from `coordinator` or `agent`;
- `agent.worker` imports nothing from `coordinator`, nothing of `dtfm` but `dtfm.core` and the
  network path's torch-side half (`WORKER_NET`: the data plane's wire, punch, path weighing),
  and nothing of `agent` outside `agent.worker` (the worker is a separate process of torch
  only); that half imports no grpc and nothing of `dtfm` but `dtfm.core`;
- the two programs never import each other: what both need lives in `dtfm`;
- `agent/`'s top holds only the entry points, every other module a concern's package;
- only entry points import a CLI module (the `cli` modules, every module of
  `coordinator.commands`, the agent's subcommand modules with a `main()`, and every
  `__main__`): library code, the coordinator's daemon and job included, never imports a
  command;
- the module-level imports among our modules have no cycle.

Which imports count. The direction rules count every import, at module level or lazily inside
a function: a lazy import is still a dependency (it only moves the cost). The cycle check
counts only imports that run while a module loads (module level, class bodies, `try`/`if`
blocks, but not `if TYPE_CHECKING:`): an import inside a function runs after every module
involved has finished loading, so it cannot see a half-initialized module, and deferring an
import is the ordinary way to keep a heavy dependency off a path. `from pkg import name` is an
edge to the submodule `pkg.name` where there is one, else to `pkg` (its `__init__`); the
parent packages that Python initializes on the way are not counted as edges of their own.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from tests.dtfm.sourcetree import PACKAGES, ROOT, module_name, sources

OURS = (*PACKAGES, "protos")
CLI_MODULES = frozenset({"coordinator.cli", "agent.cli", "agent.commands.local",
                         "agent.commands.prepare"})
# the network package's torch-side half: what the worker's transport builds on (no grpc)
WORKER_NET = frozenset({"dtfm.net.dataplane", "dtfm.net.punch", "dtfm.net.pathweigh",
                        "dtfm.net.framemac"})
# the only modules at agent/'s top: the entry points; everything else sits in a concern's package
AGENT_TOP = frozenset({"agent", "agent.__main__", "agent.cli"})
COMMAND_PACKAGES = ("coordinator.commands",)  # every module in these is a command
FORBIDDEN_IN_CORE = ("torch", "grpc", "grpc_health", "grpc_reflection")


@dataclass(frozen=True)
class Import:
    importer: str  # the importing module, dotted
    target: str  # the module imported, dotted (resolved to one of ours where it is ours)
    line: int
    at_load: bool  # runs while `importer` loads (not inside a function, not TYPE_CHECKING)

    def __str__(self) -> str:
        where = "" if self.at_load else " (inside a function)"
        return f"{self.importer} (line {self.line}) imports {self.target}{where}"




def _known_modules() -> set[str]:
    modules = set(sources())
    modules |= {module_name(p) for p in (ROOT / "protos").rglob("*.py")}
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Collector(ast.NodeVisitor):
    """Every import in one module, each marked whether it runs while the module loads."""

    def __init__(self, module: str, is_package: bool, known: set[str]) -> None:
        self.module, self.is_package, self.known = module, is_package, known
        self.imports: list[Import] = []
        self._lazy = 0

    def _add(self, target: str, node: ast.stmt) -> None:
        self.imports.append(Import(self.module, target, node.lineno, self._lazy == 0))

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._lazy += 1
        self.generic_visit(node)
        self._lazy -= 1

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self._lazy += 1
        for child in node.body:
            self.visit(child)
        self._lazy -= 1
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            package = self.module if self.is_package else self.module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            self._add(submodule if submodule in self.known else base, node)


def _all_imports() -> list[Import]:
    known = _known_modules()
    found: list[Import] = []
    for module, path in sources().items():
        collector = _Collector(module, path.name == "__init__.py", known)
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        found += collector.imports
    return sorted(set(found), key=lambda i: (i.importer, i.line, i.target))


IMPORTS = _all_imports()


def _top(name: str) -> str:
    return name.split(".", 1)[0]


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _is_cli(module: str) -> bool:
    return (module in CLI_MODULES or module.rsplit(".", 1)[-1] == "__main__"
            or any(_under(module, p) for p in COMMAND_PACKAGES))


def _assert_none(bad: list[Import], rule: str) -> None:
    assert not bad, f"{rule}:\n  " + "\n  ".join(map(str, bad))


def test_the_parser_sees_the_imports_it_should() -> None:
    """Guards the test itself: a resolver that found nothing would pass every rule."""
    pairs = {(i.importer, i.target) for i in IMPORTS}
    assert ("coordinator.__main__", "coordinator.cli") in pairs
    assert ("agent.cli", "agent.commands.local") in pairs
    assert ("dtfm.flags", "dtfm.core.spec") in pairs
    assert ("coordinator.cli", "coordinator.commands.status") in pairs
    assert _is_cli("coordinator.commands.status") and not _is_cli("coordinator.daemon.metrics")
    assert any(i.importer.startswith("agent.worker") and _top(i.target) == "torch"
               for i in IMPORTS)


def test_core_depends_on_nothing_of_ours_and_on_no_torch_or_grpc() -> None:
    def bad(i: Import) -> bool:
        if _top(i.target) in FORBIDDEN_IN_CORE:
            return True
        if _top(i.target) not in OURS or _under(i.target, "dtfm.core"):
            return False
        return not (_under(i.target, "protos.dtfm.v1") and i.target.endswith("_pb2"))

    _assert_none([i for i in IMPORTS if _under(i.importer, "dtfm.core") and bad(i)],
                 "dtfm.core may import only dtfm.core and protos.dtfm.v1.*_pb2, and never "
                 "torch or grpc")


def test_the_library_does_not_import_the_programs() -> None:
    _assert_none([i for i in IMPORTS if _under(i.importer, "dtfm")
                  and _top(i.target) in ("coordinator", "agent")],
                 "dtfm is shared by both programs and may not import either")


def test_the_worker_imports_only_torch_side_code_and_the_core() -> None:
    def bad(i: Import) -> bool:
        return (_top(i.target) in ("coordinator", "grpc")
                or (_under(i.target, "dtfm") and not _under(i.target, "dtfm.core")
                    and i.target not in WORKER_NET)
                or (_under(i.target, "agent") and not _under(i.target, "agent.worker")))

    _assert_none([i for i in IMPORTS if _under(i.importer, "agent.worker") and bad(i)],
                 "agent.worker may import agent.worker, dtfm.core, the data plane's wire, punch "
                 "and path weighing (dtfm.net) and the generated messages, never coordinator, "
                 "grpc or the rest of dtfm and agent")


def test_the_network_half_the_worker_uses_needs_no_grpc_or_torch() -> None:
    def bad(i: Import) -> bool:
        if _top(i.target) in FORBIDDEN_IN_CORE:
            return True
        return (_top(i.target) in OURS and not _under(i.target, "dtfm.core")
                and i.target not in WORKER_NET and not _under(i.target, "protos.dtfm.v1"))

    _assert_none([i for i in IMPORTS if i.importer in WORKER_NET and bad(i)],
                 f"{sorted(WORKER_NET)} run in the worker: they may import dtfm.core and each "
                 "other, never grpc, torch or the rest of dtfm")


def test_the_two_programs_do_not_import_each_other() -> None:
    _assert_none([i for i in IMPORTS if {_top(i.importer), _top(i.target)}
                  == {"coordinator", "agent"}],
                 "coordinator and agent are separate programs: what both need lives in dtfm "
                 "(checkpoints in dtfm.checkpoints, the network path in dtfm.net)")


def test_agents_top_holds_only_the_entry_points() -> None:
    top = {m for m in sources() if _top(m) == "agent" and m.count(".") <= 1
           and not (ROOT / m.replace(".", "/")).is_dir()}
    assert top <= AGENT_TOP, (
        f"agent/ keeps only its entry points at the top ({sorted(AGENT_TOP)}); put "
        f"{sorted(top - AGENT_TOP)} in the package of its concern: agent/daemon, "
        "agent/probing, agent/commands or agent/worker (docs/architecture.md, Layout)")


def test_only_entry_points_import_cli_modules() -> None:
    _assert_none([i for i in IMPORTS if _is_cli(i.target) and not _is_cli(i.importer)],
                 "a CLI module (cli, a subcommand module, __main__) is imported by a "
                 "non-entry-point; move what it needs into dtfm or a non-CLI module")


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (or a self-loop),
    found with Tarjan's algorithm (iteratively: the graph may be deep)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges.get(node, ()):
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_module_level_imports_have_no_cycle() -> None:
    edges: dict[str, set[str]] = {}
    for i in IMPORTS:
        if i.at_load and _top(i.target) in PACKAGES and i.target != i.importer:
            edges.setdefault(i.importer, set()).add(i.target)
    cycles = _cycles(edges)
    assert not cycles, "import cycles among module-level imports:\n  " + "\n  ".join(
        " <-> ".join(c) for c in cycles)
