"""Distributed checkpoints (the torch side): DCP save/restore keyed by FQN, so any layout loads any other.

Why it is built this way:

* **FQN-keyed state through torch's state-dict API.** ``get_model_state_dict`` /
  ``get_optimizer_state_dict(flatten_optimizer_state_dict=True)`` key every tensor by parameter name
  (``state.layers.0.attention.wq.weight.exp_avg``), whatever wraps the parameter: DDP, FSDP2 /
  ``replicate`` (DTensor shards), TP (DTensor), or a pipeline stage (the model with other layers
  deleted, names unchanged). DCP stores each DTensor's shards with their global offsets and reads
  back whatever slice the *loading* layout asks for, so resharding (FSDP2(2) → one process,
  TP2 → TP1, PP2 → PP1, ZeRO-3 → ZeRO-1, FSDP2×TP2 → FSDP2(4); ``tests/integration/
  test_checkpoint_dcp.py`` has the list it proves) needs no code of ours.
* **ZeRO-1 is ours.** ``ZeroRedundancyOptimizer`` has no FQN-keyed state dict (its own one needs a
  ``consolidate_state_dict`` gather to one rank). But its local optimizer (``zero.optim``) is a
  plain optimizer over the parameters this rank owns, and DSD accepts an optimizer covering a
  *subset* of the model's parameters. So each rank contributes the full, plain-tensor states of the
  parameters it owns; DCP writes every key once (by its owner), and a ZeRO-1 checkpoint is
  indistinguishable from a DDP one (FSDP2 loads it by slicing, and ZeRO-1 loads an FSDP2 one by
  asking for full tensors). After a load the outer optimizer's hyperparameters are re-synced from
  the local one (``ZeroRedundancyOptimizer.step`` copies outer → local), and groups a rank owns no
  parameter of get theirs from a rank that does (hyperparameters are stored per parameter).
* **Optimizers need not match parts one-to-one.** A pipeline rank may run one optimizer over its
  virtual stages; DSD wants one model per call and fails on optimizer parameters the model lacks.
  Each (part, optimizer) pair whose parameters only partly overlap gets a *view*: an optimizer of
  the same class over the overlap, sharing the per-parameter state, copied back after each call.
* **A rank reports, the supervisor commits.** Every rank returns a :class:`ShardReport` (the files
  it wrote, with size and SHA-256); ``etrain.workers.protocol.manifest.commit`` writes ``manifest.json`` last once
  all ranks reported. Loading verifies the manifest first: a step directory that never committed,
  or was corrupted afterwards, is never read (invariant 4).
* **Local folders or object storage.** A step directory may be an ``s3://`` URL: shards and
  ``.metadata`` then go through DCP's fsspec storage (``FsspecWriter``/``FsspecReader``, async saves
  included), ``extra.pt`` and the rank's file listing through ``workers/storage.py``.
* **Non-tensor state** (step, data position, RNG) goes to ``extra.pt``, written by rank 0 and
  readable with ``torch.load(weights_only=True)``; it is global, not per rank (the data sampler is
  global and the model has no dropout, and per-rank RNG would not survive a resize anyway).

Every function here is collective over ``process_group`` (default: the default group); without an
initialized process group they work in a single process.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import random
import shutil
import time
import warnings
from collections import defaultdict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from etrain.workers import storage
from etrain.workers.protocol.errors import CheckpointError, EtrainError
from etrain.workers.protocol.manifest import MANIFEST_NAME, FileEntry, ShardReport, atomic_write_bytes, file_entry, verify

__all__ = [
    "EXTRA_NAME",
    "AsyncCheckpointer",
    "PendingCheckpoint",
    "ShardReport",
    "capture_rng_state",
    "load_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
]

EXTRA_NAME = "extra.pt"
METADATA_NAME = ".metadata"  # DCP's global index, written by the coordinator (rank 0)
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


# -- public API ----------------------------------------------------------------------------------


def save_checkpoint(
    step_dir: str | os.PathLike,
    model_parts: list[nn.Module],
    optimizers: list[Optimizer],
    extra: dict[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
) -> ShardReport:
    """Write this rank's shards of a checkpoint into ``step_dir``; return what it wrote.

    Collective: every rank of ``process_group`` calls it with its own parts and optimizers. The
    checkpoint is *not* usable until the supervisor commits the reports of all ranks. A partial
    ``step_dir`` from an earlier crashed attempt is cleared first; a committed one is never
    overwritten (``CheckpointError``). ``step_dir`` may be an object-store URL (``s3://...``): DCP then
    writes through its fsspec storage.
    """
    directory = os.fspath(step_dir)  # a URL string is returned as is
    _start_checkpoint(directory, extra, process_group)
    collected = collect_state(model_parts, optimizers)
    writer = _writer(directory)
    with _single_process_quiet():
        dcp.save(collected.state, storage_writer=writer, process_group=process_group)
    return _shard_report(directory, writer, process_group)


def load_checkpoint(
    step_dir: str | os.PathLike,
    model_parts: list[nn.Module],
    optimizers: list[Optimizer],
    *,
    process_group: dist.ProcessGroup | None = None,
    checksums: bool = True,
    expect_digest: str | None = None,
) -> dict[str, Any]:
    """Restore model and optimizer state from a committed ``step_dir`` into the current layout.

    Collective. The manifest is verified first (the ranks hash a share of the files each and
    agree on the verdict); a directory that does not verify raises ``CheckpointError`` on every
    rank before anything is read. ``expect_digest`` (of the manifest the supervisor verified with the
    service's key): the manifest read here must be exactly that one, and every rank hashes DCP's ``.metadata``
    before DCP unpickles it, so a directory swapped after the supervisor's check is never loaded.
    The parts and optimizers may use any layout: DCP reads the slices each rank now owns. Returns
    the ``extra`` dict given to :func:`save_checkpoint`.
    """
    directory = os.fspath(step_dir)
    _verify_together(directory, checksums, process_group, expect_digest)
    collected = collect_state(model_parts, optimizers)
    state = collected.state
    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=storage_reader(directory), process_group=process_group)
    except CheckpointException as exc:  # DCP's (BaseException) wrapper around per-rank failures
        raise CheckpointError(
            f"cannot load {directory} into this layout: {exc}",
            fix="a key missing from the checkpoint means the model or optimizer differs from the saved one "
            "(model sizes, optimizer class or parameter groups)",
        ) from None
    apply_state(collected, model_parts, optimizers)
    return _read_extra(directory)


def apply_state(collected: _Collected, model_parts: list[nn.Module], optimizers: list[Optimizer]) -> None:
    """Hand filled ``collected.state`` back to each part and optimizer (after a DCP load or a snapshot).

    DCP fills the merged dicts (non-tensor values by replacement), so each part and optimizer gets
    its own entries back out of them.
    """
    state = collected.state
    for part, keys in zip(model_parts, collected.model_keys):
        set_model_state_dict(part, {key: state["model"][key] for key in keys})
    for binding in collected.bindings:
        optim_state = {key: state["optim"][key] for key in binding.keys}
        set_optimizer_state_dict(binding.part, binding.optimizer, optim_state, options=_OPTIONS)
        binding.sync_back(after_load=True)
    _share_zero_hyperparameters(optimizers)


class PendingCheckpoint:
    """An asynchronous save in flight; its :class:`ShardReport` once the files are on disk."""

    def __init__(self, step_dir: str, future: Future):
        self.step_dir = step_dir
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout_s: float) -> ShardReport:
        """The report once the files are written; ``TimeoutError`` if still writing after ``timeout_s``.

        A failed write re-raises its own exception: a dead peer or a full disk is not a user error,
        and the caller (the trainer) reports it like any other rank failure.
        """
        try:
            return self._future.result(timeout=timeout_s)
        except FutureTimeout:
            raise TimeoutError(f"checkpoint {self.step_dir} was still being written after {timeout_s:g} s") from None


class AsyncCheckpointer:
    """``dcp.async_save`` with one save in flight: staging blocks, the file writes do not.

    :meth:`save` copies the state to CPU memory (the training step may then change parameters at
    once) and returns a :class:`PendingCheckpoint`; the write, and the rank's hashing of its files,
    run on a background thread. The background save plans over its *own* gloo group, created here,
    so its collectives never interleave with the training step's on the default group (two threads
    issuing collectives on one group can pair up differently on different ranks and deadlock).

    Construction is collective over the whole world (``dist.new_group``). The owner calls
    :meth:`close` (waits for the last save) before destroying the process group.
    """

    def __init__(self, *, process_group: dist.ProcessGroup | None = None):
        self._group: dist.ProcessGroup | None = None
        if dist.is_initialized():
            ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
            self._group = dist.new_group(ranks=ranks, backend="gloo")
        self._pending: PendingCheckpoint | None = None

    def save(
        self,
        step_dir: str | os.PathLike,
        model_parts: list[nn.Module],
        optimizers: list[Optimizer],
        extra: dict[str, Any],
        *,
        previous_timeout_s: float = 600.0,
    ) -> PendingCheckpoint:
        """Start saving (collective); waits first for the previous save (its report is the caller's
        to have collected via its own handle)."""
        self.wait_previous(previous_timeout_s)
        directory = os.fspath(step_dir)
        _start_checkpoint(directory, extra, self._group)
        collected = collect_state(model_parts, optimizers)
        writer = _writer(directory)
        # The writer is a BlockingAsyncStager: the state is copied to CPU before this returns.
        written = dcp.async_save(collected.state, storage_writer=writer, process_group=self._group)
        if isinstance(written, AsyncSaveResponse):  # returned when staging itself is asynchronous
            written = written.upload_completion
        report: Future = Future()
        group = self._group

        def on_written(future: Future) -> None:
            try:
                future.result()
                report.set_result(_shard_report(directory, writer, group))
            except BaseException as exc:  # noqa: BLE001 - delivered to whoever waits
                report.set_exception(exc)

        written.add_done_callback(on_written)
        self._pending = PendingCheckpoint(directory, report)
        return self._pending

    def wait_previous(self, timeout_s: float) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.wait(timeout_s)

    def close(self, timeout_s: float = 600.0) -> None:
        """Wait for the save in flight (if any) and release the checkpoint group."""
        try:
            self.wait_previous(timeout_s)
        finally:
            if self._group is not None and dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states as ``extra`` can store them (weights_only-loadable types)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:  # numpy is optional here
        pass
    else:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`; states it does not hold are left alone."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# -- state collection ----------------------------------------------------------------------------


class _Binding:
    """One (model part, optimizer) pairing as DSD sees it.

    ``optimizer`` is what DSD reads and writes: the caller's optimizer, ZeRO's local optimizer, or a
    view over the part's share of either. ``local`` is the optimizer that really steps (the
    view's state is copied back into it); ``zero`` the outer ZeRO wrapper whose hyperparameters
    must follow a load.
    """

    def __init__(
        self,
        part: nn.Module,
        optimizer: Optimizer,
        local: Optimizer,
        zero: ZeroRedundancyOptimizer | None,
        local_groups: list[dict[str, Any]] | None = None,
    ):
        self.part = part
        self.optimizer = optimizer
        self.local = local
        self.zero = zero
        self.local_groups = local_groups  # for a view: the local group behind each view group
        self.keys: tuple[str, ...] = ()

    def sync_back(self, *, after_load: bool) -> None:
        if self.optimizer is not self.local:
            for param, state in self.optimizer.state.items():
                self.local.state[param] = state
            if after_load:
                for view_group, local_group in zip(self.optimizer.param_groups, self.local_groups):
                    local_group.update({k: v for k, v in view_group.items() if k != "params"})
        if after_load and self.zero is not None:
            for outer, inner in zip(self.zero.param_groups, self.zero.optim.param_groups):
                outer.update({k: v for k, v in inner.items() if k != "params"})


def _bind(model_parts: list[nn.Module], optimizers: list[Optimizer]) -> list[_Binding]:
    part_of: dict[torch.Tensor, int] = {}
    for index, part in enumerate(model_parts):
        for param in part.parameters():
            part_of[param] = index
    bindings = []
    for optimizer in optimizers:
        zero = optimizer if isinstance(optimizer, ZeroRedundancyOptimizer) else None
        if zero is not None and zero._overlap_with_ddp:
            raise CheckpointError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True) cannot be checkpointed: its local "
                "optimizer is a functional one without a state dict",
                field="parallel.zero",
                fix="build ZeroRedundancyOptimizer with overlap_with_ddp=False",
            )
        local = zero.optim if zero is not None else optimizer
        by_part: dict[int, list[torch.Tensor]] = defaultdict(list)
        for group in local.param_groups:
            for param in group["params"]:
                if param not in part_of:
                    raise CheckpointError(
                        f"an optimizer holds a parameter of shape {tuple(param.shape)} that belongs to "
                        "none of the model parts passed to the checkpoint",
                        fix="pass every model part the optimizers step",
                    )
                by_part[part_of[param]].append(param)
        whole = all(group["params"] for group in local.param_groups)
        for index, params in by_part.items():
            if whole and len(by_part) == 1:
                bindings.append(_Binding(model_parts[index], local, local, zero))
            else:
                view, local_groups = _optimizer_view(local, params)
                bindings.append(_Binding(model_parts[index], view, local, zero, local_groups))
    return bindings


def _optimizer_view(local: Optimizer, params: list[torch.Tensor]) -> tuple[Optimizer, list[dict[str, Any]]]:
    """An optimizer of ``local``'s class over ``params`` only, sharing their state, and the local
    group behind each of its groups (loaded hyperparameters are copied back there).

    Empty parameter groups are dropped: DSD's unflattening reads each group's hyperparameters
    through its first parameter and fails on an empty one.
    """
    keep = set(params)
    groups, local_groups = [], []
    for group in local.param_groups:
        kept = [p for p in group["params"] if p in keep]
        if kept:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": kept})
            local_groups.append(group)
    try:
        view = type(local)(groups)
    except TypeError as exc:
        raise CheckpointError(
            f"cannot checkpoint a {type(local).__name__} that spans several model parts: {exc}",
            fix="use one optimizer per model part",
        ) from exc
    view.state = defaultdict(dict, {p: local.state[p] for p in params if p in local.state})
    return view, local_groups


@dataclass
class _Collected:
    """What DCP saves or fills (``state``), and how to hand it back to each part and optimizer."""

    state: dict[str, Any]  # {"model": {fqn: tensor}, "optim": {flat key: value}}
    model_keys: list[tuple[str, ...]]  # per model part
    bindings: list[_Binding]


def collect_state(model_parts: list[nn.Module], optimizers: list[Optimizer]) -> _Collected:
    """FQN-keyed model and (flattened) optimizer state of all parts, merged into one dict: what DCP
    saves and fills (and what the in-memory snapshots of ``workers/snapshot.py`` copy)."""
    model_state: dict[str, Any] = {}
    model_keys = []
    for part in model_parts:
        part_state = get_model_state_dict(part)
        _merge(model_state, part_state, "model")
        model_keys.append(tuple(part_state))
    optim_state: dict[str, Any] = {}
    bindings = _bind(model_parts, optimizers)
    for binding in bindings:
        part_state = get_optimizer_state_dict(binding.part, binding.optimizer, options=_OPTIONS)
        binding.sync_back(after_load=False)  # DSD may have initialised empty state on a view
        binding.keys = tuple(part_state)
        _merge(optim_state, part_state, "optimizer")
    return _Collected(state={"model": model_state, "optim": optim_state}, model_keys=model_keys, bindings=bindings)


def _merge(into: dict[str, Any], part: dict[str, Any], what: str) -> None:
    clash = into.keys() & part.keys()
    if clash:
        raise CheckpointError(
            f"two model parts both hold {what} state for {sorted(clash)[:3]}: parts must not share parameters",
            fix="pass each pipeline stage's module once",
        )
    into.update(part)


def _share_zero_hyperparameters(optimizers: list[Optimizer]) -> None:
    """Give every ZeRO rank the loaded hyperparameters of every parameter group.

    Hyperparameters are stored per parameter (flattened), so a rank that owns no parameter of a
    group loaded none for it and would keep its constructor's values: harmless for its (empty)
    local step, but its ``param_groups`` would disagree with its peers' (an LR schedule reading
    them, the next save). Each group is taken from a rank that owns part of it.
    """
    for zero in optimizers:
        if not isinstance(zero, ZeroRedundancyOptimizer) or zero.world_size == 1:
            continue
        mine = [
            (bool(inner["params"]), {k: v for k, v in outer.items() if k != "params"})
            for outer, inner in zip(zero.param_groups, zero.optim.param_groups)
        ]
        everyone: list[Any] = [None] * zero.world_size
        dist.all_gather_object(everyone, mine, group=zero.process_group)
        for index, (outer, inner) in enumerate(zip(zero.param_groups, zero.optim.param_groups)):
            loaded = next((groups[index][1] for groups in everyone if groups[index][0]), None)
            if loaded is not None:
                outer.update(loaded)
                inner.update(loaded)


# -- files ---------------------------------------------------------------------------------------


class _Recording:
    """Remembers this rank's file-name prefix (``__<rank>_``) as DCP's writer plans it, so the rank
    can report exactly the files it wrote, an empty shard file included."""

    prefix: str | None = None

    def write_data(self, plan, planner):
        self.prefix = plan.storage_data.prefix
        return super().write_data(plan, planner)


class _RecordingWriter(_Recording, dcp.FileSystemWriter):
    """DCP's local file writer, recording."""


class _HashingStream:
    """A write stream that hashes and counts what passes through it to the upload it wraps."""

    def __init__(self, raw):
        self._raw = raw
        self._digest = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self._digest.update(data)
        self.size += memoryview(data).nbytes
        return self._raw.write(data)

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()

    def __getattr__(self, name: str):  # tell, flush, ...: the upload's own
        return getattr(self._raw, name)


_fsspec_classes: tuple[type, type] | None = None


def _fsspec_writer_classes() -> tuple[type, type]:
    """(recording ``FsspecWriter``, hashing fsspec ``FileSystem``), built on first use (fsspec imported then).

    The file system records ``(size, sha256)`` of every file as its upload completes (``.metadata``
    under its final name after DCP's rename), so the rank reports its shards without downloading what
    it has just uploaded. What the supervisor later verifies before a load is the objects themselves.
    """
    global _fsspec_classes
    if _fsspec_classes is None:
        from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter

        class _HashingFileSystem(FileSystem):
            def __init__(self) -> None:
                super().__init__()
                self.written: dict[str, tuple[int, str]] = {}

            @contextlib.contextmanager
            def create_stream(self, path, mode):
                with super().create_stream(path, mode) as stream:
                    if "w" not in mode:
                        yield stream
                        return
                    hashing = _HashingStream(stream)
                    yield hashing
                self.written[os.fspath(path)] = (hashing.size, hashing.sha256)  # the upload completed

            def rename(self, path, new_path) -> None:
                super().rename(path, new_path)
                if os.fspath(path) in self.written:
                    self.written[os.fspath(new_path)] = self.written.pop(os.fspath(path))

        _fsspec_classes = (type("_RecordingFsspecWriter", (_Recording, FsspecWriter), {}), _HashingFileSystem)
    return _fsspec_classes


def _writer(directory: str) -> _Recording:
    """DCP's writer for ``directory``: the local file writer, or for a URL DCP's fsspec writer
    (``FsspecWriter``: a ``FileSystemWriter`` over fsspec, so async staging works the same) over a
    hashing file system. On an object store ``sync_files`` is off: an upload is durable once its PUT
    returns, and the file objects have no descriptor to fsync (DCP would fall back to a machine-wide
    ``os.sync()`` per file)."""
    if not storage.is_url(directory):
        return _RecordingWriter(directory)
    storage.filesystem(directory)  # ConfigError naming the extra to install, before DCP's ImportError
    writer_class, filesystem_class = _fsspec_writer_classes()
    options = storage.storage_options(directory)
    writer = writer_class(directory, sync_files=False, **options)
    writer.fs = filesystem_class()
    writer.path = writer.fs.init_path(directory, **options)
    return writer


def storage_reader(directory: str):
    """DCP's reader for ``directory`` (a local path or a URL: ``FsspecReader``); ``workers/hf_io.py`` uses
    it to export a checkpoint from either."""
    if not storage.is_url(directory):
        return dcp.FileSystemReader(directory)
    storage.filesystem(directory)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(directory, **storage.storage_options(directory))


def _shard_report(directory: str, writer: _Recording, group: dist.ProcessGroup | None) -> ShardReport:
    rank, world_size = _rank(group), _world_size(group)
    assert writer.prefix is not None, "DCP finished without planning this rank's writes"
    names = sorted(n for n in storage.listdir(directory) if n.startswith(writer.prefix) and n.endswith(".distcp"))
    if rank == 0:
        names += [METADATA_NAME, EXTRA_NAME]
    uploaded = getattr(writer.fs, "written", {})  # object stores: hashed on the way up
    return ShardReport(
        rank=rank,
        world_size=world_size,
        directory=storage.basename(directory),
        files=tuple(_reported(directory, name, uploaded) for name in names),
    )


def _reported(directory: str, name: str, uploaded: dict[str, tuple[int, str]]) -> FileEntry:
    known = uploaded.get(os.path.join(directory, name))
    if known is None:
        return file_entry(directory, name)  # local files (and extra.pt): read back from storage
    return FileEntry(path=name, size=known[0], sha256=known[1])


def _start_checkpoint(directory: str, extra: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    """Rank 0 refuses a committed directory, clears a partial one and writes ``extra.pt``; every
    rank hears the verdict before any rank writes a shard (stale shards of a crashed attempt must
    not mix with new ones, and nobody may start DCP's collectives if rank 0 cannot take part)."""

    def start() -> None:  # a local folder or (URL) an object-store prefix, through workers/storage.py
        if storage.exists(storage.join(directory, MANIFEST_NAME)):
            try:
                verify(directory)
            except CheckpointError:
                # A commit that no longer verifies (rot, a corruption drill) was passed over at
                # restore; the re-run of its step replaces it. Keep the bad one aside for inspection.
                storage.replace(directory, f"{directory}.corrupt-{int(time.time())}")
            else:
                raise CheckpointError(
                    f"{directory} already holds a committed checkpoint; refusing to overwrite it",
                    fix="save each step once; resume from the committed step instead of saving it again",
                )
        if storage.is_url(directory):
            storage.rmtree(directory)  # every object under the prefix (a prefix needs no creating)
        else:  # strict locally: a folder that cannot be cleared fails the save, never mixes old shards in
            if os.path.isdir(directory):
                shutil.rmtree(directory)
            os.makedirs(directory)
        atomic_write_bytes(storage.join(directory, EXTRA_NAME), _encode_extra(extra))

    _agree(start, group, f"cannot save into {directory}")


def _encode_extra(extra: dict[str, Any]) -> bytes:
    """``extra`` serialised, after checking it will load back with ``weights_only=True`` (found out
    now, at save time, rather than at the restart that needs it)."""
    buffer = io.BytesIO()
    torch.save({"format": 1, "extra": extra}, buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint extra state cannot be restored safely: {exc}",
            fix="keep extra to tensors and plain Python values (dict, list, tuple, str, int, float, bool, None)",
        ) from None
    return data


def _read_extra(directory: str) -> dict[str, Any]:
    try:
        payload = torch.load(io.BytesIO(storage.read_bytes(storage.join(directory, EXTRA_NAME))), weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read {EXTRA_NAME} of {directory}: {exc}") from exc
    return payload["extra"]


# -- collectives ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group DCP warns on every call that it assumes one process; here that is
    the intended mode (single-process runs and tools), not a mistake worth a warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _world_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _verify_together(directory: str, checksums: bool, group: dist.ProcessGroup | None,
                     expect_digest: str | None = None) -> None:
    """Every rank checks sizes and hashes its share of the files; all raise the first rank's error."""
    rank, world_size = _rank(group), _world_size(group)
    error: CheckpointError | None = None
    try:
        verify(directory, checksums=checksums, share=(rank, world_size), expect_digest=expect_digest)
    except CheckpointError as exc:
        error = exc
    except EtrainError as exc:  # e.g. the object-store backend is not installed on this node
        error = CheckpointError(f"cannot load {directory}: {exc}")
    except OSError as exc:  # unreadable file: still a verdict, so no peer is left waiting below
        error = CheckpointError(f"cannot load {directory}: {exc}")
    if world_size > 1:
        errors: list[CheckpointError | None] = [None] * world_size
        dist.all_gather_object(errors, error, group=group)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error


def _agree(action, group: dist.ProcessGroup | None, context: str) -> None:
    """Run ``action`` on rank 0 and raise its error on every rank, so no rank goes on into a
    collective that a peer has already abandoned."""
    error: CheckpointError | None = None
    if _rank(group) == 0:
        try:
            action()
        except CheckpointError as exc:
            error = exc
        except (EtrainError, OSError) as exc:  # EtrainError: e.g. no object-store backend on this node
            error = CheckpointError(f"{context}: {exc}")
    if dist.is_initialized() and _world_size(group) > 1:
        box = [error]
        dist.broadcast_object_list(box, group=group, group_src=0)
        error = box[0]
    if error is not None:
        raise error
