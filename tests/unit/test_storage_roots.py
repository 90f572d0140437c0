"""Storage roots (service/access/storage_roots.py, service/planning/spec_paths.py pin_paths) and the checkpoint key
(service/access/checkpoint_key.py): pure rules over real temporary directories and real symlinks."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from etrain.service.access.checkpoint_key import KEY_NAME, load_or_create_key
from etrain.service.access.storage_roots import PRIVATE_FILE_NAMES, StorageRoots, inside, parse_roots, pin
from etrain.service.errors import SettingsError
from etrain.service.planning.spec import JobSpec
from etrain.service.planning.spec_paths import pin_paths, resolve_paths
from etrain.service.settings import Settings


@pytest.fixture
def layout(tmp_path):
    """<tmp>/data (the root, with a file), <tmp>/data-evil and <tmp>/outside/secret.txt (not roots)."""
    data = tmp_path / "data"
    (data / "corpus").mkdir(parents=True)
    (data / "corpus" / "a.txt").write_text("inside")
    (tmp_path / "data-evil").mkdir()
    (tmp_path / "data-evil" / "b.txt").write_text("prefix trick")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("secret")
    return tmp_path


def check(roots: StorageRoots, raw: str, base: Path):
    return roots.check("data.path", raw, pin(raw, base))


def test_inside_compares_whole_components():
    assert inside("/data", "/data") and inside("/data/x/y", "/data")
    assert not inside("/data-evil", "/data") and not inside("/datax/y", "/data") and not inside("/dat", "/data")
    assert inside("/anything", "/")


def test_paths_inside_the_root_pass_and_are_pinned_to_their_real_path(layout):
    roots = StorageRoots.of([layout / "data"])
    assert check(roots, str(layout / "data" / "corpus" / "a.txt"), layout) is None
    assert check(roots, "corpus/a.txt", layout / "data") is None  # relative to the server's directory
    assert check(roots, str(layout / "data"), layout) is None  # the root itself
    assert check(roots, str(layout / "data" / "not-yet"), layout) is None  # a missing file inside: allowed here
    assert pin("corpus/./a.txt", layout / "data") == str(layout / "data" / "corpus" / "a.txt")


def test_the_prefix_trick_is_outside(layout):
    roots = StorageRoots.of([layout / "data"])
    problem = check(roots, str(layout / "data-evil" / "b.txt"), layout)
    assert problem is not None and problem.field == "data.path"
    assert problem.message.startswith(
        f"data.path={str(layout / 'data-evil' / 'b.txt')!r} is outside the storage roots ({layout / 'data'})"
    )
    assert "ETRAIN_STORAGE_ROOTS" in problem.fix


def test_dot_dot_escapes_are_resolved_before_the_check(layout):
    roots = StorageRoots.of([layout / "data"])
    for raw in (
        f"{layout}/data/../outside/secret.txt",
        f"{layout}/data/missing/../../outside/secret.txt",
        "../outside/secret.txt",
        "corpus/../../outside/secret.txt",
    ):
        problem = check(roots, raw, layout / "data")
        assert problem is not None, raw
        assert raw in problem.message
    assert check(roots, "corpus/../corpus/a.txt", layout / "data") is None  # '..' that stays inside


def test_symlink_escapes_are_resolved_before_the_check(layout):
    roots = StorageRoots.of([layout / "data"])
    (layout / "data" / "link-file").symlink_to(layout / "outside" / "secret.txt")
    (layout / "data" / "link-dir").symlink_to(layout / "outside")
    (layout / "data" / "link-missing").symlink_to(layout / "outside" / "nope.txt")
    (layout / "data" / "link-inside").symlink_to(layout / "data" / "corpus")
    for raw in ("link-file", "link-dir/secret.txt", "link-dir/nope.txt", "link-missing"):
        problem = check(roots, raw, layout / "data")
        assert problem is not None, raw
        assert str(layout / "outside") not in problem.message  # never where the link points
    assert check(roots, "link-inside/a.txt", layout / "data") is None
    # A root that is itself a symlink is compared by its real path.
    (layout / "root-link").symlink_to(layout / "data")
    assert check(StorageRoots.of([layout / "root-link"]), str(layout / "data" / "corpus" / "a.txt"), layout) is None


def test_the_answer_is_the_same_whether_the_file_exists_or_not(layout):
    roots = StorageRoots.of([layout / "data"])
    existing = check(roots, "../outside/secret.txt", layout / "data")
    (layout / "outside" / "secret.txt").unlink()
    missing = check(roots, "../outside/secret.txt", layout / "data")
    assert existing == missing and existing is not None


def test_multiple_roots(layout):
    roots = StorageRoots.of([layout / "data", layout / "outside"])
    assert roots.roots == (str(layout / "data"), str(layout / "outside"))
    assert check(roots, str(layout / "outside" / "secret.txt"), layout) is None
    assert check(roots, str(layout / "data" / "corpus"), layout) is None
    problem = check(roots, str(layout / "data-evil"), layout)
    assert f"({layout / 'data'}, {layout / 'outside'})" in problem.message


def test_the_data_directory_is_the_default_root_and_its_private_files_are_fenced(tmp_path):
    roots = StorageRoots.of([], data_dir=tmp_path)
    assert roots.roots == (str(tmp_path),)
    for name in PRIVATE_FILE_NAMES:
        problem = check(roots, str(tmp_path / name), tmp_path)
        assert problem is not None and "service's own files" in problem.message, name
    assert check(roots, str(tmp_path), tmp_path) is None  # a folder holding them (text walks skip them)
    assert check(roots, str(tmp_path / "corpus.txt"), tmp_path) is None


def test_roots_from_the_environment(tmp_path):
    assert parse_roots(f"/a{os.pathsep}/b, /c ,,") == (Path("/a"), Path("/b"), Path("/c"))
    with pytest.raises(ValueError, match="'relative/dir' is not an absolute path"):
        parse_roots("/a,relative/dir")
    settings = Settings.from_env(
        {"ETRAIN_STORAGE_ROOTS": f"{tmp_path}/x,{tmp_path}/y", "ETRAIN_DATA_DIR": str(tmp_path)}
    )
    assert settings.storage_roots == (tmp_path / "x", tmp_path / "y")
    assert Settings(data_dir=tmp_path).storage_roots == ()
    with pytest.raises(SettingsError, match="ETRAIN_STORAGE_ROOTS"):
        Settings.from_env({"ETRAIN_STORAGE_ROOTS": "data"})
    with pytest.raises(SettingsError, match="not an absolute path"):
        Settings(storage_roots=("data",))


def _spec(**sections) -> JobSpec:
    return JobSpec.model_validate(
        {"name": "r", "model": {"preset": "gpt-tiny"}, "training": {"steps": 1, "global_batch": 1}, **sections}
    )


def test_pin_paths_checks_every_path_field_and_echoes_the_given_values(layout):
    roots = StorageRoots.of([layout / "data"])
    spec = _spec(
        model={"hf": "../outside"},
        data={"kind": "text", "path": "../outside/secret.txt", "tokenizer": f"{layout}/data-evil/tok.json"},
        checkpoint={"path": "/"},
    )
    pinned, problems = pin_paths(spec, layout / "data", roots)
    assert [p.field for p in problems] == ["model.hf", "data.path", "data.tokenizer", "checkpoint.path"]
    assert problems[1].message.startswith("data.path='../outside/secret.txt' is outside the storage roots")
    assert pinned.data.path == str(layout / "outside" / "secret.txt")

    ok = _spec(data={"kind": "text", "path": "corpus"}, checkpoint={"path": "ckpt/run"})
    pinned, problems = pin_paths(ok, layout / "data", roots)
    assert problems == []
    assert (pinned.data.path, pinned.checkpoint.path) == (
        str(layout / "data" / "corpus"),
        str(layout / "data" / "ckpt" / "run"),
    )
    assert resolve_paths(ok, layout / "data") == pinned
    assert pin_paths(_spec(), layout, roots) == (_spec(), [])  # no paths: nothing to check


# -- the checkpoint key --------------------------------------------------------------------------


def test_the_key_is_generated_once_with_mode_0600_and_reused(tmp_path):
    key = load_or_create_key(tmp_path)
    path = tmp_path / KEY_NAME
    assert len(key) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().strip() == key.hex()
    assert load_or_create_key(tmp_path) == key


def test_concurrent_first_starts_agree_on_one_key(tmp_path):
    keys: list[bytes] = []
    threads = [threading.Thread(target=lambda: keys.append(load_or_create_key(tmp_path))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(keys) == 8 and len(set(keys)) == 1


def test_a_damaged_key_file_is_a_settings_error_naming_the_fix(tmp_path):
    (tmp_path / KEY_NAME).write_text("zz" * 32)
    (tmp_path / KEY_NAME).chmod(0o600)
    with pytest.raises(SettingsError, match="not hexadecimal") as error:
        load_or_create_key(tmp_path)
    assert "delete it to generate a new key" in error.value.fix


def test_the_key_is_not_in_the_policys_repr(tmp_path):
    from etrain.service.decisions.job_policy import policy_for

    policy = policy_for(_spec())
    import dataclasses

    with_key = dataclasses.replace(policy, checkpoint_key=b"\x01" * 32)
    assert "checkpoint_key" not in repr(with_key) and "0101" not in repr(with_key)


def test_a_nul_byte_is_refused_not_an_error(layout):
    roots = StorageRoots.of([layout / "data"])
    raw = f"{layout}/data/corpus\x00/etc/passwd"
    assert pin(raw, layout) == raw
    problem = check(roots, raw, layout)
    assert problem is not None and "NUL byte" in problem.message
