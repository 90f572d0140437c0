"""Tenants end to end: a real control plane (uvicorn, JobManager, SQLite) over a real local Ray.

Alice's job trains for real; Bob gets 404 for it on every route the OpenAPI document lists with a
job id (the same body as for a job that does not exist), never sees it in his list or in /metrics,
and cannot touch it; the admin sees it; Alice's second job is over her quota (429). The job still
finishes as if nobody had tried.
"""

from __future__ import annotations

import pytest

from tests.service_harness import event_kinds

ray = pytest.importorskip("ray")

ALICE = "alice-e2e-token-1b7f0c"
BOB = "bob-e2e-token-92ad3e"
STEPS = 30


def spec(name: str) -> dict:
    return {
        "name": name,
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 2, "vocab_size": 64, "seq_len": 16},
        "data": {"kind": "synthetic", "seed": 3},
        "parallelism": {"dp": 2},
        "resources": {"cpus_per_worker": 1, "min_dp": 1, "max_dp": 2},
        "training": {"steps": STEPS, "global_batch": 8, "micro_batch": 2, "lr": 0.01, "seed": 1},
        "checkpoint": {"every_steps": 10},
    }


#: A valid body for each job route that takes one, so a 404 is not hidden behind a 422.
BODIES = {"scale": {"dp": 1}, "chaos": {"action": "kill_rank", "rank": 0, "at_step": 5}}


def test_a_tenant_sees_only_its_own_jobs_end_to_end(local_ray, tmp_path):
    from tests.service_harness import control_plane

    with (
        control_plane(tmp_path, tenant_tokens={"alice": ALICE, "bob": BOB}, tenant_max_jobs=1) as admin,
        admin.as_token(ALICE) as alice,
        admin.as_token(BOB) as bob,
        admin.as_token(None) as anonymous,
    ):
        job = alice.submit(spec("alices"))
        assert job["tenant"] == "alice"

        over = alice.client.post("/v1/jobs", json=spec("second"))
        assert over.status_code == 429, over.text
        assert over.json()["quota"] == {
            "name": "max_jobs",
            "setting": "ETRAIN_TENANT_MAX_JOBS",
            "tenant": "alice",
            "limit": 1,
            "used": 1,
            "requested": 1,
        }

        alice.wait_until(job["id"], lambda j: j["step"] >= 5, timeout_s=120, what="step 5")
        document = anonymous.client.get("/openapi.json").json()
        routes = [
            (method.upper(), path) for path, ops in document["paths"].items() for method in ops if "{job_id}" in path
        ]
        assert len(routes) >= 7
        for method, path in routes:
            verb = path.rsplit("/", 1)[-1]
            body = {"out": str(tmp_path / "export")} if verb == "export" else BODIES.get(verb)
            answers = [
                bob.client.request(method, path.replace("{job_id}", job_id), json=body if method == "POST" else None)
                for job_id in (job["id"], "nosuch-00000000")
            ]
            assert answers[0].status_code == 404, (method, path, answers[0].text)
            assert answers[0].text.replace(job["id"], "nosuch-00000000") == answers[1].text, (method, path)
            assert anonymous.client.request(method, path.replace("{job_id}", job["id"])).status_code == 401

        assert bob.client.get("/v1/jobs").json()["jobs"] == []
        assert [j["id"] for j in admin.client.get("/v1/jobs").json()["jobs"]] == [job["id"]]
        metrics = anonymous.client.get("/metrics").text
        assert job["id"] not in metrics and "alices" not in metrics
        assert f'etrain_job_step{{job_id="{job["id"]}"' in admin.client.get("/metrics").text
        assert job["id"] not in bob.client.get("/metrics").text

        final = alice.wait_terminal(job["id"], timeout_s=120)
        assert (final["status"], final["step"], final["restarts"]) == ("SUCCEEDED", STEPS, 0)
        kinds = event_kinds(alice.events(job["id"]))
        assert not {"chaos_armed", "cancel_requested", "scale_requested", "exported"} & set(kinds)
        assert [row["step"] for row in admin.steps(job["id"])] == list(range(1, STEPS + 1))
