"""Where a spec's paths point: pinned at submit time, and fenced by the storage roots.

Workers run in Ray's own working directories, so every path a spec names (``model.hf``, ``data.path``,
``data.tokenizer``, ``checkpoint.path``) is resolved against the server's directory before the job is
recorded; the resolved path is what the operator's storage roots (``service/access/storage_roots.py``)
judge, before anything looks at the files.
"""

from __future__ import annotations

import os

from etrain.service.access import storage_roots
from etrain.service.planning.spec import JobSpec, SpecProblem
from etrain.workers.protocol.errors import ConfigError

__all__ = ["PATH_FIELDS", "pin_model_kind", "pin_paths", "resolve_paths"]


#: The spec's path fields, as (dotted field, section, attribute): every one is pinned and fenced.
PATH_FIELDS = (
    ("model.hf", "model", "hf"),
    ("data.path", "data", "path"),
    ("data.tokenizer", "data", "tokenizer"),
    ("checkpoint.path", "checkpoint", "path"),
)


def resolve_paths(spec: JobSpec, base_dir: str | os.PathLike) -> JobSpec:
    """Pin model.hf, data.path, data.tokenizer and checkpoint.path: ``~`` expanded, joined with the
    server's working directory when relative, symlinks and ``..`` resolved (:func:`storage_roots.pin`).

    Workers run in Ray's own working directories, so a relative path must be pinned at submit time;
    the resolved path is also what the storage-roots rule judges (:func:`pin_paths`).
    """
    sections: dict[str, dict[str, str]] = {}
    for _field, section, name in PATH_FIELDS:
        raw = getattr(getattr(spec, section), name)
        if raw:
            pinned = storage_roots.pin(raw, base_dir)
            if pinned != raw:
                sections.setdefault(section, {})[name] = pinned
    updates = {section: getattr(spec, section).model_copy(update=values) for section, values in sections.items()}
    return spec.model_copy(update=updates) if updates else spec


def pin_paths(
    spec: JobSpec,
    base_dir: str | os.PathLike,
    roots: storage_roots.StorageRoots,
    *,
    shown_roots: tuple[str, ...] | None = None,
) -> tuple[JobSpec, list[SpecProblem]]:
    """:func:`resolve_paths`, then the storage-roots rule on the pinned paths: the spec as it will run
    and the paths it may not use (empty: all inside the roots). A ``model.hf`` the roots allow also pins
    ``model.kind`` (:func:`pin_model_kind`).

    Call it before anything looks at the files (:func:`~etrain.service.planning.spec_checks.check_spec` reports
    missing ones): a refused
    path's problem depends only on the given string and where it resolves, and echoes the given
    string, so the answer is the same whether the file exists or not. ``shown_roots``: the roots a
    refusal may name (the caller's own and the shared ones).
    """
    pinned = resolve_paths(spec, base_dir)
    problems = []
    for field, section, name in PATH_FIELDS:
        raw = getattr(getattr(spec, section), name)
        if raw:
            problem = roots.check(field, raw, getattr(getattr(pinned, section), name), shown=shown_roots)
            if problem is not None:
                problems.append(SpecProblem(field=problem.field, message=problem.message, fix=problem.fix))
    if not any(p.field == "model.hf" for p in problems):
        pinned = pin_model_kind(pinned)
    return pinned, problems


def pin_model_kind(spec: JobSpec) -> JobSpec:
    """With ``model.hf`` and no ``model.kind``: the kind its ``config.json`` holds (the family that loads its
    ``architectures``), so the stored spec says which family runs. A folder that cannot be read, or holds
    no supported architecture, is left as it is: :func:`~etrain.service.planning.spec_checks.check_spec`
    names the problem. Call it only for a ``model.hf`` the storage roots allow."""
    model = spec.model
    if model.hf is None or model.kind is not None:
        return spec
    try:
        kind = model.to_config().arch
    except ConfigError:
        return spec
    return spec.model_copy(update={"model": model.model_copy(update={"kind": kind})})
