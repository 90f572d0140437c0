"""Which way imports flow, read from the source (AST): api -> service -> workers, through the protocol.

* ``service/`` talks to the ranks through ``etrain.workers.protocol`` (messages, run config, errors,
  manifest format): it never imports the rank actor modules (``worker``, ``spare``), the drill plugin,
  the engine (``train``, ``checkpoint``), nor any worker module that imports torch when loaded. At any
  level: an import inside a function runs in the service's process just the same. The actor classes are
  named by the protocol (``RANK_ACTOR_CLASS``) and loaded where actors are created.
* ``api/`` imports from ``workers/`` only the protocol (and the few pure helpers listed with a reason).
* ``workers/`` never imports ``service/`` or ``api/``.
* No import cycle among etrain modules (module-level imports, TYPE_CHECKING ones included).
* Both sides of the actor calls agree: the classes the protocol names have every call it lists, with
  the same parameters.
"""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = {"etrain.api": "api", "etrain.service": "service", "etrain.workers": "workers"}

#: Worker modules the service must never import, at any level, beyond those that import torch.
SERVICE_NEVER = {"etrain.workers.rank.worker", "etrain.workers.rank.spare", "etrain.workers.rank.chaos", "etrain.workers.engine.train",
                 "etrain.workers.checkpoints.checkpoint"}
#: Torch-importing worker modules the service may import inside a function, with why that function never
#: runs in a service process.
SERVICE_REMOTE_BODIES = {
    "etrain.workers.checkpoints.hf_io": "the Hugging Face export task's body (supervisor's _export_folder) runs in its own Ray "
                            "worker process",
}
#: Worker modules outside the protocol that api/ may import, with why.
API_MAY_IMPORT = {
    "etrain.workers.engine.tokenized": "`etrain prepare-data` tokenizes text locally, without a server (pure: no torch)",
}


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


def _resolve(source: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = source if modules()[source].name == "__init__.py" else source.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@cache
def imports_of(source: str) -> tuple[Import, ...]:
    tree = ast.parse(modules()[source].read_text(), filename=str(modules()[source]))
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function = True
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, in_function, True)
            for child in node.orelse:
                visit(child, in_function, type_only)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(source, alias.name, node.lineno, in_function, type_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(source, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(source, sub if sub in modules() else base, node.lineno, in_function, type_only))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function, type_only)

    visit(tree, False, False)
    return tuple(dict.fromkeys(found))  # `from x import a, b`: one import of x


def _top(name: str) -> str:
    return name.split(".")[0]


@cache
def torch_at_load() -> frozenset[str]:
    """The etrain modules that import torch when they load, directly or through another etrain module."""
    result = {name for name in modules()
              if any(_top(imp.target) == "torch" and imp.at_load for imp in imports_of(name))}
    changed = True
    while changed:
        changed = False
        for name in modules():
            if name not in result and any(imp.at_load and imp.target in result for imp in imports_of(name)):
                result.add(name)
                changed = True
    return frozenset(result)


def _in(package: str, name: str) -> bool:
    return name == package or name.startswith(package + ".")


def _where(imp: Import) -> str:
    return f"{modules()[imp.source].relative_to(REPO)}:{imp.line} imports {imp.target}"


def _layer_imports(package: str) -> list[Import]:
    return [imp for name in modules() if _in(package, name) for imp in imports_of(name)]


def test_the_module_map_and_the_torch_set_are_real():
    """Not vacuous: the engine is seen to import torch, the protocol is not, and the rules' names exist."""
    names = set(modules())
    assert {"etrain.service.runtime.worker_group", "etrain.workers.protocol.messages", "etrain.api.cli"} <= names
    assert {"etrain.workers.engine.train", "etrain.workers.checkpoints.checkpoint", "etrain.workers.families.model"} <= torch_at_load()
    assert not {"etrain.workers.rank.worker", "etrain.workers.protocol.messages"} & torch_at_load()
    assert SERVICE_NEVER | set(SERVICE_REMOTE_BODIES) | set(API_MAY_IMPORT) <= names


def test_the_service_never_imports_rank_actors_the_engine_or_torch():
    bad = []
    for imp in _layer_imports("etrain.service"):
        if _top(imp.target) == "torch" or imp.target in SERVICE_NEVER:
            bad.append(_where(imp))
        elif imp.target in torch_at_load() and (imp.at_load or imp.target not in SERVICE_REMOTE_BODIES):
            bad.append(_where(imp) + " (which imports torch)")
    assert bad == [], "service/ must reach the ranks through etrain.workers.protocol:\n" + "\n".join(bad)


def test_the_service_does_not_name_rank_modules_either():
    """A dotted name in a string is an import by another route: only the protocol names the actor classes."""
    dotted = re.compile(r"^etrain(\.\w+)+$")
    bad = []
    for name, path in modules().items():
        if not _in("etrain.service", name):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and dotted.match(node.value):
                target = node.value
                while target and target not in modules():
                    target = target.rpartition(".")[0]
                if target in SERVICE_NEVER or target in torch_at_load():
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno} names {node.value!r}")
    assert bad == []


def test_the_api_imports_only_the_protocol_from_the_workers():
    bad = [_where(imp) for imp in _layer_imports("etrain.api")
           if _top(imp.target) == "torch" or (_in("etrain.workers", imp.target)
                                               and not _in("etrain.workers.protocol", imp.target)
                                               and imp.target not in API_MAY_IMPORT)]
    assert bad == [], "api/ may import only etrain.workers.protocol from the workers:\n" + "\n".join(bad)


def test_the_workers_never_import_the_service_or_the_api():
    bad = [_where(imp) for imp in _layer_imports("etrain.workers")
           if _in("etrain.service", imp.target) or _in("etrain.api", imp.target)]
    assert bad == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_etrain_modules():
    """Imports at module level, those under TYPE_CHECKING too (two modules that name each other's types
    are one module in two files); an import inside a function is a dependency of that call only."""
    graph = {name: {imp.target for imp in imports_of(name) if not imp.in_function and imp.target in modules()
                    and imp.target != name}
             for name in modules()}
    assert _cycles(graph) == []


def _parameters(function) -> list[tuple[str, object]]:
    """A call's parameters; without the ``_ray_trace_ctx`` that ``ray.remote`` adds to a class's methods
    in place (once any test in this process has made the class an actor)."""
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values() if p.name != "_ray_trace_ctx"]


def test_the_actor_classes_have_the_calls_the_protocol_lists():
    """Both sides of each Ray call: a call renamed or re-shaped on one side only fails here, not in a job."""
    from etrain.service.runtime.supervisor_actor import JobSupervisor
    from etrain.workers.protocol import messages

    pairs = [(messages.RankActor, messages.load_actor_class(messages.RANK_ACTOR_CLASS)),
             (messages.SpareActor, messages.load_actor_class(messages.SPARE_ACTOR_CLASS)),
             (messages.SupervisorReports, JobSupervisor)]
    checked = 0
    for protocol, cls in pairs:
        calls = [name for base in protocol.__mro__ if base.__module__ == messages.__name__
                 for name, member in vars(base).items() if inspect.isfunction(member) and not name.startswith("_")]
        for name in calls:
            assert _parameters(getattr(cls, name)) == _parameters(getattr(protocol, name)), (cls.__name__, name)
            checked += 1
    assert checked == 7 + 9 + 4
