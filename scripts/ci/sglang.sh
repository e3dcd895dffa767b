#!/usr/bin/env bash
# Builds the venv that holds the real `sglang` package's wire contract for the `sglang`-marked
# tests: they validate the fake SGLang server's requests and replies with
# `sglang/api/v1/api_types.py`, exactly as the real server does. Idempotent; works on a fresh
# Debian 12 machine as root.
#
#   PLAIT_SGLANG_VENV (default .venvs/sglang in the repository) is where the venv goes; the tests
#   read the same variable.
#
# SGLang has no CPU build for these machines, and its dependencies pin transformers and pull GPU
# packages, so only the sglang wheel itself (--no-deps) and msgspec (what api_types.py imports)
# are installed, in a venv of their own. Importing the `sglang` package would pull GPU-only
# modules; the tests load api_types.py as a file.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
venv=${PLAIT_SGLANG_VENV:-$repo/.venvs/sglang}
python=${PYTHON:-python3}
SGLANG_SPEC=${SGLANG_SPEC:-sglang==0.5.23}

check='import importlib.util, msgspec, pathlib
spec = importlib.util.find_spec("sglang")
assert spec and (pathlib.Path(next(iter(spec.submodule_search_locations))) / "api/v1/api_types.py").is_file()'
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$check" >/dev/null 2>&1; then
    echo "sglang.sh: $venv is ready"
    exit 0
fi

source "$(dirname "$0")/lib/venv.sh"
new_venv "$venv" "$python"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$SGLANG_SPEC" msgspec
"$venv/bin/python" -c "$check"
echo "sglang.sh: built $venv ($SGLANG_SPEC)"
