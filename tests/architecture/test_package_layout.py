"""The installed import package is ``etrain`` and nothing with a generic name is installed.

The folders ``api/``, ``service/`` and ``workers/`` stay at the top of the repository and setuptools maps
them to ``etrain.api``, ``etrain.service`` and ``etrain.workers`` (``package-dir`` in pyproject.toml).
Setuptools does not find mapped sub-packages by itself, so pyproject lists every package; these tests
keep that list equal to the folders and check what a process outside the repository can import.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = {"etrain.api": "api", "etrain.service": "service", "etrain.workers": "workers"}


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _package_folders() -> set[str]:
    names = set()
    for package, folder in FOLDERS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO / folder).as_posix()
            names.add(package if relative == "." else f"{package}.{relative.replace('/', '.')}")
    return names


def test_pyproject_lists_every_package_folder_and_nothing_else():
    tool = _pyproject()["tool"]["setuptools"]
    assert set(tool["packages"]) == _package_folders()
    assert tool["package-dir"] == FOLDERS


def test_the_cli_entry_point_is_in_the_etrain_package():
    assert _pyproject()["project"]["scripts"]["etrain"] == "etrain.api.cli:main"


def test_outside_the_repository_only_etrain_is_importable(tmp_path):
    """From another directory: ``etrain.*`` resolves to these folders and the bare names do not exist."""
    code = (
        "import importlib.util, json\n"
        "found = {name: importlib.util.find_spec(name) is not None for name in ('api', 'service', 'workers')}\n"
        "spec = importlib.util.find_spec('etrain.service.decisions.supervisor')\n"
        "print(json.dumps({'bare': found, 'origin': spec.origin}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    import json

    answer = json.loads(result.stdout)
    assert answer["bare"] == {"api": False, "service": False, "workers": False}
    assert Path(answer["origin"]) == REPO / "service" / "decisions" / "supervisor.py"


def test_no_source_file_imports_the_bare_top_level_names():
    """Every import in the code, tests and benchmarks says ``etrain.``: a bare ``service.x`` would load a
    second copy of the module (two different classes for one name) whenever the repo is on sys.path."""
    import ast

    offenders = []
    for folder in ("api", "service", "workers", "tests", "benchmarks"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    if name.split(".")[0] in ("api", "service", "workers"):
                        offenders.append(f"{path.relative_to(REPO)}:{node.lineno} imports {name}")
    assert offenders == []
