#!/usr/bin/env bash
# The test phases of `make test`, in two lanes that run at the same time:
#   lane "unit": the unit tests with the compiled codec, the benchmark suite (bench/) once
#                with --benchmark-disable, then the same unit tests with the pure-Python
#                twin (RMQFAST_NO_EXTENSIONS=1; minus the Spark tests, which do not touch
#                the codec);
#   lane "it":   the integration tests against a real RocketMQ and real clients.
# Most of the integration lane's time is spent waiting on JVMs and network round trips, so on
# two cores the lanes overlap well: the suite takes about as long as its longest lane instead of
# the sum of the three phases. Every test is written to hold on a loaded machine, which the other
# lane makes this one.
#
# Each line is printed with its lane's name as it comes; each lane's summary is printed again at
# the end. The exit status is non-zero if any phase failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
logdir="$(mktemp -d "${TMPDIR:-/tmp}/rmqfast-suite.XXXXXX")"
durations=(--durations=15 --durations-min=5 "$@")  # extra arguments go to every pytest run of tests/

lane_unit() {
    "$PYTHON" -m pytest -q -m "not integration" "${durations[@]}" || return 1
    # the pytest-benchmark suite, each benchmark run once and not timed, so it cannot rot (~10 s;
    # the extra arguments are not passed: a -k or -m meant for tests/ could select nothing here)
    "$PYTHON" -m pytest -q bench/ --benchmark-disable --durations=5 --durations-min=5 || return 1
    RMQFAST_NO_EXTENSIONS=1 "$PYTHON" -m pytest -q -m "not integration and not spark" "${durations[@]}"
}

lane_it() {
    "$PYTHON" -m pytest -q -m integration "${durations[@]}"
}

run_lane() {  # name: run lane_<name>, prefix its lines, keep them in the lane's log, record rc
    local name=$1 rc
    { "lane_$name" 2>&1; echo "rc=$?" >"$logdir/$name.rc"; } \
        | tee "$logdir/$name.log" | sed -u "s/^/[$name] /"
    rc=$(sed -n 's/^rc=//p' "$logdir/$name.rc")
    return "${rc:-1}"
}

start=$SECONDS
run_lane unit & unit_pid=$!
run_lane it & it_pid=$!
wait "$unit_pid"; unit_rc=$?
wait "$it_pid"; it_rc=$?

echo
echo "=== summary (whole suite $(( (SECONDS - start) / 60 ))m$(( (SECONDS - start) % 60 ))s; logs in $logdir)"
for name in unit it; do
    grep -E "^(=+ .*(passed|failed|error).* =+|[0-9]+ (passed|failed).*|FAILED .*|ERROR .*)$" "$logdir/$name.log" \
        | sed "s/^/[$name] /"
done
if [ "$unit_rc" -ne 0 ] || [ "$it_rc" -ne 0 ]; then
    echo "FAILED: unit lane rc=$unit_rc, integration lane rc=$it_rc"
    exit 1
fi
echo "all phases passed"
