"""The import graph of every etrain module, read from the source (AST), for the architecture tests.

An import is recorded wherever it is written: at module level, inside a function (it runs in the same
process when the function is called), or under ``if TYPE_CHECKING:`` (a dependency of the types). The
tests decide which of them a rule counts.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = {"etrain.api": "api", "etrain.service": "service", "etrain.workers": "workers"}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the module imported (a submodule when ``from package import submodule``)
    line: int
    in_function: bool
    type_only: bool  # under ``if TYPE_CHECKING:``

    @property
    def at_load(self) -> bool:
        """Runs when the source module loads."""
        return not (self.in_function or self.type_only)


@cache
def modules() -> dict[str, Path]:
    """Every etrain module (a package is its ``__init__``) -> its file."""
    found = {}
    for package, folder in FOLDERS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def resolve(source: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = source if modules()[source].name == "__init__.py" else source.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@cache
def imports_of(source: str) -> tuple[Import, ...]:
    tree = ast.parse(modules()[source].read_text(), filename=str(modules()[source]))
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function = True
        if isinstance(node, ast.If) and is_type_checking(node.test):
            for child in node.body:
                visit(child, in_function, True)
            for child in node.orelse:
                visit(child, in_function, type_only)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(source, alias.name, node.lineno, in_function, type_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = resolve(source, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(source, sub if sub in modules() else base, node.lineno, in_function, type_only))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function, type_only)

    visit(tree, False, False)
    return tuple(dict.fromkeys(found))  # `from x import a, b`: one import of x


def top(name: str) -> str:
    return name.split(".")[0]


@cache
def torch_at_load() -> frozenset[str]:
    """The etrain modules that import torch when they load, directly or through another etrain module."""
    result = {name for name in modules() if any(top(imp.target) == "torch" and imp.at_load for imp in imports_of(name))}
    changed = True
    while changed:
        changed = False
        for name in modules():
            if name not in result and any(imp.at_load and imp.target in result for imp in imports_of(name)):
                result.add(name)
                changed = True
    return frozenset(result)


def inside(package: str, name: str) -> bool:
    return name == package or name.startswith(package + ".")


def where(imp: Import) -> str:
    return f"{modules()[imp.source].relative_to(REPO)}:{imp.line} imports {imp.target}"


def layer_imports(package: str) -> list[Import]:
    return [imp for name in modules() if inside(package, name) for imp in imports_of(name)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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
                if len(component) > 1:
                    found.append(sorted(component))
    return found
