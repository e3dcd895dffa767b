#!/usr/bin/env bash
# Sets up what the SDK's interop tests (pytest -m interop) need: one venv per official ORS SDK,
# kept apart from plait's own environment because openreward pins sse-starlette and pulls in
# LLM-vendor SDKs, and one for OpenEnv (openenv-core). Idempotent; works on a fresh Debian 12 machine as root.
#   ORS_VENVS (default .venvs/ in the repository) is where the venvs go; the tests read the same variable.
set -euo pipefail
venvs=${ORS_VENVS:-$(cd "$(dirname "$0")/../.." && pwd)/.venvs}
python=${PYTHON:-python3}
mkdir -p "$venvs"

if ! "$python" -m venv --help >/dev/null 2>&1 || ! "$python" -c "import ensurepip" >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq python3-venv
fi

make_venv() {  # make_venv NAME "PIP SPEC..." IMPORT-CHECK
    local dir="$venvs/$1"
    if [ -x "$dir/bin/python" ] && "$dir/bin/python" -c "$3" >/dev/null 2>&1; then
        echo "sdk.sh: $dir is ready"
        return
    fi
    rm -rf "$dir"
    "$python" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --disable-pip-version-check $2
    "$dir/bin/python" -c "$3"
    echo "sdk.sh: built $dir"
}

make_venv ors-sdk "ors-sdk==0.1.0" "import ors, ors.client"
make_venv openreward "openreward==0.1.167" "import openreward.environments, openreward.api.environments.client"
# OpenEnv's core (pytest -m interop, sdk/tests/test_openenv.py): its own venv because it pins
# gradio, which wants older pillow and tomlkit than plait's .venv has
make_venv openenv "openenv-core==0.3.0" "import openenv.core.env_server, openenv.core.generic_client"
