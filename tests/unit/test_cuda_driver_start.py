"""The CUDA warm-up's GIL-free driver start (``workers/rank/device_info.py``) where there is no driver.

On a GPU, ``tests/gpu/test_cuda.py::test_a_spare_or_cold_ranks_cuda_warm_up_leaves_the_gil_to_its_other_threads``
proves what it is for; here: a node without the driver (every CPU node) is told apart from a failure, and
the warm-up goes on to torch's own answer.
"""

from __future__ import annotations

import ctypes.util
import os

import pytest

from etrain.workers.rank.device_info import RankGpus, start_cuda_driver


def test_without_a_driver_library_it_says_so_and_sets_lazy_module_loading_first(monkeypatch):
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    assert start_cuda_driver("libetrain-no-such-driver.so.1") == {"outcome": "no CUDA driver"}
    # Set before the driver could read it: eager loading would load every kernel of every library.
    assert os.environ["CUDA_MODULE_LOADING"] == "LAZY"
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")  # an operator's own choice is kept
    start_cuda_driver("libetrain-no-such-driver.so.1")
    assert os.environ["CUDA_MODULE_LOADING"] == "EAGER"


def test_a_library_without_the_driver_api_is_no_driver_not_a_failure():
    libc = ctypes.util.find_library("c")
    if libc is None:
        pytest.skip("no C library to stand for a library without cuInit")
    assert start_cuda_driver(libc) == {"outcome": "no CUDA driver"}


def test_the_warm_up_on_a_machine_without_cuda_reports_both_answers_and_the_rank_log_line(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/gpu/test_cuda.py covers it")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpus = RankGpus(who="rank 0 (test)", gpu_ids=["0"], bundle="bundle 0 (test)")
    assert gpus.warmup is not None and gpus.warmup.wait(60).startswith("no CUDA device visible")
    state = gpus.warmup.state()
    assert state["driver"]["outcome"] in ("no CUDA driver", "failed: cuInit returned 100"), state
    assert 0 <= state["seconds"] < 60
    summary = gpus.warmup_summary()
    assert summary.startswith(f"; cuda warm-up {state['outcome']} in "), summary
    assert f"(driver without the GIL: {state['driver']['outcome']})" in summary, summary
    assert RankGpus(who="rank 1 (test)", gpu_ids=[], bundle="bundle 1 (test)").warmup_summary() == ""
    # What a rank then asks of it: the CPU for a CPU job; for a CUDA job, the warm-up's answer in words.
    assert gpus.device("cpu") == torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"rank 0 \(test\) \(bundle 0 \(test\).* cannot use its GPU: no CUDA device"):
        gpus.device("cuda")
