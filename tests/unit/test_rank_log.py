"""Rank log files (workers/rank/rank_log.py): the writer's lines, tee, rotation, and the reader's tail/offset."""

from __future__ import annotations

import sys

import pytest

from etrain.workers.rank.rank_log import MAX_LINE_CHARS, RankLog, rank_log_path, read_lines


def test_the_path_is_per_job_and_rank_inside_the_checkpoint_root(tmp_path):
    assert rank_log_path(tmp_path, "job-1a", 3) == str(tmp_path / "logs" / "job-1a" / "rank3.log")
    for job_id in ("../x", "a/b", "..", ""):
        with pytest.raises(ValueError, match="cannot name a log folder"):
            rank_log_path(tmp_path, job_id, 0)
    with pytest.raises(ValueError, match="rank must be >= 0"):
        rank_log_path(tmp_path, "job", -1)


def written(tmp_path, count: int) -> str:
    path = rank_log_path(tmp_path, "job", 0)
    log = RankLog(path)
    for n in range(count):
        log.write(f"line {n}")
    log.close()
    return path


def test_lines_are_timestamped_and_read_back_from_the_end(tmp_path):
    path = written(tmp_path, 50)
    chunk = read_lines(path, tail=3)
    assert [line.split(" ", 1)[1] for line in chunk.lines] == ["line 47", "line 48", "line 49"]
    assert chunk.lines[0][:4].isdigit() and chunk.lines[0][10] == "T"  # ISO timestamp first
    assert chunk.offset == chunk.size == len(open(path, "rb").read())
    assert len(read_lines(path, tail=10_000).lines) == 50


def test_following_by_offset_reads_each_line_once_and_never_a_half_line(tmp_path):
    path = written(tmp_path, 7)
    seen, offset = [], 0
    while True:
        chunk = read_lines(path, tail=3, offset=offset)
        if not chunk.lines:
            break
        seen += chunk.lines
        offset = chunk.offset
    assert [line.split(" ", 1)[1] for line in seen] == [f"line {n}" for n in range(7)]
    with open(path, "a") as handle:
        handle.write("half a line")  # still being written: not returned, the offset stays
    assert (
        read_lines(path, tail=3, offset=offset).lines == [] and read_lines(path, tail=3, offset=offset).offset == offset
    )
    with open(path, "a") as handle:
        handle.write(" and the rest\n")
    assert read_lines(path, tail=3, offset=offset).lines == ["half a line and the rest"]
    # An offset past the end (the file was rotated under the follower) starts again at 0.
    assert read_lines(path, tail=1, offset=10**9).lines[0].endswith("line 0")


def test_a_missing_file_reads_as_empty_and_long_lines_are_cut(tmp_path):
    assert read_lines(tmp_path / "none.log", tail=5).lines == []
    path = tmp_path / "long.log"
    path.write_text("x" * (MAX_LINE_CHARS * 2) + "\nshort\n")
    lines = read_lines(path, tail=5).lines
    assert lines == ["x" * (MAX_LINE_CHARS - 3) + "...", "short"]


def test_the_tail_of_a_large_file_reads_only_its_end(tmp_path):
    path = tmp_path / "big.log"
    path.write_text("".join(f"{n:08d}\n" for n in range(200_000)))  # 1.8 MB
    assert read_lines(path, tail=2).lines == ["00199998", "00199999"]
    assert read_lines(path, tail=5000).lines[0] == f"{200_000 - 5000:08d}"


def test_capture_tees_stdout_and_stderr_until_released(tmp_path, capsys):
    path = rank_log_path(tmp_path, "job", 1)
    log = RankLog(path)
    log.capture()
    print("hello from the rank")
    sys.stderr.write("Traceback (most recent call last):\n  boom\n")
    print("no newline yet", end="")
    log.release()
    print("after release")
    log.close()
    text = [line.split(" ", 1)[1] for line in read_lines(path, tail=10).lines]
    assert text == ["hello from the rank", "Traceback (most recent call last):", "  boom"]
    captured = capsys.readouterr()
    assert "hello from the rank" in captured.out and "after release" in captured.out  # still printed as before
    assert "boom" in captured.err


def test_a_log_past_its_size_rotates_to_one_old_file(tmp_path):
    path = rank_log_path(tmp_path, "job", 0)
    log = RankLog(path, max_bytes=1000)
    for n in range(100):
        log.write(f"line {n:03d} " + "." * 40)
    log.close()
    current = read_lines(path, tail=1000).lines
    old = read_lines(path + ".1", tail=1000).lines
    assert current[-1].split(" ")[2] == "099" and 0 < len(current) < 100
    assert old and int(old[-1].split(" ")[2]) + 1 == int(current[0].split(" ")[2])


def test_an_unwritable_log_never_breaks_the_rank(tmp_path, capfd):
    blocker = tmp_path / "logs"
    blocker.write_text("a file where the folder should be")
    log = RankLog(rank_log_path(tmp_path, "job", 0))
    log.write("lost")
    log.write("also lost")
    log.close()
    assert capfd.readouterr().err.count("cannot write the rank log") == 1


def _warn_from_the_model() -> None:
    import warnings

    warnings.warn("a view tensor was returned", UserWarning, stacklevel=1)


def test_each_capture_shows_again_the_warnings_an_earlier_attempt_of_the_process_showed(tmp_path):
    """A rank kept by an in-place repair runs its next attempt in the same process: the warning Python showed
    in the first attempt appears in the second attempt's lines too, once each, and the filters stay."""
    import warnings

    path = rank_log_path(tmp_path, "job", 0)
    log = RankLog(path)

    def to_stderr(message, category, filename, lineno, file=None, line=None):  # as Python shows them (pytest records)
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    with warnings.catch_warnings():
        warnings.showwarning = to_stderr
        warnings.simplefilter("default")  # as Python's own: once per place
        warnings.filterwarnings("ignore", message="an ignored one")
        for attempt in (1, 2):
            log.capture()
            log.write(f"attempt {attempt}: starts")
            _warn_from_the_model()
            _warn_from_the_model()  # the same place: once per attempt
            warnings.warn("an ignored one", UserWarning, stacklevel=1)
            log.release()
    log.close()
    text = [line.split(" ", 1)[1] for line in read_lines(path, tail=20).lines]
    shown = [at for at, line in enumerate(text) if "UserWarning: a view tensor was returned" in line]
    assert len(shown) == 2, text
    assert shown[0] < text.index("attempt 2: starts") < shown[1], text
    assert not any("an ignored one" in line for line in text)
