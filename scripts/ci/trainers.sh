#!/usr/bin/env bash
# Install megatron-core for plait-megatron's tests (scripts/install.sh installs plait-fsdp2 and
# plait-megatron themselves). Idempotent; for a fresh Debian 12 machine as root.
#
#   bash scripts/ci/trainers.sh                     # into ${VENV:-.venv}
#
# megatron-core 0.16.1 is the newest release for Python 3.11 (0.17+ need 3.12); it declares only
# numpy, packaging and torch, so --no-deps keeps the pinned CPU torch in place.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
venv=${VENV:-.venv}
[[ "$venv" = /* ]] || venv="$repo/$venv"
"$venv/bin/python" -c "import megatron.core" 2>/dev/null \
    || "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "megatron-core==0.16.1"
echo "[trainers.sh] megatron-core installed into $venv"
