"""The package's shape: no module imports another that (directly or not) imports it back, whether at module
level, under TYPE_CHECKING or inside a function; and no module grows past one screenful of jobs (400 lines)."""

from __future__ import annotations

import ast
from pathlib import Path

import mili_openai

PACKAGE_DIR = Path(mili_openai.__file__).parent
PACKAGE = "mili_openai"
MAX_MODULE_LINES = 400


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `path` imports anywhere in its body (`from pkg import mod` counts `pkg.mod`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    # a package's __init__ is not an edge of its own: importing mili_openai.x.y runs it, but the cycles worth
    # catching are between modules that name each other
    return {name for name in found if name in modules and name.startswith(PACKAGE) and modules[name].name != "__init__.py"}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    visiting: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> list[str] | None:
        if module in visiting:
            return visiting[visiting.index(module):] + [module]
        if module in done:
            return None
        visiting.append(module)
        for imported in sorted(graph[module]):
            cycle = visit(imported)
            if cycle:
                return cycle
        visiting.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module)
        if cycle:
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_itself_back():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph) or [])


def test_no_module_is_over_400_lines():
    too_long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not too_long, too_long
