#!/usr/bin/env bash
# Builds the venv that holds the real agent harnesses plait-proxy serves: the openai and anthropic
# SDKs, openai-agents, smolagents and mini-swe-agent (with litellm), at pinned versions. The
# programs in examples/harnesses/ run in it, unmodified clients pointed at the proxy by base URL.
# Idempotent; works on a fresh Debian 12 machine as root.
#
#   PLAIT_HARNESS_VENV (default .venvs/harness in the repository) is where the venv goes; tests
#   that run the harnesses read the same variable.
#
# Kept apart from plait's own environment: litellm pulls in a large tree (boto3, tokenizers,
# aiohttp); the venv is about 520 MB, 2 minutes to build. Only the six clients are pinned; their
# dependencies resolve at build time.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
venv=${PLAIT_HARNESS_VENV:-$repo/.venvs/harness}
python=${PYTHON:-python3}
specs=(
    openai==3.57.0
    anthropic==2.15.0
    openai-agents==0.24.0
    smolagents==1.26.0
    mini-swe-agent==2.4.6
    litellm==1.110.2
)
# mini-swe-agent goes in without `datasets` (only its SWE-bench runners import it; with it comes
# pyarrow and pandas, a third of the venv): its other requirements are installed by name.
mini_swe_requirements=(jinja2 platformdirs prompt_toolkit python-dotenv pyyaml requests rich tenacity textual typer)

# ready when every pinned distribution is there at its pinned version (importing them all takes
# 15 s here, so only a fresh build does; litellm would fetch its cost map on import without the
# variable)
pinned="import importlib.metadata as m, sys
bad = {n: v for n, v in (s.split('==') for s in sys.argv[1:]) if m.version(n) != v}
assert not bad, bad"
imports="import openai, anthropic, agents, smolagents, litellm, minisweagent.agents.default"
export LITELLM_LOCAL_MODEL_COST_MAP=True MSWEA_SILENT_STARTUP=1
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$pinned" "${specs[@]}" >/dev/null 2>&1; then
    echo "harness.sh: $venv is ready"
    exit 0
fi

source "$(dirname "$0")/lib/venv.sh"
new_venv "$venv" "$python"
echo "harness.sh: installing ${specs[*]} into $venv (about 2 minutes)"
"$venv/bin/python" -m pip install -q --disable-pip-version-check \
    $(printf '%s\n' "${specs[@]}" | grep -v '^mini-swe-agent==') "${mini_swe_requirements[@]}"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$(printf '%s\n' "${specs[@]}" | grep '^mini-swe-agent==')"
"$venv/bin/python" -c "$pinned" "${specs[@]}"
"$venv/bin/python" -c "$imports"
echo "harness.sh: built $venv"
