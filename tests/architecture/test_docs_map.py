"""The module map (docs/architecture.md) and CONTRIBUTING.md name the modules that exist, and every module
is named.

The map is what a newcomer reads first (the README's picture links it); a module that is moved, split or
added without updating it makes the map lie. Cells name files by path (``service/jobs/poller.py``), a
package by its folder (``api/cli/``, ``api/routes/*``), or, after a first path in the same cell, a sibling
by its bare name (``spec_paths.py``) or by the shared prefix's tail (``_checkpoints.py`` after
``supervisor_lifecycle.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("api", "service", "workers")


def _module_map() -> str:
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    start = text.index("## Module map\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end == -1 else text[start:end]


def _table_names() -> set[str]:
    """Every path the module table's first column names, with siblings and folders expanded."""
    named: set[str] = set()
    for line in _module_map().splitlines():
        if not line.startswith("| `"):
            continue
        cell = line.split("|")[1]
        folder, stem = None, None
        for token in re.findall(r"`([^`]+)`", cell):
            token = token.removesuffix("*")
            if "/" in token:
                path = Path(token)
                folder, stem = (path, None) if token.endswith("/") else (path.parent, path.stem)
                named.add(token.rstrip("/"))
            elif folder is not None:
                if token.startswith("_") and stem:
                    token = stem.split("_")[0] + token
                named.add(f"{folder.as_posix()}/{token}")
    return named


def _modules() -> set[str]:
    return {
        path.relative_to(REPO).as_posix()
        for folder in FOLDERS
        for path in (REPO / folder).rglob("*.py")
        if path.name != "__init__.py" and "__pycache__" not in path.parts
    }


def _covered(module: str, named: set[str]) -> bool:
    return any(module == name or module.startswith(name + "/") for name in named)


def test_every_name_in_the_module_table_exists():
    missing = sorted(name for name in _table_names() if not (REPO / name).exists())
    assert missing == []


def test_every_module_is_in_the_module_table():
    named = _table_names()
    assert sorted(module for module in _modules() if not _covered(module, named)) == []


def test_contributing_names_only_real_paths():
    text = (REPO / "CONTRIBUTING.md").read_text(encoding="utf-8")
    paths = set(re.findall(r"`((?:api|service|workers|tests|helm|deploy|benchmarks)/[\w./]*)`", text))
    assert len(paths) > 20
    assert sorted(path for path in paths if not (REPO / path).exists()) == []
