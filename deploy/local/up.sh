#!/usr/bin/env bash
# Try etrain without Kubernetes: a multi-node Ray cluster on this machine (one head, N workers, each a
# separate raylet started with `ray start`) and the control plane (`etrain serve --ray-address`) on it.
#
#   deploy/local/up.sh [N]     # head + N workers (default 2), then the API; prints its URL and token
#   deploy/local/down.sh       # stops the API and exactly the nodes this started
#
# Layout under $STATE_DIR (default ${TMPDIR:-/tmp}/etrain-local):
#   etrain/        the control plane's data directory (SQLite, api-token): the API's alone
#   checkpoints/   the checkpoint directory, the ONE directory the nodes and the API share (as the
#                  Helm chart's ReadWriteMany volume): ranks write their shards and logs there, the
#                  supervisor commits manifests there. ETRAIN_CHECKPOINT_ROOT points at it, so a job
#                  without checkpoint.path checkpoints to checkpoints/<job-id>; it is a storage root.
#   head.pid, worker-I.pid, *.log, ray/, ray-worker-I/   the Ray nodes (start-ray-cluster.sh)
#   server/etrain.pid, server/etrain.log                  the API server
#
# Settings (environment): everything start-ray-cluster.sh reads (CPUS_PER_WORKER, GPUS_PER_WORKER,
# HEAD_PORT, DASHBOARD_PORT, CLIENT_PORT, METRICS_PORT, AGENT_PORT, INCLUDE_DASHBOARD, ...), and
#   API_HOST (127.0.0.1), API_PORT (8000)    where `etrain serve` listens
#   DATA_DIR ($STATE_DIR/etrain)             the control plane's data directory
#   CHECKPOINT_DIR ($STATE_DIR/checkpoints)  the shared checkpoint directory (e.g. an NFS mount)
#   ETRAIN_STORAGE_ROOTS                     more directories jobs may read (e.g. a corpus; ','-separated);
#                                            the checkpoint directory and the working directory are always added
#   ETRAIN_API_TOKEN                         the admin token; unset: the server generates $DATA_DIR/api-token
#   ETRAIN (etrain), RAY (ray), PYTHON (python3)   the programs, e.g. from the etrain virtualenv
#   SERVE_TIMEOUT_S (120)                    how long to wait for the API to answer /healthz
# Relative paths in job specs (e.g. the quickstart's `data.path: .`) resolve against the directory
# this script is run from, which is why it is a storage root too: run it from the repository.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export STATE_DIR=${STATE_DIR:-${TMPDIR:-/tmp}/etrain-local}
export HEAD_IP=${HEAD_IP:-127.0.0.1}
export HEAD_PORT=${HEAD_PORT:-6379}
export RAY=${RAY:-ray}
ETRAIN=${ETRAIN:-etrain}
PYTHON=${PYTHON:-python3}
API_HOST=${API_HOST:-127.0.0.1}
API_PORT=${API_PORT:-8000}
DATA_DIR=${DATA_DIR:-$STATE_DIR/etrain}
SERVE_TIMEOUT_S=${SERVE_TIMEOUT_S:-120}
SERVER_DIR=$STATE_DIR/server

# shellcheck source=common.sh
source "$HERE/common.sh"  # Ray token mode (as for the nodes), alive_pid, alive

log() { printf '[local-etrain] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

num_workers=${1:-2}
[[ $num_workers =~ ^[1-9][0-9]*$ ]] || die "N must be a number of worker nodes (1 or more), got '$num_workers'"
command -v "$ETRAIN" >/dev/null || die "'$ETRAIN' not found; activate the etrain virtualenv or set ETRAIN=/path/to/etrain"
alive "$SERVER_DIR/etrain.pid" && die "an etrain server is already running (PID $(cat "$SERVER_DIR/etrain.pid")); run $HERE/down.sh first"

mkdir -p "$SERVER_DIR"
# Absolute, as storage roots and ETRAIN_CHECKPOINT_ROOT must be.
DATA_DIR=$(mkdir -p "$DATA_DIR" && cd "$DATA_DIR" && pwd)
CHECKPOINT_DIR=$(mkdir -p "${CHECKPOINT_DIR:-$STATE_DIR/checkpoints}" && cd "${CHECKPOINT_DIR:-$STATE_DIR/checkpoints}" && pwd)

# Any failure from here on takes down what this run started.
cleanup_on_error() { log "start-up failed; stopping what was started"; "$HERE/down.sh" >&2 || true; }
trap cleanup_on_error ERR

"$HERE/start-ray-cluster.sh" start "$num_workers"

log "etrain serve on $API_HOST:$API_PORT against Ray at $HEAD_IP:$HEAD_PORT (log: $SERVER_DIR/etrain.log)"
ETRAIN_CHECKPOINT_ROOT=$CHECKPOINT_DIR ETRAIN_STORAGE_ROOTS="${ETRAIN_STORAGE_ROOTS:+$ETRAIN_STORAGE_ROOTS,}$CHECKPOINT_DIR,$PWD" \
  nohup "$ETRAIN" serve --ray-address "$HEAD_IP:$HEAD_PORT" --data-dir "$DATA_DIR" \
  --host "$API_HOST" --port "$API_PORT" >"$SERVER_DIR/etrain.log" 2>&1 &
echo $! >"$SERVER_DIR/etrain.pid"

url_host=$API_HOST
[[ $url_host == 0.0.0.0 ]] && url_host=127.0.0.1
[[ $url_host == *:* && $url_host != \[* ]] && url_host="[$url_host]"
API_URL="http://$url_host:$API_PORT"
deadline=$((SECONDS + SERVE_TIMEOUT_S))
until "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
    "$API_URL/healthz" 2>/dev/null; do
  if ! alive "$SERVER_DIR/etrain.pid"; then
    tail -n 20 "$SERVER_DIR/etrain.log" >&2 || true
    false  # the ERR trap stops the nodes
  fi
  if ((SECONDS >= deadline)); then
    log "the API did not answer $API_URL/healthz within ${SERVE_TIMEOUT_S}s"
    tail -n 20 "$SERVER_DIR/etrain.log" >&2 || true
    false
  fi
  sleep 1
done
trap - ERR

if [[ -n ${ETRAIN_API_TOKEN:-} ]]; then
  token_line="the value of ETRAIN_API_TOKEN (admin)"
else
  token_line="$DATA_DIR/api-token (admin; mode 0600. The CLI reads it with ETRAIN_DATA_DIR=$DATA_DIR)"
fi
cat <<EOF
etrain API:   $API_URL  (docs: $API_URL/docs)
API token:    $token_line
checkpoints:  $CHECKPOINT_DIR  (shared by every node; a job without checkpoint.path uses <this>/<job-id>)
Ray:          $HEAD_IP:$HEAD_PORT, $num_workers worker node(s)
server log:   $SERVER_DIR/etrain.log
try:          ETRAIN_URL=$API_URL ETRAIN_DATA_DIR=$DATA_DIR etrain submit examples/quickstart.yaml --watch
stop:         $HERE/down.sh
EOF
