"""Issue #17 item 1: symbolic links inside a folder that passed the storage-roots check are refused.

Every test builds real links in real temporary folders. ``secret`` plays the service's
``<data-dir>/checkpoint-key`` (or any file outside the roots): it must never be read, copied or deleted,
and the refusal must name the spec field and say why. The torch-side attacks (the tokenizer copied
into an HF export, a checkpoint's ``hf-export`` replaced) are in tests/integration/test_symlink_attacks.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from etrain.service.access.storage_roots import StorageRoots, pin
from etrain.service.planning.spec import JobSpec
from etrain.service.planning.spec_checks import check_spec
from etrain.workers.checkpoints.hf_config import read_hf_config, weight_files
from etrain.workers.engine.text_files import text_documents, text_size
from etrain.workers.protocol import safe_paths
from etrain.workers.protocol.errors import ConfigError, DataError, UnsafePathError
from tests.tiny_tokenizers import byte_bpe

SECRET = b"hmac-key-0123456789abcdef"
REFUSED = "symlinks are refused inside the storage roots"


@pytest.fixture
def layout(tmp_path) -> dict[str, Path]:
    """``root`` (a storage root) and, outside it, ``elsewhere/secret`` and a folder ``elsewhere/dir``."""
    root, outside = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    (outside / "dir").mkdir(parents=True)
    (outside / "secret").write_bytes(SECRET)
    (outside / "dir" / "stolen.txt").write_bytes(SECRET)
    return {"root": root, "outside": outside, "secret": outside / "secret"}


def _refusal(err: pytest.ExceptionInfo, field: str) -> str:
    assert isinstance(err.value, UnsafePathError) and err.value.field == field
    assert REFUSED in err.value.message and err.value.fix
    assert "elsewhere" not in err.value.message  # names the path as given, never where the link points
    return err.value.message


# -- the helper itself ---------------------------------------------------------------------------


def test_a_link_anywhere_on_the_path_is_refused_and_a_plain_path_is_read(layout):
    root = layout["root"]
    (root / "sub").mkdir()
    (root / "sub" / "a.txt").write_bytes(b"mine")
    (root / "key.json").symlink_to(layout["secret"])
    (root / "linked").symlink_to(root / "sub")  # even a link that stays inside is refused: one simple rule

    assert safe_paths.read_file(root / "sub" / "a.txt", field="data.path") == b"mine"
    assert safe_paths.read_file(root, "sub/a.txt", field="data.path") == b"mine"
    with pytest.raises(UnsafePathError) as err:
        safe_paths.read_file(root / "key.json", field="model.hf")
    assert f"model.hf={str(root / 'key.json')!r} is a symbolic link" in _refusal(err, "model.hf")
    with pytest.raises(UnsafePathError) as err:
        safe_paths.read_file(root, "linked/a.txt", field="data.path")
    assert "reaches 'linked', which is a symbolic link" in _refusal(err, "data.path")
    with pytest.raises(UnsafePathError, match="outside its folder"):
        safe_paths.read_file(root, "../elsewhere/secret", field="model.hf")
    with pytest.raises(UnsafePathError, match="outside its folder"):
        safe_paths.open_inside(root, str(layout["secret"]), field="model.hf")
    assert issubclass(UnsafePathError, ConfigError) and issubclass(UnsafePathError, DataError)


def test_copies_take_contents_never_links_and_skip_what_is_missing_or_special(layout, tmp_path):
    root, out = layout["root"], tmp_path / "out"
    out.mkdir()
    (root / "tokenizer.json").write_bytes(b'{"real": 1}')
    os.mkfifo(root / "merges.txt")  # a FIFO would block a plain open for reading forever
    (root / "vocab.json").symlink_to(layout["secret"])

    assert safe_paths.copy_file_inside(root, "tokenizer.json", out, "tokenizer.json", field="model.hf")
    assert (out / "tokenizer.json").read_bytes() == b'{"real": 1}' and not (out / "tokenizer.json").is_symlink()
    assert not safe_paths.copy_file_inside(root, "missing.json", out, "missing.json", field="model.hf")
    assert not safe_paths.copy_file_inside(root, "merges.txt", out, "merges.txt", field="model.hf")
    with pytest.raises(UnsafePathError):
        safe_paths.copy_file_inside(root, "vocab.json", out, "vocab.json", field="model.hf")
    assert sorted(os.listdir(out)) == ["tokenizer.json"]
    (out / "planted").symlink_to(layout["secret"])  # the destination is created exclusively, never through a link
    with pytest.raises(FileExistsError):
        safe_paths.copy_file_inside(root, "tokenizer.json", out, "planted", field="model.hf")
    assert layout["secret"].read_bytes() == SECRET


def test_remove_tree_deletes_real_folders_only_and_never_through_a_link(layout):
    root, outside = layout["root"], layout["outside"]
    tree = root / "hf-export"
    (tree / "nested").mkdir(parents=True)
    (tree / "nested" / "w.safetensors").write_bytes(b"x")
    (tree / "escape").symlink_to(outside / "dir")  # a link inside the tree: removed as a link, not followed
    assert safe_paths.remove_tree(tree, field="checkpoint.path")
    assert not tree.exists() and (outside / "dir" / "stolen.txt").read_bytes() == SECRET

    tree.symlink_to(outside / "dir")
    with pytest.raises(UnsafePathError) as err:
        safe_paths.remove_tree(tree, field="checkpoint.path")
    _refusal(err, "checkpoint.path")
    assert tree.is_symlink() and (outside / "dir" / "stolen.txt").read_bytes() == SECRET
    assert not safe_paths.remove_tree(root / "never-made", field="checkpoint.path")


def test_a_file_view_shows_the_checked_files_only(layout):
    root = layout["root"]
    (root / "model.safetensors").write_bytes(b"weights")
    (root / "notes.md").write_bytes(b"not selected")
    with safe_paths.file_view(root, field="model.hf", select=lambda n: n.endswith(".safetensors")) as view:
        assert os.listdir(view) == ["model.safetensors"]
        os.remove(root / "model.safetensors")  # swapped after the check: the view still reads what was checked
        (root / "model.safetensors").symlink_to(layout["secret"])
        assert (Path(view) / "model.safetensors").read_bytes() == b"weights"
    assert not os.path.exists(view)
    with pytest.raises(UnsafePathError):
        with safe_paths.file_view(root, field="model.hf", select=lambda n: n.endswith(".safetensors")):
            pass


# -- (c) a folder swapped for a link after the roots check -------------------------------------------


def test_a_folder_swapped_for_a_link_after_pin_is_refused_at_open(layout):
    root, outside = layout["root"], layout["outside"]
    (root / "data").mkdir()
    (root / "data" / "a.txt").write_bytes(b"tenant text")
    roots = StorageRoots.of([root])
    pinned = pin("data", root)
    assert roots.check("data.path", "data", pinned) is None
    assert [p.name for p in text_documents(pinned)] == ["a.txt"]

    os.rename(root / "data", root / "data-before")  # after submit: the checked folder becomes a link out
    (root / "data").symlink_to(outside / "dir")
    with pytest.raises(UnsafePathError) as err:
        text_documents(pinned)
    _refusal(err, "data.path")
    with pytest.raises(UnsafePathError):
        text_size(Path(pinned) / "stolen.txt")

    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    pinned_model = pin("model", root)
    os.rename(model, root / "model-before")
    (root / "model").symlink_to(outside / "dir")
    with pytest.raises(UnsafePathError):
        read_hf_config(pinned_model)


# -- (d) the text walk -----------------------------------------------------------------------------


def test_the_text_walk_refuses_links_to_files_and_folders_and_never_reads_them(layout):
    from etrain.workers.engine.text_bytes import text_bytes

    data = layout["root"] / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_bytes(b"first")
    (data / "sub" / "b.md").write_bytes(b"second")
    (data / ".git").mkdir()
    (data / ".git" / "HEAD.txt").symlink_to(layout["secret"])  # in a skipped folder: passed over as before
    (data / ".hidden.txt").symlink_to(layout["secret"])  # a hidden name: passed over as before
    assert text_bytes(str(data))[:].tobytes() == b"first\nsecond"

    (data / "notes.txt").symlink_to(layout["secret"])
    with pytest.raises(UnsafePathError) as err:
        text_bytes(str(data))
    assert f"data.path={str(data / 'notes.txt')!r} is a symbolic link" in _refusal(err, "data.path")
    os.remove(data / "notes.txt")
    (data / "more").symlink_to(layout["outside"] / "dir")
    with pytest.raises(UnsafePathError) as err:
        text_bytes(str(data))
    _refusal(err, "data.path")
    (layout["root"] / "one.txt").symlink_to(layout["secret"])  # data.path itself a link to one file
    with pytest.raises(UnsafePathError):
        text_bytes(str(layout["root"] / "one.txt"))


# -- the submit-time readers: model.hf's config.json, its index, data.tokenizer -----------------------


def test_submit_names_the_field_of_a_linked_file_in_the_model_and_tokenizer_folders(layout):
    root = layout["root"]
    model = root / "model"
    model.mkdir()
    layout["secret"].write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (model / "config.json").symlink_to(layout["secret"])
    body = {"name": "t", "model": {"hf": str(model)}, "training": {"steps": 2, "global_batch": 2, "micro_batch": 1}}
    problems = {p.field: p.message for p in check_spec(JobSpec.model_validate(body))}
    assert REFUSED in problems["model.hf"]

    tokenizer = byte_bpe(root / "tok")
    (root / "tok" / "tokenizer_config.json").symlink_to(layout["secret"])
    (root / "data.txt").write_text("hello world")
    body = {
        "name": "t",
        "model": {"preset": "gpt-tiny"},
        "data": {"kind": "text", "path": str(root / "data.txt"), "tokenizer": str(tokenizer)},
        "training": {"steps": 2, "global_batch": 2, "micro_batch": 1},
    }
    problems = {p.field: p.message for p in check_spec(JobSpec.model_validate(body))}
    assert REFUSED in problems["data.tokenizer"]


def test_a_weights_index_may_name_only_files_of_its_own_folder(layout):
    model = layout["root"] / "model"
    model.mkdir()
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../elsewhere/secret"}}))
    with pytest.raises(ConfigError, match="names files outside the folder") as err:
        weight_files(model)
    assert err.value.field == "model.hf"
    (model / "model.safetensors.index.json").unlink()
    (model / "model.safetensors.index.json").symlink_to(layout["secret"])
    with pytest.raises(UnsafePathError):
        weight_files(model)


def test_a_held_folder_swapped_for_a_link_keeps_every_write_in_the_folder_that_passed(tmp_path):
    """Issue #17, item (a) of the session notes: the checkpoint folder is held by descriptor. Swapped for a
    link to another folder after it was opened, writes, listings and deletes under the held name still
    reach the folder that passed; the link's target sees nothing. Links *below* it are refused as ever."""
    root, outside = tmp_path / "runs" / "mine", tmp_path / "victim"
    outside.mkdir()
    (outside / "keep.txt").write_text("victim's")
    with safe_paths.HeldDir(root, field="checkpoint.path") as held:  # made: it did not exist
        assert root.is_dir() and held.given == str(root)
        assert held.path.startswith("/proc/self/fd/") and held.path != str(root)
        (root / "step_1").mkdir()
        os.rename(root, tmp_path / "runs" / "moved")  # the attacker swaps the name for a link
        os.symlink(outside, root)
        step = held.inside(str(root / "step_1"))
        assert step == os.path.join(held.path, "step_1") and held.inside(str(outside)) == str(outside)
        fd = safe_paths.open_path(os.path.join(step, "shard.bin"), os.O_WRONLY | os.O_CREAT, field="checkpoint.path")
        os.write(fd, b"shard")
        os.close(fd)
        os.close(safe_paths.open_dir(os.path.join(held.path, "logs", "job"), field="checkpoint.path", create=True))
        assert safe_paths.list_names(held.path, field="checkpoint.path") == ["logs", "step_1"]
        assert safe_paths.remove_tree(step, field="checkpoint.path")
        assert sorted(os.listdir(outside)) == ["keep.txt"]  # nothing written, listed or deleted there
        assert sorted(os.listdir(tmp_path / "runs" / "moved")) == ["logs"]
        # What a person reads is the folder's real name, wherever it is now.
        assert safe_paths.display(os.path.join(held.path, "step_2")) == str(tmp_path / "runs" / "moved" / "step_2")
        assert held.shown(f"no space at {held.path}/step_2") == f"no space at {root}/step_2"
        os.symlink(outside, tmp_path / "runs" / "moved" / "step_3")  # a link planted below the held folder
        with pytest.raises(UnsafePathError, match="checkpoint.path"):
            safe_paths.open_dir(os.path.join(held.path, "step_3"), field="checkpoint.path", create=True)
        with pytest.raises(UnsafePathError):
            safe_paths.remove_tree(os.path.join(held.path, "step_3"), field="checkpoint.path")
        assert (outside / "keep.txt").read_text() == "victim's"
    with pytest.raises(UnsafePathError, match="checkpoint.path"):  # a held folder is never reached through a link
        safe_paths.HeldDir(root, field="checkpoint.path")
