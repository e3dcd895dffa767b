#!/usr/bin/env bash
# Install what the trainer plugins' tests need beyond scripts/install.sh: plait-fsdp2 and
# plait-megatron (editable) and megatron-core. Idempotent; for a fresh Debian 12 machine as root.
#
#   bash scripts/ci/trainers.sh                     # into ${VENV:-.venv}
#
# megatron-core 0.16.1 is the newest release for Python 3.11 (0.17+ need 3.12); it declares only
# numpy, packaging and torch, so --no-deps keeps the pinned CPU torch in place.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
venv=${VENV:-.venv}
[[ "$venv" = /* ]] || venv="$repo/$venv"
PIP=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" --no-deps -e "$repo/plugins/fsdp2" -e "$repo/plugins/megatron"
"$venv/bin/python" -c "import megatron.core" 2>/dev/null || "${PIP[@]}" --no-deps "megatron-core==0.16.1"
echo "[trainers.sh] plait-fsdp2, plait-megatron and megatron-core installed into $venv"
