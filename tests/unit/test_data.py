"""Datasets and the global sampler: deterministic, layout-independent, resize-exact, clear errors."""

from __future__ import annotations

import math
import time
from collections import Counter

import numpy as np
import pytest
import torch

from etrain.workers.engine.data import GlobalSampler, TokenDataset, build_dataset, synthetic_tokens
from etrain.workers.engine.text_bytes import text_bytes
from etrain.workers.protocol.errors import ConfigError, DataError
from etrain.workers.protocol.run_config import DataConfig, ModelConfig

MODEL = ModelConfig(n_layers=1, d_model=8, n_heads=2, vocab_size=256, seq_len=8)


# -- sampler -----------------------------------------------------------------------------------


def test_global_batch_is_a_pure_function_of_seed_and_step() -> None:
    a = GlobalSampler(num_samples=100, global_batch=8, seed=1)
    b = GlobalSampler(num_samples=100, global_batch=8, seed=1)
    # Ask b in another order: no iterator state may leak between steps.
    b_batches = {step: b.indices(step) for step in [7, 3, 0, 12, 5]}
    for step, batch in b_batches.items():
        assert a.indices(step) == batch
    assert GlobalSampler(100, 8, seed=2).indices(0) != a.indices(0)


def test_one_epoch_visits_every_sample_once_then_reshuffles() -> None:
    sampler = GlobalSampler(num_samples=40, global_batch=8, seed=0)
    epoch0 = [i for step in range(5) for i in sampler.indices(step)]
    epoch1 = [i for step in range(5, 10) for i in sampler.indices(step)]
    assert sorted(epoch0) == list(range(40))
    assert sorted(epoch1) == list(range(40))
    assert epoch0 != epoch1


def test_a_batch_that_straddles_epochs_continues_into_the_next_permutation() -> None:
    sampler = GlobalSampler(num_samples=10, global_batch=4, seed=0)
    stream = [i for step in range(5) for i in sampler.indices(step)]  # 20 samples = 2 epochs
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))


def test_a_corpus_of_a_trillion_samples_costs_nothing_to_start() -> None:
    """No table is built: the first batch of a 10^12-sample corpus comes at once, distinct and in range."""
    started = time.perf_counter()
    batch = GlobalSampler(num_samples=10**12, global_batch=512, seed=0).indices(123_456)
    assert time.perf_counter() - started < 0.5
    assert len(set(batch)) == 512 and all(0 <= i < 10**12 for i in batch)


def test_a_batch_larger_than_the_corpus_spans_several_epochs() -> None:
    sampler = GlobalSampler(num_samples=3, global_batch=10, seed=4)
    batch = sampler.indices(1)  # positions 10..19: the end of epoch 3, epochs 4 and 5, the start of epoch 6
    assert sorted(batch[2:5]) == [0, 1, 2] and sorted(batch[5:8]) == [0, 1, 2]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dp_slices_concatenate_to_the_global_batch(dp: int) -> None:
    sampler = GlobalSampler(num_samples=1000, global_batch=16, seed=3)
    for step in range(6):
        slices = [sampler.local_indices(step, rank, dp) for rank in range(dp)]
        assert [i for s in slices for i in s] == sampler.indices(step)


def test_resizing_dp_mid_run_neither_skips_nor_repeats_samples() -> None:
    sampler = GlobalSampler(num_samples=1000, global_batch=16, seed=3)
    seen = []
    for step, dp in enumerate([4, 4, 2, 1, 2, 4]):  # elastic resizes between steps
        for rank in range(dp):
            for micro in sampler.local_micro_batches(step, rank, dp, micro_batch=2):
                seen.extend(micro)
    assert seen == [i for step in range(6) for i in sampler.indices(step)]
    assert len(set(seen)) == len(seen)


def test_local_micro_batches_split_the_rank_slice_in_order() -> None:
    sampler = GlobalSampler(num_samples=100, global_batch=8, seed=0)
    micro = sampler.local_micro_batches(2, dp_rank=1, dp=2, micro_batch=2)
    assert micro == [sampler.indices(2)[4:6], sampler.indices(2)[6:8]]


def test_indivisible_batches_are_config_errors() -> None:
    sampler = GlobalSampler(num_samples=100, global_batch=8, seed=0)
    # The batch rule (etrain.workers.protocol.layout_rules.batch_problems), the same message the spec answers with.
    with pytest.raises(
        ConfigError,
        match=r"global_batch=8 is not divisible by parallelism.dp \* training.micro_batch "
        r"= 3 \* 1 = 3",
    ):
        sampler.local_indices(0, 0, 3)
    with pytest.raises(ConfigError, match=r"= 2 \* 3 = 6") as info:
        sampler.local_micro_batches(0, 0, 2, micro_batch=3)
    assert info.value.field == "training.global_batch"


# -- datasets ----------------------------------------------------------------------------------


def test_samples_are_windows_and_targets_are_inputs_shifted_by_one() -> None:
    dataset = TokenDataset(np.arange(100, dtype=np.int32), seq_len=8, source="test")
    assert len(dataset) == 12  # (100 - 1) // 8
    inputs, targets = dataset.batch([0, 3])
    assert inputs.dtype == torch.int64 and inputs.shape == (2, 8)
    assert inputs[1].tolist() == list(range(24, 32))
    assert targets[1].tolist() == list(range(25, 33))


def test_synthetic_stream_is_deterministic_and_learnable() -> None:
    a, b = synthetic_tokens(64, seed=5, num_tokens=50_000), synthetic_tokens(64, seed=5, num_tokens=50_000)
    assert np.array_equal(a, b) and len(a) == 50_000
    assert not np.array_equal(a, synthetic_tokens(64, seed=6, num_tokens=50_000))
    assert a.min() >= 0 and a.max() < 64
    # Conditional entropy of the next token given the previous one is far below ln(vocab):
    # a model can learn the stream, so a loss curve falls clearly.
    pairs = Counter(zip(a[:-1].tolist(), a[1:].tolist()))
    firsts = Counter(a[:-1].tolist())
    entropy = -sum(n / (len(a) - 1) * math.log(n / firsts[p]) for (p, _), n in pairs.items())
    assert entropy < 0.5 * math.log(64)


def test_text_folder_reads_text_files_sorted_and_skips_the_rest(tmp_path) -> None:
    (tmp_path / "b.py").write_text("print(1)\n")
    (tmp_path / "a.md").write_text("# A\n")
    (tmp_path / "Makefile").write_text("all:\n")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    (tmp_path / "blob.txt").write_bytes(b"\x00\x01binary")  # text suffix, binary content
    (tmp_path / ".hidden.txt").write_text("secret")
    for skipped in (".git", ".venv", "__pycache__", ".cache"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "x.txt").write_text("skip me")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("héllo")

    tokens = text_bytes(str(tmp_path))

    assert tokens.dtype == np.uint8
    # Sorted by name (byte order: "Makefile" < "a.md"), files before the sub-folder's.
    assert tokens[:].tobytes().decode() == "all:\n\n# A\n\nprint(1)\n\nhéllo"


def test_text_file_dataset_uses_byte_tokens(tmp_path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text("abcdefghijklmnopqrstuvwxyz" * 4)
    dataset = build_dataset(DataConfig(kind="text", path=str(path)), MODEL)
    inputs, targets = dataset.batch([0])
    assert bytes(inputs[0].tolist()) == b"abcdefgh" and bytes(targets[0].tolist()) == b"bcdefghi"


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_is_memory_mapped(tmp_path, dtype: str) -> None:
    path = tmp_path / "train.bin"
    np.arange(200, dtype=dtype).tofile(path)
    dataset = build_dataset(DataConfig(kind="tokens", path=str(path), token_dtype=dtype), MODEL)
    assert isinstance(dataset.tokens, np.memmap)
    assert len(dataset) == (200 - 1) // 8
    assert dataset.sample(2).tolist() == list(range(16, 25))


# -- errors ------------------------------------------------------------------------------------


def _error(data: DataConfig, model: ModelConfig = MODEL) -> DataError:
    with pytest.raises(DataError) as info:
        build_dataset(data, model)
    return info.value


def test_missing_path_names_the_setting_and_the_fix(tmp_path) -> None:
    error = _error(DataConfig(kind="text", path=str(tmp_path / "nope")))
    assert error.field == "data.path" and "does not exist" in str(error) and "Fix:" in str(error)
    assert _error(DataConfig(kind="tokens", path=None)).field == "data.path"


def test_empty_data_is_rejected(tmp_path) -> None:
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    assert "holds no text" in str(_error(DataConfig(kind="text", path=str(tmp_path))))
    (tmp_path / "empty.bin").write_bytes(b"")
    assert "is empty" in str(_error(DataConfig(kind="tokens", path=str(tmp_path / "empty.bin"))))


def test_binary_file_given_as_text_is_rejected(tmp_path) -> None:
    (tmp_path / "x.txt").write_bytes(b"\xff\xfe\x00")
    assert "not UTF-8" in str(_error(DataConfig(kind="text", path=str(tmp_path / "x.txt"))))


def test_fewer_tokens_than_one_sample(tmp_path) -> None:
    (tmp_path / "short.txt").write_text("abc")
    error = _error(DataConfig(kind="text", path=str(tmp_path / "short.txt")))
    assert "3 tokens, fewer than model.seq_len + 1 = 9" in str(error)


def test_token_file_size_and_dtype_are_checked(tmp_path) -> None:
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    error = _error(DataConfig(kind="tokens", path=str(odd), token_dtype="uint16"))
    assert error.field == "data.token_dtype" and "not a multiple of 2" in str(error)
    # uint16 tokens read as uint32 give ids far beyond the vocabulary.
    wrong = tmp_path / "wrong.bin"
    np.array([1, 2, 3, 4] * 50, dtype=np.uint16).tofile(wrong)
    error = _error(DataConfig(kind="tokens", path=str(wrong), token_dtype="uint32"))
    assert error.field == "data.token_dtype" and ">= model.vocab_size=256" in str(error)


def test_text_needs_a_byte_vocabulary(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("x" * 100)
    small = ModelConfig(n_layers=1, d_model=8, n_heads=2, vocab_size=64, seq_len=8)
    with pytest.raises(ConfigError, match="vocab_size=64"):
        build_dataset(DataConfig(kind="text", path=str(tmp_path)), small)


def test_errors_survive_pickling() -> None:
    import pickle

    error = DataError("bad", field="data.path", fix="fix it")
    clone = pickle.loads(pickle.dumps(error))
    assert (type(clone), clone.field, clone.fix) == (DataError, "data.path", "fix it")
