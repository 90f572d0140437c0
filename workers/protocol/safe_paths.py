"""Open a job's files without following symbolic links: the one file-level check every caller uses (pure).

Why: the storage roots (``service/access/storage_roots.py``) judge the path a spec names once, at submit,
after resolving it (``os.path.realpath``). The files opened inside it later (a ``model.hf`` folder's
``tokenizer.json``, the texts of a data folder, a checkpoint's ``hf-export``) are named by whoever can
write that folder, and the folder itself can be swapped for a link after the check. A path string handed
back to the OS is resolved again at every open, so a check made on a string protects nothing: the check
has to be the open itself.

The rule: a path is opened one component at a time, each relative to the descriptor of the one before
(``openat``-style, ``dir_fd``), with ``O_NOFOLLOW`` (and ``O_DIRECTORY`` for folders). A symbolic link at
any component is refused (:class:`~etrain.workers.protocol.errors.UnsafePathError`, naming the spec field
and the path as given, never where the link points), and what the caller reads, copies or deletes is the
very descriptor that passed, so there is no window between check and use. A pinned path is a realpath
with no link on it, so a link met later was planted inside the folder or swapped in after submit: never
legitimate, and refused rather than skipped so the job says why instead of silently training on less.
Names under a folder (:func:`open_inside`) are plain relative paths: ``..`` and absolute names are refused.

* :func:`walk_files` lists regular files and never descends through a link; :func:`copy_file_inside`
  copies *contents* from a descriptor opened this way (never a link); :func:`remove_tree` refuses a
  link where it is asked to delete and removes a real folder with ``shutil.rmtree``'s descriptor-based
  walk (``dir_fd``; it never follows links inside).
* Libraries that only take a path (safetensors, DCP's reader) get :func:`descriptor_path`
  (``/proc/self/fd/N``: the kernel maps it to the opened file or folder itself, never re-resolved by
  name) or a :func:`file_view` (a private folder of such links to checked files). Without ``/proc``
  (not Linux) they get the checked path: a check-then-use window, documented; the ranks run on Linux.
* Special files are not opened for reading (a FIFO named ``tokenizer.json`` would block forever): a
  read opens with ``O_NONBLOCK`` and refuses anything that is not a regular file.

Not covered: hard links (a hard link is the file itself; Linux's ``fs.protected_hardlinks`` stops a
user linking files it cannot read or write), and ``s3://`` URLs (an object store has no links).
Standard library only; neither torch nor Ray.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from typing import IO

from etrain.workers.protocol.errors import UnsafePathError

__all__ = [
    "HeldDir",
    "copy_file_inside",
    "descriptor_path",
    "display",
    "file_view",
    "list_names",
    "open_dir",
    "open_file",
    "open_inside",
    "open_path",
    "open_regular",
    "read_file",
    "remove_tree",
    "remove_tree_inside",
    "rename_inside",
    "stat_path",
    "walk_files",
]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC
_PROC_FD = "/proc/self/fd"
_FIX = (
    "replace the link with the file or folder itself (cp -L, rsync -L), or name the real location "
    "inside the storage roots"
)


def _refused(field: str, shown: str, component: str | None = None) -> UnsafePathError:
    """``component``: the link's name when it is a folder on the way, not ``shown`` itself."""
    where = "is" if component is None else f"reaches {component!r}, which is"
    return UnsafePathError(
        f"{field}={display(shown)!r} {where} a symbolic link; symlinks are refused inside the storage roots (a job's "
        "files are opened without following links, so none can lead outside the roots).",
        field=field,
        fix=_FIX,
    )


def _outside(field: str, shown: str) -> UnsafePathError:
    return UnsafePathError(
        f"{field}={display(shown)!r} names a file outside its folder ('..' or an absolute name).",
        field=field,
        fix="name files inside the folder by plain relative names",
    )


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_at(dir_fd: int, name: str, flags: int, mode: int, field: str, shown: str, *, last: bool = True) -> int:
    """``openat(dir_fd, name, flags | O_NOFOLLOW)``; a link there is :class:`UnsafePathError`."""
    try:
        return os.open(name, flags | os.O_NOFOLLOW | _CLOEXEC, mode, dir_fd=dir_fd)
    except OSError:
        if _is_link(dir_fd, name):  # ELOOP (file) or ENOTDIR (O_DIRECTORY): which one varies by system
            raise _refused(field, shown, None if last else name) from None
        raise


def _descend(
    fd: int, parts: list[str], flags: int, mode: int, field: str, shown: str, *, create_dirs: bool = False
) -> int:
    """Open ``parts`` below the folder ``fd`` (which this consumes); the last part with ``flags``."""
    try:
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            part_flags = flags if last else _DIR_FLAGS
            try:
                child = _open_at(fd, part, part_flags, mode, field, shown, last=last)
            except FileNotFoundError:
                if not (create_dirs and part_flags & os.O_DIRECTORY):
                    raise
                with contextlib.suppress(FileExistsError):  # made meanwhile: opened (and checked) below
                    os.mkdir(part, dir_fd=fd)  # mkdir never follows a link: one put there is EEXIST
                child = _open_at(fd, part, part_flags, mode, field, shown, last=last)
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def _parts(relative: str, field: str, shown: str) -> list[str]:
    if os.path.isabs(relative):
        raise _outside(field, shown)
    parts = [part for part in relative.replace(os.sep, "/").split("/") if part not in ("", ".")]
    if ".." in parts:
        raise _outside(field, shown)
    return parts


def open_path(
    path: str | os.PathLike[str], flags: int = os.O_RDONLY, *, field: str, mode: int = 0o666, create_dirs: bool = False
) -> int:
    """Open ``path`` with no symbolic link at any component (walked from ``/``; a relative path is made
    absolute first, lexically: with no link allowed, ``..`` means what it says). The caller closes the
    descriptor. ``create_dirs`` makes missing folders on the way (and the last one, with ``O_DIRECTORY``)."""
    shown = os.fspath(path)
    held = _held_prefix(os.path.abspath(shown))
    if held is not None:  # under a folder this process holds open (HeldDir): walked from its descriptor
        top, rest = held
        parts = [part for part in rest.split(os.sep) if part]
    else:
        parts = [part for part in os.path.abspath(shown).split(os.sep) if part]
        top = os.open(os.sep, _DIR_FLAGS)
    if not parts:
        return top
    return _descend(top, parts, flags, mode, field, shown, create_dirs=create_dirs)


def _held_prefix(path: str) -> tuple[int, str] | None:
    """``(a duplicate of N, the rest)`` for ``/proc/self/fd/N/rest`` when N is a folder this process has
    open (a :class:`HeldDir`'s :func:`descriptor_path`), else None. ``/proc/self`` is itself a link, so
    such a path would be refused by the walk from ``/``; its prefix names the held folder exactly, so
    the walk starts at that descriptor instead (what follows it is walked without links as usual)."""
    split = _descriptor_name(path)
    if split is None:
        return None
    number, rest = split
    try:
        top = os.dup(number)
    except OSError:
        return None
    if not stat.S_ISDIR(os.fstat(top).st_mode):
        os.close(top)
        return None
    return top, rest


def open_dir(path: str | os.PathLike[str] | int, *, field: str, create: bool = False) -> int:
    """A descriptor of the folder ``path`` (no link on the way; ``create`` makes what is missing). An
    ``int`` is a folder already open: it is duplicated, so the caller always closes what it gets."""
    if isinstance(path, int):
        return os.dup(path)
    return open_path(path, _DIR_FLAGS, field=field, create_dirs=create)


def open_inside(
    root: str | os.PathLike[str] | int, relative: str, flags: int = os.O_RDONLY, *, field: str, mode: int = 0o666
) -> int:
    """Open ``relative`` under the folder ``root`` (a path, itself walked without links, or an open
    folder's descriptor): no link anywhere, nothing outside ``root``. The caller closes the descriptor."""
    shown = relative if isinstance(root, int) else os.path.join(os.fspath(root), relative)
    parts = _parts(relative, field, shown)
    top = open_dir(root, field=field)
    if not parts:
        return top
    return _descend(top, parts, flags, mode, field, shown)


def _regular(fd: int, shown: str) -> int:
    """``fd`` back in blocking mode if it is a regular file; else it is closed and an ``OSError`` raised."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", shown)
        raise OSError(errno.EINVAL, "Not a regular file", shown)
    os.set_blocking(fd, True)
    return fd


def open_regular(root: str | os.PathLike[str] | int, relative: str | None = None, *, field: str) -> int:
    """A descriptor of the regular file ``root`` (or ``relative`` under the folder ``root``) opened for reading, no
    link on the way (see :func:`open_file`). The caller closes it."""
    if relative is None:
        assert not isinstance(root, int)
        return _regular(open_path(root, _READ_FLAGS, field=field), os.fspath(root))
    return _regular(open_inside(root, relative, _READ_FLAGS, field=field), relative)


@contextlib.contextmanager
def open_file(root: str | os.PathLike[str] | int, relative: str | None = None, *, field: str) -> Iterator[IO[bytes]]:
    """A regular file opened for reading in binary (``root`` alone, or ``relative`` under it), no link on
    the way. ``FileNotFoundError``, ``IsADirectoryError`` or ``OSError`` for anything else, as ``open`` would."""
    stream = os.fdopen(open_regular(root, relative, field=field), "rb")
    with stream:
        yield stream


def read_file(
    root: str | os.PathLike[str] | int, relative: str | None = None, *, field: str, limit: int | None = None
) -> bytes:
    """The bytes of a regular file (see :func:`open_file`); ``ValueError`` past ``limit`` bytes."""
    with open_file(root, relative, field=field) as stream:
        if limit is not None and os.fstat(stream.fileno()).st_size > limit:
            raise ValueError(f"{relative or os.fspath(root)} is larger than {limit} bytes")
        return stream.read()


def stat_path(path: str | os.PathLike[str], *, field: str) -> os.stat_result:
    """``lstat`` of ``path`` after walking its folders without links; a link at the end is refused too.
    Advisory (what kind of thing is there): whatever is then read is opened with the same rule."""
    shown = os.fspath(path)
    parent, name = os.path.split(os.path.abspath(shown))
    fd = open_dir(parent, field=field) if name else os.open(os.sep, _DIR_FLAGS)
    try:
        if not name:
            return os.fstat(fd)
        found = os.stat(name, dir_fd=fd, follow_symlinks=False)
    finally:
        os.close(fd)
    if stat.S_ISLNK(found.st_mode):
        raise _refused(field, shown)
    return found


def list_names(path: str | os.PathLike[str] | int, *, field: str) -> list[str]:
    """The entry names of a folder (sorted), listed through a descriptor reached without links."""
    fd = open_dir(path, field=field)
    try:
        return sorted(os.listdir(fd))
    finally:
        os.close(fd)


def copy_file_inside(
    root: str | os.PathLike[str] | int,
    relative: str,
    dest_dir: str | os.PathLike[str] | int,
    dest_name: str,
    *,
    field: str,
) -> bool:
    """Copy the *contents* of regular file ``relative`` under ``root`` to a new file ``dest_name`` in
    ``dest_dir`` (created exclusively, never through a link), fsynced. ``False`` when there is no such
    regular file (optional files); :class:`UnsafePathError` when it is, or passes through, a link."""
    try:
        source = open_regular(root, relative, field=field)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return False
    except OSError as err:
        if err.errno == errno.EINVAL:  # there, but not a regular file
            return False
        raise
    with os.fdopen(source, "rb") as reader:
        folder = open_dir(dest_dir, field=field)
        try:
            target = os.open(
                dest_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o666, dir_fd=folder
            )
        finally:
            os.close(folder)
        with os.fdopen(target, "wb") as writer:
            shutil.copyfileobj(reader, writer, 1 << 20)
            writer.flush()
            os.fsync(writer.fileno())
    return True


def walk_files(
    root: str | os.PathLike[str] | int, *, field: str, keep_dir: Callable[[str], bool], keep_file: Callable[[str], bool]
) -> Iterator[str]:
    """Relative paths of the regular files under ``root`` whose names ``keep_file`` accepts, in sorted
    order (a folder's files, then its kept sub-folders', like a sorted top-down ``os.walk``), descending
    only into folders ``keep_dir`` accepts. A link the walk would have read or entered (a name either
    accepts) is :class:`UnsafePathError`; other names, links included, are passed over as before. A
    sub-folder that cannot be opened or listed is passed over, as ``os.walk`` does."""
    top = open_dir(root, field=field)
    shown = os.fspath(root) if not isinstance(root, int) else "."
    yield from _walk(top, "", field, shown, keep_dir, keep_file)


def _walk(
    fd: int, prefix: str, field: str, shown: str, keep_dir: Callable[[str], bool], keep_file: Callable[[str], bool]
) -> Iterator[str]:
    try:
        with os.scandir(fd) as listing:
            entries = sorted(listing, key=lambda entry: entry.name)
        folders = []
        for entry in entries:
            name = entry.name
            if entry.is_symlink():
                if keep_dir(name) or keep_file(name):
                    raise _refused(field, os.path.join(shown, prefix + name))
            elif entry.is_dir(follow_symlinks=False):
                if keep_dir(name):
                    folders.append(name)
            elif keep_file(name) and entry.is_file(follow_symlinks=False):
                yield prefix + name
        for name in folders:
            try:
                child = _open_at(fd, name, _DIR_FLAGS, 0, field, os.path.join(shown, prefix + name))
            except OSError:  # unreadable, or gone since the listing (a link swapped in is UnsafePathError)
                continue
            yield from _walk(child, f"{prefix}{name}{os.sep}", field, shown, keep_dir, keep_file)
    finally:
        os.close(fd)


def remove_tree(path: str | os.PathLike[str], *, field: str) -> bool:
    """Delete the file or folder ``path`` without following a link anywhere (:func:`remove_tree_inside`
    of its parent folder, walked without links). ``False`` when nothing is there."""
    shown = os.fspath(path)
    parent, name = os.path.split(os.path.abspath(shown))
    if not name:
        raise _outside(field, shown)
    return remove_tree_inside(parent, name, field=field, shown=shown)


def remove_tree_inside(root: str | os.PathLike[str] | int, name: str, *, field: str, shown: str | None = None) -> bool:
    """Delete entry ``name`` of the folder ``root`` (a path walked without links, or an open folder's
    descriptor). A link *at* ``name`` is refused: never deleted through, nor silently dropped (a link
    where the service keeps its own output is tampering); a folder goes with ``shutil.rmtree`` on the
    parent's descriptor, which follows no link inside. ``False`` when nothing is there."""
    shown = shown or (name if isinstance(root, int) else os.path.join(os.fspath(root), name))
    if _parts(name, field, shown) != [name]:
        raise _outside(field, shown)
    fd = open_dir(root, field=field)
    try:
        try:
            found = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if stat.S_ISLNK(found.st_mode):
            raise _refused(field, shown)
        if not stat.S_ISDIR(found.st_mode):
            os.unlink(name, dir_fd=fd)
            return True
        if not shutil.rmtree.avoids_symlink_attacks:  # pragma: no cover - every platform etrain runs on has it
            raise OSError(f"cannot delete {shown} safely here (no descriptor-based rmtree)")
        try:
            shutil.rmtree(name, dir_fd=fd)
        except OSError:
            if _is_link(fd, name):  # swapped for a link since the check: rmtree refused it
                raise _refused(field, shown) from None
            raise
        return True
    finally:
        os.close(fd)


def rename_inside(root: str | os.PathLike[str] | int, name: str, new_name: str, *, field: str) -> None:
    """Rename entry ``name`` of the folder ``root`` to ``new_name`` (both plain names) through the folder's
    descriptor: a rename moves a link itself, never what it points at, and the folder is reached without links."""
    shown = name if isinstance(root, int) else os.path.join(os.fspath(root), name)
    if _parts(name, field, shown) != [name] or _parts(new_name, field, shown) != [new_name]:
        raise _outside(field, shown)
    fd = open_dir(root, field=field)
    try:
        os.rename(name, new_name, src_dir_fd=fd, dst_dir_fd=fd)
    finally:
        os.close(fd)


class HeldDir:
    """A folder opened once, with no link on the way (made if missing), and named from then on by its
    descriptor: every file a job writes, reads or deletes under its checkpoint folder goes through
    :attr:`path` (``/proc/self/fd/N``), so the folder swapped for a link after submit changes nothing:
    the kernel maps the descriptor to the folder that passed the check, and the names below it are
    walked without links by this module's functions (:func:`open_path` starts at the descriptor).

    Held for a process's work on the folder (a rank's attempt, a supervisor's life); :meth:`close`
    releases it. Without ``/proc`` :attr:`path` is the checked path (a check-then-use window,
    documented above). ``given`` stays the name to show and to hand to other processes, which hold
    the folder themselves."""

    def __init__(self, path: str | os.PathLike[str], *, field: str, create: bool = True):
        self.given = os.fspath(path)
        self._fd: int | None = open_dir(self.given, field=field, create=create)
        self.path = descriptor_path(self._fd, self.given)

    def inside(self, path: str | None) -> str | None:
        """``path`` (a name under :attr:`given`, or None) as the same name under the held folder; a path
        not under it is returned as it is."""
        if path is None or self.path == self.given:  # nothing to map (a URL, or no /proc)
            return path
        relative = os.path.relpath(os.path.abspath(path), os.path.abspath(self.given))
        if relative == os.curdir:
            return self.path
        if relative == os.pardir or relative.startswith(os.pardir + os.sep):
            return path
        return os.path.join(self.path, relative)

    def shown(self, text: str) -> str:
        """``text`` (a message, a path) with the held folder's descriptor name put back as ``given``."""
        return text.replace(self.path, self.given) if self.path != self.given else text

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> HeldDir:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def display(path: str) -> str:
    """``path`` as a person should read it: a held folder's descriptor name (``/proc/self/fd/N/rest``)
    becomes the folder's own path as the kernel knows it now; anything else is returned as it is."""
    split = _descriptor_name(path) if isinstance(path, str) else None
    if split is None:
        return path
    number, rest = split
    try:
        folder = os.readlink(f"{_PROC_FD}/{number}")
    except OSError:
        return path
    return os.path.join(folder, rest) if rest else folder


def _descriptor_name(path: str) -> tuple[int, str] | None:
    """``(N, rest)`` for a :func:`descriptor_path` name ``/proc/self/fd/N[/rest]``, else None."""
    prefix = _PROC_FD + os.sep
    if not path.startswith(prefix):
        return None
    number, _, rest = path[len(prefix) :].partition(os.sep)
    return (int(number), rest) if number.isdigit() else None


def descriptor_path(fd: int, fallback: str | os.PathLike[str]) -> str:
    """A path that names the file or folder open at ``fd`` itself (``/proc/self/fd/N``), for libraries
    that only take paths; ``fallback`` (the checked path) where ``/proc`` is not mounted."""
    own = f"{_PROC_FD}/{fd}"
    return own if os.path.exists(own) else os.fspath(fallback)


@contextlib.contextmanager
def file_view(folder: str | os.PathLike[str], *, field: str, select: Callable[[str], bool]) -> Iterator[str]:
    """A folder to hand a path-only library: the entries of ``folder`` that ``select`` accepts, each
    opened here as a regular file without links (a link among them is :class:`UnsafePathError`), shown
    as links in a private temporary folder to their descriptors (:func:`descriptor_path`), so the library
    reads exactly the checked files whatever happens to ``folder`` meanwhile. Entries that are not regular
    files are left out. Without ``/proc`` the view is ``folder`` itself, after the same checks."""
    directory = open_dir(folder, field=field)
    opened: dict[str, int] = {}
    view = None
    try:
        for name in sorted(os.listdir(directory)):
            if select(name):
                try:
                    opened[name] = open_regular(directory, name, field=field)
                except (FileNotFoundError, IsADirectoryError):
                    continue
                except OSError as err:
                    if err.errno != errno.EINVAL:
                        raise
        if not os.path.isdir(_PROC_FD):
            yield os.fspath(folder)
            return
        view = tempfile.mkdtemp(prefix="etrain-view-")
        for name, fd in opened.items():
            os.symlink(f"{_PROC_FD}/{fd}", os.path.join(view, name))
        yield view
    finally:
        for fd in opened.values():
            os.close(fd)
        os.close(directory)
        if view is not None:
            shutil.rmtree(view, ignore_errors=True)
