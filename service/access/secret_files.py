"""Reading the service's secrets from its data directory: the API token and the checkpoint signing key.

One check for both (pure: stdlib only), because a secret is only a secret while nobody else can read or
replace it: the file is opened without following a link (a link planted at the path could point the
server at a file an attacker controls), must be a regular file (a FIFO planted there must not hang the
start-up: ``O_NONBLOCK``), owned by the user running the server, and closed to group and others. Each
refusal is a :class:`~etrain.service.errors.SettingsError` naming the file and the fix; the server does
not start with a secret others can read (a warning is not enough: the key signs what every rank
unpickles). ``etrain.service.errors`` (pydantic) is imported only on the error path: the CLI reads
the token file and must start quickly.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Secret", "read_secret"]


@dataclass(frozen=True)
class Secret:
    """What the errors say about one kind of secret file."""

    #: e.g. "the API token file"
    what: str
    #: the ``field`` of every SettingsError
    field: str
    #: how to get a new one, e.g. "delete it (a new token is generated at the next start)"
    renew: str
    #: what to do when the file cannot be read at all (another user's file, say)
    unreadable_fix: str
    #: the most bytes read: a secret is short, and a huge file must not be read whole
    max_bytes: int = 4096


def read_secret(path: Path, secret: Secret) -> bytes:
    """The file's bytes after the checks above; FileNotFoundError when there is no file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise
    except OSError as err:
        if path.is_symlink():
            raise _refuse(
                secret,
                f"{secret.what} {path} is a symlink; the server only trusts a plain file.",
                f"remove {path}: {secret.renew}",
            ) from None
        raise _refuse(
            secret, f"cannot read {secret.what} {path}: {err.strerror or err}.", secret.unreadable_fix
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refuse(secret, f"{secret.what} {path} is not a regular file.", f"remove {path}: {secret.renew}")
        if info.st_mode & 0o077:
            raise _refuse(
                secret,
                f"{secret.what} {path} is accessible to other users "
                f"({stat.filemode(info.st_mode)}); a secret others can read is not a secret.",
                f"chmod 600 {path} if nobody else has read it, otherwise delete it: {secret.renew}",
            )
        if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
            raise _refuse(
                secret,
                f"{secret.what} {path} belongs to user id {info.st_uid}, not to this user ({os.geteuid()}).",
                f"run as its owner, or delete {path}: {secret.renew}",
            )
        return os.read(fd, secret.max_bytes)
    finally:
        os.close(fd)


def _refuse(secret: Secret, message: str, fix: str) -> Exception:
    from etrain.service.errors import SettingsError

    return SettingsError(message, field=secret.field, fix=fix)
