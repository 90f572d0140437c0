#!/usr/bin/env bash
# Stop what deploy/local/up.sh started: the API server first (its jobs' supervisors live on the
# cluster and stop with it), then the Ray nodes. Only the PIDs recorded in $STATE_DIR are signalled;
# other Ray clusters and servers on this machine are left alone. Same STATE_DIR as up.sh.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export STATE_DIR=${STATE_DIR:-${TMPDIR:-/tmp}/etrain-local}
STOP_TIMEOUT_S=${STOP_TIMEOUT_S:-30}
pid_file=$STATE_DIR/server/etrain.pid

log() { printf '[local-etrain] %s\n' "$*" >&2; }
# shellcheck source=common.sh
source "$HERE/common.sh"  # alive_pid

if [[ -f $pid_file ]]; then
  pid=$(cat "$pid_file")
  if alive_pid "$pid"; then
    kill -TERM "$pid"
    deadline=$((SECONDS + STOP_TIMEOUT_S))
    while alive_pid "$pid" && ((SECONDS < deadline)); do sleep 1; done
    if alive_pid "$pid"; then
      log "etrain server (PID $pid) ignored SIGTERM for ${STOP_TIMEOUT_S}s; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    log "stopped the etrain server (PID $pid)"
  fi
  rm -f "$pid_file"
fi

"$HERE/start-ray-cluster.sh" stop
