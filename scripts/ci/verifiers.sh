#!/usr/bin/env bash
# Builds the venv the `verifiers` environment (plait-proxy) runs verifiers environments in:
# verifiers 0.1.14, the last of the 0.1.x line whose `load_environment()` / SingleTurnEnv /
# ToolEnv / Rubric API most published environments use, and the example environments of
# examples/verifiers/. Idempotent; works on a fresh Debian 12 machine as root.
#
#   PLAIT_VERIFIERS_VENV (default .venvs/verifiers in the repository) is where the venv goes; the
#   environment's default interpreter and its tests read the same variable.
#
# Kept apart from plait's own environment: verifiers pins an older stack (openai, pydantic,
# datasets, ...). About 850 MB; 1 min 40 s to build here (2 cores). Only verifiers is pinned; its
# dependencies resolve at build time. The examples build their data in code, so nothing is
# downloaded when they load.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
venv=${PLAIT_VERIFIERS_VENV:-$repo/.venvs/verifiers}
python=${PYTHON:-python3}
spec=verifiers==0.1.14
# vf-reasoning-gym's data: the version plait-math pins
reasoning_gym=reasoning-gym==0.1.25
examples=("$repo/examples/verifiers/vf_arith" "$repo/examples/verifiers/vf_calculator"
    "$repo/examples/verifiers/vf_reasoning_gym")

# ready when verifiers is at its pin and every example is installed at the version of its
# pyproject (importing verifiers takes 8 s here, so only a fresh build does)
ready="import importlib.metadata as m, sys, tomllib
assert m.version('verifiers') == sys.argv[1]
for folder in sys.argv[2:]:
    project = tomllib.load(open(folder + '/pyproject.toml', 'rb'))['project']
    assert m.version(project['name']) == project['version'], project['name']"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$ready" "${spec#*==}" "${examples[@]}" >/dev/null 2>&1; then
    echo "verifiers.sh: $venv is ready"
    exit 0
fi

source "$(dirname "$0")/lib/venv.sh"
new_venv "$venv" "$python"
echo "verifiers.sh: installing $spec and the examples into $venv (about 2 minutes)"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "$spec" "$reasoning_gym" hatchling
# the examples are installed as they are published (not editable), without touching the pins
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation "${examples[@]}"
"$venv/bin/python" -c "$ready" "${spec#*==}" "${examples[@]}"
"$venv/bin/python" -c "import verifiers as vf; [vf.load_environment(e) for e in ('vf-arith', 'vf-calculator')]"
echo "verifiers.sh: built $venv"
