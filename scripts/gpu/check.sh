#!/usr/bin/env bash
# The GPU check: plait-torch's trainer (with MFU against the measured bf16 matmul peak) and
# inference engine (sampling tokens/s) in bf16 on a random model of Qwen3-0.6B's shapes, plait-fsdp2
# on one rank with NCCL, a short GRPO run of examples/arith_tiny.toml through `plait run`, and the
# tests marked `gpu`. Sized for one call of a lent NVIDIA H100 (one command, at most 10 minutes):
# the install takes under a minute and the parts about 4-5 minutes (a budget of 8 minutes in all).
# scripts/gpu/check.py has the parts and their sizes.
#
# On a lent GPU machine (it has torch, transformers and triton but no network: plait's other
# dependencies travel as wheels in the ignored folder .whl/):
#   1. here:   bash scripts/gpu/wheels.sh          (fills .whl/, about 10 MiB; idempotent)
#   2. the session's `run` tool, in one call:
#        command: bash scripts/gpu/check.sh --out $OUT
#        carry: [".whl"]   timeout_s: 600
#   3. here:   copy gpu_check.json from the reply's files_at folder to
#              benchmarks/results/gpu_check.json and commit it (gpu_check.log is the whole log).
# There it installs the wheels and plait's own distributions (built from this tree, no network)
# with `pip install --target` into a folder on PYTHONPATH, so that plait finds its plugins through
# their entry points.
#
# On the CPU:  bash scripts/gpu/check.sh --dry-run [--out DIR]
#   the same parts and code paths at tiny-qwen3-8k's sizes (gloo instead of NCCL; a random
#   tiny-qwen3-8k for the GRPO run), with the repository's .venv and no install; the JSON
#   (dry_run: true) goes to DIR or a new temporary folder, never to benchmarks/results/.
#   tests/test_gpu_check.py runs it.
#
# Options: --out DIR (default $OUT, else a new temporary folder); --python PY (default python3,
# or .venv/bin/python with --dry-run); --install (install from .whl/ with --dry-run too, e.g. into
# another interpreter to try the GPU machine's install); --wheels DIR (instead of .whl/, e.g. the
# same list for another Python); --keep (keep the work folder: model, runs, logs). Exit status 1
# when a part failed (gpu_check.json says which).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"

dry_run=0 install= python= out=${OUT:-} keep=0 wheels=.whl
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --install) install=1 ;;
        --keep) keep=1 ;;
        --out) out=$2; shift ;;
        --python) python=$2; shift ;;
        --wheels) wheels=$2; shift ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
if [ "$dry_run" = 1 ]; then
    python=${python:-$repo/.venv/bin/python}
    install=${install:-0}
else
    python=${python:-python3}
    install=${install:-1}
fi
[ -n "$out" ] || out=$(mktemp -d /tmp/plait-gpu-check-out.XXXXXX)
mkdir -p "$out"
out=$(cd "$out" && pwd)
if [ "$dry_run" = 1 ] && [ "$out" = "$repo/benchmarks/results" ]; then
    echo "check.sh: a dry run's results do not go to benchmarks/results/ (pass --out DIR)" >&2
    exit 2
fi
work=$(mktemp -d /tmp/plait-gpu-check.XXXXXX)
[ "$keep" = 1 ] || trap 'rm -rf "$work"' EXIT

log() { echo "[$(date +%H:%M:%S)] check.sh: $*"; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PLAIT_CACHE_DIR=$work/cache

# plait's distributions that the parts and the gpu tests import (in dependency order).
dists=(core libs/testing libs/hf libs/weights libs/train libs/server sdk plugins/torch
    plugins/fsdp2 plugins/megatron plugins/vllm plugins/sinks envs/math)
started=$(date +%s.%N)
if [ "$install" = 1 ]; then
    compgen -G "$wheels/*.whl" >/dev/null \
        || { echo "check.sh: no wheels in $wheels/: run scripts/gpu/wheels.sh, carry .whl" >&2; exit 2; }
    site=$work/site
    pip=("$python" -m pip --disable-pip-version-check)
    log "installing $(ls "$wheels"/*.whl | wc -l) wheels from $wheels/ into $site"
    "${pip[@]}" install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        "$wheels"/*.whl
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    log "building plait's distributions from this tree (hatchling from $wheels/, no network)"
    "${pip[@]}" wheel -q --no-index --no-deps --no-build-isolation --no-cache-dir \
        -w "$work/dist" "${dists[@]/#/$repo/}"
    "${pip[@]}" install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$work"/dist/*.whl
fi
setup_s=$(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $started }")
log "python $python; set-up took ${setup_s} s; results go to $out"
"$python" -c "import plait, plait_torch, plait_fsdp2, plait_math, torch
print('plait from', plait.__file__, '| torch', torch.__version__, '| cuda', torch.cuda.is_available())"

args=(--out "$out" --work "$work" --setup-seconds "$setup_s")
[ "$dry_run" = 1 ] && args+=(--dry-run)
set +e
"$python" scripts/gpu/check.py "${args[@]}" 2>&1 | tee "$out/gpu_check.log"
status=${PIPESTATUS[0]}
set -e
log "exit status $status; results: $out/gpu_check.json, log: $out/gpu_check.log"
exit "$status"
