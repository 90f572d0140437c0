"""Which way imports flow between the layers, read from the source (AST): api -> service -> workers.

* ``service/`` talks to the ranks through ``etrain.workers.protocol`` (messages, run config, errors,
  manifest format, layout rules): it never imports the rank actor modules (``rank.worker``,
  ``rank.spare``), the drill plugin (``rank.chaos``), the engine (``engine.train``,
  ``checkpoints.checkpoint``), nor any worker module that imports torch when loaded. At any level: an
  import inside a function runs in the service's process just the same. The actor classes are named by
  the protocol (``RANK_ACTOR_CLASS``) and loaded where actors are created.
* ``workers/`` never imports ``service/`` or ``api/``.
* No import cycle among etrain modules (every import: module level, TYPE_CHECKING, inside functions).
* Both sides of the actor calls agree: the classes the protocol names have every call it lists, with
  the same parameters.

Which rooms of ``workers/`` the service and the API may import, and the rooms' own rules:
``test_rooms.py``.
"""

from __future__ import annotations

import ast
import inspect
import re

from tests.architecture.import_graph import (
    REPO,
    cycles,
    imports_of,
    inside,
    layer_imports,
    modules,
    top,
    torch_at_load,
    where,
)

#: Worker modules the service must never import, at any level, beyond those that import torch.
SERVICE_NEVER = {
    "etrain.workers.rank.worker",
    "etrain.workers.rank.spare",
    "etrain.workers.rank.chaos",
    "etrain.workers.engine.train",
    "etrain.workers.checkpoints.checkpoint",
}
#: Torch-importing worker modules the service may import inside a function, with why that function never
#: runs in a service process.
SERVICE_REMOTE_BODIES = {
    "etrain.workers.checkpoints.hf_io": "the Hugging Face export task's body (supervisor's _export_folder) runs in "
    "its own Ray worker process",
}


def test_the_module_map_and_the_torch_set_are_real():
    """Not vacuous: the engine is seen to import torch, the protocol is not, and the rules' names exist."""
    names = set(modules())
    assert {"etrain.service.runtime.worker_group", "etrain.workers.protocol.messages", "etrain.api.cli"} <= names
    assert {
        "etrain.workers.engine.train",
        "etrain.workers.checkpoints.checkpoint",
        "etrain.workers.families.model",
    } <= torch_at_load()
    assert not {"etrain.workers.rank.worker", "etrain.workers.protocol.messages"} & torch_at_load()
    assert SERVICE_NEVER | set(SERVICE_REMOTE_BODIES) <= names


def test_the_service_never_imports_rank_actors_the_engine_or_torch():
    bad = []
    for imp in layer_imports("etrain.service"):
        if top(imp.target) == "torch" or imp.target in SERVICE_NEVER:
            bad.append(where(imp))
        elif imp.target in torch_at_load() and (imp.at_load or imp.target not in SERVICE_REMOTE_BODIES):
            bad.append(where(imp) + " (which imports torch)")
    assert bad == [], "service/ must reach the ranks through etrain.workers.protocol:\n" + "\n".join(bad)


def test_the_service_does_not_name_rank_modules_either():
    """A dotted name in a string is an import by another route: only the protocol names the actor classes."""
    dotted = re.compile(r"^etrain(\.\w+)+$")
    bad = []
    for name, path in modules().items():
        if not inside("etrain.service", name):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and dotted.match(node.value):
                target = node.value
                while target and target not in modules():
                    target = target.rpartition(".")[0]
                if target in SERVICE_NEVER or target in torch_at_load():
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno} names {node.value!r}")
    assert bad == []


def test_the_workers_never_import_the_service_or_the_api():
    bad = [
        where(imp)
        for imp in layer_imports("etrain.workers")
        if inside("etrain.service", imp.target) or inside("etrain.api", imp.target)
    ]
    assert bad == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_etrain_modules():
    """Every import counts: at module level, under TYPE_CHECKING (two modules that name each other's types
    are one module in two files) and inside a function (a function-level import that closes a loop is a
    cycle put off until the call, not a cycle broken: the two modules still cannot be understood, moved
    or tested apart)."""
    graph = {
        name: {imp.target for imp in imports_of(name) if imp.target in modules() and imp.target != name}
        for name in modules()
    }
    assert cycles(graph) == []


def _parameters(function) -> list[tuple[str, object]]:
    """A call's parameters; without the ``_ray_trace_ctx`` that ``ray.remote`` adds to a class's methods
    in place (once any test in this process has made the class an actor)."""
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values() if p.name != "_ray_trace_ctx"]


def test_the_actor_classes_have_the_calls_the_protocol_lists():
    """Both sides of each Ray call: a call renamed or re-shaped on one side only fails here, not in a job."""
    from etrain.service.runtime.supervisor_actor import JobSupervisor
    from etrain.workers.protocol import messages

    pairs = [
        (messages.RankActor, messages.load_actor_class(messages.RANK_ACTOR_CLASS)),
        (messages.SpareActor, messages.load_actor_class(messages.SPARE_ACTOR_CLASS)),
        (messages.SupervisorReports, JobSupervisor),
    ]
    checked = 0
    for protocol, cls in pairs:
        calls = [
            name
            for base in protocol.__mro__
            if base.__module__ == messages.__name__
            for name, member in vars(base).items()
            if inspect.isfunction(member) and not name.startswith("_")
        ]
        for name in calls:
            assert _parameters(getattr(cls, name)) == _parameters(getattr(protocol, name)), (cls.__name__, name)
            checked += 1
    assert checked == 7 + 9 + 4
