"""A slow rank under TP, ZeRO-3 and EP is found, and its waiting peer is not (two real gloo ranks, no Ray).

Under tensor parallelism and FSDP2 the collectives are inside forward/backward, so a rank waiting
for a slow peer waits *inside* its compute span. Measured here on timing-sync steps (every step):

* ``drill``: the chaos ``slow_rank`` drill (a ``slow_rank`` order, factor 4, fired by the rank's drill
  plugin ``etrain.workers.rank.chaos.RankDrills``) sleeps at the start of each micro-step;
* ``layers``: a slow device, modelled as a sleep before every attention and feed-forward block of
  rank 1, i.e. between the collectives (3x its own compute in total): the case a barrier before
  each micro-step would not fix, since the peer waits at every layer;
* ``layers_backward``: the same sleep split between those blocks' forward and backward, so the peer
  also waits in the backward's collectives (expert parallelism's reverse all-to-alls among them);
* ``unfixed``: ``layers`` with the collective-wait clock removed, the measurement before the fix.

For each, rank 1 runs ``BASELINE`` steps at normal speed, then ``SLOWED`` steps slow; the per-rank
``compute_s`` go through the real :class:`~etrain.service.decisions.stragglers.StragglerDetector`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import pytest
import torch

from etrain.service.decisions.stragglers import StragglerConfig, StragglerDetector, stage_map
from etrain.workers.families import MODEL_PRESETS
from etrain.workers.protocol.run_config import ModelConfig, ParallelConfig
from tests.dist_utils import run_distributed
from tests.equivalence_utils import small_config

BASELINE, SLOWED = 4, 4
SLOW_RANK = 1
THRESHOLD = 1.5


class _SlowLayers:
    """From ``start_step`` on, sleep before each attention / feed-forward block on ``rank``: in total
    ``extra`` times the rank's own median baseline compute per step."""

    def __init__(self, trainer, rank: int, extra: float, backward: bool = False):
        self.trainer, self.rank, self.extra, self.backward = trainer, rank, extra, backward
        self.calls_per_step = 0
        self.delay = 0.0
        self.counting = trainer.rank == rank
        if self.counting:
            for part in trainer.model_parts:
                for name, module in part.named_modules():
                    if name.endswith(".attention") or name.endswith(".feed_forward"):
                        module.register_forward_pre_hook(self._hook)
                        if backward:  # slow in the backward too (half the delay each way)
                            module.register_full_backward_pre_hook(self._backward_hook)

    def _hook(self, module, args):
        if self.delay:
            time.sleep(self.delay)
        else:
            self.calls_per_step += 1

    def _backward_hook(self, module, grad_output):
        if self.delay:
            time.sleep(self.delay)

    def slow_down(self, baseline_compute: list[float]) -> None:
        if self.counting:
            calls = self.calls_per_step / BASELINE * (2 if self.backward else 1)
            self.delay = self.extra * statistics.median(baseline_compute) / calls


def _measure(rank: int, world_size: int, parallel: ParallelConfig, model=None) -> dict[str, list[dict]]:
    from etrain.workers.engine.train import Trainer
    from etrain.workers.protocol.messages import ChaosOrder
    from etrain.workers.rank.chaos import RankDrills

    # Two micro-steps per rank in both layouts (global batch 4 at tp=2, 8 at dp=2): TP on CPU is slow per op.
    config = small_config(
        parallel=parallel,
        steps=BASELINE + SLOWED,
        timing_sync_every=1,
        global_batch=4 * parallel.dp,
        micro_batch=2,
        **({"model": model} if model is not None else {}),
    )
    out: dict[str, list[dict]] = {}
    for variant in ("drill", "layers", "layers_backward", "unfixed"):
        drills = RankDrills(rank=rank, report=lambda order, step: None)  # no supervisor to tell here
        trainer = Trainer(
            config, rank=rank, world_size=world_size, device=torch.device("cpu"), callbacks=[drills.callback]
        )
        if variant == "unfixed":
            trainer._waits = None  # the measurement before workers/engine/collective_waits.py
        backward = variant == "layers_backward"
        layers = _SlowLayers(trainer, SLOW_RANK, extra=3.0, backward=backward) if variant != "drill" else None
        rows = []
        for step in range(BASELINE + SLOWED):
            if step == BASELINE and rank == SLOW_RANK:
                if variant == "drill":
                    drills.receive(ChaosOrder(id=1, action="slow_rank", rank=rank, factor=4.0))  # fires at once
                else:
                    layers.slow_down([row["compute_s"] for row in rows])
            metrics = trainer.train_step(step)
            rows.append(
                {
                    "compute_s": metrics.compute_s,
                    "comm_wait_s": metrics.comm_wait_s,
                    "step_s": metrics.step_s,
                    "timing_synced": metrics.timing_synced,
                }
            )
        out[variant] = rows
    return out


#: The mixture of experts whose experts ep=2 splits (the token exchange's all-to-alls sit in every block).
MOE = dataclasses.replace(ModelConfig(**MODEL_PRESETS["qwen3-moe-tiny"]), seq_len=16)


@pytest.fixture(scope="module", params=["tp2", "zero3", "ep2"])
def measured(request) -> tuple[str, dict, list[dict]]:
    parallel = {"tp2": ParallelConfig(tp=2), "zero3": ParallelConfig(dp=2, zero=3), "ep2": ParallelConfig(dp=2, ep=2)}
    model = MOE if request.param == "ep2" else None
    layout = parallel[request.param]
    return request.param, layout, run_distributed(_measure, 2, layout, model, timeout_s=300.0)


def _median(results: list[dict], variant: str, rank: int, key: str, steps: slice) -> float:
    return statistics.median(row[key] for row in results[rank][variant][steps])


BEFORE, AFTER = slice(1, BASELINE), slice(BASELINE + 1, None)  # skip the first step of each phase


def _detect(results: list[dict], variant: str, layout: ParallelConfig) -> list:
    detector = StragglerDetector(
        StragglerConfig(window=SLOWED, patience=1, threshold=THRESHOLD),
        stages=stage_map(pp=layout.pp, dp=layout.dp, tp=layout.tp),
    )
    findings = []
    for step in range(BASELINE, BASELINE + SLOWED):
        assert all(r[variant][step]["timing_synced"] for r in results)
        findings += detector.observe(step, {rank: r[variant][step]["compute_s"] for rank, r in enumerate(results)})
    return findings


@pytest.mark.parametrize("variant", ["drill", "layers", "layers_backward"])
def test_the_slow_rank_is_found_and_its_waiting_peer_is_not(measured, variant):
    name, layout, results = measured
    peer = 1 - SLOW_RANK
    slow_compute = _median(results, variant, SLOW_RANK, "compute_s", AFTER)
    peer_compute = _median(results, variant, peer, "compute_s", AFTER)

    findings = _detect(results, variant, layout)
    assert [f.rank for f in findings] == [SLOW_RANK], (name, variant, findings)
    assert findings[0].factor > THRESHOLD  # rank 1's compute / its peer's: ~4x on a quiet machine
    assert peer_compute / slow_compute < THRESHOLD  # the peer's factor (it is ~1/4)

    # The peer did wait for what rank 1 added (its comm_wait_s is that much above rank 1's, which no
    # longer waits for anyone), and that wait did not become its compute (which grew by a small part
    # of it at most: the noise of a shared 2-core box).
    added = slow_compute - _median(results, variant, SLOW_RANK, "compute_s", BEFORE)
    peer_rise = peer_compute - _median(results, variant, peer, "compute_s", BEFORE)
    waited = _median(results, variant, peer, "comm_wait_s", AFTER) - _median(
        results, variant, SLOW_RANK, "comm_wait_s", AFTER
    )
    assert waited > 0.5 * added, (name, variant, added, waited)
    assert peer_rise < 0.35 * added, (name, variant, added, peer_rise)


def test_without_timing_the_waits_the_peer_looks_as_slow_as_the_slow_rank(measured):
    # The measurement before the fix: the peer's compute absorbs the wait at every layer.
    name, layout, results = measured
    peer = 1 - SLOW_RANK
    added = _median(results, "unfixed", SLOW_RANK, "compute_s", AFTER) - _median(
        results, "unfixed", SLOW_RANK, "compute_s", BEFORE
    )
    peer_rise = _median(results, "unfixed", peer, "compute_s", AFTER) - _median(
        results, "unfixed", peer, "compute_s", BEFORE
    )
    ratio = _median(results, "unfixed", SLOW_RANK, "compute_s", AFTER) / _median(
        results, "unfixed", peer, "compute_s", AFTER
    )
    assert peer_rise > 0.7 * added, (name, added, peer_rise)
    assert ratio < THRESHOLD, (name, ratio)
    assert _detect(results, "unfixed", layout) == []  # the slow rank is not found
