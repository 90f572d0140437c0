#!/usr/bin/env bash
# `make test`: the whole suite in two lanes side by side, then the timing tests alone.
#
# Why two lanes: the Ray tests (tests/e2e, tests/chaos) spend most of their time waiting (Ray's start,
# node-death detection, heartbeats, back-offs), and a 2-core CI machine idles meanwhile. So they run in
# one pytest process while a second runs everything else (unit, API, chart, multi-process gloo): never two
# Ray clusters at once (they starve each other's control calls and share Ray's ports). The tests marked
# `timing` (a measured time or time ratio: the pipeline bubble, straggler compute times, millisecond
# bounds) then run with nothing beside them. pytest-xdist's `loadgroup` would do the first part, but it
# renames test ids in a way pytest 9 ignores.
#
# Arguments go to every pytest run (e.g. --durations=30). One test or one file: call pytest directly
# (CONTRIBUTING.md). Exit status: the first failing lane's; "no tests collected" (5) counts as success.
set -uo pipefail
PY=${PY:-.venv/bin/python}
work=$(mktemp -d -t etrain-suite.XXXXXX)
trap 'rm -rf "$work"' EXIT
started=$(date +%s)

ok() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ]; }

"$PY" -m pytest tests/e2e tests/chaos -m "not timing" -p no:cacheprovider --basetemp="$work/ray" "$@" \
    >"$work/ray.log" 2>&1 &
ray_pid=$!
"$PY" -m pytest tests --ignore=tests/e2e --ignore=tests/chaos -m "not timing" --basetemp="$work/rest" "$@"
rest=$?
wait "$ray_pid"
ray=$?
echo "======== tests/e2e and tests/chaos, run beside the above (exit $ray) ========"
cat "$work/ray.log"
echo "======== the timing tests, alone ========"
"$PY" -m pytest tests -m timing --basetemp="$work/timing" "$@"
timing=$?
echo "make test: lanes exited rest=$rest ray=$ray timing=$timing; $(( $(date +%s) - started )) s in all"
for code in "$rest" "$ray" "$timing"; do
    ok "$code" || exit "$code"
done
exit 0
