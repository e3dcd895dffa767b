#!/usr/bin/env bash
# Builds the venv the `verifiers` environment (plait-proxy) runs verifiers 0.4.0 (`verifiers.v1`)
# tasksets in (`api = "v1"`): verifiers 0.4.0, uv (the `null` harness runs its chat program with
# `uv`, which fetches that program's dependencies from PyPI the first time) and the example
# taskset of examples/verifiers/vf_v1_arith. Idempotent; works on a fresh Debian 12 machine as
# root.
#
#   PLAIT_VERIFIERS_V1_VENV (default .venvs/verifiers-v1 in the repository) is where the venv goes;
#   the environment's default interpreter (api = "v1") and its tests read the same variable.
#
# Kept apart from plait's own environment and from verifiers 0.1.14's venv
# (scripts/ci/verifiers.sh): each pins its own stack. About 625 MB, plus 62 MB in uv's cache
# (~/.cache/uv) for the chat program; 1 min 40 s to build here (2 cores, busy). verifiers and uv
# are pinned; their dependencies (and the chat program's) resolve at build time.
set -euo pipefail
# uv trusts the system's certificates (a machine behind a TLS proxy adds its CA there), as pip does
export UV_NATIVE_TLS=${UV_NATIVE_TLS:-1}
repo=$(cd "$(dirname "$0")/../.." && pwd)
venv=${PLAIT_VERIFIERS_V1_VENV:-$repo/.venvs/verifiers-v1}
python=${PYTHON:-python3}
spec=verifiers==0.4.0
uv=uv==0.13.9
examples=("$repo/examples/verifiers/vf_v1_arith")

# ready when verifiers and uv are at their pins and every example is installed at the version of
# its pyproject
ready="import importlib.metadata as m, sys, tomllib
assert m.version('verifiers') == sys.argv[1]
assert m.version('uv') == sys.argv[2]
for folder in sys.argv[3:]:
    project = tomllib.load(open(folder + '/pyproject.toml', 'rb'))['project']
    assert m.version(project['name']) == project['version'], project['name']"
if [ -x "$venv/bin/python" ] &&
    "$venv/bin/python" -c "$ready" "${spec#*==}" "${uv#*==}" "${examples[@]}" >/dev/null 2>&1; then
    echo "verifiers_v1.sh: $venv is ready"
    exit 0
fi

source "$(dirname "$0")/lib/venv.sh"
new_venv "$venv" "$python"
echo "verifiers_v1.sh: installing $spec, $uv and the examples into $venv (about a minute)"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "$spec" "$uv" hatchling
# the examples are installed as they are published (not editable), without touching the pins
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation "${examples[@]}"
"$venv/bin/python" -c "$ready" "${spec#*==}" "${uv#*==}" "${examples[@]}"
"$venv/bin/python" -c "
from verifiers.v1.utils.loaders import load_environment, resolve_env_config
env = load_environment(resolve_env_config({'taskset': {'id': 'vf-v1-arith'}}))
assert len(list(env.taskset)) == 50"
# the null harness's chat program: uv installs its dependencies (openai, mcp, httpx, ...) into
# its cache now, so that rollouts start without fetching them (PyPI is needed here, not then)
PATH="$venv/bin:$PATH" "$venv/bin/python" -c "
import asyncio
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes.subprocess import SubprocessConfig, SubprocessRuntime

async def prepare():
    runtime = SubprocessRuntime(SubprocessConfig())
    await runtime.start()
    try:
        await runtime.prepare_uv_script(CHAT_PROGRAM_SOURCE)
    finally:
        await runtime.stop()

asyncio.run(prepare())"
echo "verifiers_v1.sh: built $venv"
