"""The package's import graph: every import points down, nothing imports in a circle.

Read from the source with `ast` (nothing is imported), counting imports inside
functions too: a lazy import is still an arrow. Checked twice: between modules,
and between the package's rooms (a top-level module, or a sub-package taken
as one), so that two folders cannot lean on each other through different files.
"""

import ast
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_spec"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, modules: Set[str]) -> Set[str]:
    """The package's modules that `path` imports (absolute or relative, at any depth)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` names a module; `from mod import name` names the module
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> Dict[str, Set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    graph = {module_name(f): imported_modules(f, modules) for f in files}
    # A package's __init__ re-exporting its own modules is the package, not an arrow up.
    for name, targets in graph.items():
        graph[name] = {t for t in targets if not (t.startswith(name + ".") and
                                                   (PACKAGE.parent / name.replace(".", "/")).is_dir())}
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def rooms(graph: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    """The graph between rooms: mlx_spec.X for a module X or a sub-package X."""
    def room(name: str) -> str:
        return ".".join(name.split(".")[:2])

    collapsed: Dict[str, Set[str]] = {}
    for name, targets in graph.items():
        collapsed.setdefault(room(name), set()).update(room(t) for t in targets)
    return {name: targets - {name} for name, targets in collapsed.items()}


def test_no_module_imports_in_a_circle():
    assert cycles(import_graph()) == []


def test_no_two_rooms_import_each_other():
    assert cycles(rooms(import_graph())) == []


def test_the_leaves_import_nothing_of_the_package():
    graph = import_graph()
    for leaf in ("defaults", "arguments", "acceptance", "costmodel", "memory", "attention"):
        assert graph[f"mlx_spec.{leaf}"] <= {"mlx_spec.defaults"}, leaf


def test_nothing_below_the_command_line_imports_it():
    graph = import_graph()
    for name, targets in graph.items():
        if name.startswith(("mlx_spec.cli", "mlx_spec.console", "mlx_spec.__main__")):
            continue
        assert not any(t == "mlx_spec.cli" or t.startswith("mlx_spec.cli.") for t in targets), name


FORBIDDEN_TOP_LEVELS = {"training", "bench", "tests", "subprocess"}  # the repository's rest; a shell


def top_level_imports(source: str) -> Set[str]:
    """The first names of the absolute imports in `source`, at any depth (os.system counts as
    an import of os.system)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Attribute) and node.attr in ("system", "popen")
              and isinstance(node.value, ast.Name) and node.value.id == "os"):
            found.add("subprocess")  # os.system / os.popen: a shell all the same
    return found


def test_the_package_imports_nothing_of_the_repository_and_runs_no_shell():
    """The wheel holds mlx_spec/ alone: the studies (bench/), training/ and the tests are not
    installed, and nothing in the product shells out."""
    for path in sorted(PACKAGE.rglob("*.py")):
        assert not top_level_imports(path.read_text()) & FORBIDDEN_TOP_LEVELS, path


def test_the_checks_can_fail():
    """Negative control: a circle through three modules, and two rooms leaning on each other."""
    graph = {"mlx_spec.a": {"mlx_spec.b"}, "mlx_spec.b": {"mlx_spec.c"}, "mlx_spec.c": {"mlx_spec.a"},
             "mlx_spec.d": set()}
    assert cycles(graph) == [["mlx_spec.a", "mlx_spec.b", "mlx_spec.c"]]
    files = {"mlx_spec.x.one": {"mlx_spec.y.two"}, "mlx_spec.y.three": {"mlx_spec.x.four"},
             "mlx_spec.x.four": set(), "mlx_spec.y.two": set()}
    assert cycles(files) == []
    assert cycles(rooms(files)) == [["mlx_spec.x", "mlx_spec.y"]]
    for source in ("from training.data import load_corpus", "import subprocess",
                   "def f():\n    from bench.studies import RESULTS_DIR", "import os\nos.system('git')"):
        assert top_level_imports(source) & FORBIDDEN_TOP_LEVELS, source
    assert not top_level_imports("from .bench import runner\nimport mlx.core") & FORBIDDEN_TOP_LEVELS


def test_the_reader_sees_relative_and_lazy_imports(tmp_path):
    assert "mlx_spec.sampling" in import_graph()["mlx_spec.loop"]
    assert "mlx_spec.cache.prefill" in import_graph()["mlx_spec.drafters.draft_model"]
    assert "mlx_spec.calibration" in import_graph()["mlx_spec.cli.tune"]  # inside a function
