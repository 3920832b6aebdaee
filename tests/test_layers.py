"""The package's layers: no import cycle between its top-level units, and the benchmarks apart from the runtime.

A unit is a subpackage (`duplexd/asr`, `duplexd/bench`, ...) or a top-level module (`duplexd/cli.py`, ...).
Every import in a file counts, also one inside a function, and so does a string that names a duplexd module
(`importlib.import_module("duplexd.bench.asr")`, `python -m duplexd.bench.relay`), but for a package only
read for its files (`importlib.resources.files("duplexd.clients.web")`).
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

import duplexd

PACKAGE = Path(duplexd.__file__).resolve().parent
ROOT = PACKAGE.parent
MODULE_NAME = re.compile(r"duplexd(\.\w+)+")
BENCH_IMPORTERS = {"duplexd/cli.py"}  # its `bench` dispatch and `relay` command: the only way in from outside


@dataclass(frozen=True, slots=True)
class Import:
    path: str  # duplexd/clients/loadtest.py
    line: int
    module: str  # duplexd.bench.scenarios
    source: str  # the statement as written

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source}"


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> list[Import]:
    """Every duplexd module `path` imports, by the statement (or string) that names it."""
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text, filename=str(path))
    rel = path.relative_to(ROOT).as_posix()
    package = _module_of(path) if path.name == "__init__.py" else _module_of(path).rpartition(".")[0]
    data = {  # `importlib.resources.files("duplexd.clients.web")`: files read, not code run
        id(arg)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "files"
        for arg in node.args
    }
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from duplexd import bench` imports the module duplexd.bench; `from duplexd.x import f`, duplexd.x
            names = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in data:
            names = [node.value] if MODULE_NAME.fullmatch(node.value) and _is_module(node.value) else []
        for name in dict.fromkeys(names):
            if name == "duplexd" or name.startswith("duplexd."):
                source = " ".join((ast.get_source_segment(text, node) or "").split())
                out.append(Import(rel, node.lineno, name, source))
    return out


def _unit(module: str) -> str:
    """duplexd.bench.server -> bench; duplexd.cluster -> cluster; duplexd -> duplexd (the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


@functools.cache
def _all_imports() -> list[Import]:
    return [imp for path in sorted(PACKAGE.rglob("*.py")) for imp in _imports(path)]


def _graph(imports: list[Import]) -> dict[str, dict[str, list[Import]]]:
    """unit -> unit it imports -> the import lines that make the edge."""
    graph: dict[str, dict[str, list[Import]]] = defaultdict(lambda: defaultdict(list))
    for imp in imports:
        src, dst = _unit(_module_of(ROOT / imp.path)), _unit(imp.module)
        if src != dst:
            graph[src][dst].append(imp)
    return graph


def _cycles(graph: dict[str, dict[str, list[Import]]]) -> list[list[str]]:
    """The shortest cycle (u1, u2, ..., u1) through each unit of every strongly connected group (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, {})):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)

    cycles: dict[tuple[str, ...], list[str]] = {}
    for group in groups:
        for start in sorted(group):
            cycle = _shortest_cycle(graph, group, start)
            turn = cycle.index(min(cycle[:-1]))  # the same cycle found from another of its units
            cycles.setdefault(tuple(cycle[turn:-1] + cycle[:turn]), cycle[turn:-1] + cycle[:turn] + [cycle[turn]])
    return sorted(cycles.values(), key=lambda c: (len(c), c))


def _shortest_cycle(graph: dict[str, dict[str, list[Import]]], group: set[str], start: str) -> list[str]:
    """Breadth first inside a strongly connected `group`: the shortest way from `start` back to it."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    return [*paths[v], start]
                if w in group and w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in no cycle of {sorted(group)}")


def test_units_import_each_other_without_a_cycle() -> None:
    graph = _graph(_all_imports())
    assert {"asr", "bench", "clients", "cli", "cluster", "dialog", "transport"} <= set(graph)  # the parse saw them
    report = []
    for cycle in _cycles(graph):
        report.append(" -> ".join(cycle))
        for a, b in zip(cycle, cycle[1:], strict=False):
            report += [f"  {a} -> {b}:", *(f"    {imp}" for imp in graph[a][b])]
    if report:
        pytest.fail("import cycles between units:\n" + "\n".join(report), pytrace=False)


def test_only_the_cli_imports_the_benchmarks() -> None:
    outside = [
        imp
        for imp in _all_imports()
        if _unit(imp.module) == "bench"
        and not imp.path.startswith("duplexd/bench/")
        and imp.path not in BENCH_IMPORTERS
    ]
    if outside:
        pytest.fail("imports of duplexd.bench from outside it:\n" + "\n".join(map(str, outside)), pytrace=False)


def test_server_clients_and_cluster_load_without_the_benchmarks() -> None:
    code = (
        "import sys\n"
        "import duplexd.transport.server, duplexd.clients.loadtest, duplexd.cluster\n"
        "print('\\n'.join(sorted(m for m in sys.modules if m == 'duplexd.bench' or m.startswith('duplexd.bench.'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [], f"duplexd.bench modules imported: {done.stdout.split()}"


def test_the_scan_sees_imports_inside_functions_and_module_names_in_strings() -> None:
    """The checks above can fail: an import inside a function and a module named in a string both count."""
    cli = {imp.module for imp in _imports(PACKAGE / "cli.py")}
    assert "duplexd.clients.loadtest" in cli  # imported inside `_cmd_loadtest`
    assert any(module.startswith("duplexd.bench.") for module in cli)  # the bench table's module paths
    graph = {"a": {"b": []}, "b": {"c": [], "a": []}, "c": {"a": [], "d": []}, "d": {}}
    assert _cycles(graph) == [["a", "b", "a"], ["a", "b", "c", "a"]]


def test_each_benchmark_is_a_bench_module_with_main() -> None:
    """`duplexd bench NAME` imports the module `cli.BENCHMARKS` names and calls its `main(args)`."""
    from duplexd.cli import BENCHMARKS

    for name, module in BENCHMARKS.items():
        assert _unit(module) == "bench" and _is_module(module), (name, module)
        tree = ast.parse(ROOT.joinpath(*module.split(".")).with_suffix(".py").read_text(encoding="utf-8"))
        assert any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body), (name, module)
