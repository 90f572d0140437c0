"""Which compiled code a job shares through its checkpoint folder, and who writes and reads it (pure).

Why: inductor's caches live on a node's disk (``workers/engine/compile.py``), so a rank that lands on a
node the job never ran on (a node lost and replaced, a resize onto a new node, a relaunch elsewhere)
compiles from scratch: 12 s of a 17 s start on a fresh H200 node, against 1.1 s with the node's cache
warm. torch's portable cache artifacts (``torch.compiler.save_cache_artifacts``: inductor's FX graphs,
with the Triton kernels bundled, and AOTAutograd's entries) carry that cache to any node, so one rank
per pipeline stage writes them next to the checkpoints once it has compiled, and a rank started later
loads its stage's set before its first step (``workers/engine/compile_artifacts.py``).

Trust: the artifacts are code the rank will run (torch unpickles them, and the graphs are Python it
imports), and the checkpoint folder can be written by the job's tenant. So a set is loaded only when its bytes hash to the digest its writer reported to the
supervisor over Ray (:class:`CompileArtifacts` rides in the :class:`~etrain.workers.protocol.messages.
LaunchPlan`, never read back from storage): a file replaced in the folder is refused, not run.

Neither torch nor Ray: the supervisor checks what a rank reports with :func:`parse_report`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from etrain.workers.protocol.topology import Coords

__all__ = [
    "FOLDER",
    "MAX_BYTES",
    "CompileArtifacts",
    "file_name",
    "for_stage",
    "parse_report",
    "replace_stage",
    "writes_for_its_stage",
]

#: The folder under the job's checkpoint folder that holds the sets (``<sha256>.bin`` each).
FOLDER = "compile-cache"
#: The largest set written or read (a Llama-1B stage's compiled blocks are a few MB; the bound keeps a
#: runaway set, or a planted file, from filling a node's memory).
MAX_BYTES = 1 << 30

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, kw_only=True)
class CompileArtifacts:
    """One stage's compiled code as a rank wrote it: what a later rank of that stage loads."""

    stage: int  # the pipeline stage (pp coordinate) whose blocks were compiled
    sha256: str  # of the file's bytes, as the writer computed them before writing
    size: int  # bytes


def file_name(sha256: str) -> str:
    """The set's file under :data:`FOLDER`: named by its content, so two writes of one set are one file
    and a name can never hold another set's bytes."""
    return f"{sha256}.bin"


def writes_for_its_stage(coords: Coords) -> bool:
    """Whether the rank at ``coords`` writes its stage's set: the first rank of each stage. Its data-,
    context- and tensor-parallel peers compile the same graphs (same code, same shapes), so one copy a
    stage is enough, and a stage's later ranks load it whatever their position."""
    return coords.dp == 0 and coords.tp == 0 and coords.cp == 0


def for_stage(records: Iterable[CompileArtifacts], stage: int) -> CompileArtifacts | None:
    """The set a rank of ``stage`` loads: its stage's own, else the first stage's (its blocks compile the
    same graphs as every other stage's; only the last stage's loss is missing), else none."""
    by_stage = {record.stage: record for record in records}
    return by_stage.get(stage) or by_stage.get(0)


def replace_stage(records: Iterable[CompileArtifacts], new: CompileArtifacts) -> tuple[CompileArtifacts, ...]:
    """``records`` with ``new`` in place of its stage's set, ordered by stage."""
    kept = {record.stage: record for record in records}
    kept[new.stage] = new
    return tuple(kept[stage] for stage in sorted(kept))


def parse_report(report: Mapping[str, object], *, stages: int) -> CompileArtifacts:
    """A rank's report of a set it wrote, checked field by field (``ValueError`` naming the field): the
    supervisor keeps only sets a later plan can safely name."""
    if not isinstance(report, Mapping):
        raise ValueError(f"a compile-artifacts report is a mapping, not {type(report).__name__}")
    stage, sha256, size = report.get("stage"), report.get("sha256"), report.get("size")
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < stages:
        raise ValueError(f"stage must be a pipeline stage 0..{stages - 1}, not {stage!r}")
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        raise ValueError(f"sha256 must be 64 lowercase hex digits, not {str(sha256)[:80]!r}")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_BYTES:
        raise ValueError(f"size must be 1..{MAX_BYTES} bytes, not {size!r}")
    return CompileArtifacts(stage=stage, sha256=sha256, size=size)
