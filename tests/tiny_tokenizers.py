"""Tiny Hugging Face tokenizers built (and trained) in the test with the ``tokenizers`` library itself:
no downloads. Each builder writes ``<folder>/tokenizer.json`` and returns its path."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.\n",
    "Elastic training resumes from the last committed checkpoint.\n",
    "def step(batch):\n    loss = model(batch)\n    return loss\n",
    "Pipeline stages exchange activations; tensor parallel ranks share every matmul.\n",
]


def byte_bpe(folder: Path, *, vocab_size: int = 300, eos: str | None = "<|endoftext|>") -> Path:
    """GPT-2 style byte-level BPE (every byte has an id, so nothing is unknown), trained on ``CORPUS``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos] if eos else [],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    return _save(tokenizer, folder)


def word_level_with_bos(folder: Path) -> Path:
    """Whitespace words; the post-processor puts ``<s>`` before every sequence; ``</s>`` is the EOS."""
    words = sorted({word for line in CORPUS for word in line.split()})
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{word: 3 + i for i, word in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return _save(tokenizer, folder)


def wide_word_level(folder: Path, size: int = 70_000) -> Path:
    """A word-level vocabulary of ``size`` ids (more than uint16 holds): ``w0 .. w{size-2}`` and ``[UNK]``."""
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(size - 1)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return _save(tokenizer, folder)


def _save(tokenizer: Tokenizer, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return path
