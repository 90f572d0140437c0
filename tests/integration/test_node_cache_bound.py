"""The node compile cache's bound on a real folder (``workers/engine/node_cache_bound.py``).

* A pass removes exactly the idle files the rule names, never a link, a lock, a dot-file or a folder, and
  forgets the sets the node held (their markers); one pass per node at a time and per interval.
* inductor survives a pass: a real compile's generated code and kernels removed under its FX-graph entries
  (the case where a cache hit finds its files gone) and the next process compiles to the same numbers from
  those entries, writing the files again.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time

from etrain.workers.engine.compile_artifacts import MARKERS
from etrain.workers.engine.node_cache_bound import bound, bound_in_background, scan

DAYS = 86400.0


def _write(path, size: int, days_ago: float) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as stream:
        stream.write(b"x" * size)
    then = time.time() - days_ago * DAYS
    os.utime(path, (then, then))
    return str(path)


def test_a_pass_removes_the_idle_files_oldest_first_and_nothing_it_must_not(tmp_path):
    cache = tmp_path / "cache"
    outside = _write(tmp_path / "elsewhere" / "precious.bin", 5000, 30)
    oldest = _write(cache / "ab" / "cabc.so", 2000, 20)
    older = _write(cache / "fxgraph" / "cd" / "fcd" / "entry", 3000, 10)
    recent = _write(cache / "ef" / "cef.py", 3000, 1)
    kept_idle = _write(cache / "triton" / "0" / "k" / "kernel.cubin", 3000, 5)
    lock = _write(cache / "locks" / "cabc.lock", 100, 40)
    lonely_lock = _write(cache / "x.lock", 100, 40)
    in_progress = _write(cache / "ab" / ".tmp_write", 100, 40)
    marker = _write(cache / MARKERS / ("d" * 64), 0, 40)
    os.symlink(tmp_path / "elsewhere", cache / "linked-folder")
    os.symlink(outside, cache / "ab" / "linked-file")

    assert sorted(f.path for f in scan(str(cache))) == sorted([oldest, older, recent, kept_idle])
    # 11,000 bytes against a bound of 10,000 (low water 8,000): the two oldest go, 6,000 bytes left
    line = bound(str(cache), max_bytes=10_000, every_s=0)
    assert line is not None and line.startswith("compile cache over its bound (0.0 MiB > 0.0 MiB"), line
    assert "removed 2 files" in line and "unused for 2 days or more" in line
    for path in (oldest, older):
        assert not os.path.exists(path)
    for path in (recent, kept_idle, lock, lonely_lock, in_progress, outside):
        assert os.path.exists(path), path
    assert os.path.islink(cache / "linked-folder") and os.path.islink(cache / "ab" / "linked-file")
    assert os.path.isdir(cache / "fxgraph" / "cd" / "fcd")  # folders stay
    assert not os.path.exists(marker)  # a marked set may have lost files: its next rank loads it again

    # within the bound now: a pass says nothing and removes nothing
    assert bound(str(cache), max_bytes=10_000, every_s=0) is None
    assert os.path.exists(recent) and os.path.exists(kept_idle)


def test_one_pass_per_node_at_a_time_and_per_interval(tmp_path):
    cache = tmp_path / "cache"
    idle = _write(cache / "ab" / "old.so", 1000, 9)
    with open(cache / ".etrain-cache-bound.lock", "w") as held:  # another rank's pass under way
        fcntl.flock(held, fcntl.LOCK_EX)
        assert bound(str(cache), max_bytes=10, every_s=0) is None
        assert os.path.exists(idle)
    assert bound(str(cache), max_bytes=10, every_s=600) is not None  # no stamp yet: the first pass runs
    assert not os.path.exists(idle)
    again = _write(cache / "ab" / "old2.so", 1000, 9)
    assert bound(str(cache), max_bytes=10, every_s=600) is None  # a pass ran just now
    assert os.path.exists(again)
    assert bound(str(cache), max_bytes=10, every_s=600, now=time.time() + 601) is not None
    assert not os.path.exists(again)
    assert bound(str(cache), max_bytes=None, every_s=0) is None  # no bound: nothing to do


def test_the_background_pass_reads_the_nodes_setting_and_reports_a_bad_one(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    _write(cache / "ab" / "old.so", 3 << 20, 9)
    lines: list[str] = []
    monkeypatch.setenv("ETRAIN_COMPILE_CACHE_MAX_GB", "0.001")  # ~1 MiB
    bound_in_background([str(cache)], lines.append).join(timeout=30)
    assert len(lines) == 1 and lines[0].startswith("compile cache over its bound (3.0 MiB > 1.0 MiB"), lines
    monkeypatch.setenv("ETRAIN_COMPILE_CACHE_MAX_GB", "lots")
    lines.clear()
    bound_in_background([str(cache)], lines.append).join(timeout=30)
    assert lines == [
        "ETRAIN_COMPILE_CACHE_MAX_GB='lots' is not a positive number of GiB (or 'none'): the default 10 GiB applies"
    ]


# One fused kernel (a C++ build on CPU, the slow part), forward only: an FX-graph entry, its Python module
# and its compiled kernel, the three kinds of file a pass removes.
_COMPILE = """
import json, torch
from torch._dynamo.utils import counters
x = torch.arange(16, dtype=torch.float32)
y = torch.compile(lambda t: (t * 0.5).sin() + t)(x)
print(json.dumps({"y": y.tolist(), "hits": counters["inductor"]["fxgraph_cache_hit"]}))
"""


def _compile(cache: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_inductor_compiles_from_its_entries_after_a_pass_removed_their_code(tmp_path):
    cache = str(tmp_path / "cache")
    first = _compile(cache)
    assert first["hits"] == 0
    old = time.time() - 3 * DAYS
    code = []
    for cached in scan(cache):  # every generated file and kernel idle; the FX-graph and AOT entries in use
        if not os.path.relpath(cached.path, cache).startswith(("fxgraph", "aotautograd")):
            os.utime(cached.path, (old, old))
            code.append(cached.path)
    assert any(path.endswith(".so") for path in code) and any(path.endswith(".py") for path in code), code
    line = bound(cache, max_bytes=1, every_s=0)
    assert f"removed {len(code)} files" in line, line
    assert not any(os.path.exists(path) for path in code)

    second = _compile(cache)
    assert second["hits"] > 0  # the entries were used, and their code written again
    assert second["y"] == first["y"]
    assert any(cached.path.endswith(".so") for cached in scan(cache))  # the kernels were built again


def test_a_rank_whose_compile_grew_the_cache_runs_a_pass_and_logs_it(tmp_path, monkeypatch):
    """The rank's side (``TrainWorker._bound_node_cache``, called after a first step with cache misses): the
    pass runs on the folder the rank compiles into, and its line lands in the rank log under the attempt."""
    from types import SimpleNamespace

    from etrain.workers.engine import node_cache_bound
    from etrain.workers.rank.worker import TrainWorker

    cache = tmp_path / "cache"
    idle = _write(cache / "ab" / "old.so", 3 << 20, 9)
    monkeypatch.setattr(node_cache_bound, "inductor_header_folder", lambda: str(tmp_path / "no-headers"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    monkeypatch.setenv("ETRAIN_COMPILE_CACHE_MAX_GB", "0.001")
    log = SimpleNamespace(lines=[])
    log.write = log.lines.append
    TrainWorker._bound_node_cache(SimpleNamespace(attempt=3), log).join(timeout=30)
    assert not os.path.exists(idle)
    assert len(log.lines) == 1 and log.lines[0].startswith("attempt 3: compile cache over its bound (3.0 MiB"), (
        log.lines
    )
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert TrainWorker._bound_node_cache(SimpleNamespace(attempt=3), log) is None


def test_the_rank_bounds_inductors_precompiled_headers_too(tmp_path, monkeypatch):
    """inductor keeps its precompiled C++ headers (~150 MB each, one per compiler, flags and include paths)
    in its default folder whatever ``TORCHINDUCTOR_CACHE_DIR`` says: the rank's pass bounds that folder as
    well, and names it in its line."""
    from types import SimpleNamespace

    from torch._inductor import codecache

    from etrain.workers.engine import node_cache_bound
    from etrain.workers.rank.worker import TrainWorker

    assert node_cache_bound.inductor_header_folder() == codecache._HEADER_DIR  # where torch really puts them
    headers = tmp_path / "torchinductor_user" / "precompiled_headers"
    idle = _write(headers / "abc.h.gch", 3 << 20, 9)
    lock = _write(headers / "locks" / "abc.lock", 1 << 20, 9)
    monkeypatch.setattr(node_cache_bound, "inductor_header_folder", lambda: str(headers))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ETRAIN_COMPILE_CACHE_MAX_GB", "0.001")
    log = SimpleNamespace(lines=[])
    log.write = log.lines.append
    TrainWorker._bound_node_cache(SimpleNamespace(attempt=2), log).join(timeout=30)
    assert not os.path.exists(idle) and os.path.exists(lock)
    assert len(log.lines) == 1 and log.lines[0].endswith(f"(in {headers})"), log.lines
