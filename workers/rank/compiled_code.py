"""A rank's part in sharing compiled code through the job's checkpoint folder (``training.compile``).

Before its first step a rank loads its pipeline stage's set, if the plan names one
(``workers/engine/compile_artifacts.py``); after it, the first rank of each stage writes the set when
the plan had none for its stage or the step still compiled something, in the background (training
does not wait for the write), and reports it to the supervisor, which names it in every later plan.
The rules are in ``workers/protocol/compile_sharing.py``.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

from etrain.workers.protocol import compile_sharing
from etrain.workers.protocol.messages import LaunchPlan
from etrain.workers.protocol.topology import Coords

__all__ = ["CompiledCode"]


class CompiledCode:
    """One attempt's loading and sharing of one rank's compiled code."""

    def __init__(self, plan: LaunchPlan, *, rank: int, coords: Coords, supervisor: Any, log: Any):
        config = plan.config
        self._plan, self._rank, self._stage = plan, rank, coords.pp
        self._supervisor, self._log = supervisor, log
        self._writer = compile_sharing.writes_for_its_stage(coords)
        self.active = bool(config.training.compile and config.checkpoint.path)
        self.thread: threading.Thread | None = None

    def load(self) -> bool:
        """Load this stage's set before the first step; whether there was one to load."""
        record = compile_sharing.for_stage(self._plan.compile_artifacts, self._stage) if self.active else None
        if record is None:
            return False
        from etrain.workers.engine.compile_artifacts import load

        self._write(load(self._plan.config.checkpoint.path, record, cache_dir=_cache_dir()))
        return True

    def after_first_step(self, compiled_anything: bool) -> None:
        """Share this stage's set if this rank is its writer and the plan lacks it (or it grew)."""
        own = {record.stage for record in self._plan.compile_artifacts}
        if not (self.active and self._writer and (self._stage not in own or compiled_anything)):
            return
        from etrain.workers.engine.compile_artifacts import open_folder

        folder, why = open_folder(self._plan.config.checkpoint.path)  # now, while the attempt holds its folder
        if folder is None:
            self._write(why)
            return
        self.thread = threading.Thread(
            target=self._share, args=(folder,), name=f"compile-cache-{self._rank}", daemon=True
        )
        self.thread.start()

    def _share(self, folder: int | str) -> None:
        from etrain.workers.engine.compile_artifacts import save

        record, line = save(folder, stage=self._stage, cache_dir=_cache_dir())
        self._write(line)
        if record is not None:
            self._supervisor.report_compile_artifacts.remote(self._plan.attempt, self._rank, dataclasses.asdict(record))

    def _write(self, line: str) -> None:
        if self._log is not None:
            self._log.write(f"attempt {self._plan.attempt}: {line}")


def _cache_dir() -> str | None:
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR")
