"""Per-rank log files: what ``GET /v1/jobs/{id}/logs?rank=R`` and ``etrain logs`` show.

Where: ``<checkpoint root>/logs/<job id>/rank<R>.log``. The checkpoint root already has to be storage
every rank's node and the control plane share (ranks write their shards there and the supervisor on
the head node writes the manifest next to them), so a file there is readable from the control plane
whatever node the rank ran on, and it outlives the rank, its node and the Ray cluster. Ray's own
per-actor logs (``ray.util.state.get_log``) were the alternative; they need the dashboard's state API
(not every cluster runs it; the tests' clusters do not), stay on the node that ran the actor (gone
with a lost node, exactly when a user wants to read them) and are keyed by an actor id that changes
with every attempt. The job id is in the path because a checkpoint folder can be shared by jobs
(resuming a finished job's folder).

The writer (:class:`RankLog`, used by ``workers/rank/worker.py``) appends timestamped lines, tees the
rank's ``sys.stdout``/``sys.stderr`` (prints, warnings, tracebacks) into the file while a run is in
progress, and rotates once at :data:`MAX_BYTES` (one ``.1`` file kept), so a file never grows without
bound. The reader (:func:`read_lines`, used by the control plane) returns whole lines only, from the
end (``tail``) or from a byte offset (following), reading at most :data:`MAX_READ_BYTES`.

Object storage: when the checkpoint root is ``s3://...`` a log cannot be appended to in place (an object
is written whole). The rank then writes the same file locally, in a temporary folder of its own, after
first fetching what earlier attempts left at the key (so the lines of every attempt stay in one log), and
uploads it to ``<checkpoint root>/logs/<job id>/rank<R>.log`` at each checkpoint (:meth:`RankLog.sync`,
called by the worker) and when the attempt ends (:meth:`RankLog.close`). The control plane reads the
object through fsspec with ranged reads. A rank killed outright (SIGKILL, a lost node) loses the lines
written since its last upload; its checkpoint-time lines and everything of finished attempts are kept.

Stdlib only (fsspec, through ``workers/checkpoints/storage.py``, only for URLs): the torch-free control
plane imports it.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import TextIO

from etrain.workers.checkpoints import storage
from etrain.workers.protocol import safe_paths
from etrain.workers.protocol.errors import UnsafePathError

LOG_DIR = "logs"
#: A file is rotated (to ``.1``) when it grows past this; readers see the current file only.
MAX_BYTES = 64 << 20
#: The most one read returns, whatever ``tail`` asks for (a line is cut at MAX_LINE_CHARS).
MAX_READ_BYTES = 4 << 20
MAX_LINE_CHARS = 4000
_SAFE_JOB = re.compile(r"^[A-Za-z0-9._-]+$")


def rank_log_path(checkpoint_root: str | os.PathLike, job_id: str, rank: int) -> str:
    """``<checkpoint root>/logs/<job id>/rank<rank>.log`` (job ids are names: letters, digits, ``._-``)."""
    if not _SAFE_JOB.match(job_id) or job_id in (".", ".."):
        raise ValueError(f"job id {job_id!r} cannot name a log folder")
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return storage.join(checkpoint_root, LOG_DIR, job_id, f"rank{rank}.log")


@dataclass(frozen=True)
class LogChunk:
    lines: list[str]
    offset: int  # byte offset just after the last whole line returned: pass it back to follow
    size: int  # the file's size when read (0 when it does not exist yet)


def read_lines(path: str | os.PathLike, *, tail: int, offset: int | None = None) -> LogChunk:
    """Whole lines of the file at ``path``.

    ``offset`` None: the last ``tail`` lines. ``offset`` given: up to ``tail`` lines starting there
    (``offset`` past the end means the file was rotated: start again at 0). A line still being
    written (no newline yet) is left for the next read. Reads at most MAX_READ_BYTES.
    """
    if tail < 1:
        raise ValueError(f"tail must be >= 1, got {tail}")
    remote = storage.is_url(path)
    try:
        handle = storage.open_read(path) if remote else open(path, "rb")
    except FileNotFoundError:
        return LogChunk(lines=[], offset=0, size=0)
    with handle:
        size = int(handle.size) if remote else os.fstat(handle.fileno()).st_size
        if offset is None:
            return _last_lines(handle, size, tail)
        start = 0 if offset > size else max(0, offset)
        handle.seek(start)
        data = handle.read(min(size - start, MAX_READ_BYTES))
    end = data.rfind(b"\n")
    if end < 0:
        return LogChunk(lines=[], offset=start, size=size)
    lines = data[: end + 1].split(b"\n")[:-1][:tail]
    consumed = sum(len(line) + 1 for line in lines)
    return LogChunk(lines=[_text(line) for line in lines], offset=start + consumed, size=size)


def _last_lines(handle, size: int, tail: int) -> LogChunk:
    """The last ``tail`` whole lines, read backwards in blocks (never the whole file)."""
    block = 64 << 10
    data = b""
    position = size
    while position > 0 and data.count(b"\n") <= tail and size - position < MAX_READ_BYTES:
        step = min(block, position, MAX_READ_BYTES - (size - position))
        position -= step
        handle.seek(position)
        data = handle.read(step) + data
    last_newline = data.rfind(b"\n")
    if last_newline < 0:
        return LogChunk(lines=[], offset=position, size=size)
    end = position + last_newline + 1
    body = data[: last_newline + 1]
    lines = body.split(b"\n")[:-1]
    if position > 0 and lines:  # the first piece may be the end of a line that started before the read
        lines = lines[1:]
    return LogChunk(lines=[_text(line) for line in lines[-tail:]], offset=end, size=size)


def _text(line: bytes) -> str:
    text = line.decode("utf-8", errors="replace").rstrip("\r")
    return text if len(text) <= MAX_LINE_CHARS else text[: MAX_LINE_CHARS - 3] + "..."


class RankLog:
    """Appends a rank's log lines to its file; :meth:`capture` also tees stdout/stderr into it.

    Thread-safe (the actor's control calls and its run thread both write). Never raises into training:
    a log that cannot be written (a read-only or full volume) is given up on with one line on stderr.

    ``path`` may be a URL (``s3://...``): :attr:`path` is then a local file in a temporary folder and
    :attr:`remote` the URL it is uploaded to by :meth:`sync` and :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike, *, max_bytes: int = MAX_BYTES):
        self.remote: str | None = None
        self._local_dir: str | None = None
        if storage.is_url(path):
            self.remote = path
            self._local_dir = tempfile.mkdtemp(prefix="etrain-rank-log-")
            path = os.path.join(self._local_dir, storage.basename(path))
        self.path = os.fspath(path)
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        self._broken = False
        self._saved: tuple[TextIO, TextIO] | None = None
        self._rotated = False  # a rotated .1 file not yet uploaded (remote only)
        self._fetched = False  # what earlier attempts uploaded has been fetched (remote only)

    def write(self, message: str) -> None:
        """One timestamped line per line of ``message``."""
        stamp = datetime.datetime.now().isoformat(timespec="milliseconds")
        self._append("".join(f"{stamp} {line}\n" for line in message.rstrip("\n").split("\n")))

    def _append(self, text: str) -> None:
        with self._lock:
            handle = self._open()
            if handle is None:
                return
            try:
                handle.write(text)
                handle.flush()
                if handle.tell() > self._max_bytes:
                    handle.close()
                    self._file = None
                    os.replace(self.path, self.path + ".1")
                    self._rotated = self.remote is not None
            except OSError as err:
                self._give_up(err)

    def _open(self) -> TextIO | None:
        if self._file is None and not self._broken:
            if self.remote is not None and not self._fetched:
                self._fetch()
            try:
                if self.remote is not None:  # a private local copy of the object-store log
                    os.makedirs(os.path.dirname(self.path), exist_ok=True)
                    self._file = open(self.path, "a", encoding="utf-8", errors="replace")
                else:  # in the job's checkpoint folder: no link on the way, nor at the file (made if missing)
                    fd = safe_paths.open_path(
                        self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, field="checkpoint.path", create_dirs=True
                    )
                    self._file = os.fdopen(fd, "a", encoding="utf-8", errors="replace")
            except (OSError, UnsafePathError) as err:
                self._give_up(err)
        return self._file

    def _give_up(self, err: Exception) -> None:
        self._broken = True
        self._file = None
        print(f"etrain: cannot write the rank log {self.path}: {err}; logging to it stops", file=sys.__stderr__)

    def capture(self) -> None:
        """Tee ``sys.stdout`` and ``sys.stderr`` into the file (until :meth:`release`). The rank's actor has
        a process of its own, so this catches exactly this rank's prints, warnings and tracebacks."""
        if self._saved is None:
            self._saved = (sys.stdout, sys.stderr)
            sys.stdout = _Tee(sys.stdout, self)
            sys.stderr = _Tee(sys.stderr, self)
            forget_shown_warnings()

    def release(self) -> None:
        if self._saved is not None:
            sys.stdout, sys.stderr = self._saved
            self._saved = None

    def _fetch(self) -> None:
        """Start from what earlier attempts uploaded to :attr:`remote` (remote only; called under the lock)."""
        self._fetched = True
        try:
            storage.download(self.remote, self.path)
        except FileNotFoundError:
            pass
        except Exception as err:  # noqa: BLE001 - the log goes on; only the earlier lines are not prepended
            print(f"etrain: cannot fetch the rank log {self.remote}: {err}; starting a new one", file=sys.__stderr__)

    def sync(self) -> None:
        """Upload the file to :attr:`remote` (a no-op for a local log). Never raises: an upload that fails is
        reported on stderr and tried again at the next sync."""
        if self.remote is None:
            return
        with self._lock:
            try:
                if self._file is not None:
                    self._file.flush()
                if self._rotated:
                    storage.upload(self.path + ".1", self.remote + ".1")
                    self._rotated = False
                if os.path.exists(self.path):
                    storage.upload(self.path, self.remote)
            except Exception as err:  # noqa: BLE001 - a log upload must never stop training
                print(f"etrain: cannot upload the rank log to {self.remote}: {err}", file=sys.__stderr__)

    def close(self) -> None:
        self.release()
        with self._lock:
            if self._file is not None:
                try:
                    self._file.close()
                except OSError:
                    pass
                self._file = None
        if self.remote is not None:
            self.sync()
            if self._local_dir is not None:
                shutil.rmtree(self._local_dir, ignore_errors=True)
            self._fetched = False  # written again after this (not done today): fetch the uploaded lines first


def forget_shown_warnings() -> None:
    """Let Python show again, once, each warning it has already shown in this process.

    Why: Python shows a warning once per place it comes from (each module's ``__warningregistry__``, and the
    "once" registry) until something resets the registries (any ``warnings.catch_warnings`` block does on its
    way out, as a checkpoint save's). A rank kept by an in-place repair runs its next attempt in the same
    process, and the attempt's section of the rank log would miss the warnings the first attempt showed until
    then (FSDP2's note on view outputs, a deprecation): the log of the attempt being read looks clean when the
    code still warns. Filters are left as they are (``warnings.resetwarnings`` would drop the ones libraries
    set)."""
    import warnings

    warnings.onceregistry.clear()
    for module in list(sys.modules.values()):
        try:
            registry = vars(module).get("__warningregistry__")
        except TypeError:  # an object in sys.modules without a __dict__
            continue
        if isinstance(registry, dict):
            registry.clear()


class _Tee:
    """A text stream that writes to ``stream`` and, line by line, to a RankLog."""

    def __init__(self, stream: TextIO, log: RankLog):
        self._stream = stream
        self._log = log
        self._pending = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        try:
            self._stream.write(text)
        except Exception:  # the original stream going away must not break the rank
            pass
        with self._lock:
            self._pending += text
            lines, _, self._pending = self._pending.rpartition("\n")
        if lines:
            self._log.write(lines)
        return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except Exception:
            pass

    def __getattr__(self, name: str):  # fileno, isatty, encoding, ...: the original stream's
        return getattr(self._stream, name)
