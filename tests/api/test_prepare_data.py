"""``etrain prepare-data`` (local: progress bar on stderr, the cache file and its token count on stdout) and
the submit path: the real JobManager (Ray replaced by FakeRuntime) tokenizes ``data.tokenizer`` text with the
same function, into the same token cache (the service's, never beside the data), bounded, or answers 422 naming
the field and the fix."""

from __future__ import annotations

import io
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer

from etrain.api import cli
from etrain.api.app import create_app
from etrain.service.settings import Settings
from tests.fakes import FakeRuntime
from tests.service_harness import admin_headers
from tests.tiny_tokenizers import CORPUS, byte_bpe

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    return byte_bpe(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(autouse=True)
def server_environment(tmp_path, monkeypatch) -> Path:
    """The environment ``etrain serve`` would read here: its data directory is ``<tmp>/state`` (the manager's
    below), so ``etrain prepare-data``'s default cache folder is the service's."""
    for name in ("ETRAIN_CHECKPOINT_ROOT", "ETRAIN_TOKEN_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ETRAIN_DATA_DIR", str(tmp_path / "state"))
    return tmp_path / "state" / "checkpoints" / ".token-cache"


@pytest.fixture
def corpus(tmp_path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for index, text in enumerate(CORPUS):
        (folder / f"{index}.txt").write_text(text * 50)
    return folder


def expected_ids(bpe: Path, corpus: Path) -> list[int]:
    tokenizer = Tokenizer.from_file(str(bpe))
    eos = tokenizer.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for index, path in enumerate(sorted(corpus.glob("*.txt"))):
        ids += ([eos] if index else []) + tokenizer.encode(path.read_text()).ids
    return ids


def etrain(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(list(args), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


# -- etrain prepare-data ------------------------------------------------------------------------------------


def test_prepare_data_prints_the_cache_and_its_token_count(bpe, corpus, server_environment):
    expected = expected_ids(bpe, corpus)

    code, out, err = etrain("prepare-data", "--tokenizer", str(bpe), str(corpus))

    assert code == 0, err
    cache_line, tokens_line = out.splitlines()
    path = Path(cache_line.split()[1])
    assert path.parent == server_environment and cache_line.endswith(" (written)")  # the server's token cache
    assert json.loads(Path(f"{path}.json").read_text())["prepared"] is True  # the operator's: never pruned
    assert [p.name for p in corpus.iterdir()] == [p.name for p in corpus.glob("*.txt")]  # nothing beside the data
    assert tokens_line == (f"tokens: {len(expected)} uint16 (4 documents, EOS '<|endoftext|>', tokenizer vocab 300)")
    assert np.fromfile(path, dtype=np.uint16).tolist() == expected
    # the progress bar: hashing, then tokenizing, each ending at 100% on stderr (stdout stays clean)
    assert "hashing    100.0% |" + "#" * 30 + "|" in err
    assert f"note: {server_environment} is the token cache of a server started here with this environment" in err
    assert "tokenizing 100.0% |" + "#" * 30 + "|" in err and f"{len(expected):,} tokens" in err
    assert err.endswith("\n")

    again = etrain("prepare-data", "--tokenizer", str(bpe.parent), str(corpus))
    assert again[0] == 0 and again[1].splitlines() == [f"cache:  {path} (reused)", tokens_line]
    assert "tokenizing" not in again[2]

    elsewhere = corpus.parent / "operator-cache"  # --cache-dir: the cache of a server with other settings
    code, out, err = etrain("prepare-data", "--tokenizer", str(bpe), str(corpus), "--cache-dir", str(elsewhere))
    assert code == 0 and out.splitlines()[0] == f"cache:  {elsewhere / path.name} (written)"


def test_prepare_data_out_and_json(bpe, corpus, tmp_path):
    out_file = tmp_path / "train.bin"
    code, out, err = etrain("--json", "prepare-data", "--tokenizer", str(bpe), str(corpus), "--out", str(out_file))

    assert code == 0, err
    body = json.loads(out)
    assert body["path"] == str(out_file) and body["reused"] is False
    assert body["num_tokens"] == len(expected_ids(bpe, corpus)) and body["dtype"] == "uint16"
    assert out_file.stat().st_size == 2 * body["num_tokens"]
    assert not (tmp_path / "state").exists()  # nothing in the token cache either


def test_prepare_data_errors_name_the_setting_and_the_fix(bpe, corpus, tmp_path, server_environment):
    code, out, err = etrain("prepare-data", "--tokenizer", str(tmp_path / "nope.json"), str(corpus))
    assert (code, out) == (1, "")
    assert err.splitlines()[0] == f"error: data.tokenizer={str(tmp_path / 'nope.json')!r} is not a file."
    assert err.splitlines()[1].startswith("  fix: point data.tokenizer at a Hugging Face tokenizer.json")

    code, _, err = etrain("prepare-data", "--tokenizer", str(bpe), str(tmp_path / "absent"))
    assert code == 1 and "data.path=" in err and "does not exist" in err
    assert etrain("prepare-data", str(corpus))[0] == 2  # --tokenizer is required

    code, out, err = etrain("prepare-data", "--tokenizer", str(bpe), str(corpus), "--cache-dir", "")
    assert code == 0 and out.startswith(f"cache:  {server_environment}/")  # empty: the server's default
    assert f"note: {server_environment} is the token cache of a server" in err
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ETRAIN_TOKEN_CACHE_DIR", "relative/cache")
        code, out, err = etrain("prepare-data", "--tokenizer", str(bpe), str(corpus))
    assert (code, out) == (1, "") and "ETRAIN_TOKEN_CACHE_DIR='relative/cache' is not an absolute folder" in err


def test_the_console_command_runs_without_a_server(bpe, corpus, server_environment):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "etrain.api.cli",
            "--url",
            "http://127.0.0.1:9",
            "prepare-data",
            "--tokenizer",
            str(bpe),
            str(corpus),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"cache:  {server_environment}/")
    assert result.stdout.splitlines()[1].startswith(f"tokens: {len(expected_ids(bpe, corpus))} uint16")
    assert "tokenizing 100.0%" in result.stderr


# -- at submit: the real JobManager -------------------------------------------------------------------------


@pytest.fixture
def manager(tmp_path):
    manager_module = pytest.importorskip("etrain.service.manager")  # imports Ray (not started)
    manager = manager_module.JobManager(
        Settings(
            data_dir=tmp_path / "state", poll_interval_s=60, storage_roots=(tmp_path.parent,)
        ),  # bpe: another tmp dir
        runtime=FakeRuntime(),
        base_dir=str(tmp_path),
    )
    yield manager
    manager.close()


def job(data: dict[str, Any], **model: Any) -> dict[str, Any]:
    return {
        "name": "tok",
        "model": {"preset": "gpt-tiny", "vocab_size": 320, **model},
        "data": data,
        "training": {"steps": 4, "global_batch": 2},
    }


def test_submit_tokenizes_once_with_the_same_function(tmp_path, manager, bpe, corpus, server_environment):
    client = TestClient(
        create_app(Settings(data_dir=tmp_path / "state"), manager=manager), headers=admin_headers(tmp_path / "state")
    )
    spec = job({"kind": "text", "path": "corpus", "tokenizer": str(bpe)})  # relative to the server's dir

    first = client.post("/v1/jobs", json=spec)

    assert first.status_code == 201, first.text
    [cache] = server_environment.glob("*.bin")
    assert np.fromfile(cache, dtype=np.uint16).tolist() == expected_ids(bpe, corpus)
    config = manager.runtime.jobs[first.json()["id"]]["config"]
    assert (config.data.kind, config.data.path, config.data.tokenizer) == ("text", str(corpus), str(bpe))
    assert config.data.token_cache_dir == str(server_environment)  # where the ranks find it
    events = client.get(f"/v1/jobs/{first.json()['id']}/events").json()["events"]
    tokenized = [event["detail"]["message"] for event in events if event["kind"] == "data_tokenized"]
    assert tokenized == [f"{len(expected_ids(bpe, corpus))} tokens (uint16) written to {cache}"]

    mtime = cache.stat().st_mtime_ns
    second = client.post("/v1/jobs", json=spec)
    assert second.status_code == 201 and cache.stat().st_mtime_ns == mtime
    events = client.get(f"/v1/jobs/{second.json()['id']}/events").json()["events"]
    assert any(e["kind"] == "data_tokenized" and "reused from" in e["detail"]["message"] for e in events)


def test_submit_refuses_a_tokenizer_the_model_cannot_embed(tmp_path, manager, bpe, corpus):
    client = TestClient(
        create_app(Settings(data_dir=tmp_path / "state"), manager=manager), headers=admin_headers(tmp_path / "state")
    )

    response = client.post(
        "/v1/jobs", json=job({"kind": "text", "path": str(corpus), "tokenizer": str(bpe)}, vocab_size=256)
    )

    assert response.status_code == 422
    [problem] = response.json()["detail"]
    assert problem["field"] == "data.tokenizer"
    assert "has 300 token ids but model.vocab_size=256" in problem["message"]
    assert problem["fix"].startswith("set model.vocab_size to at least 300")
    assert not (tmp_path / "state" / "checkpoints").exists()  # refused before any tokenizing


def test_submit_bounds_the_work_and_points_at_prepare_data(tmp_path, manager, bpe, corpus):
    client = TestClient(
        create_app(Settings(data_dir=tmp_path / "state"), manager=manager), headers=admin_headers(tmp_path / "state")
    )
    spec = job({"kind": "text", "path": str(corpus), "tokenizer": str(bpe)})
    manager.submit_tokenize_max_bytes = 1000  # the corpus is ~13 kB

    too_big = client.post("/v1/jobs", json=spec)

    assert too_big.status_code == 422
    [problem] = too_big.json()["detail"]
    assert problem["field"] == "data.path"
    assert "more than the 0.0 MiB tokenized while a submit waits" in problem["message"]
    assert f"`etrain prepare-data --tokenizer {bpe} {corpus}`" in problem["fix"]

    manager.submit_tokenize_max_bytes, manager.submit_tokenize_timeout_s = 1 << 30, 0.0
    too_slow = client.post("/v1/jobs", json=spec)
    assert too_slow.status_code == 422 and "did not finish within 0 s" in too_slow.json()["detail"][0]["message"]

    assert etrain("prepare-data", "--tokenizer", str(bpe), str(corpus))[0] == 0  # what the fix says
    manager.submit_tokenize_timeout_s = 20.0
    manager.submit_tokenize_max_bytes = 1000
    assert client.post("/v1/jobs", json=spec).status_code == 201  # the prepared cache is reused


def test_the_token_cache_stays_under_its_bound_and_keeps_what_unfinished_jobs_use(
    tmp_path, bpe, server_environment, monkeypatch
):
    """ETRAIN_TOKEN_CACHE_MAX_GB: after a submit writes a cache, the least recently used caches are removed until the
    folder fits, except those an unfinished job uses and those found in the last 10 minutes."""
    from etrain.workers.engine import tokenized

    monkeypatch.setattr(tokenized, "SETTLED_S", 0.0)  # the corpora written just now count as settled: stamps kept
    manager_module = pytest.importorskip("etrain.service.manager")
    settings = Settings(
        data_dir=tmp_path / "state", poll_interval_s=60, storage_roots=(tmp_path.parent,), token_cache_max_gb=1e-9
    )  # a 1-byte bound: every cache that may go, goes
    manager = manager_module.JobManager(settings, runtime=FakeRuntime(), base_dir=str(tmp_path))
    client = TestClient(create_app(settings, manager=manager), headers=admin_headers(tmp_path / "state"))
    corpora = []
    for index in range(3):
        corpus = tmp_path / f"corpus{index}"
        corpus.mkdir()
        (corpus / "a.txt").write_text(CORPUS[index] * 30)
        corpora.append(corpus)

    def submit(corpus: Path) -> tuple[str, str]:
        response = client.post("/v1/jobs", json=job({"kind": "text", "path": str(corpus), "tokenizer": str(bpe)}))
        assert response.status_code == 201, response.text
        [event] = [
            e
            for e in client.get(f"/v1/jobs/{response.json()['id']}/events").json()["events"]
            if e["kind"] == "data_tokenized"
        ]
        return response.json()["id"], event["detail"]["cache_sha256"]

    def age(sha256: str, seconds: float) -> None:
        sidecar = server_environment / f"{sha256}.bin.json"
        os.utime(sidecar, (sidecar.stat().st_atime, sidecar.stat().st_mtime - seconds))

    def held() -> set[str]:
        return {path.name.removesuffix(".bin") for path in server_environment.glob("*.bin")}

    def stamped() -> set[str]:
        return {json.loads(path.read_text())["sha256"] for path in server_environment.glob("*.stamp")}

    try:
        first_job, first = submit(corpora[0])
        manager.store.update_job(first_job, status="SUCCEEDED")
        second_job, second = submit(corpora[1])
        assert held() == {first, second}  # the first is unused but was used a moment ago
        assert stamped() == {first, second}
        age(first, 3600)
        age(second, 3600)
        _, third = submit(corpora[2])
        assert held() == {second, third}  # the second is the running second job's, the third the new one's
        assert stamped() == {second, third}  # the removed cache's stamp went with it

        again_job, again = submit(corpora[0])  # the removed one is tokenized once more when asked for
        assert again == first and held() == {second, third, first}
        events = client.get(f"/v1/jobs/{again_job}/events").json()["events"]
        assert any(e["kind"] == "data_tokenized" and "written to" in e["detail"]["message"] for e in events)

        # a pruning that fails never fails the submit, nor leaves its job unscheduled
        asked: list[bool] = []

        def locked() -> set[str]:
            asked.append(True)
            raise sqlite3.OperationalError("database is locked")

        manager._token_caches_in_use = locked
        corpus = tmp_path / "corpus3"
        corpus.mkdir()
        (corpus / "a.txt").write_text(CORPUS[3] * 30)
        before = held()
        late_job, late = submit(corpus)  # a 201, above
        assert asked == [True] and held() == before | {late}  # the pruning failed: nothing removed, no error
        assert late_job not in manager._submitting and manager.get(late_job).status.value != "FAILED"
    finally:
        manager.close()
