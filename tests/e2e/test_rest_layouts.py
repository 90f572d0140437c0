"""Issue #3 acceptance: composed layouts run as real jobs through REST on a local Ray cluster.

Each job's per-step losses must equal a single-process run of the same spec (the reference is the
same Trainer, in this process, at world size 1): the REST/Ray path changes nothing in the numbers.
DP2×TP2 runs on the built-in GPT and on a Llama given by explicit sizes (``kind: llama``, GQA); CP2
(context parallelism: ring attention over the sequence; cp × dp is tests/integration/test_context_parallel.py's)
on the Llama.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from tests.equivalence_utils import spec_reference_losses  # noqa: E402

GPT_MODEL = {"n_layers": 4, "d_model": 32, "n_heads": 4, "vocab_size": 64, "seq_len": 16}
LLAMA_MODEL = {
    "kind": "llama",
    "n_layers": 4,
    "d_model": 32,
    "n_heads": 4,
    "n_kv_heads": 2,
    "d_ff": 64,
    "vocab_size": 64,
    "seq_len": 16,
}


def layout_spec(name: str, model: dict | None = None, **parallelism) -> dict:
    return {
        "name": name,
        "model": model or GPT_MODEL,
        "data": {"kind": "synthetic", "seed": 1},
        "parallelism": parallelism,
        "resources": {"cpus_per_worker": 1},
        # 4 steps of 2 micro-batches per rank, a commit after 2 and 4: every part of a step and a save runs,
        # and a 4-rank DTensor step is ~1.5 s of a 2-core machine (8 steps of 4 micro-batches were 30-50 s a job).
        "training": {"steps": 4, "global_batch": 8, "micro_batch": 2, "lr": 0.003, "seed": 2, "grad_clip": 0.5},
        "checkpoint": {"every_steps": 2},
    }


@pytest.mark.parametrize(
    "name, model, parallelism",
    [
        ("dp2-tp2", GPT_MODEL, {"dp": 2, "tp": 2}),
        ("dp2-pp2", GPT_MODEL, {"dp": 2, "pp": 2, "pp_schedule": "1f1b"}),
        ("llama-dp2-tp2", LLAMA_MODEL, {"dp": 2, "tp": 2}),
        ("llama-cp2", LLAMA_MODEL, {"dp": 1, "cp": 2}),
    ],
    ids=["dp2-tp2", "dp2-pp2", "llama-dp2-tp2", "llama-cp2"],
)
def test_composed_layout_job_matches_one_process(plane, name, model, parallelism):
    body = layout_spec(name, model, **parallelism)
    job = plane.submit(body)
    degrees = [parallelism.get(axis, 1) for axis in ("pp", "dp", "tp", "cp")]
    assert job["world_size"] == degrees[0] * degrees[1] * degrees[2] * degrees[3]
    final = plane.wait_terminal(job["id"], timeout_s=300)
    assert final["status"] == "SUCCEEDED", final
    pp, dp, tp, cp = degrees
    assert final["layout"].startswith(f"pp{pp}·dp{dp}·tp{tp}" + (f" cp{cp}" if cp > 1 else ""))
    losses = [row["loss"] for row in plane.steps(job["id"])]
    expected = spec_reference_losses(body)
    assert len(losses) == len(expected) == 4
    for step, (got, want) in enumerate(zip(losses, expected), start=1):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: job {got} vs one process {want}"
    assert final["last_checkpoint_step"] == 4
