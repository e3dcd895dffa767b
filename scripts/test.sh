#!/usr/bin/env bash
# The whole test suite, as CI runs it: set up the services the tests need (scripts/ci/*.sh:
# Docker engine, sandbox image, vLLM venv, ...), then every test except those that need a GPU.
# Usage: scripts/test.sh [--fast | --setup-only] [extra pytest args]
#   --fast: no service set-up, only the default (fast) suite: the check to run before every commit.
#   --setup-only: the service set-up alone (idempotent; .ci/run starts it while the linters run).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
pytest_args=(-m "not gpu" --durations=30)  # the slowest tests listed, to keep CI within its limit
setup_only=false
if [ "${1:-}" = "--fast" ]; then
    shift
    pytest_args=()  # the default markers in pyproject.toml leave out slow and service-bound tests
else
    [ "${1:-}" = "--setup-only" ] && { shift; setup_only=true; }
    # docker.sh first (it may apt-get); then the others side by side, each logging to a file: they
    # build venvs of their own (or pip-install one package), so their downloads and installs overlap.
    first=scripts/ci/docker.sh
    if [ -e "$first" ]; then
        echo "== $first"
        bash "$first" || { echo "setup step $first failed" >&2; exit 1; }
    fi
    logs=$(mktemp -d)
    steps=()
    pids=()
    for setup in scripts/ci/*.sh; do
        [ "$setup" = "$first" ] && continue
        bash "$setup" >"$logs/$(basename "$setup").log" 2>&1 &
        steps+=("$setup")
        pids+=($!)
    done
    failed=()
    for i in "${!steps[@]}"; do
        wait "${pids[$i]}" || failed+=("${steps[$i]}")
        echo "== ${steps[$i]}"
        cat "$logs/$(basename "${steps[$i]}").log"
    done
    rm -rf "$logs"
    [ ${#failed[@]} -eq 0 ] || { echo "setup steps failed: ${failed[*]}" >&2; exit 1; }
    $setup_only && exit 0
fi
dirs=()
for d in core/tests libs/*/tests sdk/tests plugins/*/tests envs/*/tests renderers/*/tests examples/plugins/*/tests tests; do
    [ -d "$d" ] && dirs+=("$d")
done
"$VENV/bin/python" -m pytest "${dirs[@]}" "${pytest_args[@]}" -q "$@"
rc=$?
[ "$rc" -eq 5 ] && rc=0  # "no tests collected" is not a failure
exit "$rc"
