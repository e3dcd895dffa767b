#!/usr/bin/env bash
# Install the Docker engine, start it, and build plait's sandbox image.
#
# Idempotent; for a fresh Debian 12 machine as root (CI's `.ci/run` calls it before the
# `docker`-marked tests). Each step is skipped when its result is already there.
#
#   bash scripts/ci/docker.sh                       # uses ${VENV:-.venv}/bin/python
#   PYTHON=/path/to/python bash scripts/ci/docker.sh
#
# That Python must have plait-docker installed (it runs `python -m plait_docker build-image`);
# without it, the engine is still installed and started and the image step says what to do.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
venv=${VENV:-.venv}
[[ "$venv" = /* ]] || venv="$repo/$venv"
PYTHON=${PYTHON:-$([ -x "$venv/bin/python" ] && echo "$venv/bin/python" || echo python3)}
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/plait-dockerd.log}
ENGINE_WAIT_S=${ENGINE_WAIT_S:-60}

log() { echo "[docker.sh] $*"; }

engine_answers() { timeout 10 docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

# 1. packages: the engine, and debootstrap for the image's root file system
missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# 2. the engine: start dockerd in the background unless one already answers
if engine_answers; then
    log "engine already running ($(docker version --format '{{.Server.Version}}'))"
else
    # a dockerd that died leaves its pid file behind, and a new one refuses to start beside it
    for pidfile in /var/run/docker.pid /run/docker/containerd/containerd.pid; do
        if [ -f "$pidfile" ] && ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then rm -f "$pidfile"; fi
    done
    log "starting dockerd (log: $DOCKERD_LOG)"
    nohup dockerd >>"$DOCKERD_LOG" 2>&1 </dev/null &
    for ((waited = 0; ; waited++)); do
        if engine_answers; then break; fi
        if ((waited >= ENGINE_WAIT_S)); then
            log "dockerd did not answer within ${ENGINE_WAIT_S}s; last lines of $DOCKERD_LOG:"
            tail -n 20 "$DOCKERD_LOG" >&2
            exit 1
        fi
        sleep 1
    done
    log "engine up after ${waited}s ($(docker version --format '{{.Server.Version}}'))"
fi

# 3. the sandbox image (build-image is itself idempotent: a present tag is not rebuilt)
if ! "$PYTHON" -c "import plait_docker" 2>/dev/null; then
    log "$PYTHON cannot import plait_docker; install envs/docker (pip install -e envs/docker) and set PYTHON"
    exit 1
fi
"$PYTHON" -m plait_docker build-image
