# etrain — the two commands a newcomer needs: `make run` and `make test`.
# Both create .venv and (re)install the project when it is missing or pyproject.toml changed.

SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# Tests run with a fixed worker thread count so a 2-core CI machine is not oversubscribed.
export ETRAIN_TORCH_THREADS ?= 1
export PYTHONUNBUFFERED := 1

.PHONY: install run test test-fast test-gpu gpu-check gpu-wheels bench bench-quick lint format clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch is pinned to exactly 2.13.0 in pyproject.toml: with the CPU wheel available to pip this
	# installs no CUDA packages (a looser range would pull several GB of them).
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

## make run: local Ray + control plane + dashboard, then the quickstart job (Ctrl-C stops everything).
## Auth is on: the server keeps its admin token in .etrain/api-token (0600); `etrain` run from this
## directory finds it there.
## The quickstart trains on this repository's files, so the repository is the storage root.
run: $(STAMP)
	ETRAIN_STORAGE_ROOTS="$(CURDIR)" $(VENV)/bin/etrain demo examples/quickstart.yaml --data-dir .etrain

## make test: the whole suite, in two phases, and fails if either fails.
## 1. The single-process tests (architecture, unit, API, chart and image): one core each, so two pytest-xdist
##    workers run them side by side (4.1 -> 2.2 min on the 2-core machine, measured).
## 2. The multi-process, Ray and chaos tests, one at a time: they keep both cores 70-88% busy on their own,
##    and their timing checks (stragglers, hangs, the pipeline bubble) need the cores they measure.
## The project's modules are compiled to bytecode first: where PYTHONDONTWRITEBYTECODE is set (this
## development machine's image sets it), every rank, spare and supervisor process compiled them again
## (0.25 s of a core per rank process, measured). PYTEST_ARGS (flags: -x, -k NAME) goes to both phases.
FAST_WORKERS ?= 2
FAST_TESTS := tests/architecture tests/unit tests/api tests/deploy
SLOW_TESTS := tests/integration tests/e2e tests/chaos tests/gpu
test: $(STAMP)
	$(PY) -m compileall -q api service workers
	@rc=0; \
	$(PY) -m pytest -n $(FAST_WORKERS) $(FAST_TESTS) $(PYTEST_ARGS) || { r=$$?; [ $$r -eq 5 ] || rc=$$r; }; \
	$(PY) -m pytest $(SLOW_TESTS) $(PYTEST_ARGS) || { r=$$?; [ $$r -eq 5 ] || rc=$$r; }; \
	exit $$rc

## make test-fast: phase 1 of make test alone, the architecture, unit, API and chart/image tests (about 3 minutes).
test-fast: $(STAMP)
	$(PY) -m pytest -n $(FAST_WORKERS) $(FAST_TESTS) $(PYTEST_ARGS)

## make test-gpu: the NCCL / CUDA / bf16 tests (needs a GPU).
test-gpu: $(STAMP)
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

## make gpu-check: on a machine with one GPU, within 8 minutes: the engine probe (etrain's Trainer against the
## same loop in transformers, Llama-3.2-1B shapes), then the whole service on that GPU over REST (a clean job,
## and one whose rank 0 is SIGKILLed at step 25); figures to benchmarks/results/gpu_*.json and docs/gpu.md's table
## (benchmarks/gpu/run.sh). Without a GPU it says so and exits 0. Needs no .venv and no network: python3 with
## PyTorch, plus .whl/ (`make gpu-wheels`) where Ray/FastAPI/pydantic are missing. GPU_CHECK_TINY=1: the same
## run on CPU with a tiny model (.venv's python when there is one).
gpu-check:
	bash benchmarks/gpu/run.sh

## make gpu-wheels: fill .whl/ with the cp312 x86-64 wheels gpu-check installs where Ray/FastAPI/pydantic are missing.
gpu-wheels:
	bash benchmarks/gpu/make_wheels.sh

## make bench-gpu: etrain against transformers on one GPU in one run (benchmarks/gpu/throughput.py): etrain eager,
## compile, + chunked loss, + selective AC, + float8 (skipped without training.float8), transformers eager and
## per-block compile, on Llama-3.2-1B shapes and on Llama-3.1-8B widths with as many layers as fit the GPU
## (ARGS='--layers N' sets them). Step, tokens/s, MFU, peak
## memory per row to benchmarks/results/gpu_throughput.json, and the markdown table for docs (also printed, and
## in gpu_throughput.md beside it). Without a GPU it says so and exits 0. Needs no .venv: python3 (or GPU_PYTHON)
## with PyTorch and transformers. BENCH_GPU_TINY=1: every row on CPU with the tiny model, in under a minute
## (.venv's python when there is one). ARGS passes more flags, e.g. ARGS='--shapes 1b --steps 12'.
.PHONY: bench-gpu
BENCH_GPU_PY = $(or $(GPU_PYTHON),$(if $(BENCH_GPU_TINY),$(if $(wildcard $(PY)),$(PY),python3),python3))
bench-gpu:
	$(BENCH_GPU_PY) -m benchmarks.gpu.throughput $(if $(BENCH_GPU_TINY),--tiny) $(ARGS)

## make bench: the benchmark suite (benchmarks/suite.py: start-up, recovery, goodput, stragglers, hangs,
## checkpoints, pipeline bubble, steady state, each against Ray Train v2, torchrun or a formula); raw
## samples to benchmarks/results/*.json, benchmarks/README.md's table regenerated from them. Then the throughput,
## memory, API and fair-use (one tenant floods, another's reads are timed) benchmarks (bench-results/).
## `make bench QUICK=1` (or `make bench-quick`, or ARGS=--quick): the suite alone, under 15 minutes on
## 2 CPU cores. ARGS passes more suite flags, e.g. ARGS='--only recovery --note "shared machine"'.
BENCH_QUICK = $(or $(QUICK),$(findstring --quick,$(ARGS)))
bench: $(STAMP)
	$(PY) -m benchmarks.suite $(if $(QUICK),--quick) $(ARGS)
	$(if $(BENCH_QUICK),@echo "quick: benchmarks/run.py, bench_api.py and bench_fair_use.py skipped",$(PY) -m benchmarks.run --out bench-results)
	$(if $(BENCH_QUICK),,$(PY) -m benchmarks.bench_api --out bench-results)
	$(if $(BENCH_QUICK),,$(PY) -m benchmarks.bench_fair_use --out bench-results)

bench-quick:
	$(MAKE) bench QUICK=1

## make lint: ruff check and ruff format --check over the whole tree (rules in pyproject.toml); .ci/run runs it
## before make test. `make format` applies the formatter and ruff's safe fixes.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .etrain bench-results .pytest_cache
