"""The pure layers import neither torch nor Ray: a meta-path hook refuses both, then every module loads.

"Pure" is what the design says it is (docs/architecture.md): the service's decisions, planning, access
rules, store and vocabulary, and the workers' shared protocol and arithmetic. They run in the control
plane, which never loads torch, and they are unit-tested without a cluster. A module that starts to pull
either in (directly, through another etrain module, or through a third-party package) fails here with the
chain that did it. Each check runs in a fresh interpreter, so nothing already imported by the test
process can hide an import.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: Whole sub-packages that are pure: every module found in them is checked (new ones too).
PURE_PACKAGES = {
    "etrain.service.decisions": "service/decisions",
    "etrain.service.planning": "service/planning",
    "etrain.service.access": "service/access",
    "etrain.service.store": "service/store",
    "etrain.workers.protocol": "workers/protocol",
}

#: Single pure modules outside those packages (the workers' by room: tests/architecture/test_rooms.py).
PURE_MODULES = [
    "etrain.service.errors",
    "etrain.service.ports",
    "etrain.service.settings",
    "etrain.service.prometheus",
    "etrain.workers",
    "etrain.workers.families",  # the registry and each family's declaration; their *_model modules are torch
    "etrain.workers.families.base",
    "etrain.workers.families.gpt",
    "etrain.workers.families.layout",  # the layout rules that ask a family
    "etrain.workers.families.llama",
    "etrain.workers.families.mixtral",
    "etrain.workers.families.olmo2",
    "etrain.workers.families.qwen3_moe",
    "etrain.workers.checkpoints",
    "etrain.workers.checkpoints.checkpoint_commit",
    "etrain.workers.checkpoints.checkpoint_cadence",
    "etrain.workers.checkpoints.hf_config",
    "etrain.workers.checkpoints.storage",
    "etrain.workers.checkpoints.storage_faults",
    "etrain.workers.engine",
    "etrain.workers.engine.metrics",
    "etrain.workers.engine.text_files",
    "etrain.workers.engine.tokenized",
    "etrain.workers.rank",
    "etrain.workers.rank.device_info",
    "etrain.workers.rank.rank_log",
    "etrain.workers.rank.report_batch",
    "etrain.workers.rank.step_control",
    "etrain.workers.rank.host_memory",
]

BLOCKED = ("torch", "ray")

_PROBE = r"""
import importlib, importlib.abc, json, sys, traceback

BLOCKED = {blocked!r}

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked import of {{name}}")
        return None

sys.meta_path.insert(0, Refuse())
try:
    importlib.import_module({module!r})
except Exception:
    print(json.dumps({{"ok": False, "error": traceback.format_exc(limit=30)}}))
else:
    print(json.dumps({{"ok": True, "loaded": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)}}))
"""


def _exists(name: str) -> bool:
    """A module's file, or a package's ``__init__.py``, is in the repository."""
    path = REPO / name.removeprefix("etrain.").replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def pure_modules() -> list[str]:
    names = []
    for package, folder in PURE_PACKAGES.items():
        names.append(package)
        names += [f"{package}.{info.name}" for info in pkgutil.iter_modules([str(REPO / folder)])]
    names += [name for name in PURE_MODULES if _exists(name)]
    return sorted(names)


def test_the_list_of_pure_modules_is_not_empty_and_names_real_files():
    names = pure_modules()
    assert len(names) >= 30, names
    missing = [n for n in PURE_MODULES if not _exists(n)]
    assert missing == [], f"PURE_MODULES names modules that do not exist: {missing}"


@pytest.mark.parametrize("module", pure_modules())
def test_a_pure_module_imports_without_torch_or_ray(module, tmp_path):
    code = _PROBE.format(blocked=BLOCKED, module=module)
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["ok"], f"{module} pulls in torch or ray:\n{answer['error']}"
    assert answer["loaded"] == []


def test_every_registered_family_declaration_is_listed_as_pure():
    """A family added to the registry is declared in a pure module (the control plane imports it)."""
    from etrain.workers.families import FAMILIES

    declared = {type(found).__module__ for found in FAMILIES.values()}
    assert declared <= set(PURE_MODULES), sorted(declared - set(PURE_MODULES))


def test_the_hook_really_blocks(tmp_path):
    """The probe is not vacuous: a module that does import torch fails it."""
    code = _PROBE.format(blocked=BLOCKED, module="etrain.workers.families.model")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert not answer["ok"] and "blocked import of torch" in answer["error"]
