#!/usr/bin/env bash
# Builds the venv that holds tinker-cookbook 0.5.8 (the newest whose dependencies install from
# the package registry; 0.6.1 needs tml-renderers>=0.4.1, which is not there) with its math_rl
# extra and the tinker 0.38 SDK: the unmodified recipes that plugins/tinker/tests/test_cookbook.py
# runs against `plait serve tinker`. Idempotent; works on a fresh Debian 12 machine as root.
#
#   PLAIT_COOKBOOK_VENV (default .venvs/cookbook in the repository) is where the venv goes; the
#   test reads the same variable.
#
# Kept apart from plait's own environment: the cookbook pins transformers<=5.5.4. torch is pinned
# to the CPU build on disk (an unpinned torch would pull a multi-GB CUDA build); about 1.6 GB.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
venv=${PLAIT_COOKBOOK_VENV:-$repo/.venvs/cookbook}
python=${PYTHON:-python3}
specs=(torch==2.13.0 tinker==0.38.0 "tinker-cookbook[math-rl]==0.5.8")
check="import importlib.metadata as m
assert (m.version('tinker'), m.version('tinker-cookbook')) == ('0.38.0', '0.5.8')
import tinker_cookbook.recipes.math_rl.train, tinker_cookbook.recipes.chat_sl.train"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$check" >/dev/null 2>&1; then
    echo "cookbook.sh: $venv is ready"
    exit 0
fi

source "$(dirname "$0")/lib/venv.sh"
new_venv "$venv" "$python"
echo "cookbook.sh: installing ${specs[*]} into $venv (about 3 minutes)"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "${specs[@]}"
"$venv/bin/python" -c "$check"
echo "cookbook.sh: built $venv"
