"""Token datasets (no network) and the global, layout-independent sampler.

Why the sampler is a pure function of ``(seed, step)``: every parallel layout, every restart and
every elastic resize must feed the optimizer exactly the same samples at step ``s`` — otherwise
the equivalence, failure-transparency and elastic-exactness invariants cannot hold. So the global
batch of a step never depends on the world size or on any iterator state: a checkpoint only needs
the step number to resume the data stream exactly.

A dataset is a long 1-D token stream cut into non-overlapping windows: sample ``i`` is the
``seq_len + 1`` tokens starting at ``i * seq_len`` (inputs are the first ``seq_len``, targets the
same window shifted by one).

Kinds:

* ``text``      a UTF-8 file, or a folder of text-like files walked in sorted order; bytes are
                tokens (vocabulary 256), read from the files a sample at a time
                (``workers/engine/text_bytes.py``: never held whole in a rank's memory). With ``data.tokenizer`` (a Hugging Face tokenizer.json) the
                text is tokenized once into a cached ``.bin`` in the service's token cache
                (``DataConfig.token_cache_dir``, never beside the data) and read like ``tokens``
                (``workers/engine/tokenized.py``; the service usually writes it at submit).
* ``tokens``    a nanoGPT-style ``.bin``: a raw array of ``uint16``/``uint32`` token ids, memory-mapped.
* ``synthetic`` a deterministic, learnable stream built from a seed (random "words" of distinct
                tokens repeated in a random order), so a loss curve falls clearly without any file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from etrain.workers.engine.shuffle import permuted
from etrain.workers.engine.text_bytes import text_bytes
from etrain.workers.engine.tokenized import tokenize_text
from etrain.workers.protocol import layout_rules, safe_paths
from etrain.workers.protocol.errors import ConfigError, DataError
from etrain.workers.protocol.run_config import DataConfig, ModelConfig

__all__ = [
    "BYTE_VOCAB_SIZE",
    "GlobalSampler",
    "TokenDataset",
    "build_dataset",
    "read_token_file",
    "synthetic_tokens",
]

BYTE_VOCAB_SIZE = 256
SYNTHETIC_NUM_TOKENS = 1 << 20  # 1M tokens: ~8k samples of 128 tokens, generated in milliseconds
_TOKEN_RANGE_PROBE = 1 << 20  # tokens checked against the vocabulary when a .bin is opened


class TokenDataset:
    """Samples of ``seq_len + 1`` tokens over a 1-D token stream (numpy array, memmap or ``TextBytes``)."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, source: str):
        if tokens.ndim != 1:
            raise ValueError(f"token stream must be 1-D, got shape {tokens.shape}")
        if len(tokens) < seq_len + 1:
            raise DataError(
                f"{source} has {len(tokens)} tokens, fewer than model.seq_len + 1 = {seq_len + 1}.",
                field="data.path",
                fix="use more data or a shorter model.seq_len",
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.source = source

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def sample(self, index: int) -> np.ndarray:
        """Sample ``index`` (wrapping modulo the dataset length): ``seq_len + 1`` int64 tokens."""
        start = (index % len(self)) * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets ``[len(indices), seq_len]`` (int64) for the given sample indices."""
        window = torch.from_numpy(np.stack([self.sample(i) for i in indices]))
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


class GlobalSampler:
    """Which samples step ``s`` trains on: a seeded permutation per epoch, read in order.

    ``indices(step)`` is the global batch and depends only on ``(seed, step)``; data-parallel rank
    ``r`` of ``dp`` takes the contiguous ``r``-th ``1/dp`` slice. Concatenating the slices of all
    ranks gives back the global batch for any ``dp``, which is what makes elastic resizes exact.
    """

    def __init__(self, num_samples: int, global_batch: int, seed: int):
        if num_samples < 1:
            raise DataError("the dataset has no samples.", field="data.path", fix="use more data")
        if global_batch < 1:
            raise ConfigError(f"training.global_batch must be >= 1, got {global_batch}.", field="training.global_batch")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed

    def indices(self, step: int) -> list[int]:
        """The global batch of ``step`` (sample indices in batch order): positions ``step * global_batch`` onward of
        the epochs' orders laid end to end, each epoch's a keyed permutation (``workers/engine/shuffle.py``)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        first = step * self.global_batch
        epochs, offsets = np.divmod(np.arange(first, first + self.global_batch, dtype=np.int64), self.num_samples)
        out = np.empty(self.global_batch, dtype=np.int64)
        for epoch in np.unique(epochs):  # each epoch the batch spans (two, where it wraps, unless it is the larger)
            where = epochs == epoch
            out[where] = permuted(offsets[where], self.num_samples, seed=self.seed, epoch=int(epoch))
        return out.tolist()

    def local_indices(self, step: int, dp_rank: int, dp: int) -> list[int]:
        """Data-parallel rank ``dp_rank``'s contiguous slice of the global batch of ``step``."""
        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp={dp}")
        layout_rules.check(layout_rules.batch_problems(global_batch=self.global_batch, micro_batch=1, dp=dp))
        share = self.global_batch // dp
        return self.indices(step)[dp_rank * share : (dp_rank + 1) * share]

    def local_micro_batches(self, step: int, dp_rank: int, dp: int, micro_batch: int) -> list[list[int]]:
        """The local slice split into consecutive micro-batches of ``micro_batch`` samples."""
        layout_rules.check(layout_rules.batch_problems(global_batch=self.global_batch, micro_batch=micro_batch, dp=dp))
        local = self.local_indices(step, dp_rank, dp)
        return [local[i : i + micro_batch] for i in range(0, len(local), micro_batch)]


# -- readers --------------------------------------------------------------------------------------


def read_token_file(path: str, token_dtype: str, vocab_size: int) -> np.ndarray:
    """Memory-map a raw ``.bin`` of token ids (nanoGPT format: no header, native byte order)."""
    file = Path(path)
    if not file.is_file():
        raise DataError(
            f"data.path={path!r} is not a file.",
            field="data.path",
            fix="point data.path at a .bin of token ids (e.g. nanoGPT's train.bin)",
        )
    dtype = np.dtype(token_dtype)
    size = file.stat().st_size
    if size == 0:
        raise DataError(f"data.path={path!r} is empty.", field="data.path", fix="use a non-empty token file")
    if size % dtype.itemsize:
        raise DataError(
            f"data.path={path!r} has {size} bytes, not a multiple of {dtype.itemsize} "
            f"(data.token_dtype={token_dtype}).",
            field="data.token_dtype",
            fix="set data.token_dtype to the dtype the file was written with (uint16 or uint32)",
        )
    with safe_paths.open_file(file, field="data.path") as stream:  # no link on the way (swapped after submit)
        tokens = np.memmap(stream, dtype=dtype, mode="r")
    probe_max = int(tokens[:_TOKEN_RANGE_PROBE].max())
    if probe_max >= vocab_size:
        raise DataError(
            f"data.path={path!r} holds token id {probe_max} >= model.vocab_size={vocab_size} "
            f"(read as data.token_dtype={token_dtype}).",
            field="data.token_dtype",
            fix="check data.token_dtype (uint16 vs uint32) and model.vocab_size",
        )
    return tokens


def synthetic_tokens(vocab_size: int, seed: int, num_tokens: int = SYNTHETIC_NUM_TOKENS) -> np.ndarray:
    """A learnable stream: a fixed set of random "words" (4-12 distinct tokens) in a random order.

    Each token id belongs to at most one word, so inside a word the next token is determined by
    the current one; only the choice of the next word is random. A model quickly learns the words
    and the loss falls from ln(vocab_size) towards ~ln(num_words) / mean word length, never to
    zero. Fully vectorised: a million tokens take milliseconds.
    """
    rng = np.random.default_rng([seed, 0x5EED])
    pool = rng.permutation(vocab_size)[: min(vocab_size, 512)]
    cuts, position = [], 0
    while position < len(pool):
        position += int(rng.integers(4, 13))
        cuts.append(min(position, len(pool)))
    words = [pool[start:end] for start, end in zip([0] + cuts[:-1], cuts)]
    mean_len = len(pool) / len(words)
    order = rng.integers(0, len(words), size=int(num_tokens / mean_len) + len(words))
    stream = np.concatenate([words[i] for i in order])
    while len(stream) < num_tokens:  # only for tiny num_tokens with unlucky word lengths
        stream = np.concatenate([stream, stream])
    return stream[:num_tokens].astype(np.int32)


def build_dataset(data: DataConfig, model: ModelConfig) -> TokenDataset:
    """The dataset a run reads; checks the model can represent every token it will see."""
    if data.kind == "synthetic":
        num_tokens = max(SYNTHETIC_NUM_TOKENS, 64 * (model.seq_len + 1))
        return TokenDataset(
            synthetic_tokens(model.vocab_size, data.seed, num_tokens),
            seq_len=model.seq_len,
            source=f"synthetic(seed={data.seed})",
        )
    if data.path is None:
        raise DataError(
            f"data.kind={data.kind!r} needs data.path.",
            field="data.path",
            fix="set data.path, or use data.kind='synthetic'",
        )
    if data.kind == "text" and data.tokenizer:
        if data.token_cache_dir is None:
            raise ConfigError(
                "data.tokenizer needs the token cache folder, and data.token_cache_dir is not set.",
                field="data.token_cache_dir",
                fix="run the job through the service (it sets its cache folder), or set data.token_cache_dir",
            )
        cache = tokenize_text(
            data.path, data.tokenizer, cache_dir=data.token_cache_dir, model_vocab_size=model.vocab_size
        )
        tokens = read_token_file(cache.path, cache.dtype, model.vocab_size)
    elif data.kind == "text":
        if model.vocab_size < BYTE_VOCAB_SIZE:
            raise ConfigError(
                f"data.kind='text' uses byte tokens (256 ids) but model.vocab_size={model.vocab_size}.",
                field="model.vocab_size",
                fix="set model.vocab_size >= 256",
            )
        tokens = text_bytes(data.path)
    elif data.kind == "tokens":
        tokens = read_token_file(data.path, data.token_dtype, model.vocab_size)
    else:
        raise DataError(
            f"unknown data.kind={data.kind!r}.", field="data.kind", fix="use 'text', 'tokens' or 'synthetic'"
        )
    return TokenDataset(tokens, seq_len=model.seq_len, source=f"data.path={data.path!r}")
