"""`make bench`'s API benchmark stays runnable: a short run against its real server process."""

from __future__ import annotations

from benchmarks import bench_api


def test_the_api_benchmark_runs_and_every_answer_is_200():
    results = bench_api.run(clients=4, seconds=0.5, warmup_s=0.2, use_ray=False)
    assert [r.endpoint for r in results] == ["GET /v1/jobs/{id}", "POST /v1/plan (examples/3d.yaml)"]
    for result in results:
        assert result.clients == 4 and result.requests > 0 and result.errors == 0
        assert 0 < result.p50_ms <= result.p99_ms <= result.max_ms
    table = bench_api.table(results, use_ray=False).splitlines()
    assert table[2] == "| endpoint | clients | answers | errors | throughput (req/s) | p50 (ms) | p99 (ms) | max (ms) |"
    assert table[4].startswith("| `GET /v1/jobs/{id}` | 4 | ")
