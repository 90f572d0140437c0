"""Byte-level text as a view over its files (workers/engine/text_bytes.py): every slice equals the files joined
in memory, the UTF-8 check agrees with the whole-file reader, a rank holds none of the corpus, and a file that
changes or becomes a link while the job reads it is an error naming it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from etrain.workers.engine.data import TokenDataset, build_dataset
from etrain.workers.engine.text_bytes import TextBytes, text_bytes
from etrain.workers.engine.text_files import text_documents, text_size
from etrain.workers.protocol.errors import DataError, UnsafePathError
from etrain.workers.protocol.run_config import DataConfig, ModelConfig
from etrain.workers.rank.host_memory import host_memory_use

MIB = 1 << 20


def _whole_text(path: Path) -> bytes | None:
    """The rule of what is text as the readers before the streaming check applied it, to the whole file at once:
    no NUL in its first 8 KiB, and all of it valid UTF-8."""
    data = path.read_bytes()
    if b"\x00" in data[:8192]:
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return data


def _joined(path: Path) -> bytes:
    """The reference: what the reader before the view held (every text file read whole, joined by newlines)."""
    return b"\n".join(data for doc in text_documents(path) if (data := _whole_text(doc)))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "a.txt").write_bytes(b"alpha")
    (tmp_path / "b.txt").write_bytes(b"")  # empty: no document, no separator
    (tmp_path / "c.md").write_bytes(b"x")  # one byte
    (tmp_path / "d.bin.txt").write_bytes(b"\x00binary")  # text name, binary content: skipped
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "e.py").write_text("héllo\nwörld\n")
    return tmp_path


def test_every_slice_equals_the_files_joined_in_memory(folder: Path) -> None:
    expected = _joined(folder)
    view = text_bytes(str(folder))
    assert len(view) == len(expected) == 5 + 1 + 1 + 1 + len("héllo\nwörld\n".encode()) and view.dtype == np.uint8
    for start in range(len(expected) + 1):
        for stop in range(start, len(expected) + 2):  # past the end is cut, as a numpy slice is
            assert view[start:stop].tobytes() == expected[start:stop], (start, stop)
    assert view[:].tobytes() == expected and view[-3:].tobytes() == expected[-3:]


def test_a_single_file_is_its_own_bytes(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"abcdefghijklmnopqrstuvwxyz" * 4)
    dataset = build_dataset(
        DataConfig(kind="text", path=str(corpus)),
        ModelConfig(n_layers=1, d_model=8, n_heads=2, vocab_size=256, seq_len=8),
    )
    assert isinstance(dataset.tokens, TextBytes) and dataset.num_tokens == 104
    inputs, targets = dataset.batch([0, 11])
    assert bytes(inputs[1].tolist()) == corpus.read_bytes()[88:96] and bytes(targets[0].tolist()) == b"bcdefghi"


@pytest.mark.parametrize(
    "content",
    [
        b"plain ascii\n",
        "héllo wörld ✓ 🙂".encode(),
        b"",
        b"\x00 in the probe",
        b"a" * 9000 + b"\x00 after the probe is text",
        b"a" * (MIB + 5) + b"\xff",  # invalid past the first piece
        b"a" * (MIB - 1) + "é".encode(),  # a character across the piece boundary
        "truncated é".encode()[:-1],  # ends inside a character
        b"\xc3\x28",
    ],
    ids=lambda content: f"{len(content)}B",
)
def test_the_streaming_check_agrees_with_the_whole_file_reader(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "doc.txt"
    path.write_bytes(content)
    whole = _whole_text(path)
    assert text_size(path) == (None if whole is None else len(whole))


def test_a_rank_holds_none_of_the_corpus(tmp_path: Path) -> None:
    """The reader before the view held the corpus in the rank's anonymous memory (64 MiB here, and the same again
    while it decoded it); the view holds the samples it reads."""
    corpus = tmp_path / "corpus.txt"
    with corpus.open("wb") as out:
        for line in range(64 * MIB // 64):
            out.write(f"{line:063d}\n".encode())
    before = host_memory_use().anonymous
    if before is None:
        pytest.skip("the kernel does not report anonymous pages")
    dataset = build_dataset(
        DataConfig(kind="text", path=str(corpus)),
        ModelConfig(n_layers=1, d_model=8, n_heads=2, vocab_size=256, seq_len=64),
    )
    inputs, _ = dataset.batch(list(range(0, len(dataset), len(dataset) // 64)))
    grown = host_memory_use().anonymous - before
    assert dataset.num_tokens == 64 * MIB and inputs.shape == (65, 64)
    assert grown < 16 * MIB, f"the rank's anonymous memory grew {grown / MIB:.1f} MiB for a 64 MiB corpus"


def test_a_file_that_shrinks_while_read_is_an_error_naming_it_and_one_that_grows_keeps_its_first_bytes(
    folder: Path,
) -> None:
    view = text_bytes(str(folder))
    expected = _joined(folder)
    with (folder / "a.txt").open("ab") as more:
        more.write(b"-appended")
    assert view[:].tobytes() == expected  # the bytes the job checked, in place
    (folder / "sub" / "e.py").write_bytes(b"h")
    with pytest.raises(DataError) as err:
        view[len(expected) - 3 :]
    assert err.value.field == "data.path" and str(folder / "sub" / "e.py") in str(err.value)
    assert "changed while the job read it" in str(err.value) and err.value.fix
    assert view[:4].tobytes() == b"alph"  # the files before it still read
    os.remove(folder / "c.md")
    with pytest.raises(
        DataError,
        match="changed while the job read it: it held 1 bytes when the job started and "
        "cannot be read: No such file or directory",
    ) as err:
        view[:8]
    assert str(folder / "c.md") in str(err.value)


def test_a_single_file_is_read_through_the_descriptor_opened_at_the_start(tmp_path: Path) -> None:
    """Replacing the file (a new one renamed over it, as editors and tools save) leaves the job reading what it
    checked; no read walks the path again."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"first version\n")
    view = text_bytes(str(corpus))
    (tmp_path / "new.txt").write_bytes(b"SECOND VERSION, LONGER\n")
    os.replace(tmp_path / "new.txt", corpus)
    assert view[:].tobytes() == b"first version\n"


def test_a_file_swapped_for_a_link_after_the_start_is_refused_at_the_read(folder: Path, tmp_path_factory) -> None:
    secret = tmp_path_factory.mktemp("outside") / "secret.txt"
    secret.write_bytes(b"s" * 64)
    view = text_bytes(str(folder))
    os.remove(folder / "a.txt")
    (folder / "a.txt").symlink_to(secret)
    with pytest.raises(UnsafePathError):
        view[:3]


def test_the_view_is_a_token_stream_the_dataset_checks(tmp_path: Path) -> None:
    (tmp_path / "short.txt").write_bytes(b"abc")
    with pytest.raises(DataError, match="3 tokens, fewer than model.seq_len"):
        TokenDataset(text_bytes(str(tmp_path / "short.txt")), seq_len=8, source="short")
    with pytest.raises(TypeError):
        text_bytes(str(tmp_path / "short.txt"))[1]
    with pytest.raises(ValueError):
        TextBytes(str(tmp_path), [])
