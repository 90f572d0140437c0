"""A real small file system for storage-fault tests: a tmpfs of a given size, or a skip where mounting
is not allowed (it needs root or CAP_SYS_ADMIN; CI's machines have it)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """Mount a ``size`` tmpfs on ``folder`` (created), yield it, unmount it (lazily: a rank may still hold a file)."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)
