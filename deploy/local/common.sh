# Shared by start-ray-cluster.sh, up.sh and down.sh (sourced, never run).

# Ray token authentication, decided once for every process of this cluster. `ray start --head` turns
# it on by itself when a token exists (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, which
# a local `ray.init()` creates), but a joining `ray start`, `ray status` and a driver given an address
# (`etrain serve --ray-address`) do not: they would be refused. So with a token the mode is exported.
if [[ -z ${RAY_AUTH_MODE:-} ]] && [[ -n ${RAY_AUTH_TOKEN:-} || -s ${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token} ]]; then
  export RAY_AUTH_MODE=token
fi

# A PID is alive while it exists and is not a zombie (exited, not yet reaped: in a container whose
# PID 1 reaps nothing, a stopped node would otherwise look alive forever). One read of /proc/PID/stat
# decides (a zombie reaped between two reads must not look alive); without /proc, kill -0.
# Every exit status is explicit: a bare `return` in a function run from a trap handler (a script's
# EXIT-trap cleanup) returns the status from before the trap, so a PID that was gone looked alive and
# every stop waited out its whole grace period, then SIGKILLed (5 s each for `etrain serve` and the
# Ray head in `make gpu-check`, read as "ignored SIGINT").
alive_pid() {
  local stat
  if ! stat=$(cat "/proc/$1/stat" 2>/dev/null); then
    if [[ ! -d /proc/self ]] && kill -0 "$1" 2>/dev/null; then
      return 0
    fi
    return 1
  fi
  if [[ ${stat##*) } == Z* ]]; then
    return 1
  fi
  return 0
}
alive() { [[ -f $1 ]] && alive_pid "$(cat "$1")"; }
