"""Distributed checkpoints (the torch side): DCP save/restore keyed by FQN, so any layout loads any other.

:func:`save_checkpoint` and :func:`load_checkpoint` are collective over ``process_group`` (default: the
default group); without an initialized process group they work in a single process. A save returns
this rank's ``ShardReport``; the checkpoint becomes usable only when the supervisor commits every
rank's report (``workers/checkpoints/checkpoint_commit.py``), and a load verifies that commit before it reads a
byte. :class:`AsyncCheckpointer` is the same save with the file writes off the training step.

The pieces each have their own module: what state is saved and how it maps onto the parts and
optimizers of any layout (``workers/checkpoints/checkpoint_state.py``), and the files, their hashes and ``extra.pt``
(``workers/checkpoints/checkpoint_io.py``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.optim import Optimizer

from etrain.workers.checkpoints import storage
from etrain.workers.checkpoints.checkpoint_io import (
    abandon,
    dcp_writer,
    new_plan_cache,
    read_extra,
    save_planner,
    shard_report,
    start_checkpoint,
    storage_reader,
    verify_together,
)
from etrain.workers.checkpoints.checkpoint_state import apply_state, collect_state
from etrain.workers.checkpoints.storage_faults import storage_fault
from etrain.workers.protocol.errors import CheckpointError
from etrain.workers.protocol.manifest import ShardReport

__all__ = [
    "AsyncCheckpointer",
    "PendingCheckpoint",
    "held_as_saved",
    "load_checkpoint",
    "local_tensors",
    "save_checkpoint",
]


def save_checkpoint(
    step_dir: str | os.PathLike,
    model_parts: list[nn.Module],
    optimizers: list[Optimizer],
    extra: dict[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
    plan_cache: str | None = None,
    owner: str | None = None,
) -> ShardReport:
    """Write this rank's shards of a checkpoint into ``step_dir``; return what it wrote.

    ``plan_cache``: a generation from ``checkpoint_io.new_plan_cache`` shared by this group's saves
    (DCP then plans from its cache after the first one, see ``checkpoint_io.save_planner``); every
    rank of the group must pass one made for this group. None: plan every save in full.
    ``owner``: the job's id, written to ``writer.json`` (``checkpoint_io.start_checkpoint``).

    Collective: every rank of ``process_group`` calls it with its own parts and optimizers. The
    checkpoint is *not* usable until the supervisor commits the reports of all ranks. A partial
    ``step_dir`` from an earlier crashed attempt is cleared first; a committed one is never
    overwritten (``CheckpointError``). ``step_dir`` may be an object-store URL (``s3://...``): DCP then
    writes through its fsspec storage.
    """
    directory = os.fspath(step_dir)  # a URL string is returned as is
    collected = collect_state(model_parts, optimizers)
    expected = start_checkpoint(directory, extra, process_group, state_bytes=_local_bytes(collected.state), owner=owner)
    with storage.hold_dir(directory) as step:  # DCP writes into the folder that passed, by its descriptor
        writer = dcp_writer(step.path)
        try:
            with _single_process_quiet():
                planner = save_planner(plan_cache) if plan_cache else None
                dcp.save(collected.state, storage_writer=writer, process_group=process_group, planner=planner)
        except CheckpointException as exc:  # a rank's writes failed; DCP raised it on every rank
            raise _abandoned(exc, directory, expected, process_group) from None
        return shard_report(step.path, writer, process_group)


def _abandoned(
    error: BaseException, directory: str, expected_bytes: int, group: dist.ProcessGroup | None
) -> BaseException:
    """A failed save's files removed (rank 0), and the error to raise: a ``StorageFault`` that says why
    in words (``workers/checkpoints/storage_faults.py``), or the error itself when the storage is not the cause."""
    fault = storage_fault(error, directory, expected_bytes)
    abandon(directory, group)
    return fault if fault is not None else error


def local_tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor of ``state`` (nested dicts, lists and tuples: a collected state, a staged one) as this
    rank holds it: a DTensor's local shard."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_leaves

    return [
        leaf._local_tensor if isinstance(leaf, DTensor) else leaf
        for leaf in tree_leaves(state)
        if isinstance(leaf, torch.Tensor)
    ]


def _local_bytes(state: dict[str, Any]) -> int:
    """Bytes of this rank's share of ``state``."""
    return sum(tensor.numel() * tensor.element_size() for tensor in local_tensors(state))


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
    verify_together(directory, checksums, process_group, expect_digest)
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
    return read_extra(directory)


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

    :meth:`save` copies the state to host memory (the training step may then change parameters at
    once) and returns a :class:`PendingCheckpoint`; the write, and the rank's hashing of its files,
    run on a background thread. The background save plans over its *own* gloo group, created here,
    so its collectives never interleave with the training step's on the default group (two threads
    issuing collectives on one group can pair up differently on different ranks and deadlock).

    The staging copy goes to host buffers that the first save allocates and every later one reuses
    (DCP's ``DefaultStager``, which caches a staged storage per source storage), **pinned** on CUDA: a
    device -> pinned copy runs at PCIe speed, where a copy into fresh pageable memory (DCP's default)
    allocates the whole state again on every save and copies at a fraction of it. The price is host
    memory the size of the rank's state, held for the attempt, and a slower first save (measured on an
    H100: 6.1-6.8 s for a 1B model's 15 GB, allocating and pinning included).

    Construction is collective over the whole world (``dist.new_group``). The owner calls
    :meth:`close` (waits for the last save) before destroying the process group.
    """

    def __init__(self, *, process_group: dist.ProcessGroup | None = None, pinned: bool = False, write_threads: int = 1):
        self._group: dist.ProcessGroup | None = None
        if dist.is_initialized():
            ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
            self._group = dist.new_group(ranks=ranks, backend="gloo")
        self._pending: PendingCheckpoint | None = None
        self._plan_cache = new_plan_cache()  # this checkpointer's group (checkpoint_io.save_planner)
        self._stager = _reused_stager(pinned)
        self._write_threads = write_threads
        self._preparing: threading.Thread | None = None
        #: Seconds the last :meth:`save` waited for the write before it (0.0: none was in flight).
        self.waited_for_previous_s = 0.0

    def prepare(self, model_parts: list[nn.Module], optimizers: list[Optimizer]) -> None:
        """Allocate (and pin) the staging buffers now, on a background thread, so the first save blocks
        training only for its copy. Not collective; call it once the optimizer has its state (made
        before the first step by ``Trainer.materialize_optimizer_state``, else after that step).

        Why: the buffers are allocated by the first staging of each tensor, and allocating and pinning
        15 GB of host memory made a 1B model's first save block training 6.1-6.8 s on an H100. Done
        ahead the way DCP does it (a throwaway staging), it still stalled the step beside it 5.1-6.6 s:
        ``cudaHostRegister`` of fresh memory faults every page in under the driver's lock, and the
        training thread's kernel launches wait for that lock. Here each buffer's pages are written
        first (no lock held), then the buffer is registered whole: the steps beside it lost 0.47 s in
        all (``benchmarks/gpu/pinning.py``, ``benchmarks/results/gpu_pinning.json``). Nothing is copied
        from the device. Never fatal: a failure leaves it to the first save, as before.
        """
        if self._stager is None or self._preparing is not None:
            return
        state = collect_state(model_parts, optimizers).state  # on the caller's thread: DSD may touch the optimizer

        def allocate() -> None:
            try:
                self._stager.allocate(state)
            except Exception as err:  # noqa: BLE001 - the first save allocates instead
                warnings.warn(f"staging buffers not prepared ahead: {err}", RuntimeWarning, stacklevel=1)

        self._preparing = threading.Thread(target=allocate, name="ckpt-stage-ahead", daemon=True)
        self._preparing.start()

    def _prepared(self, timeout_s: float) -> None:
        """Wait for :meth:`prepare`'s staging (the stager serves one thread at a time)."""
        if self._preparing is not None:
            self._preparing.join(timeout=timeout_s)
            if self._preparing.is_alive():
                raise TimeoutError(f"the staging buffers were still being prepared after {timeout_s:g} s")

    def save(
        self,
        step_dir: str | os.PathLike,
        model_parts: list[nn.Module],
        optimizers: list[Optimizer],
        extra: dict[str, Any],
        *,
        previous_timeout_s: float = 600.0,
        owner: str | None = None,
    ) -> PendingCheckpoint:
        """Start saving (collective); waits first for the previous save (whose outcome, a failure
        included, is the caller's to have collected through its own handle: the staging buffers are
        reused, so the previous write must be over). :attr:`waited_for_previous_s` says how long that wait
        took: saves that come faster than writes land block training for it."""
        self._wait_for_previous(previous_timeout_s)
        self._prepared(previous_timeout_s)
        state = collect_state(model_parts, optimizers).state
        # Staging is synchronous: the state is in host memory when this returns.
        return self._write(step_dir, state, extra, owner, self._stager)

    def save_held(
        self,
        step_dir: str | os.PathLike,
        model_parts: list[nn.Module],
        optimizers: list[Optimizer],
        held: dict[str, dict[str, Any]],
        extra: dict[str, Any],
        *,
        previous_timeout_s: float = 600.0,
        owner: str | None = None,
    ) -> PendingCheckpoint:
        """Start saving ``held`` (collective): a copy of this rank's state already in host memory that nothing
        changes until the write ends (an in-memory snapshot's ``state``: ``workers/checkpoints/snapshot.py``),
        keyed and shaped as ``collect_state`` gives the live ``model_parts`` and ``optimizers``. It is written as
        it is, with no staging: the files are those :meth:`save` would write of a live state equal to it.

        Why: an in-place repair that resumed from memory past the last commit saves that step again before its
        first step. Staged from the live state, that save blocked every rank for the copy (and, in a new process,
        for allocating and pinning the staging buffers: 6.1-6.8 s for a 1B model on an H100), or on CPU for the
        whole write; the snapshot it resumed from already holds those bytes in host memory."""
        self._wait_for_previous(previous_timeout_s)
        live = collect_state(model_parts, optimizers).state
        return self._write(step_dir, held_as_saved(live, held), extra, owner, _AlreadyStaged())

    def _wait_for_previous(self, timeout_s: float) -> None:
        waiting = time.monotonic()
        self.wait_previous(timeout_s)
        self.waited_for_previous_s = time.monotonic() - waiting

    def _write(
        self, step_dir: str | os.PathLike, state: dict[str, Any], extra: dict[str, Any], owner: str | None, stager: Any
    ) -> PendingCheckpoint:
        """Check and clear ``step_dir`` (collective), stage ``state`` with ``stager`` (None: DCP's own) and write it
        on DCP's background thread; the handle reports the files once written."""
        directory = os.fspath(step_dir)
        expected = start_checkpoint(directory, extra, self._group, state_bytes=_local_bytes(state), owner=owner)
        step = storage.hold_dir(directory)  # written by its descriptor (as in save_checkpoint) until the write ends
        try:
            writer = dcp_writer(step.path, threads=self._write_threads)
            staging = {"async_stager": stager} if stager is not None else {}
            written = dcp.async_save(
                state,
                storage_writer=writer,
                process_group=self._group,
                planner=save_planner(self._plan_cache),
                **staging,
            )
        except BaseException:
            step.close()
            raise
        if isinstance(written, AsyncSaveResponse):  # returned when staging itself is asynchronous
            written = written.upload_completion
        report: Future = Future()
        group = self._group

        def on_written(future: Future) -> None:
            try:
                future.result()
                report.set_result(shard_report(step.path, writer, group))
            except CheckpointException as exc:  # a rank's writes failed: on every rank alike
                report.set_exception(_abandoned(exc, directory, expected, group))
            except BaseException as exc:  # noqa: BLE001 - delivered to whoever waits
                report.set_exception(exc)
            finally:
                step.close()

        written.add_done_callback(on_written)
        self._pending = PendingCheckpoint(directory, report)
        return self._pending

    def wait_previous(self, timeout_s: float) -> None:
        """Wait until the save in flight is over; its failure is not raised here (its handle has it)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                pending.wait(timeout_s)
            except TimeoutError:
                raise
            except BaseException:  # noqa: BLE001 - reported by the handle's owner
                pass

    def close(self, timeout_s: float = 600.0) -> None:
        """Wait for the save in flight (if any) and release the checkpoint group and staging buffers."""
        try:
            self.wait_previous(timeout_s)
            self._prepared(timeout_s)
        finally:
            if self._stager is not None:
                self._stager.release()
                self._stager = None
            if self._group is not None and dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None


class _AlreadyStaged(AsyncStager):
    """DCP's staging step for a state already in host memory that nothing changes while it is written
    (:meth:`AsyncCheckpointer.save_held`): the state is handed to the writer as it is, no copy."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def held_as_saved(live: dict[str, dict[str, Any]], held: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``held`` (host copies of this rank's state, a DTensor's as its local shard: ``snapshot.take_snapshot``)
    in the form DCP saves ``live`` (``collect_state``'s state of the same layout): each DTensor's copy wrapped
    in that DTensor's spec (mesh, placements, global shape), so DCP writes the same shards under the same
    keys and offsets; plain tensors and other values as held. The wrapper is DTensor's own constructor, as
    DCP's transport rebuilds received shards (``torch.distributed.checkpoint._pg_transport``):
    ``DTensor.from_local`` would move the copy to the mesh's device. A key or a shard's shape that differs
    raises ``ValueError`` before anything is written."""
    from torch.distributed.tensor import DTensor

    if set(live) != set(held) or any(set(live[section]) != set(held[section]) for section in live):
        missing = sorted(f"{s}/{k}" for s in live for k in live[s] if k not in held.get(s, {}))
        unexpected = sorted(f"{s}/{k}" for s in held for k in held[s] if k not in live.get(s, {}))
        raise ValueError(f"the held state is not this layout's: missing {missing[:5]}, unexpected {unexpected[:5]}")
    shaped: dict[str, dict[str, Any]] = {}
    for section, values in live.items():
        shaped[section] = {}
        for key, current in values.items():
            kept = held[section][key]
            if isinstance(current, DTensor):
                if not torch.is_tensor(kept) or tuple(kept.shape) != tuple(current.to_local().shape):
                    raise ValueError(f"{section}/{key}: the held shard does not match the live one")
                kept = DTensor(kept, current._spec, requires_grad=False)
            elif torch.is_tensor(current) and (not torch.is_tensor(kept) or kept.shape != current.shape):
                raise ValueError(f"{section}/{key}: the held tensor does not match the live one")
            shaped[section][key] = kept
    return shaped


def _reused_stager(pinned: bool) -> Any:
    """DCP's stager into host buffers allocated by the first save (or ahead of it: ``allocate``) and
    reused by every later one (pinned for a CUDA state), copying synchronously (the caller blocks only
    for the copy); None where this torch has no ``DefaultStager``."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:  # an older torch: DCP's default (fresh pageable copies) still works
        return None

    class ReusedStager(DefaultStager):
        """A ``DefaultStager`` whose buffers and copier only its owner closes (:meth:`release`), and
        whose buffers can be made ahead of the first staging (:meth:`allocate`).

        Why: torch 2.11 closes the stager twice over where 2.13 leaves it to the caller. Its
        ``async_save`` closes the stager it is given once the upload is done, and its
        ``DefaultStager._stage`` closes the inner copier (``_state_dict_stager``) after *every*
        staging. A closed copier has dropped its host buffers (each save would allocate and pin the
        whole state again) and cleared its copy table, so the next staging of a state holding a class
        object failed with ``KeyError: <class 'type'>`` (found by ``make gpu-check`` on an H100: at a
        job's second save, then, once buffers were prepared ahead, at its first). Here neither close
        does anything; the buffers live until :meth:`release`.
        """

        def __init__(self, options: Any) -> None:
            super().__init__(options)
            self._copier = getattr(self, "_state_dict_stager", None)  # private to DCP: absent, nothing to keep
            if self._copier is not None:
                self._copier.close = _keep_open  # this instance's close only; release() calls the class's

        def allocate(self, state: dict[str, Any]) -> int:
            """Make the host buffer of every storage of ``state`` that has none yet, as DCP's copier
            would at its first staging, but with its pages written before it is pinned; returns the
            bytes allocated. The copier finds them in its cache (keyed by the source storage) and
            copies into them. Where this DCP keeps no such cache, nothing is done (the first staging
            allocates, as before)."""
            cache = getattr(self._copier, "_cached_storage_mapping", None)
            if cache is None:
                return 0
            pin_from = getattr(self._copier, "pin_memory_min_bytes", 1)
            made = 0
            for source in _source_storages(state):
                if source in cache:
                    continue
                host = type(source)(source.size(), device="cpu")
                if host.nbytes():
                    # Write every page now: fault them in off the driver's lock (ATen's fill_ releases the GIL).
                    torch.empty(0, dtype=torch.uint8).set_(host).fill_(0)
                if pinned and host.nbytes() >= pin_from:
                    _pin_whole(host)
                cache[source] = host
                made += host.nbytes()
            return made

        def close(self) -> None:  # called by DCP after each upload on some torch versions
            pass

        def release(self) -> None:
            if self._copier is not None:
                type(self._copier).close(self._copier)
            DefaultStager.close(self)

    return ReusedStager(
        StagingOptions(
            use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=pinned
        )
    )


def _source_storages(state: Any) -> list[Any]:
    """The storages DCP's copier stages for ``state`` (a DTensor's are its local shard's), each once."""
    storages = (tensor.untyped_storage() for tensor in local_tensors(state) if tensor.device.type != "meta")
    return list({id(storage): storage for storage in storages}.values())


def _pin_whole(host: Any) -> None:
    """Page-lock ``host`` (a CPU storage) as one registration, released when it is freed, as DCP pins its
    own buffers. One registration per buffer: a copy may not span buffers registered in pieces (an
    H100 answered ``CUDA error: invalid argument``)."""
    import weakref

    cudart = torch.cuda.cudart()
    pointer = host.data_ptr()
    code = int(cudart.cudaHostRegister(pointer, host.nbytes(), 1))  # 1: cudaHostRegisterPortable, as DCP
    if code != 0:
        raise RuntimeError(f"cudaHostRegister of a {host.nbytes()}-byte staging buffer failed: CUDA error {code}")
    finalizer = weakref.finalize(host, _unpin, pointer)
    finalizer.atexit = False  # never after the CUDA context is gone


def _unpin(pointer: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(pointer)


def _keep_open() -> None:
    """A reused stager's copier ignores DCP's close (:func:`_reused_stager`)."""


@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group DCP warns on every call that it assumes one process; here that is
    the intended mode (single-process runs and tools), not a mistake worth a warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
