"""``etrain prepare-data``: tokenize text here, once, into the cache a ``data: {kind: text}`` job reads.

It runs the same function the server runs at submit (``etrain.workers.engine.tokenized.tokenize_text``), but
locally, with no server and no time limit, and with a progress bar: the way to prepare a corpus too
big to tokenize while a submit waits. It writes into the service's token cache (``--cache-dir``, default the one
``etrain serve`` would use with this environment), so it is run by whoever may write that folder: the operator,
or a single user on the server's machine. Anyone else writes a token file of their own (``--out``) and trains on
it with ``data.kind: tokens``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import TextIO

from etrain.api.cli.client import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, CliError
from etrain.api.cli.output import print_error, print_json


class ProgressBar:
    """``etrain prepare-data``'s progress: one line on ``stream`` (stderr) redrawn in place, at most every
    ``interval_s`` seconds and always at 100%; a new stage (hashing, then tokenizing) starts a new line."""

    WIDTH = 30

    def __init__(self, stream: TextIO, *, interval_s: float = 0.2):
        self.stream = stream
        self.interval_s = interval_s
        self._stage: str | None = None
        self._started = self._drawn = 0.0

    def __call__(self, stage: str, done: int, total: int, tokens: int) -> None:
        now = time.monotonic()
        if stage != self._stage:
            if self._stage is not None:
                self.stream.write("\n")
            self._stage, self._started, self._drawn = stage, now, 0.0
        elif done < total and now - self._drawn < self.interval_s:
            return
        self._drawn = now
        fraction = done / total if total else 1.0
        filled = min(self.WIDTH, int(fraction * self.WIDTH))
        mib = 1 << 20
        rate = done / mib / max(now - self._started, 1e-6)
        line = (
            f"{stage:<10} {100 * fraction:5.1f}% |{'#' * filled}{'.' * (self.WIDTH - filled)}| "
            f"{done / mib:.1f}/{total / mib:.1f} MiB  {rate:.1f} MiB/s"
        )
        if stage == "tokenizing":
            line += f"  {tokens:,} tokens"
        self.stream.write("\r" + line)
        self.stream.flush()

    def close(self) -> None:
        if self._stage is not None:
            self.stream.write("\n")
            self.stream.flush()
            self._stage = None


def _cache_dir(given: str | None) -> str:
    """``--cache-dir``, or the token cache ``etrain serve`` would use with this environment (the three variables
    that place it, and only those: the rest of the server's settings are not this command's business)."""
    if given:
        return os.path.realpath(os.path.expanduser(given))
    from etrain.service.settings import Settings

    placing = ("ETRAIN_DATA_DIR", "ETRAIN_CHECKPOINT_ROOT", "ETRAIN_TOKEN_CACHE_DIR")
    return Settings.from_env({name: os.environ[name] for name in placing if name in os.environ}).token_cache_dir


def cmd_prepare_data(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Tokenize text with a tokenizer.json into the cache a ``data: {kind: text, tokenizer: ...}`` job reads
    (or into ``--out``), here, with no server and no time limit; print the file and its token count."""
    from etrain.workers.engine.tokenized import tokenize_text
    from etrain.workers.protocol.errors import EtrainError

    bar = ProgressBar(err)
    try:
        cache_dir = None if args.out else _cache_dir(args.cache_dir)
        # Resolved here as the server pins them at submit (symlinks followed once, on the user's own say): the
        # cache lands where the server will look, and the files inside are then opened without links, as there.
        cache = tokenize_text(
            os.path.realpath(os.path.expanduser(args.path)),
            os.path.realpath(os.path.expanduser(args.tokenizer)),
            cache_dir=cache_dir,
            out=os.path.realpath(os.path.expanduser(args.out)) if args.out else None,
            progress=bar,
            prepared=cache_dir is not None,  # the operator's: the cache's bound leaves it to the operator
        )
    except EtrainError as error:
        bar.close()
        print_error(CliError(error.message, error.fix), err)
        return EXIT_FAILED
    except KeyboardInterrupt:
        bar.close()
        return EXIT_INTERRUPTED
    bar.close()
    if cache_dir is not None and not args.cache_dir:
        print(
            f"note: {cache_dir} is the token cache of a server started here with this environment; for another "
            "server give its folder with --cache-dir, or write a file of your own with --out",
            file=err,
        )
    if args.json:
        print_json({**cache.sidecar(), "reused": cache.reused}, out)
        return EXIT_OK
    eos = f"EOS {cache.eos_token!r}" if cache.eos_token else "no EOS"
    print(f"cache:  {cache.path} ({'reused' if cache.reused else 'written'})", file=out)
    print(
        f"tokens: {cache.num_tokens} {cache.dtype} ({cache.documents} documents, {eos}, "
        f"tokenizer vocab {cache.vocab_size})",
        file=out,
    )
    return EXIT_OK
