"""Issue #8, signed checkpoints end to end: real server, real Ray, real training, a forged manifest.

A one-rank tiny GPT commits every 5 steps; rank 0 hangs at step 12 (after step 10 committed). While
it hangs, the test forges step 10's manifest the way an attacker with write access to the storage
would: a changed field and a recomputed checksum, so the keyless integrity check passes, but the
HMAC (the key is the server's, in ``<data-dir>/checkpoint-key``) cannot be recomputed. The restart
must refuse step 10 with a ``checkpoint_refused`` event naming the signature, move it aside, resume
from step 5, never load step 10, and still finish all 20 steps.
"""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from tests.service_harness import event_kinds, event_text

ray = pytest.importorskip("ray")

STEPS, EVERY, HANG_AT = 20, 5, 12


def spec() -> dict:
    return {
        "name": "signed",
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 2, "vocab_size": 64, "seq_len": 16},
        "data": {"kind": "synthetic", "seed": 3},
        "parallelism": {"dp": 1},
        "resources": {"cpus_per_worker": 1},
        "training": {"steps": STEPS, "global_batch": 4, "micro_batch": 2, "lr": 0.01, "seed": 5},
        "checkpoint": {"every_steps": EVERY, "keep_last": 5},
        "fault_tolerance": {"max_restarts": 2, "heartbeat_timeout_s": 4, "backoff_base_s": 0.1, "backoff_max_s": 0.5},
        "stragglers": {"enabled": False},
    }


def forge(manifest_path) -> None:
    """Edit the manifest and recompute its checksum (what the checksum alone cannot catch)."""
    document = json.loads(manifest_path.read_text())
    document["created_at"] = 0.0
    body = {name: value for name, value in document.items() if name not in ("checksum", "hmac")}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    document["checksum"] = hashlib.sha256(canonical).hexdigest()
    manifest_path.write_text(json.dumps(document, sort_keys=True, indent=1) + "\n")


def test_a_forged_manifest_is_refused_on_resume_and_never_loaded(plane):
    job = plane.submit(spec())
    plane.chaos(job["id"], action="hang_rank", rank=0, at_step=HANG_AT)
    root = plane.data_dir / "checkpoints" / job["id"]
    plane.wait_until(
        job["id"],
        lambda j: j["last_checkpoint_step"] == 10 and j["step"] >= HANG_AT,
        timeout_s=120,
        what="step 10 committed and the rank hanging",
    )
    manifest = root / "step_00000010" / "manifest.json"
    signed = json.loads(manifest.read_text())
    assert signed["format"] == "etrain.checkpoint/2" and signed["job_id"] == job["id"]
    assert re.fullmatch(r"[0-9a-f]{64}", signed["hmac"])
    forge(manifest)

    final = plane.wait_terminal(job["id"], timeout_s=180)
    events = plane.events(job["id"])
    assert final["status"] == "SUCCEEDED", (final, [f"{e['kind']}: {event_text(e)}" for e in events])
    assert (final["step"], final["last_checkpoint_step"], final["restarts"]) == (STEPS, STEPS, 1)

    kinds = event_kinds(events)
    assert "hang_detected" in kinds
    [refused] = [event_text(e) for e in events if e["kind"] == "checkpoint_refused"]
    assert refused.startswith("step 10: ") and "signature does not verify" in refused, refused
    assert re.search(r"not loaded, moved to step_00000010\.refused-\d+$", refused), refused
    launches = [event_text(e) for e in events if e["kind"] == "launching"]
    assert len(launches) == 2
    assert launches[0].endswith("fresh start") and launches[1].endswith("resuming from step 5"), launches
    assert kinds.index("checkpoint_refused") < [i for i, k in enumerate(kinds) if k == "launching"][1]

    # The second attempt re-ran steps 6..20, step 10 included: it resumed from 5 and never loaded 10.
    attempts = {row["step"]: row["attempt"] for row in plane.steps(job["id"])}
    assert sorted(attempts) == list(range(1, STEPS + 1))
    first, second = attempts[1], attempts[STEPS]
    assert second > first
    rerun = [step for step, attempt in sorted(attempts.items()) if attempt == second]
    assert rerun == list(range(EVERY + 1, STEPS + 1))

    # The forged directory is kept for inspection beside the re-saved, signed step 10.
    assert len(list(root.glob("step_00000010.refused-*"))) == 1
    resaved = json.loads(manifest.read_text())
    assert resaved["job_id"] == job["id"] and resaved["hmac"] != signed["hmac"]
    assert sorted(p.name for p in root.glob("step_????????") if (p / "manifest.json").exists()) == [
        f"step_{s:08d}" for s in (5, 10, 15, 20)
    ]
    assert "checkpoint_key" not in json.dumps(final) and (
        plane.data_dir / "checkpoint-key"
    ).read_text().strip() not in json.dumps(events)

    # A new job may resume from that directory only while every checkpoint in it is signed by this
    # service: once one is forged, the submit is refused (422) and nothing is created.
    resume = {**spec(), "training": {**spec()["training"], "steps": STEPS + EVERY}, "checkpoint": {"path": str(root)}}
    forge(root / "step_00000020" / "manifest.json")
    jobs_before = len(plane.client.get("/v1/jobs").json()["jobs"])
    response = plane.client.post("/v1/jobs", json=resume)
    assert response.status_code == 422, response.text
    assert len(plane.client.get("/v1/jobs").json()["jobs"]) == jobs_before
    [problem] = response.json()["detail"]
    assert problem["field"] == "checkpoint.path"
    assert "holds step 20, which this service did not commit for you" in problem["message"]
    assert "signature does not verify" in problem["message"]
