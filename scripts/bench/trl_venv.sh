#!/usr/bin/env bash
# Builds the venv that runs the real TRL (GRPOTrainer) for benchmarks/vs_trl.py. Idempotent: a venv
# that already imports trl is left as it is.
#
#   bash scripts/bench/trl_venv.sh
#
#   PLAIT_TRL_VENV (default .venvs/trl in the repository) is where the venv goes (vs_trl.py reads the
#   same variable); PYTHON picks the interpreter (default python3); TRL_SPEC the TRL release
#   (default trl==1.16.0, the release the issue measured).
#
# torch is pinned to plait's own torch==2.13.0, which resolves to the CPU wheel on this machine's
# wheel cache (/opt/wheels): PyPI's plain torch==2.13.0 is the multi-GB CUDA build, so the script
# asks pip which build it would take first and stops unless it is a +cpu one. transformers,
# accelerate and datasets come in as TRL's own dependencies. Uses uv when it is on PATH, else pip.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
venv=${PLAIT_TRL_VENV:-$repo/.venvs/trl}
python=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TRL_SPEC=${TRL_SPEC:-trl==1.16.0}
versions='import torch, trl, transformers, accelerate, datasets
print(f"trl {trl.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}, "
      f"datasets {datasets.__version__}, torch {torch.__version__}")'

if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import trl' >/dev/null 2>&1; then
    echo "trl_venv.sh: $venv is ready ($("$venv/bin/python" -c "$versions"))"
    exit 0
fi

source "$repo/scripts/ci/lib/venv.sh"
new_venv "$venv" "$python"

if command -v uv >/dev/null 2>&1; then
    # uv reads no pip.conf: hand it the local wheel folder pip is told about.
    links=()
    for dir in ${PIP_FIND_LINKS:-/opt/wheels}; do [ -d "$dir" ] && links+=(--find-links "$dir"); done
    install() { uv pip install --quiet --python "$venv/bin/python" "${links[@]}" "$@"; }
    dry_run() { uv pip install --dry-run --python "$venv/bin/python" "${links[@]}" "$@" 2>&1; }
    echo "trl_venv.sh: installing with uv"
else
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
    install() { "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
    dry_run() { "$venv/bin/python" -m pip install --disable-pip-version-check --dry-run --no-deps "$@" 2>&1; }
    echo "trl_venv.sh: installing with pip"
fi

plan=$(dry_run "$TORCH_SPEC")
if ! grep -q '+cpu' <<<"$plan"; then
    echo "$plan" >&2
    echo "trl_venv.sh: $TORCH_SPEC does not resolve to a CPU build here; refusing to pull the CUDA wheel" >&2
    echo "trl_venv.sh: set TORCH_SPEC (e.g. to a local torch-2.13.0+cpu wheel) and run again" >&2
    exit 1
fi
echo "trl_venv.sh: installing $TORCH_SPEC (CPU build) and $TRL_SPEC (with transformers, accelerate, datasets) into $venv"
install "$TORCH_SPEC" "$TRL_SPEC" transformers accelerate datasets
echo "trl_venv.sh: built $venv ($("$venv/bin/python" -c "$versions"))"
