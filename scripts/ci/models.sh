#!/usr/bin/env bash
# Builds the models the slow tests share into plait's model cache ($PLAIT_CACHE_DIR, default
# ~/.cache/plait): tiny-qwen3-arith (supervised steps on tiny-qwen3-8k, a minute or two), its MoE
# upcycle, tiny-qwen3-propose (more supervised steps on it) and SmolLM2-135M converted from its GGUF. The tests would build them on first use; built
# here, that happens while the other set-up steps download. Idempotent (a cached model is kept).
set -euo pipefail
cd "$(dirname "$0")/../.."
"${VENV:-.venv}/bin/python" - <<'PY'
from plait.components import resolve_model

for name in ("tiny-qwen3-arith", "tiny-qwen3-moe-arith", "tiny-qwen3-propose", "smollm2-135m-instruct"):
    print(f"models.sh: {name} at {resolve_model(name).path}", flush=True)
PY
