"""Tokenized text data: ids equal ``Tokenizer.encode`` joined with EOS, written once into a content-addressed
cache in the service's token cache folder (never beside the data), reused, never torn; the spec rules for
``data.tokenizer``. Tokenizers are trained
in the test (tests/tiny_tokenizers.py), never downloaded."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from etrain.service.planning.spec import JobSpec
from etrain.service.planning.spec_checks import check_spec
from etrain.service.planning.spec_paths import resolve_paths
from etrain.workers.engine import tokenized
from etrain.workers.engine.data import build_dataset, read_token_file
from etrain.workers.engine.tokenized import cache_file, tokenize_text
from etrain.workers.protocol.errors import ConfigError, DataError, UnsafePathError
from etrain.workers.protocol.run_config import DataConfig, ModelConfig
from tests.tiny_tokenizers import CORPUS, byte_bpe, wide_word_level, word_level_with_bos


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    return byte_bpe(tmp_path_factory.mktemp("bpe"))


def token_cache(data: Path) -> Path:
    """The test's token cache folder: beside the folder holding the data (every test keeps its data in tmp_path),
    shared by the test's corpora as the service's is by every job's."""
    return Path(data).parent / "token-cache"


def tokens(data: Path, tokenizer: Path, **kwargs) -> tokenized.TokenCache:
    """``tokenize_text`` as the service calls it (into its cache folder), or with ``out``."""
    if "out" not in kwargs:
        kwargs["cache_dir"] = token_cache(data)
    return tokenize_text(data, tokenizer, **kwargs)


def encode(tokenizer_path: Path, text: str) -> list[int]:
    return Tokenizer.from_file(str(tokenizer_path)).encode(text).ids


def read_ids(cache: tokenized.TokenCache) -> list[int]:
    return np.fromfile(cache.path, dtype=cache.dtype).tolist()


def corpus_folder(root: Path) -> tuple[Path, list[str]]:
    """A folder of text files, plus files the walk must skip; the documents in walk order."""
    root.mkdir()
    (root / "a.txt").write_text(CORPUS[0] + CORPUS[1])
    (root / "b.md").write_text(CORPUS[2])
    (root / "sub").mkdir()
    (root / "sub" / "c.py").write_text(CORPUS[3])
    (root / "empty.txt").write_text("")
    (root / "image.txt").write_bytes(b"\x89PNG\x00\x00binary")
    (root / "notes.bin").write_text("not a text suffix")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "d.txt").write_text("hidden folders are skipped")
    return root, [CORPUS[0] + CORPUS[1], CORPUS[2], CORPUS[3]]


# -- the token stream ------------------------------------------------------------------------------------


def test_a_folder_is_encode_of_each_document_joined_with_eos(tmp_path, bpe):
    data, documents = corpus_folder(tmp_path / "corpus")
    listed = sorted(os.walk(data))

    cache = tokens(data, bpe)

    eos = Tokenizer.from_file(str(bpe)).token_to_id("<|endoftext|>")
    expected = encode(bpe, documents[0]) + [eos] + encode(bpe, documents[1]) + [eos] + encode(bpe, documents[2])
    assert read_ids(cache) == expected
    assert (cache.num_tokens, cache.dtype, cache.documents, cache.vocab_size) == (len(expected), "uint16", 3, 300)
    assert (cache.eos_id, cache.eos_token, cache.reused) == (eos, "<|endoftext|>", False)
    # content-addressed, in the token cache; nothing written beside the data
    assert Path(cache.path) == tmp_path / "token-cache" / f"{cache.sha256}.bin"
    assert Path(cache.path) == cache_file(tmp_path / "token-cache", cache.sha256)
    assert sorted(os.walk(data)) == listed
    sidecar = json.loads(Path(cache.path + ".json").read_text())
    assert sidecar == {
        "format": 1,
        "path": cache.path,
        "num_tokens": len(expected),
        "dtype": "uint16",
        "vocab_size": 300,
        "sha256": cache.sha256,
        "tokenizer": str(bpe),
        "data": str(data),
        "documents": 3,
        "eos_id": eos,
        "eos_token": "<|endoftext|>",
        "prepared": False,  # a submit's or a rank's: the cache's bound may remove it
    }
    assert sorted(p.name for p in (tmp_path / "token-cache").iterdir()) == [
        f".{cache.sha256}.bin.lock",  # its writer's lock (empty)
        f"{cache.sha256}.bin",
        f"{cache.sha256}.bin.json",
    ]  # no <stamp>.stamp: the data was written just now (tokenized.SETTLED_S)
    assert tokens(data, bpe).sha256 == cache.sha256


def test_a_post_processor_bos_starts_every_document_and_a_file_gets_no_cache_beside_it(tmp_path):
    tok = word_level_with_bos(tmp_path / "wl")
    single = tmp_path / "corpus.txt"
    single.write_text(CORPUS[0] + "an unknown word\n")

    cache = tokens(single, tok)

    assert read_ids(cache) == encode(tok, single.read_text())
    assert read_ids(cache)[0] == 1 and read_ids(cache)[-3:] == [0, 0, 0]  # <s> first; unknown words: [UNK]
    assert Path(cache.path).parent == tmp_path / "token-cache"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "token-cache", "wl"]

    folder = tmp_path / "two"
    folder.mkdir()
    (folder / "1.txt").write_text(CORPUS[0])
    (folder / "2.txt").write_text(CORPUS[1])
    ids = read_ids(tokens(folder, tok))
    assert ids == encode(tok, CORPUS[0]) + [2] + encode(tok, CORPUS[1])  # </s> between, <s> inside each
    assert ids.count(1) == 2


def test_without_an_eos_token_documents_are_concatenated(tmp_path):
    tok = byte_bpe(tmp_path / "noeos", eos=None)
    data, documents = corpus_folder(tmp_path / "corpus")
    cache = tokens(data, tok)
    assert (cache.eos_id, cache.eos_token) == (None, None)
    assert read_ids(cache) == [i for document in documents for i in encode(tok, document)]


def test_tokenizer_config_names_the_eos_and_changes_the_cache(tmp_path):
    tok = word_level_with_bos(tmp_path / "wl")
    data = tmp_path / "two"
    data.mkdir()
    (data / "1.txt").write_text(CORPUS[0])
    (data / "2.txt").write_text(CORPUS[1])
    by_name = tokens(data, tok)
    (tmp_path / "wl" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "[UNK]"}}))

    by_config = tokens(data, tok)

    assert (by_name.eos_token, by_config.eos_token) == ("</s>", "[UNK]")
    assert by_config.sha256 != by_name.sha256
    assert read_ids(by_config) == encode(tok, CORPUS[0]) + [0] + encode(tok, CORPUS[1])


def test_long_documents_are_encoded_in_pieces_with_the_same_ids(tmp_path, bpe, monkeypatch):
    monkeypatch.setattr(tokenized, "PIECE_CHARS", 300)
    monkeypatch.setattr(tokenized, "BATCH_CHARS", 1000)
    text = "".join(CORPUS[i % 4] for i in range(200))  # ~13k characters, indented lines included
    assert len(tokenized._pieces(text, 300)) >= 45 and "".join(tokenized._pieces(text, 300)) == text
    (tmp_path / "long.txt").write_text(text)
    progress: list[tuple[str, int, int, int]] = []

    cache = tokens(tmp_path / "long.txt", bpe, progress=lambda *event: progress.append(event))

    assert read_ids(cache) == encode(bpe, text)
    tokenizing = [event for event in progress if event[0] == "tokenizing"]
    assert len(tokenizing) > 10  # one report per batch
    assert tokenizing[-1] == ("tokenizing", len(text), len(text), cache.num_tokens)
    assert [event[1] for event in tokenizing] == sorted(event[1] for event in tokenizing)


@pytest.mark.parametrize("limit", [1, 2, 5, 12, 300, 10_000])
def test_a_document_read_in_chunks_is_cut_into_the_pieces_of_the_whole_text(tmp_path, monkeypatch, limit):
    """The pieces of a document read 7 bytes at a time (characters split across reads) are the pieces of its
    whole text, each marked first and last as the whole would be, and its hash is the whole document's."""
    from etrain.workers.engine import text_files

    monkeypatch.setattr(text_files, "_BINARY_PROBE_BYTES", 5)
    monkeypatch.setattr(text_files, "_CHECK_CHUNK_BYTES", 7)
    monkeypatch.setattr(tokenized, "PIECE_CHARS", limit)
    text = "".join(CORPUS[i % 4] for i in range(12)) + "naïve café ✓ 🙂\n  indented\nend"
    (tmp_path / "doc.txt").write_text(text)
    whole = tokenized._pieces(text, limit)
    digest = hashlib.sha256()
    read = list(tokenized._document_pieces(tmp_path / "doc.txt", digest, "doc.txt"))
    assert [piece for piece, _, _ in read] == whole
    assert [(first, last) for _, first, last in read] == [(i == 0, i == len(whole) - 1) for i in range(len(whole))]
    expected = hashlib.sha256(len(text.encode()).to_bytes(8, "little") + text.encode())
    assert digest.hexdigest() == expected.hexdigest()


def test_pieces_prefer_a_newline_between_two_non_space_characters():
    text = "aaaa\n  bb\ncccc\n\ndddd"
    assert tokenized._pieces(text, 12) == ["aaaa\n  bb\n", "cccc\n\ndddd"]
    assert tokenized._pieces("x" * 10, 4) == ["xxxx", "xxxx", "xx"]  # no newline: a hard cut


def test_ids_beyond_uint16_are_stored_as_uint32(tmp_path):
    tok = wide_word_level(tmp_path / "wide")
    (tmp_path / "words.txt").write_text("w1 w65999 w69998 nope")

    cache = tokens(tmp_path / "words.txt", tok)

    assert (cache.dtype, cache.vocab_size) == ("uint32", 70_000)
    assert read_ids(cache) == [2, 66000, 69999, 0]
    assert read_token_file(cache.path, cache.dtype, 70_000).tolist() == [2, 66000, 69999, 0]


# -- the cache --------------------------------------------------------------------------------------------


def test_the_second_call_reuses_the_cache_without_tokenizing(tmp_path, bpe, monkeypatch):
    monkeypatch.setattr(tokenized, "SETTLED_S", 0.0)  # data written just now counts as settled
    data = tmp_path / "big.txt"
    data.write_text("".join(CORPUS) * 3000)  # ~700 kB
    started = time.perf_counter()
    first = tokens(data, bpe)
    first_s = time.perf_counter() - started
    mtime = Path(first.path).stat().st_mtime_ns
    stages: list[str] = []

    started = time.perf_counter()
    second = tokens(data, bpe, progress=lambda stage, *_: stages.append(stage))
    second_s = time.perf_counter() - started

    assert (first.reused, second.reused) == (False, True)
    assert (second.path, second.num_tokens, second.sha256) == (first.path, first.num_tokens, first.sha256)
    assert Path(first.path).stat().st_mtime_ns == mtime
    assert stages == []  # nothing was encoded, nor even hashed: found by the data's stamp
    assert second_s < first_s / 2, (first_s, second_s)


def _unread(monkeypatch) -> None:
    """From now on, reading a document's bytes fails the test."""

    def read(*_args, **_kwargs):
        raise AssertionError("a document was read")

    monkeypatch.setattr(tokenized, "text_chunks", read)
    monkeypatch.setattr(tokenized, "text_size", read)


def test_a_prepared_corpus_is_found_by_its_stamp_without_reading_it_and_a_changed_one_is_hashed_again(
    tmp_path, bpe, monkeypatch
):
    data, _ = corpus_folder(tmp_path / "corpus")
    first = tokens(data, bpe)
    stamps = lambda: sorted((tmp_path / "token-cache").glob("*.stamp"))  # noqa: E731
    assert stamps() == []  # written just now: not settled
    monkeypatch.setattr(tokenized, "SETTLED_S", 0.0)
    assert tokens(data, bpe).reused  # found by its hash, and now its stamp kept
    [index] = stamps()
    assert json.loads(index.read_text()) == {"format": 1, "sha256": first.sha256}
    with monkeypatch.context() as patch:
        _unread(patch)
        again = tokens(data, bpe)  # what a submit and every rank's start do: a walk and a stat a file
    assert again.reused and (again.path, again.sha256) == (first.path, first.sha256)

    stat = (data / "b.md").stat()
    os.utime(data / "b.md", ns=(stat.st_atime_ns, stat.st_mtime_ns - 10**10))  # touched, same bytes
    stages: list[str] = []
    touched = tokens(data, bpe, progress=lambda stage, *_: stages.append(stage))
    assert touched.reused and touched.sha256 == first.sha256 and set(stages) == {"hashing"}  # hashed again
    with monkeypatch.context() as patch:
        _unread(patch)
        assert tokens(data, bpe).reused  # and its new stamp kept: not hashed a second time

    # The same size and modification time, other bytes: the change time still moves (touch cannot set it back).
    text = (data / "b.md").read_bytes()
    stat = (data / "b.md").stat()
    (data / "b.md").write_bytes(text.upper())
    os.utime(data / "b.md", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    edited = tokens(data, bpe)
    assert not edited.reused and edited.sha256 != first.sha256
    assert read_ids(edited) != read_ids(first)


def test_a_cache_planted_beside_the_data_is_never_read_and_nothing_is_written_there(tmp_path, bpe, monkeypatch):
    """A tenant who can write files in a shared root plants, for another tenant's corpus, the cache that earlier
    versions kept beside the data (``<path>.etrain-tokens/<sha256>.bin`` with a matching sidecar and stamp): it is
    never read, since the cache lives only in the service's folder; and the corpus's folder is left as it was,
    so a read-only dataset volume needs no write access."""
    monkeypatch.setattr(tokenized, "SETTLED_S", 0.0)
    data = tmp_path / "shared" / "corpus.txt"
    data.parent.mkdir()
    data.write_text("".join(CORPUS))
    honest = tokenize_text(data, bpe, out=tmp_path / "honest.bin")  # the real ids, and their sha256 and stamp
    planted = tmp_path / "shared" / "corpus.txt.etrain-tokens"
    planted.mkdir()
    poison = np.full(honest.num_tokens, 7, dtype=honest.dtype)
    poison.tofile(planted / f"{honest.sha256}.bin")
    sidecar = json.loads((tmp_path / "honest.bin.json").read_text())
    (planted / f"{honest.sha256}.bin.json").write_text(json.dumps({**sidecar, "path": str(planted)}))
    listed = sorted(os.walk(data.parent))
    cache = tokenize_text(data, bpe, cache_dir=tmp_path / "token-cache")
    again = tokenize_text(data, bpe, cache_dir=tmp_path / "token-cache")
    assert read_ids(cache) == read_ids(honest) == encode(bpe, data.read_text()) != poison.tolist()
    assert Path(cache.path).parent == tmp_path / "token-cache" and again.reused and again.path == cache.path
    assert sorted(os.walk(data.parent)) == listed  # nothing written beside the data: a read-only volume will do


def test_a_cache_linked_elsewhere_is_never_read(tmp_path, bpe, monkeypatch):
    """Defence in depth, should anything but the service write its folder: ``<name>.bin`` made a link to a file
    elsewhere, with a sidecar that matches, is no cache (it is replaced by a real one, the file it points at
    untouched and unread)."""
    monkeypatch.setattr(tokenized, "SETTLED_S", 0.0)
    data, _ = corpus_folder(tmp_path / "corpus")
    cache = tokens(data, bpe)
    secret = tmp_path / "outside.bin"
    secret.write_bytes(Path(cache.path).read_bytes()[::-1])  # the same size, other ids
    os.remove(cache.path)
    os.symlink(secret, cache.path)
    again = tokens(data, bpe)
    assert not again.reused and not Path(again.path).is_symlink() and read_ids(again) == read_ids(cache)
    assert secret.read_bytes() == Path(cache.path).read_bytes()[::-1]

    # The cache folder itself made a link to a folder elsewhere: refused, nothing written there.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(tmp_path / "token-cache")
    os.symlink(elsewhere, tmp_path / "token-cache")
    with pytest.raises(UnsafePathError) as refused:
        tokens(data, bpe)
    assert refused.value.field == "data.path" and list(elsewhere.iterdir()) == []


def test_the_hash_reads_a_document_in_pieces_keeps_the_name_and_meets_the_deadline_inside_it(tmp_path, bpe):
    from etrain.workers.rank.host_memory import host_memory_use

    data, documents = corpus_folder(tmp_path / "corpus")
    digest = tokenized._new_digest(tokenized.tokenizer_info(bpe))
    for text in documents:  # the name as it was before the hash streamed: caches written then are still found
        digest.update(len(text.encode()).to_bytes(8, "little"))
        digest.update(text.encode())
    assert tokens(data, bpe).sha256 == digest.hexdigest()

    big = tmp_path / "big.txt"
    with big.open("wb") as out:
        for line in range(64 * 1024 * 1024 // 64):
            out.write(f"{line:063d}\n".encode())
    with pytest.raises(
        DataError, match=r"hashing data.path=.* did not finish within 0 s \(0\.\d MiB of 64\.0 MiB done\)"
    ):
        tokens(big, bpe, timeout_s=0)  # checked as the document is read, not once it is
    before = host_memory_use().anonymous
    if before is None:
        pytest.skip("the kernel does not report anonymous pages")
    with pytest.raises(DataError, match="more than the 1.0 MiB"):
        tokens(big, bpe, max_bytes=1 << 20)  # hashed whole (to look for a cache), then refused
    grown = host_memory_use().anonymous - before
    assert grown < 16 << 20, f"hashing a 64 MiB document grew the process {grown / (1 << 20):.1f} MiB"


def test_the_hash_follows_the_content_of_data_and_tokenizer(tmp_path, bpe):
    data, _ = corpus_folder(tmp_path / "corpus")
    base = tokens(data, bpe)

    copy, _ = corpus_folder(tmp_path / "copy")
    assert tokens(copy, bpe).sha256 == base.sha256  # same bytes, same name: content, not path
    moved = shutil.copytree(data, tmp_path / "moved")  # another stamp, found by its hash: the same cache
    found = tokens(moved, bpe)
    assert found.reused and found.path == base.path and found.data == str(moved)

    (data / "b.md").write_text(CORPUS[2] + "one more line\n")
    edited = tokens(data, bpe)
    assert edited.sha256 != base.sha256 and not edited.reused
    assert Path(base.path).is_file()  # the old cache is left, never overwritten

    other = tokens(data, byte_bpe(tmp_path / "bpe320", vocab_size=320))
    assert other.sha256 not in (base.sha256, edited.sha256)

    (data / "b.md").write_text(CORPUS[2])
    assert tokens(data, bpe).reused and tokens(data, bpe).sha256 == base.sha256


def test_a_tokenizer_folder_means_its_tokenizer_json(tmp_path, bpe):
    (tmp_path / "t.txt").write_text(CORPUS[0])
    assert tokens(tmp_path / "t.txt", bpe.parent).sha256 == tokens(tmp_path / "t.txt", bpe).sha256


def test_racing_writers_leave_one_whole_cache(tmp_path, bpe):
    data = tmp_path / "race.txt"
    data.write_text("".join(CORPUS) * 500)
    barrier = threading.Barrier(3)
    results: list[tokenized.TokenCache] = []
    errors: list[BaseException] = []

    def run() -> None:
        barrier.wait()
        try:
            results.append(tokens(data, bpe))
        except BaseException as err:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert errors == [] and len(results) == 3
    assert len({cache.path for cache in results}) == 1
    assert read_ids(results[0]) == encode(bpe, data.read_text())
    assert sorted(p.name for p in Path(results[0].path).parent.iterdir()) == [
        f".{Path(results[0].path).name}.lock",
        Path(results[0].path).name,
        Path(results[0].path).name + ".json",
    ]  # no temporary files left
    assert sorted(cache.reused for cache in results) == [False, True, True]  # one wrote it, two waited for it


def test_out_writes_a_tokens_file_that_kind_tokens_reads(tmp_path, bpe):
    data, documents = corpus_folder(tmp_path / "corpus")
    out = tmp_path / "prepared" / "train.bin"

    cache = tokens(data, bpe, out=out)

    assert cache.path == str(out) and (tmp_path / "prepared" / "train.bin.json").is_file()
    assert not (tmp_path / "token-cache").exists()
    assert tokens(data, bpe, out=out).reused
    model = ModelConfig(n_layers=1, d_model=8, n_heads=2, vocab_size=300, seq_len=8)
    dataset = build_dataset(DataConfig(kind="tokens", path=str(out), token_dtype="uint16"), model)
    assert dataset.num_tokens == cache.num_tokens


# -- errors ----------------------------------------------------------------------------------------------


def test_bad_tokenizers_name_data_tokenizer(tmp_path, bpe):
    (tmp_path / "t.txt").write_text(CORPUS[0])
    (tmp_path / "broken.json").write_text('{"model": "nope"}')
    (tmp_path / "empty").mkdir()
    for path, words in [
        (tmp_path / "missing.json", "is not a file"),
        (tmp_path / "empty", "holds no tokenizer.json"),
        (tmp_path / "broken.json", "is not a Hugging Face tokenizer.json"),
    ]:
        with pytest.raises(DataError, match=words) as raised:
            tokens(tmp_path / "t.txt", path)
        assert raised.value.field == "data.tokenizer" and raised.value.fix
    with pytest.raises(DataError, match="has 300 token ids but model.vocab_size=256") as raised:
        tokens(tmp_path / "t.txt", bpe, model_vocab_size=256)
    assert raised.value.field == "data.tokenizer" and "300" in raised.value.fix


def test_bad_data_names_data_path(tmp_path, bpe):
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00 not utf-8")
    (tmp_path / "nothing").mkdir()
    for path, words in [
        (tmp_path / "absent", "does not exist"),
        (tmp_path / "bin.txt", "is not UTF-8 text"),
        (tmp_path / "nothing", "holds no text"),
    ]:
        with pytest.raises(DataError, match=words) as raised:
            tokens(path, bpe)
        assert raised.value.field == "data.path"


def test_a_bounded_run_refuses_big_or_slow_work_with_the_prepare_data_fix(tmp_path, bpe):
    data = tmp_path / "c.txt"
    data.write_text("".join(CORPUS) * 10)
    size = data.stat().st_size

    with pytest.raises(DataError, match="holds 0.0 MiB of text to tokenize, more than the 0.0 MiB") as raised:
        tokens(data, bpe, max_bytes=size - 1)
    assert raised.value.field == "data.path"
    assert raised.value.fix.startswith(
        "tokenize it once ahead of the submit on a machine that mounts the service's token cache (the operator): "
        f"`etrain prepare-data --tokenizer {bpe} {data}`, then submit again; or write a token file of your own "
        "with `etrain prepare-data --out FILE ...` and train on FILE with data.kind: tokens"
    )
    with pytest.raises(DataError, match="did not finish within 0 s") as raised:
        tokens(data, bpe, timeout_s=0)
    assert "etrain prepare-data" in raised.value.fix
    assert not (tmp_path / "token-cache").exists() or not any((tmp_path / "token-cache").iterdir())

    tokens(data, bpe)  # prepared ahead (no bounds): a bounded run now only reuses it
    assert tokens(data, bpe, max_bytes=1, timeout_s=60).reused


# -- the worker side --------------------------------------------------------------------------------------


def test_build_dataset_reads_the_tokenized_stream_and_bytes_stay_the_default(tmp_path, bpe):
    data, documents = corpus_folder(tmp_path / "corpus")
    model = ModelConfig(n_layers=1, d_model=8, n_heads=2, vocab_size=320, seq_len=8)

    tokenized_text = DataConfig(kind="text", path=str(data), tokenizer=str(bpe), token_cache_dir=str(token_cache(data)))
    dataset = build_dataset(tokenized_text, model)

    expected = tokens(data, bpe)
    assert expected.reused  # build_dataset wrote it; the same function finds it
    assert dataset.tokens.dtype == np.uint16 and dataset.tokens.tolist() == read_ids(expected)
    assert len(dataset) == (expected.num_tokens - 1) // 8
    assert build_dataset(DataConfig(kind="text", path=str(data)), model).tokens.dtype == np.uint8  # bytes
    with pytest.raises(DataError) as raised:
        build_dataset(tokenized_text, ModelConfig(n_layers=1, d_model=8, n_heads=2, vocab_size=256, seq_len=8))
    assert raised.value.field == "data.tokenizer"
    with pytest.raises(ConfigError) as raised:  # a run config the service did not make
        build_dataset(DataConfig(kind="text", path=str(data), tokenizer=str(bpe)), model)
    assert raised.value.field == "data.token_cache_dir" and "through the service" in raised.value.fix


# -- the job spec -----------------------------------------------------------------------------------------


def spec(data: dict, **model) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "tok",
            "model": {"preset": "gpt-tiny", **model},
            "data": data,
            "training": {"steps": 2, "global_batch": 2},
        }
    )


def test_a_spec_with_a_tokenizer_validates_and_reaches_the_workers(tmp_path, bpe):
    (tmp_path / "t.txt").write_text(CORPUS[0])
    relative = resolve_paths(
        spec({"kind": "text", "path": "t.txt", "tokenizer": "bpe/tokenizer.json"}, vocab_size=320), tmp_path
    )
    assert relative.data.tokenizer == str(tmp_path / "bpe" / "tokenizer.json")
    assert relative.data.path == str(tmp_path / "t.txt")

    job = resolve_paths(
        spec({"kind": "text", "path": str(tmp_path / "t.txt"), "tokenizer": str(bpe)}, vocab_size=320), tmp_path
    )
    assert check_spec(job) == []
    config = job.to_run_config(job_id="tok-1", checkpoint_root=str(tmp_path / "ckpt"), token_cache_dir="/cache")
    assert config.data == DataConfig(
        kind="text", path=str(tmp_path / "t.txt"), tokenizer=str(bpe), token_cache_dir="/cache"
    )
    untokenized = spec({"kind": "text", "path": str(tmp_path / "t.txt")})
    assert (
        untokenized.to_run_config(job_id="b", checkpoint_root="/c", token_cache_dir="/cache").data.token_cache_dir
        is None
    )

    small = word_level_with_bos(tmp_path / "wl")  # 35 ids: a model under 256 is fine, no byte rule
    assert (
        check_spec(spec({"kind": "text", "path": str(tmp_path / "t.txt"), "tokenizer": str(small)}, vocab_size=64))
        == []
    )


def test_spec_problems_name_data_tokenizer_with_a_fix(tmp_path, bpe):
    (tmp_path / "t.txt").write_text(CORPUS[0])
    text = {"kind": "text", "path": str(tmp_path / "t.txt")}

    [too_big] = check_spec(spec({**text, "tokenizer": str(bpe)}))  # gpt-tiny: vocab_size 256
    assert too_big.field == "data.tokenizer"
    assert too_big.message == (
        f"data.tokenizer {bpe} has 300 token ids but model.vocab_size=256: ids >= 256 have no embedding."
    )
    assert too_big.fix.startswith("set model.vocab_size to at least 300 (e.g. 320)")

    [missing] = check_spec(spec({**text, "tokenizer": str(tmp_path / "nope.json")}, vocab_size=320))
    assert missing.field == "data.tokenizer" and "is not a file" in missing.message and missing.fix

    (tmp_path / "bad.json").write_text("not json")
    [unreadable] = check_spec(spec({**text, "tokenizer": str(tmp_path / "bad.json")}, vocab_size=320))
    assert unreadable.field == "data.tokenizer" and "not a Hugging Face tokenizer.json" in unreadable.message

    bin_file = tmp_path / "x.bin"
    bin_file.write_bytes(b"\x00\x00")
    [wrong_kind] = check_spec(spec({"kind": "tokens", "path": str(bin_file), "tokenizer": str(bpe)}, vocab_size=320))
    assert (wrong_kind.field, wrong_kind.fix) == ("data.tokenizer", "remove data.tokenizer, or set data.kind: text")


def test_the_cache_folder_lists_each_cache_with_its_last_use_and_removes_one_whole(tmp_path, bpe, monkeypatch):
    """What the service's bound reads and does (service/decisions/token_cache.py decides): each complete cache with
    its bytes and last use, which every reuse renews; a removed cache takes its sidecar and stamps along."""
    from etrain.workers.engine.tokenized import cached_corpora, remove_caches

    monkeypatch.setattr(tokenized, "SETTLED_S", 0.0)
    folder = tmp_path / "token-cache"
    assert cached_corpora(folder) == []  # no folder yet
    one = tmp_path / "one.txt"
    one.write_text(CORPUS[0] * 20)
    two = tmp_path / "two.txt"
    two.write_text(CORPUS[1] * 20)
    first, second = tokens(one, bpe), tokens(two, bpe)
    tokens(one, bpe), tokens(two, bpe)  # found by their hashes: now each has a <stamp>.stamp
    (folder / ("f" * 64 + ".bin")).write_bytes(b"\0\0")  # ids without a sidecar: being written, no cache yet
    (folder / "notes.bin").write_bytes(b"")
    sidecar = Path(first.path + ".json")
    os.utime(sidecar, (0, 1_000_000))
    listed = {sha: (size, used, pinned) for sha, size, used, pinned in cached_corpora(folder)}
    assert listed == {
        first.sha256: (os.path.getsize(first.path) + sidecar.stat().st_size, 1_000_000.0, False),
        second.sha256: (
            os.path.getsize(second.path) + Path(second.path + ".json").stat().st_size,
            pytest.approx(Path(second.path + ".json").stat().st_mtime),
            False,
        ),
    }
    before = time.time()
    assert tokens(one, bpe).reused  # a reuse (a submit, a rank's start) is its last use
    assert {sha: used for sha, _, used, _ in cached_corpora(folder)}[first.sha256] >= before - 1
    three = tmp_path / "three.txt"
    three.write_text(CORPUS[2] * 20)
    prepared = tokens(three, bpe, prepared=True)  # what etrain prepare-data writes: pinned
    assert prepared.prepared and tokens(three, bpe).prepared  # and found as such
    assert {sha: pinned for sha, *_, pinned in cached_corpora(folder)}[prepared.sha256] is True
    assert tokens(two, bpe, prepared=True).prepared  # prepare-data finding a submit's cache pins it
    assert {sha: pinned for sha, *_, pinned in cached_corpora(folder)}[second.sha256] is True

    remove_caches(folder, [first.sha256, "not-a-hash"])
    remove_caches(folder, [prepared.sha256])
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith((".stamp", ".lock"))) == sorted(
        [f"{second.sha256}.bin", f"{second.sha256}.bin.json", "f" * 64 + ".bin", "notes.bin"]
    )  # the writers' lock files stay: one may be held
    assert [json.loads(p.read_text())["sha256"] for p in folder.glob("*.stamp")] == [second.sha256]
    again = tokens(one, bpe)
    assert not again.reused and read_ids(again) == read_ids(first)  # asked for again: written again

    # a writer that died leaves its temporary ids: removed once unchanged for the given time, never a fresh one;
    # and a lock file as old whose cache is gone, unless a writer holds it
    from etrain.workers.engine.tokenized import remove_stale_temporaries

    stale, fresh = folder / f".{'e' * 64}.bin.tmp-1-2-abc", folder / f".{'d' * 64}.bin.tmp-3-4-def"
    stale.write_bytes(b"\0" * 8)
    fresh.write_bytes(b"\0" * 8)
    held_lock = folder / f".{'c' * 64}.bin.lock"
    held_lock.write_bytes(b"")
    holder = os.open(held_lock, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    for old in (stale, held_lock, *folder.glob(".*.lock")):
        os.utime(old, (0, time.time() - 7200))
    remove_stale_temporaries(folder, older_than_s=3600)
    os.close(holder)
    assert not stale.exists() and fresh.exists() and Path(again.path).exists()
    assert sorted(p.name for p in folder.glob(".*.lock")) == sorted(
        [f".{'c' * 64}.bin.lock", f".{second.sha256}.bin.lock", f".{first.sha256}.bin.lock"]
    )  # held, or its cache there: kept; the prepared one's (its cache removed, free, old): gone


def test_one_writer_tokenizes_a_cache_and_the_others_wait_for_it(tmp_path, bpe):
    """Ranks of a node that miss the same cache (a corpus changed since the submit, or tokenized by an earlier
    version) do not each tokenize it: the first holds the writer's lock, the others wait and then find its cache;
    a submit waits no longer than its deadline."""
    data = tmp_path / "corpus.txt"
    data.write_text("".join(CORPUS) * 50)
    elsewhere = tokenize_text(data, bpe, cache_dir=tmp_path / "elsewhere")  # the cache the "other writer" makes
    folder = tmp_path / "token-cache"
    folder.mkdir()
    lock = os.open(folder / f".{elsewhere.sha256}.bin.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)  # another writer at work
    stages: list[str] = []
    results: list[tokenized.TokenCache] = []
    waiting = threading.Thread(
        target=lambda: results.append(tokens(data, bpe, progress=lambda stage, *_: stages.append(stage)))
    )
    waiting.start()
    time.sleep(0.6)
    assert waiting.is_alive() and "tokenizing" not in stages and not list(folder.glob("*.bin"))

    bounded: list[BaseException] = []

    def submit() -> None:  # a submit: bounded by its deadline (in a thread: a wait past it fails here, not hangs)
        try:
            tokens(data, bpe, timeout_s=0.3)
        except DataError as err:
            bounded.append(err)

    submitting = threading.Thread(target=submit)
    submitting.start()
    submitting.join(timeout=20)
    assert not submitting.is_alive() and len(bounded) == 1
    assert re.search(r"waiting for another writer to tokenize data.path=.* within 0.3 s", bounded[0].message)

    for suffix in (".bin.json", ".bin"):  # the other writer finishes (sidecar first) and lets go
        shutil.copy(elsewhere.path.removesuffix(".bin") + suffix, folder / f"{elsewhere.sha256}{suffix}")
    os.close(lock)
    waiting.join(timeout=30)
    [found] = results
    assert found.reused and found.path == str(folder / f"{elsewhere.sha256}.bin") and "tokenizing" not in stages
    assert read_ids(found) == read_ids(elsewhere)

    # no other writer: the lock is taken at once and the cache written
    from etrain.workers.engine.tokenized import remove_caches

    remove_caches(folder, [elsewhere.sha256])
    assert sorted(p.name for p in folder.iterdir()) == [f".{elsewhere.sha256}.bin.lock"]
    written = tokens(data, bpe)
    assert not written.reused and read_ids(written) == read_ids(elsewhere)


def test_a_writer_goes_ahead_past_a_stuck_holder_or_without_locks(tmp_path, bpe, monkeypatch):
    """The lock only saves work: a holder that stopped touching its lock file (stopped, hung, on a crashed node
    whose lock the filesystem kept) is passed after WRITER_STALE_S by a waiter with no deadline, and a filesystem
    without flock (ENOLCK) writes unlocked; each time the cache is written and right."""
    import errno

    data = tmp_path / "corpus.txt"
    data.write_text("".join(CORPUS) * 20)
    expected = encode(bpe, data.read_text())
    sha256 = tokenize_text(data, bpe, cache_dir=tmp_path / "probe").sha256
    folder = tmp_path / "token-cache"
    folder.mkdir()
    lock = os.open(folder / f".{sha256}.bin.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)  # held, never released in this test
    os.utime(lock, (0, time.time() - 700))  # and untouched for 700 s
    result: list[tokenized.TokenCache] = []
    waiting = threading.Thread(target=lambda: result.append(tokens(data, bpe)))
    waiting.start()
    waiting.join(timeout=30)
    assert not waiting.is_alive() and not result[0].reused and read_ids(result[0]) == expected
    os.close(lock)

    real = fcntl.flock

    def no_locks(fd, operation):
        if operation & fcntl.LOCK_EX:
            raise OSError(errno.ENOLCK, "No locks available")
        return real(fd, operation)

    monkeypatch.setattr(tokenized.fcntl, "flock", no_locks)
    unlocked = tokenize_text(data, bpe, cache_dir=tmp_path / "no-locks")
    assert not unlocked.reused and read_ids(unlocked) == expected
