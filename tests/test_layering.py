"""The engine stays light and independent: importing it pulls in neither the harness nor HF modeling code; neither
package has an import circle at run time."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Set


def test_import_engine_is_light():
    code = ("import sys, engine, engine.core, engine.sample, engine.distributed; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('harness', 'transformers', 'scipy', 'pandas', "
            "'matplotlib', 'tests')]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_engine_never_imports_the_harness():
    root = Path(__file__).resolve().parent.parent / "engine"
    offenders = [str(p) for p in root.rglob("*.py")
                 if "import harness" in p.read_text() or "from harness" in p.read_text()
                 or "modeling_" in p.read_text()]
    assert not offenders


# ------------------------------------------------------------------------------------------------ import circles
ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "harness")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, with_type_only: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import that runs: at module level, in functions and classes; those under `if TYPE_CHECKING:` only
    with with_type_only."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node) and not with_type_only:
            for other in node.orelse:
                yield from _imports(ast.Module(body=[other], type_ignores=[]), with_type_only)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node, with_type_only)


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_package: bool, modules: Set[str]) -> Set[str]:
    """The project modules an import statement loads: `from a.b import c` is a.b.c when that is a module, else a.b."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names} & modules
    base = node.module or ""
    if node.level:
        package = name.split(".") if is_package else name.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names} & modules


def import_graph(root: Path, packages: Sequence[str], with_type_only: bool = False) -> Dict[str, Set[str]]:
    """module -> the project modules it imports at run time (and with with_type_only, under TYPE_CHECKING too), read
    from the source (ast) of every module."""
    files = {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = {t for node in _imports(tree, with_type_only)
                       for t in _targets(node, name, path.name == "__init__.py", set(files))} - {name}
    return graph


def find_cycle(graph: Dict[str, Set[str]]) -> List[str] | None:
    """One import circle as [a, b, ..., a], or None: a depth-first search for an edge back onto the path."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> List[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_circle_at_run_time():
    graph = import_graph(ROOT, PACKAGES)
    assert "harness.parity.run" in graph and "engine.core" in graph  # the packages were read
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_import_circle_through_with_type_only_imports():
    cycle = find_cycle(import_graph(ROOT, PACKAGES, with_type_only=True))
    assert cycle is None, "import circle (type-only imports included): " + " -> ".join(cycle)


def test_the_circle_check_finds_circles(tmp_path: Path):
    """The same reading on a small package written here: a circle through a function-level import is found and
    named; one closed only under TYPE_CHECKING only when type-only imports count."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "sub" / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n")
    (pkg / "e.py").write_text("from pkg import d\n")
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.e"] == {"pkg.d"} and graph["pkg.d"] == set()
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]
    (pkg / "sub" / "c.py").write_text("")
    assert find_cycle(import_graph(tmp_path, ["pkg"], with_type_only=True)) == ["pkg.d", "pkg.e", "pkg.d"]
    assert find_cycle(import_graph(tmp_path, ["pkg"])) is None
