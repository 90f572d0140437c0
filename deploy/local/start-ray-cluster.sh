#!/usr/bin/env bash
# A local Ray cluster for etrain development: one head and N worker nodes on this machine, each a
# separate raylet, so placement groups, node failures and elastic resizes behave as on real nodes.
#
#   deploy/local/start-ray-cluster.sh start [N]   # head + N workers (default 2), waits until all are up
#   deploy/local/start-ray-cluster.sh status
#   deploy/local/start-ray-cluster.sh stop        # stops only the nodes this script started
#   deploy/local/start-ray-cluster.sh kill-worker I   # SIGKILL worker I: a node failure, for chaos runs
#
# Then:  etrain serve --data-dir ./data --ray-address 127.0.0.1:6379      (driver on the head node)
#   or:  etrain serve --data-dir ./data --ray-address ray://127.0.0.1:10001 (Ray Client)
#
# Every node runs `ray start --block` in the background; its PID is kept in $STATE_DIR, and `stop`
# signals exactly those PIDs (unlike `ray stop`, which kills every Ray process of the user).
# Each worker gets its own ports (metrics, dashboard agent) so that several fit on one host, and with
# GPUS_PER_WORKER > 0 its own slice of CUDA_VISIBLE_DEVICES (e.g. an 8-GPU box as 4 nodes x 2 GPUs).
set -euo pipefail

RAY=${RAY:-ray}
STATE_DIR=${STATE_DIR:-${TMPDIR:-/tmp}/etrain-local-ray}
HEAD_IP=${HEAD_IP:-127.0.0.1}
HEAD_PORT=${HEAD_PORT:-6379}               # GCS
DASHBOARD_PORT=${DASHBOARD_PORT:-8265}
INCLUDE_DASHBOARD=${INCLUDE_DASHBOARD:-1}  # 0: no dashboard process on the head (lighter; tests use it)
CLIENT_PORT=${CLIENT_PORT:-10001}          # Ray Client server (ray://)
METRICS_PORT=${METRICS_PORT:-8080}         # head's metrics exporter; worker i uses METRICS_PORT+i
AGENT_PORT=${AGENT_PORT:-52365}            # dashboard agent HTTP; worker i uses AGENT_PORT+i
HEAD_CPUS=${HEAD_CPUS:-0}                  # 0 keeps training ranks off the head, as in the Helm chart
CPUS_PER_WORKER=${CPUS_PER_WORKER:-2}
GPUS_PER_WORKER=${GPUS_PER_WORKER:-0}
START_TIMEOUT_S=${START_TIMEOUT_S:-120}
START_ATTEMPTS=${START_ATTEMPTS:-3}        # tries per node (see start_node)
# On SIGTERM a Ray node first drains (waits for its leases to end, 30 s by default) for rolling
# upgrades; `stop` takes the whole cluster down, where there is nowhere to drain to.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}
RAY_TEMP_DIR=${RAY_TEMP_DIR:-$STATE_DIR/ray}  # keeps this cluster's session files apart from /tmp/ray
# Worker i gets its own Ray temp dir, $RAY_TEMP_DIR-worker-i, as a node on another machine would: nodes
# started at once in one session directory race for the same socket names (`bind: Address in use`).

# shellcheck source=common.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"  # Ray token mode, alive_pid, alive

log() { printf '[local-ray] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# `ray start --block` in the background, logging to $STATE_DIR/<name>.log (an earlier try's: .log.1).
launch() {
  local name=$1; shift
  if [[ -f $STATE_DIR/$name.log ]]; then mv -f "$STATE_DIR/$name.log" "$STATE_DIR/$name.log.1"; fi
  nohup "$RAY" start --block --disable-usage-stats "$@" >"$STATE_DIR/$name.log" 2>&1 &
  echo $! >"$STATE_DIR/$name.pid"
}

# Start one node and wait until it is registered with the GCS: `ray start` prints "Ray runtime
# started." only then (a cheap check; `ray status` costs a Python start per call). On a loaded machine
# a node's agents can miss Ray's internal start-up deadlines and `ray start` exits; such a node is
# started again, up to START_ATTEMPTS times, all within START_TIMEOUT_S.
start_node() {
  local name=$1; shift
  local attempt deadline=$((SECONDS + START_TIMEOUT_S))
  for ((attempt = 1; attempt <= START_ATTEMPTS; attempt++)); do
    launch "$name" "$@"
    while alive "$STATE_DIR/$name.pid"; do
      grep -q "Ray runtime started" "$STATE_DIR/$name.log" && return 0
      ((SECONDS < deadline)) || die "$name did not start within ${START_TIMEOUT_S}s; see $STATE_DIR/$name.log"
      sleep 1
    done
    log "$name exited during start-up (try $attempt of $START_ATTEMPTS): $(grep -m1 -E '^[A-Za-z.]*(Exception|Error)' \
      "$STATE_DIR/$name.log" || echo "see $STATE_DIR/$name.log")"
  done
  die "$name failed to start $START_ATTEMPTS times; see $STATE_DIR/$name.log"
}

alive_nodes() {
  # `ray status` lists one "<count> node_<id>" line per alive node under "Active:".
  "$RAY" status --address "$HEAD_IP:$HEAD_PORT" 2>/dev/null | grep -cE '^ +[0-9]+ node_' || true
}

wait_for_nodes() {
  local want=$1 deadline=$((SECONDS + START_TIMEOUT_S)) have=0
  while ((SECONDS < deadline)); do
    have=$(alive_nodes)
    ((have >= want)) && return 0
    for pid_file in "$STATE_DIR"/*.pid; do
      alive "$pid_file" || die "$(basename "$pid_file" .pid) exited; see ${pid_file%.pid}.log"
    done
    sleep 2
  done
  die "only $have of $want nodes alive after ${START_TIMEOUT_S}s; logs in $STATE_DIR"
}

start() {
  local num_workers=${1:-2}
  [[ $num_workers =~ ^[0-9]+$ ]] || die "N must be a number of workers, got '$num_workers'"
  command -v "$RAY" >/dev/null || die "'$RAY' not found; activate the etrain virtualenv or set RAY=/path/to/ray"
  mkdir -p "$STATE_DIR"
  alive "$STATE_DIR/head.pid" && die "a cluster is already running (head PID $(cat "$STATE_DIR/head.pid")); run '$0 stop' first"
  rm -f "$STATE_DIR"/*.pid

  log "head: $HEAD_IP:$HEAD_PORT, dashboard :$DASHBOARD_PORT, client :$CLIENT_PORT, metrics :$METRICS_PORT"
  local dashboard_args=(--dashboard-host 0.0.0.0 --dashboard-port "$DASHBOARD_PORT")
  [[ $INCLUDE_DASHBOARD == 0 ]] && dashboard_args=(--include-dashboard=false)
  start_node head --head --node-ip-address "$HEAD_IP" --port "$HEAD_PORT" \
    "${dashboard_args[@]}" --ray-client-server-port "$CLIENT_PORT" \
    --metrics-export-port "$METRICS_PORT" --dashboard-agent-listen-port "$AGENT_PORT" \
    --num-cpus "$HEAD_CPUS" --num-gpus 0 --temp-dir "$RAY_TEMP_DIR"

  # The workers start at once (each with its own tries, in a subshell) and are then waited for.
  local i pids=()
  for ((i = 1; i <= num_workers; i++)); do
    local gpu_args=(--num-gpus 0) visible=""
    if ((GPUS_PER_WORKER > 0)); then
      local first=$(((i - 1) * GPUS_PER_WORKER))
      visible=$(seq -s, "$first" $((first + GPUS_PER_WORKER - 1)))
      gpu_args=(--num-gpus "$GPUS_PER_WORKER")
    fi
    log "worker $i: $CPUS_PER_WORKER CPUs, $GPUS_PER_WORKER GPUs${visible:+ (CUDA_VISIBLE_DEVICES=$visible)}, metrics :$((METRICS_PORT + i))"
    (
      if [[ -n $visible ]]; then export CUDA_VISIBLE_DEVICES=$visible; fi
      start_node "worker-$i" --address "$HEAD_IP:$HEAD_PORT" --node-ip-address "$HEAD_IP" \
        --num-cpus "$CPUS_PER_WORKER" "${gpu_args[@]}" --temp-dir "$RAY_TEMP_DIR-worker-$i" \
        --metrics-export-port $((METRICS_PORT + i)) --dashboard-agent-listen-port $((AGENT_PORT + i))
    ) &
    pids+=($!)
  done
  local pid failed=0
  for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
  ((failed == 0)) || die "$failed worker node(s) failed to start; logs in $STATE_DIR"
  wait_for_nodes $((num_workers + 1))
  log "up: $((num_workers + 1)) nodes.$([[ $INCLUDE_DASHBOARD == 0 ]] || echo " Dashboard http://$HEAD_IP:$DASHBOARD_PORT")"
  log "etrain serve --ray-address $HEAD_IP:$HEAD_PORT   (or ray://$HEAD_IP:$CLIENT_PORT)"
  log "Prometheus targets for Ray: $RAY_TEMP_DIR/prom_metrics_service_discovery.json"
}

stop() {
  [[ -d $STATE_DIR ]] || { log "nothing to stop"; return 0; }
  local pid_file pids=()
  # Workers first, then the head, so that no worker reports a lost GCS on the way down.
  for pid_file in "$STATE_DIR"/worker-*.pid "$STATE_DIR"/head.pid; do
    if alive "$pid_file"; then
      pids+=("$(cat "$pid_file")")
      kill -TERM "$(cat "$pid_file")"
    fi
    rm -f "$pid_file"
  done
  local deadline=$((SECONDS + 30)) pid
  for pid in "${pids[@]}"; do
    while alive_pid "$pid" && ((SECONDS < deadline)); do sleep 1; done
    alive_pid "$pid" && { log "PID $pid ignored SIGTERM; sending SIGKILL"; kill -KILL "$pid" || true; }
  done
  log "stopped ${#pids[@]} node(s)"
}

status() {
  local pid_file
  for pid_file in "$STATE_DIR"/*.pid; do
    [[ -e $pid_file ]] || { log "no cluster started from $STATE_DIR"; return 1; }
    printf '%-10s pid %-8s %s\n' "$(basename "$pid_file" .pid)" "$(cat "$pid_file")" \
      "$(alive "$pid_file" && echo alive || echo dead)"
  done
  "$RAY" status --address "$HEAD_IP:$HEAD_PORT"
}

kill_worker() {
  local pid_file="$STATE_DIR/worker-${1:?usage: $0 kill-worker I}.pid"
  alive "$pid_file" || die "worker $1 is not running"
  # SIGKILL the `ray start` process; Ray's reaper then takes down that node's raylet and workers.
  kill -KILL "$(cat "$pid_file")"
  log "killed worker $1 (PID $(cat "$pid_file"))"
}

case ${1:-start} in
  start) start "${2:-2}" ;;
  stop) stop ;;
  status) status ;;
  kill-worker) kill_worker "${2:-}" ;;
  *) die "usage: $0 [start [N] | stop | status | kill-worker I]" ;;
esac
