#!/usr/bin/env bash
# make gpu-check: the engine probe, then the whole service on this machine's GPU, within 8 minutes.
#
#   benchmarks/gpu/run.sh            # needs one GPU; without one it says so and exits 0
#   benchmarks/gpu/run.sh --tiny     # (or GPU_CHECK_TINY=1) the same run on CPU with a tiny model
#
# 1. No GPU (nvidia-smi or torch.cuda finds none): a message, exit 0. --tiny skips this test.
# 2. Python: $GPU_PYTHON, else .venv/bin/python for --tiny when there is one, else python3. When it lacks
#    Ray / FastAPI / uvicorn / pydantic (the project's GPU machines have PyTorch and transformers but no
#    network), the wheels in .whl/ (`make gpu-wheels`) are installed into a temporary --target folder.
#    When `etrain` is not installed, a temporary folder holds etrain/{api,service,workers} links to this
#    checkout (pyproject maps those folders into the package `etrain`): nothing is pip-installed here.
# 3. The engine probe (benchmarks/gpu/probe.py), alone on the device, time-boxed.
# 4. A Ray head of its own (`ray start --head --block`, the GPU, its own ports and temp dir, no
#    dashboard) and `etrain serve --ray-address` on it (chaos on, a fresh admin token, two warm spares),
#    then the clean and the killed job over REST (benchmarks/gpu/service_jobs.py), time-boxed.
# 5. Always (trap): the server and exactly the Ray head this started are stopped, checkpoints removed.
# Results: gpu_probe.json, gpu_service.json in benchmarks/results (--tiny: a temporary folder, or
# $GPU_CHECK_RESULTS) and in $OUT when set; logs in the work folder, and with $OUT set packed into
# $OUT/gpu-check-logs.tgz (a device call hands back at most 8 files: the JSON files and that one archive).
# Then the table of docs/gpu.md (benchmarks/gpu/table.py); the exit status is 1 unless the jobs asked for SUCCEEDED.
# Settings: GPU_CHECK_BUDGET_S (470: the whole run), GPU_CHECK_PROBE_S (150: the probe's box),
# GPU_CHECK_PROBE_ROWS (etrain,hf; none skips the probe), GPU_CHECK_JOBS (clean,kill: which jobs, in order;
# kill-new-node adds a kill whose replacement finds the node compile cache deleted),
# GPU_CHECK_MTBF_HOURS (the auto job's fault_tolerance.mtbf_hours; default the service's), GPU_CHECK_EXTRA
# (tests,writes,pinning: first `pytest -m gpu tests/gpu` in the same environment, time box GPU_CHECK_TESTS_S,
# only the tests GPU_CHECK_TESTS_K selects (pytest -k) where set,
# the async save's writer threads measured on this disk, GPU_CHECK_WRITE_GIB, and the ways of pinning its
# staging buffers beside training, benchmarks/gpu/pinning.py; off by default: the 8 minutes; and bench:
# after the jobs, make bench-gpu's rows GPU_CHECK_BENCH_ROWS on GPU_CHECK_BENCH_SHAPES, time box
# GPU_CHECK_BENCH_S, beyond the 8 minutes), GPU_PYTHON,
# GPU_WHEELS_DIR (.whl), GPU_CHECK_RESULTS (where the JSON goes), GPU_CHECK_DIR (the work folder: a new /tmp one),
# GPU_CHECK_STOP_GRACE_S (5: seconds the server and the Ray head get to stop before SIGKILL).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO" || exit 1
T0=$SECONDS
TINY=${GPU_CHECK_TINY:-0}
[[ $TINY == 0 || -z $TINY ]] && TINY=0 || TINY=1
for arg in "$@"; do
  case $arg in
    --tiny) TINY=1 ;;
    *) echo "usage: $0 [--tiny]" >&2; exit 2 ;;
  esac
done
BUDGET_S=${GPU_CHECK_BUDGET_S:-470}
PROBE_S=${GPU_CHECK_PROBE_S:-150}
log() { printf '[gpu-check %4ds] %s\n' $((SECONDS - T0)) "$*"; }

PY=${GPU_PYTHON:-}
if [[ -z $PY ]]; then
  if [[ $TINY == 1 && -x .venv/bin/python ]]; then PY=$REPO/.venv/bin/python; else PY=python3; fi
fi

# -- 1. a GPU? ------------------------------------------------------------------------------------------
if [[ $TINY == 0 ]] && { ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; }; then
  echo "no GPU on this machine: make gpu-check skipped (nvidia-smi finds none)"
  exit 0
fi
mapfile -t found < <("$PY" - "$TINY" 2>/dev/null <<'EOF'
import sys
try:
    import torch
except ImportError:
    print("no-torch"); print(""); print(""); sys.exit()
ok = sys.argv[1] == "1" or torch.cuda.is_available()
print("ok" if ok else "no-cuda")
print("cpu" if sys.argv[1] == "1" else (torch.cuda.get_device_name() if ok else ""))
print(torch.__version__)
EOF
)
case ${found[0]:-} in
  ok) ;;
  no-cuda) echo "no GPU on this machine: make gpu-check skipped (torch.cuda finds none)"; exit 0 ;;
  *) if [[ $TINY == 0 ]]; then
       echo "no GPU on this machine: make gpu-check skipped (no PyTorch for $PY)"; exit 0
     fi
     echo "no PyTorch for $PY: --tiny needs torch (make install, or GPU_PYTHON=...)" >&2; exit 1 ;;
esac
export GPU_CHECK_DEVICE=${found[1]} GPU_CHECK_TORCH=${found[2]}
log "device: $GPU_CHECK_DEVICE, torch $GPU_CHECK_TORCH, python $PY$([[ $TINY == 1 ]] && echo ' (--tiny)')"
[[ $TINY == 1 ]] || log "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -n 1)"

WORK=${GPU_CHECK_DIR:-$(mktemp -d /tmp/gpu-check.XXXXXX)}
mkdir -p "$WORK"
LOGS=$WORK/logs
mkdir -p "$LOGS"
touch "$WORK/.started"  # results newer than this were written by this run (the cleanup hands back only those)
if [[ $TINY == 1 ]]; then RESULTS=${GPU_CHECK_RESULTS:-$WORK/results}; else RESULTS=${GPU_CHECK_RESULTS:-$REPO/benchmarks/results}; fi
rm -f "$RESULTS/gpu_probe.json" "$RESULTS/gpu_service.json"  # a part that does not finish leaves no stale figures
TINY_FLAG=()
[[ $TINY == 1 ]] && TINY_FLAG=(--tiny)

SERVER_PID="" RAY_PID=""
# shellcheck source=../../deploy/local/common.sh
source "$REPO/deploy/local/common.sh"  # RAY_AUTH_MODE as for every local Ray; alive_pid

# Stop one process this script started (the leader of its own process group): the signal to the leader
# alone, then KILL to the whole group after a grace period. To the leader alone: `ray start --block` drains
# its node on TERM, which asks the GCS, then takes its raylet, GCS and workers down itself; a TERM to the
# whole group killed the GCS first and the drain waited ~30 s for it (measured; then this grace SIGKILLed
# it). `etrain serve` stops cleanly on INT (as on Ctrl-C: on TERM, the Ray driver's handler exits inside
# uvicorn).
stop_group() {
  local pid=$1 name=$2 grace=${3:-30} signal=${4:-TERM} deadline started=$SECONDS
  [[ -n $pid ]] && alive_pid "$pid" || return 0
  kill "-$signal" "$pid" 2>/dev/null
  deadline=$((SECONDS + grace))
  while alive_pid "$pid" && ((SECONDS < deadline)); do sleep 0.2; done
  if alive_pid "$pid"; then
    log "$name (PID $pid) ignored SIG$signal for ${grace}s: SIGKILL"
  fi
  kill -KILL -- "-$pid" 2>/dev/null  # whatever of its group is left
  log "stopped $name (PID $pid) in $((SECONDS - started)) s"
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  # Short graces (GPU_CHECK_STOP_GRACE_S): the figures are written by then, and device time spent waiting
  # measures nothing. Both go in 1-2 s (2 CPU cores); the 5 s SIGKILLs the H100 runs logged were
  # alive_pid's (deploy/local/common.sh: a gone PID looked alive inside this trap), not theirs.
  stop_group "$SERVER_PID" "etrain serve" "${GPU_CHECK_STOP_GRACE_S:-5}" INT
  stop_group "$RAY_PID" "the Ray head" "${GPU_CHECK_STOP_GRACE_S:-5}"
  rm -rf "$WORK/data" "$WORK/site" "$WORK/pkg" "$WORK/ray"
  if [[ -n ${OUT:-} ]]; then
    tar czf "$OUT/gpu-check-logs.tgz" -C "$WORK" logs 2>/dev/null
    # The probe and the jobs write theirs to $OUT; these two only where this run measured them (the
    # checkout's own copies are older runs' and would take two of a device call's 8 files).
    for result in gpu_write_threads.json gpu_pinning.json; do
      [[ $RESULTS/$result -nt $WORK/.started ]] && cp "$RESULTS/$result" "$OUT/"
    done
  fi
  log "logs: $LOGS; results: $RESULTS; total $((SECONDS - T0)) s; exit $rc"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# -- 2. Python packages ---------------------------------------------------------------------------------
PYPATH=$REPO
if ! "$PY" -c "import ray, fastapi, uvicorn, pydantic, starlette" 2>/dev/null; then
  shopt -s nullglob
  wheels=("${GPU_WHEELS_DIR:-$REPO/.whl}"/*.whl)
  shopt -u nullglob
  if ((${#wheels[@]} == 0)); then
    echo "Ray/FastAPI/uvicorn/pydantic are missing for $PY and .whl/ holds no wheels: run 'make gpu-wheels' on a" \
         "machine with network and bring .whl/ along" >&2
    exit 1
  fi
  log "installing ${#wheels[@]} wheels from .whl/ into $WORK/site (no network, no deps)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$WORK/site" "${wheels[@]}" || exit 1
  PYPATH=$WORK/site:$PYPATH
  export PATH=$WORK/site/bin:$PATH
fi
if ! PYTHONPATH=$PYPATH${PYTHONPATH:+:$PYTHONPATH} "$PY" -c "import etrain.api" 2>/dev/null; then
  mkdir -p "$WORK/pkg/etrain"  # pyproject's package-dir mapping, without an install
  for folder in api service workers; do ln -sfn "$REPO/$folder" "$WORK/pkg/etrain/$folder"; done
  PYPATH=$WORK/pkg:$PYPATH
fi
export PYTHONPATH=$PYPATH${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
"$PY" -c "import ray, fastapi, pydantic, etrain.api.app, etrain.service.manager; print('ray', ray.__version__, \
'fastapi', fastapi.__version__, 'pydantic', pydantic.__version__)" || exit 1
log "packages ready"

# -- 3a. on request (GPU_CHECK_EXTRA=tests,writes,pinning): the CUDA tests, the async save's writer threads, -
#    the ways of pinning its staging buffers beside training --------------------------------------------
EXTRA=,${GPU_CHECK_EXTRA:-},
if [[ $EXTRA == *,tests,* ]]; then
  tests_s=${GPU_CHECK_TESTS_S:-150}
  only=()
  [[ -n ${GPU_CHECK_TESTS_K:-} ]] && only=(-k "$GPU_CHECK_TESTS_K")
  log "CUDA tests: pytest -m gpu tests/gpu ${only[*]} (time box ${tests_s}s)"
  timeout -k 10 "$tests_s" "$PY" -m pytest -q -m gpu -p no:cacheprovider "${only[@]}" tests/gpu >"$LOGS/tests.log" 2>&1
  tests_rc=$?
  grep -E "passed|failed|error|skipped|FAILED|ERROR" "$LOGS/tests.log" | tail -n 25
  log "CUDA tests exited $tests_rc (log: $LOGS/tests.log)"
fi
# One measurement benchmarks/gpu/NAME.py, time-boxed: its stale result removed first, its stderr in
# $LOGS/NAME.err, a failure said and not fatal (the service jobs still run).
measure() {
  local name=$1 box=$2 what=$3
  shift 3
  log "$what (benchmarks/gpu/$name.py, time box ${box}s)"
  rm -f "$RESULTS/gpu_$name.json"
  timeout -k 10 "$box" "$PY" -m "benchmarks.gpu.$name" "${TINY_FLAG[@]}" --results-dir "$RESULTS" "$@" \
    2>"$LOGS/$name.err" || { log "$name failed:"; tail -n 20 "$LOGS/$name.err"; }
}
[[ $EXTRA == *,writes,* ]] && measure write_threads 120 "writer threads of an async save" \
  --gib "${GPU_CHECK_WRITE_GIB:-4}" --threads 1,4,8,16 --dir "$WORK"
[[ $EXTRA == *,pinning,* ]] && measure pinning 150 "pinning the staging buffers beside training"

# -- 3. the engine probe --------------------------------------------------------------------------------
if [[ ${GPU_CHECK_PROBE_ROWS:-etrain,hf} == none ]]; then
  log "engine probe skipped (GPU_CHECK_PROBE_ROWS=none)"
else
  log "engine probe (time box ${PROBE_S}s)"
  timeout -k 10 "$PROBE_S" "$PY" -m benchmarks.gpu.probe "${TINY_FLAG[@]}" --rows "${GPU_CHECK_PROBE_ROWS:-etrain,hf}" \
    --results-dir "$RESULTS" 2>"$LOGS/probe.err"
  probe_rc=$?
  ((probe_rc == 0)) || { log "the probe exited $probe_rc; its stderr:"; tail -n 20 "$LOGS/probe.err"; }
  log "probe done"
fi

# -- 4. Ray head + etrain serve -------------------------------------------------------------------------
read -r RAY_PORT CLIENT_PORT AGENT_PORT METRICS_PORT API_PORT < <("$PY" -c "
import socket
socks = [socket.socket() for _ in range(5)]
for s in socks:
    s.bind(('127.0.0.1', 0))
print(*[s.getsockname()[1] for s in socks])")
if [[ $TINY == 1 ]]; then NUM_GPUS=0 NUM_CPUS=4; else NUM_GPUS=1 NUM_CPUS=$(($(nproc) > 12 ? 12 : $(nproc))); fi
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0
log "Ray head on 127.0.0.1:$RAY_PORT ($NUM_CPUS CPUs, $NUM_GPUS GPU)"
# The Ray Client server (default port 10001, shared by every Ray on the machine) gets a port of its own
# where Ray can run one; a minimal Ray (the wheels: no grpcio) refuses the option and runs none.
client_args=()
"$PY" -c "import grpc" 2>/dev/null && client_args=(--ray-client-server-port "$CLIENT_PORT")
: >"$LOGS/ray-head.log"
setsid "$PY" -m ray.scripts.scripts start --head --block --disable-usage-stats --node-ip-address 127.0.0.1 \
  --port "$RAY_PORT" --include-dashboard=false "${client_args[@]}" \
  --dashboard-agent-listen-port "$AGENT_PORT" --metrics-export-port "$METRICS_PORT" \
  --num-cpus "$NUM_CPUS" --num-gpus "$NUM_GPUS" --temp-dir "$WORK/ray" >>"$LOGS/ray-head.log" 2>&1 &
RAY_PID=$!
disown "$RAY_PID"  # stopped by stop_group; no job-control notice when it goes
until grep -qs "Ray runtime started" "$LOGS/ray-head.log"; do
  alive_pid "$RAY_PID" || { log "the Ray head exited:"; tail -n 20 "$LOGS/ray-head.log"; exit 1; }
  ((SECONDS - T0 < BUDGET_S)) || { log "the Ray head did not start in time"; exit 1; }
  sleep 0.5
done
TOKEN=$("$PY" -c "import secrets; print(secrets.token_hex(24))")
URL=http://127.0.0.1:$API_PORT
log "etrain serve on $URL"
ETRAIN_API_TOKEN=$TOKEN ETRAIN_ENABLE_CHAOS=1 ETRAIN_WARM_SPARES_PER_NODE=2 setsid "$PY" -m etrain.api.cli serve \
  --host 127.0.0.1 --port "$API_PORT" --data-dir "$WORK/data" --ray-address "127.0.0.1:$RAY_PORT" \
  >"$LOGS/serve.log" 2>&1 &
SERVER_PID=$!
disown "$SERVER_PID"
until "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" "$URL/healthz" 2>/dev/null; do
  alive_pid "$SERVER_PID" || { log "etrain serve exited:"; tail -n 20 "$LOGS/serve.log"; exit 1; }
  ((SECONDS - T0 < BUDGET_S - 60)) || { log "etrain serve did not answer in time"; tail -n 20 "$LOGS/serve.log"; exit 1; }
  sleep 0.5
done
log "service up"

# -- 5. the service jobs --------------------------------------------------------------------------------
left=$((BUDGET_S - (SECONDS - T0) - 10))
log "service jobs (time box ${left}s)"
ETRAIN_API_TOKEN=$TOKEN timeout -k 10 "$left" "$PY" -m benchmarks.gpu.service_jobs "${TINY_FLAG[@]}" --url "$URL" \
  --ray-address "127.0.0.1:$RAY_PORT" --data-dir "$WORK/data" --logs-dir "$LOGS" --results-dir "$RESULTS" \
  --deadline $(($(date +%s) + left - 5)) 2>"$LOGS/service_jobs.err"
jobs_rc=$?
((jobs_rc == 0)) || { log "the service driver exited $jobs_rc; its stderr:"; tail -n 20 "$LOGS/service_jobs.err"; }
log "service jobs done"

# -- 4b. on request (GPU_CHECK_EXTRA=bench): make bench-gpu's rows in the same call, after the jobs (the
#    GPU is free again); torchao for the float8 row from .whl/ where it is missing -----------------------
# The default rows are issue #19's goals: etrain compile against transformers, and float8 against it, at
# 1B shapes and at the 8B widths with as many layers as fit (20 on an H200: ~1 s steps, hence 300 s).
[[ $EXTRA == *,bench,* ]] && measure throughput "${GPU_CHECK_BENCH_S:-300}" "make bench-gpu's rows" \
  --shapes "${GPU_CHECK_BENCH_SHAPES:-1b,8b-widths}" --steps "${GPU_CHECK_BENCH_STEPS:-8}" \
  --rows "${GPU_CHECK_BENCH_ROWS:-etrain-compile,etrain-compile-float8,hf}"

no_probe=()
[[ ${GPU_CHECK_PROBE_ROWS:-etrain,hf} == none ]] && no_probe=(--no-probe)
"$PY" -m benchmarks.gpu.table --results-dir "$RESULTS" --check "${no_probe[@]}" --jobs "${GPU_CHECK_JOBS:-clean,kill}"
