"""The checkpoint signing key: one secret per service, in ``<data-dir>/checkpoint-key`` (pure: stdlib only).

DCP's ``.metadata`` is unpickled on every rank at restore, so a checkpoint directory written by
anyone but this service is code that runs on every rank. The supervisor therefore signs each
manifest with HMAC-SHA256 under this key (``etrain.workers.checkpoints.checkpoint_commit.commit``) and
refuses, before any rank reads a byte, a manifest whose signature does not verify. The key never leaves
the control plane except in a supervisor's :class:`~etrain.service.decisions.job_policy.JobPolicy` (not in
the spec, the job's JSON, events or logs).

The first start generates 32 random bytes and writes them as hex, with ``O_CREAT | O_EXCL`` and
mode 0600, so two servers starting together never overwrite each other's key (the loser reads the
winner's); every later start reuses it, after the checks every secret file gets
(:func:`~etrain.service.access.secret_files.read_secret`): a link, another user's file or one that group
or others can read is refused and the server does not start (whoever reads the key can sign a manifest
whose ``.metadata`` every rank unpickles). Deleting the file makes every existing checkpoint
unverifiable: jobs then refuse them (they are moved aside, not deleted) and start fresh.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from pathlib import Path

from etrain.service.access.secret_files import Secret, read_secret
from etrain.service.errors import SettingsError

__all__ = ["KEY_BYTES", "KEY_NAME", "load_or_create_key"]

log = logging.getLogger(__name__)

KEY_NAME = "checkpoint-key"
KEY_BYTES = 32
_HEX_CHARS = 2 * KEY_BYTES
#: How long a reader waits for a concurrent creator to finish writing the key.
_CREATE_WAIT_S = 2.0
_KEY_FILE = Secret(
    what="the checkpoint signing key",
    field=KEY_NAME,
    renew="a new key is generated at the next start (checkpoints signed with the old one are then refused and "
    "their jobs start fresh)",
    unreadable_fix="run the server as the user that owns the data directory",
)


def load_or_create_key(data_dir: str | os.PathLike) -> bytes:
    """The service's checkpoint key, generated into ``<data_dir>/checkpoint-key`` on first use."""
    path = Path(data_dir) / KEY_NAME
    deadline = time.monotonic() + _CREATE_WAIT_S
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except FileExistsError:
            key = _read(path)
            if key is not None:
                return key
            if time.monotonic() > deadline:  # still short: not a creator mid-write, a damaged file
                raise _unusable(path, "it holds fewer than 64 hex digits") from None
            time.sleep(0.05)
            continue
        key = secrets.token_bytes(KEY_BYTES)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask did, owner read/write only
            os.write(fd, key.hex().encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        log.info("generated the checkpoint signing key in %s", path)
        return key


def _read(path: Path) -> bytes | None:
    """The key in ``path``; ``None`` while it is shorter than a key (a creator is still writing)."""
    text = read_secret(path, _KEY_FILE).decode("ascii", errors="replace").strip()
    if len(text) < _HEX_CHARS:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise _unusable(path, "it is not hexadecimal") from None


def _unusable(path: Path, why: str) -> SettingsError:
    return SettingsError(
        f"the checkpoint signing key {path} is unusable: {why}.",
        field=KEY_NAME,
        fix="restore the file from a backup, or delete it to generate a new key (checkpoints signed with the "
        "old key are then refused and their jobs start fresh)",
    )
