"""`make bench`'s fair-use benchmark stays runnable: a tiny flood against its real server process."""

from __future__ import annotations

from benchmarks import bench_fair_use


def test_the_fair_use_benchmark_runs_and_the_flood_is_refused_with_retry_after():
    quiet, flood = bench_fair_use.run(
        seconds=0.5, warmup_s=0.5, streams=12, plans=4, health=10, ray_health_ms=5, hostile=False
    )
    assert (quiet.name, flood.name) == ("quiet (bob alone)", "flood")
    for phase in (quiet, flood):  # the other tenant's reads: every one answered, and 200
        assert phase.victim.answers > 0 and phase.victim.errors == 0
        assert 0 < phase.victim.p50_ms <= phase.victim.p99_ms <= phase.victim.max_ms
    # the default stream cap (8) holds; every refusal is a 429 that says when to retry
    assert (flood.streams_accepted, flood.streams_refused, flood.streams_other) == (8, 4, 0)
    assert flood.plans_ok > 0 and flood.plans_other == 0
    assert flood.health.answers > 0 and flood.health.errors == 0
    table = bench_fair_use.table([quiet, flood], streams=12, plans=4, health=10, ray_health_ms=5).splitlines()
    assert table[2].startswith("| phase | bob's GETs | not 200 | p50 (ms) | p99 (ms) |")
    assert table[5].startswith("| flood | ") and "| 8 / 4 |" in table[5]
    assert table[-1].startswith("Target (bob's p99 < 50 ms under the flood, every answer 200): **")
