"""``make bench-gpu``'s two loops train the same numbers, so its table compares like with like.

The transformers row starts from etrain's initial weights and reads etrain's micro-batches with
etrain's optimizer recipe (``benchmarks/gpu/probe.py``: ``_start_like_etrain``); before, it trained
its own random weights on uniformly random tokens, and its losses said nothing about etrain's. Here,
on CPU in fp32 with the ``--tiny`` stand-ins of a dense shape and of the mixture-of-experts shape (its
experts go through the hub's per-expert layout into transformers' fused modules, and its
load-balancing loss is added as transformers adds it), every step's loss of the two rows must agree:
a GPU run's table then shows whether etrain and transformers train alike at full size.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks.gpu.measures import BENCH_SHAPES  # noqa: E402
from benchmarks.gpu.probe import run_row  # noqa: E402

STEPS = 4


@pytest.mark.parametrize("shape", ["1b", "moe"])
def test_the_transformers_row_trains_the_numbers_of_the_etrain_row(shape):
    sizes = BENCH_SHAPES[shape][2]  # the --tiny sizes: fp32, CPU
    threads = torch.get_num_threads()
    try:
        etrain = run_row("etrain", sizes, STEPS, torch.device("cpu"), "cpu")
        hf = run_row("hf", sizes, STEPS, torch.device("cpu"), "cpu")
    finally:
        torch.set_num_threads(threads)
    assert "error" not in etrain and "error" not in hf, (etrain.get("error"), hf.get("error"))
    assert len(etrain["losses"]) == len(hf["losses"]) == STEPS
    for step, (ours, theirs) in enumerate(zip(etrain["losses"], hf["losses"])):
        assert theirs == pytest.approx(ours, rel=2e-5), (step, etrain["losses"], hf["losses"])
    assert etrain["losses"][-1] < etrain["losses"][0]  # it trains: the comparison is not of constants
