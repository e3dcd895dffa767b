#!/usr/bin/env bash
# The whole test suite, as CI runs it: set up the services the tests need (scripts/ci/*.sh:
# Docker engine, sandbox image, vLLM venv, ...) and, while they install, run the fast suite; then
# every other test except those that need a GPU.
# Usage: scripts/test.sh [--fast | --setup-only] [extra pytest args]
#   --fast: no service set-up, only the default (fast) suite: the check to run before every commit.
#   --setup-only: the service set-up alone (idempotent).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# The fast suite is pytest's default selection (pyproject.toml's addopts); the rest is its complement.
REST_MARKERS="not gpu and (slow or docker or vllm or sglang or distributed)"

timed() {  # timed CMD...: CMD, then how long it took (CI's budget is spent here and in the tests)
    local start=$SECONDS rc=0
    "$@" || rc=$?
    echo "($* took $((SECONDS - start)) s, exit status $rc)"
    return "$rc"
}

setup() {
    # docker.sh first (it may apt-get); then the others side by side, each logging to a file: they
    # build venvs of their own (or pip-install one package), so their downloads and installs overlap.
    local first=scripts/ci/docker.sh
    if [ -e "$first" ]; then
        echo "== $first"
        timed bash "$first" || { echo "setup step $first failed" >&2; return 1; }
    fi
    local logs steps=() pids=() failed=()
    logs=$(mktemp -d)
    for step in scripts/ci/*.sh; do
        [ "$step" = "$first" ] && continue
        timed bash "$step" >"$logs/$(basename "$step").log" 2>&1 &
        steps+=("$step")
        pids+=($!)
    done
    for i in "${!steps[@]}"; do
        wait "${pids[$i]}" || failed+=("${steps[$i]}")
        echo "== ${steps[$i]}"
        cat "$logs/$(basename "${steps[$i]}").log"
    done
    rm -rf "$logs"
    [ ${#failed[@]} -eq 0 ] || { echo "setup steps failed: ${failed[*]}" >&2; return 1; }
}

# Every distribution's test directory; tests/ holds the end-to-end runs across them.
UNIT_DIRS=(core/tests libs/*/tests sdk/tests plugins/*/tests envs/*/tests renderers/*/tests examples/plugins/*/tests)

tests_in() {  # tests_in DIR... -- [pytest args]: exit status 5 ("no tests collected") is not a failure
    local dirs=()
    while [ "$1" != "--" ]; do
        [ -d "$1" ] && dirs+=("$1")
        shift
    done
    shift
    "$VENV/bin/python" -m pytest "${dirs[@]}" -q "$@"
    local rc=$?
    [ "$rc" -eq 5 ] && rc=0
    return "$rc"
}

# Two pytest-xdist workers, each taking the next unit of tests as it finishes one, in collection
# order (conftest.py: a distribution's tests are one unit, sharing its session fixtures' servers;
# each file under tests/ is one). The fast suite takes 3.8 min on two (2 cores, alone); three took
# longer.
ON_TWO_WORKERS=(-n 2 --dist loadscope --no-loadscope-reorder)

# The fast suite, the largest distributions first, so that neither worker is left with one at the
# end.
FAST_LONGEST_FIRST=(plugins/proxy/tests plugins/remote/tests plugins/torch/tests plugins/tinker/tests)
fast() { tests_in "${FAST_LONGEST_FIRST[@]}" "${UNIT_DIRS[@]}" tests -- "${ON_TWO_WORKERS[@]}" "$@"; }

case "${1:-}" in
    --fast) shift; fast "$@"; exit $? ;;
    --setup-only) setup; exit $? ;;
esac

# The fast suite needs none of the set-up: run them side by side, the fast suite on two workers (the
# slowest tests listed, to keep CI within its limit). Measured on a bare 2-core machine: the set-up
# takes 7 min (its steps beside each other, 11 min of CPU), and the fast suite took 15 min on one
# worker, a core idle for about half of it.
setup_log=$(mktemp)
setup >"$setup_log" 2>&1 &
setup_pid=$!
fast --durations=15 "$@"
fast_rc=$?
setup_rc=0
wait "$setup_pid" || setup_rc=$?
cat "$setup_log"
rm -f "$setup_log"
[ "$setup_rc" -eq 0 ] || { echo "service set-up failed (scripts/test.sh --setup-only)" >&2; exit "$setup_rc"; }
# The rest on two workers, the longest units (measured) first, then tests/'s files, then the rest,
# so that both cores stay busy to the end (pytest collects a folder named twice once).
LONGEST_FIRST=(plugins/vllm/tests plugins/fsdp2/tests plugins/remote/tests plugins/proxy/tests
    envs/docker/tests plugins/sglang/tests tests)
tests_in "${LONGEST_FIRST[@]}" "${UNIT_DIRS[@]}" -- -m "$REST_MARKERS" "${ON_TWO_WORKERS[@]}" \
    --durations=30 "$@"
rest_rc=$?
for rc in "$fast_rc" "$rest_rc"; do
    [ "$rc" -ne 0 ] && exit "$rc"
done
exit 0
