# Sourced by the scripts in scripts/ci/ that build a venv of their own.

# new_venv VENV PYTHON: an empty venv at VENV made by PYTHON (Debian's python3-venv installed
# first where it is missing, as on a fresh machine).
new_venv() {
    local venv=$1 python=$2
    if ! "$python" -c "import ensurepip, venv" >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    fi
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
}
