"""The rooms of ``workers/``: each sub-package has one purpose, and imports between them flow one way.

``workers/`` holds rooms only (no loose modules). The rooms form a layering: a room may import the rooms
listed before it in :data:`ROOMS`, never one after it, so the rank process sits on the engine, the engine
on the checkpoints, and everything on the model families and the protocol. There is no import against
that order: the protocol names a model family (``ModelConfig.arch``) but never asks one, so what depends
on a family (whether a name is registered, the parameter count, the presets, the layout rules that read
a family's declaration: ``etrain.workers.families.layout``) lives in the families room, which builds on
the protocol. The service and the API import the pure rooms (:data:`SERVICE_ROOMS`, :data:`API_ROOMS`)
and, from the other rooms, only the modules named with a reason.

Every import counts here, wherever it is written (module level, inside a function, under TYPE_CHECKING):
a function-level import is still a dependency of the room that writes it. ``test_boundaries.py`` adds
that none of what the service imports loads torch, and that no module imports another in a cycle.
"""

from __future__ import annotations

import ast

from tests.architecture.import_graph import REPO, Import, imports_of, inside, modules, torch_at_load, where

WORKERS = "etrain.workers"

#: Every room, in layering order (a room may import only rooms before it), with its one-line purpose.
ROOMS = {
    "protocol": "what the service and the ranks share and both apply: run config, errors, manifest format, "
    "messages, the family-free layout rules, topology, safe paths (pure; it asks no model family)",
    "families": "the model families: one declaration each and the registry (presets, parameter counts), the "
    "layout rules that ask a family (all pure), their torch modules, the builder and the loss",
    "checkpoints": "DCP save/load, commit, snapshots, storage and its faults, Hugging Face in and out",
    "engine": "one rank's Trainer: parallelism, pipeline, mesh, init, optimizer, data, timing; torchrun",
    "rank": "the rank process: the Ray actor, warm spares, rank log, reports, step control, chaos drills",
}

#: Which rooms each room may import (every import, at any level): only rooms before it in ``ROOMS``.
MAY_IMPORT = {
    "protocol": set(),
    "families": {"protocol"},
    "checkpoints": {"protocol", "families"},
    "engine": {"protocol", "families", "checkpoints"},
    "rank": {"protocol", "families", "checkpoints", "engine"},
}

#: The rooms the service may import any module of (the torch modules of the families excepted:
#: ``test_boundaries.py`` refuses every import of a module that loads torch).
SERVICE_ROOMS = {"protocol", "families"}
#: The modules of the other rooms the service may import, with why.
SERVICE_MAY_IMPORT = {
    "etrain.workers.checkpoints.checkpoint_commit": "the supervisor commits, verifies and prunes step directories; "
    "the manager reads which steps are committed (pure)",
    "etrain.workers.checkpoints.storage": "checkpoint directories and logs on local folders or s3:// (pure)",
    "etrain.workers.checkpoints.hf_config": "a model.hf folder's config.json is read at submit, to check and plan "
    "the job (pure)",
    "etrain.workers.checkpoints.hf_io": "inside the Hugging Face export task's body only, a Ray task "
    "(test_boundaries.SERVICE_REMOTE_BODIES)",
    "etrain.workers.engine.tokenized": "inside the submit checks: a text data set with a tokenizer is tokenized "
    "once, at submit (torch-free)",
    "etrain.workers.rank.rank_log": "GET /logs reads the log files the ranks write (pure)",
    "etrain.workers.rank.device_info": "inside the one-GPU probe task's body only, a Ray task",
}

#: The rooms the API may import any module of, and the other modules it may import, with why.
API_ROOMS = {"protocol"}
API_MAY_IMPORT = {
    "etrain.workers.engine.tokenized": "`etrain prepare-data` tokenizes text locally, without a server (torch-free)",
}


def room_of(module: str) -> str | None:
    """The room a workers module is in (None for ``etrain.workers`` itself and for modules elsewhere)."""
    if not inside(WORKERS, module) or module == WORKERS:
        return None
    return module.split(".")[2]


def _workers_imports() -> list[Import]:
    return [
        imp for name in modules() if inside(WORKERS, name) for imp in imports_of(name) if inside(WORKERS, imp.target)
    ]


def room_violations(imports: list[Import]) -> list[Import]:
    """The imports between rooms that ``MAY_IMPORT`` does not allow."""
    return [
        imp
        for imp in imports
        if room_of(imp.source) != room_of(imp.target)
        and room_of(imp.target) not in MAY_IMPORT.get(room_of(imp.source), set())
    ]


def _outside_violations(layer: str, rooms: set[str], allowed: dict[str, str]) -> list[str]:
    return [
        where(imp)
        for name in modules()
        if inside(layer, name)
        for imp in imports_of(name)
        if inside(WORKERS, imp.target) and room_of(imp.target) not in rooms and imp.target not in allowed
    ]


def _docstring(path) -> str | None:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))


def test_workers_holds_the_rooms_and_nothing_else():
    """Every workers module is in a room; every folder under workers/ is a room or inside one."""
    folders = {path.name for path in (REPO / "workers").iterdir() if (path / "__init__.py").exists()}
    assert folders == set(ROOMS)
    outside = sorted(
        name for name in modules() if inside(WORKERS, name) and name != WORKERS and room_of(name) not in ROOMS
    )
    assert outside == []
    assert sorted(path.name for path in (REPO / "workers").glob("*.py")) == ["__init__.py"]


def test_each_room_says_its_one_purpose_and_loads_light():
    """Each room's ``__init__`` opens with its purpose; importing a room's package loads no torch."""
    for room in ROOMS:
        doc = _docstring(REPO / "workers" / room / "__init__.py")
        assert doc and doc.split(".")[0].strip(), f"workers/{room}/__init__.py has no one-line purpose"
        assert f"{WORKERS}.{room}" not in torch_at_load(), f"importing etrain.workers.{room} loads torch"
    assert _docstring(REPO / "workers" / "__init__.py"), "workers/__init__.py names the rooms"


def test_the_rooms_are_a_layering():
    """Each room may import only rooms before it, so the allowed imports between rooms have no cycle."""
    order = list(ROOMS)
    assert set(MAY_IMPORT) == set(ROOMS)
    for room, allowed in MAY_IMPORT.items():
        assert allowed <= set(order[: order.index(room)]), (room, allowed)


def test_every_import_between_rooms_is_allowed():
    bad = [
        where(imp) + f" ({room_of(imp.source)} -> {room_of(imp.target)})" for imp in room_violations(_workers_imports())
    ]
    assert bad == [], "an import between the rooms of workers/ that MAY_IMPORT does not allow:\n" + "\n".join(bad)


def test_the_service_imports_only_the_pure_rooms_and_the_modules_named():
    bad = _outside_violations("etrain.service", SERVICE_ROOMS, SERVICE_MAY_IMPORT)
    assert bad == [], (
        "service/ may import from workers/ only "
        + ", ".join(sorted(SERVICE_ROOMS))
        + " and SERVICE_MAY_IMPORT:\n"
        + "\n".join(bad)
    )


def test_the_api_imports_only_the_protocol_and_the_modules_named():
    bad = _outside_violations("etrain.api", API_ROOMS, API_MAY_IMPORT)
    assert bad == [], "api/ may import from workers/ only etrain.workers.protocol and API_MAY_IMPORT:\n" + "\n".join(
        bad
    )


def test_the_modules_named_for_the_service_and_the_api_exist_and_are_used():
    """A name left behind by a move, or a reason no longer true, fails here."""
    used = {
        imp.target
        for name in modules()
        if inside("etrain.service", name) or inside("etrain.api", name)
        for imp in imports_of(name)
    }
    for allowed in (SERVICE_MAY_IMPORT, API_MAY_IMPORT):
        assert set(allowed) <= set(modules()), sorted(set(allowed) - set(modules()))
        assert set(allowed) <= used, sorted(set(allowed) - used)


def test_what_the_service_imports_from_the_other_rooms_is_pure():
    """Loaded with torch and Ray blocked (``test_pure_layers.py``), but for the Ray task bodies."""
    from tests.architecture.test_boundaries import SERVICE_REMOTE_BODIES
    from tests.architecture.test_pure_layers import pure_modules

    assert sorted(set(SERVICE_MAY_IMPORT) - set(SERVICE_REMOTE_BODIES) - set(pure_modules())) == []


def test_the_room_rules_are_not_vacuous():
    """The rule sees the imports the layering is made of, and refuses one against it."""
    seen = {(room_of(imp.source), room_of(imp.target)) for imp in _workers_imports()}
    assert {
        ("rank", "engine"),
        ("engine", "checkpoints"),
        ("checkpoints", "families"),
        ("families", "protocol"),
    } <= seen
    upward = Import("etrain.workers.engine.train", "etrain.workers.rank.worker", 1, True, False)
    sideways = Import("etrain.workers.rank.worker", "etrain.workers.engine.train", 1, True, False)
    asks_a_family = Import("etrain.workers.protocol.run_config", "etrain.workers.families", 1, False, False)
    assert room_violations([upward, sideways, asks_a_family]) == [upward, asks_a_family]
