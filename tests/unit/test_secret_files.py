"""The service's secret files (``service/access/secret_files.py``): the checkpoint signing key and the API
token get one check, and the server refuses a key others can read (issue #17's low item: it only warned,
while the same for the API token was refused). Real files, modes, links, a FIFO and another owner."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from etrain.service.access import checkpoint_key
from etrain.service.access.api_token import ensure_api_token, read_api_token
from etrain.service.access.checkpoint_key import KEY_BYTES, load_or_create_key
from etrain.service.errors import SettingsError


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_key_others_can_read_stops_the_server(tmp_path, mode):
    load_or_create_key(tmp_path)
    path = tmp_path / "checkpoint-key"
    path.chmod(mode)
    with pytest.raises(SettingsError) as refused:
        load_or_create_key(tmp_path)
    assert refused.value.field == "checkpoint-key"
    assert f"is accessible to other users ({stat.filemode(stat.S_IFREG | mode)})" in refused.value.message
    assert refused.value.fix.startswith(f"chmod 600 {path}")


def test_a_linked_key_is_refused_not_followed(tmp_path):
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir()
    planted = elsewhere / "key"
    planted.write_text("ab" * KEY_BYTES + "\n")
    planted.chmod(0o600)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "checkpoint-key").symlink_to(planted)
    with pytest.raises(SettingsError, match="is a symlink; the server only trusts a plain file"):
        load_or_create_key(data_dir)


def test_a_fifo_at_the_key_path_is_refused_without_hanging(tmp_path):
    os.mkfifo(tmp_path / "checkpoint-key", 0o600)
    with pytest.raises(SettingsError, match="is not a regular file"):
        load_or_create_key(tmp_path)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown to another user needs root")
def test_another_users_key_is_refused(tmp_path):
    load_or_create_key(tmp_path)
    os.chown(tmp_path / "checkpoint-key", 4242, -1)
    with pytest.raises(SettingsError, match="belongs to user id 4242"):
        load_or_create_key(tmp_path)


def test_a_key_left_short_is_waited_for_then_refused(tmp_path, monkeypatch):
    """A creator mid-write leaves a short file for a moment; one that stays short is damaged."""
    monkeypatch.setattr(checkpoint_key, "_CREATE_WAIT_S", 0.05)
    path: Path = tmp_path / "checkpoint-key"
    path.write_text("ab" * 4)
    path.chmod(0o600)
    with pytest.raises(SettingsError, match="fewer than 64 hex digits") as refused:
        load_or_create_key(tmp_path)
    assert "delete it to generate a new key" in refused.value.fix


def test_the_api_token_file_gets_the_same_checks(tmp_path):
    token = ensure_api_token(tmp_path).token
    path = tmp_path / "api-token"
    assert read_api_token(path) == token
    path.chmod(0o644)
    with pytest.raises(SettingsError, match="accessible to other users") as refused:
        read_api_token(path)
    assert refused.value.field == "api_token_file"
