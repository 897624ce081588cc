#!/usr/bin/env bash
# Make (or reuse) the project's virtual environment, then install a requirements file and syncwise (editable) into
# it, keeping a torch that is already installed.
#
#   bash scripts/setup.sh requirements.txt        # what scripts/train.sh runs
#   bash scripts/setup.sh requirements-dev.txt    # what scripts/test.sh runs
#
# Where it installs (scripts/python.sh): PYTHON if set; else the active virtual environment (VIRTUAL_ENV); else the
# project's .venv/ (SYNCWISE_VENV), created here with `python3 -m venv`. A distribution's own Python refuses
# `pip install` outside a venv (Debian/Ubuntu: "externally-managed-environment"), hence the venv. On Debian/Ubuntu
# `python3 -m venv` needs the python3-venv package: installed here when run as root with apt-get, otherwise named in
# one line. When `python3` already imports a torch, the venv is made with --system-site-packages: that torch (a CUDA
# build, GBs, matched to the machine's driver, often from PyTorch's own index) stays visible and is kept below,
# instead of a venv that would install requirements.txt's CPU pin over it. The venv's own site-packages come first,
# so what pip installs there wins over the system's copies.
#
# requirements.txt pins the CPU build `torch==2.13.0` (the wheel on this project's machines). On a GPU
# machine that would replace the user's CUDA torch, so when `import torch` already works, every requirement
# except torch is installed (`-r` includes followed) with the installed torch held by a constraint: pip keeps
# it, or stops with a resolution error (a torch older than pyproject's torch>=2.5) instead of swapping it.
# Without an importable torch, the file is installed as it is (the pinned CPU build).
#
# SYNCWISE_SETUP_DRY_RUN=1 prints the decision and the pip command (and the requirements it would install) instead
# of running it (the venv is still made); SYNCWISE_SETUP_PIP_ARGS adds arguments to pip's (tests/test_devices.py
# passes "--dry-run --report FILE" to see what pip would install); SYNCWISE_BASE_PYTHON (default python3) is the Python
# that makes the venv; SYNCWISE_SETUP_APT=0: never apt-get install python3-venv, only say so.
set -euo pipefail
cd "$(dirname "$0")/.."
req="${1:?usage: scripts/setup.sh REQUIREMENTS_FILE}"
dry="${SYNCWISE_SETUP_DRY_RUN:-0}"
read -r -a pip_args <<< "${SYNCWISE_SETUP_PIP_ARGS:-}"
source scripts/python.sh
py="$SYNCWISE_PYTHON"

run() {
    if [ "$dry" = 1 ]; then
        echo "would run: $*"
    else
        "$@"
    fi
}

# pip quiet (its "already satisfied" lines bury what matters), with a line before and after: the first install
# downloads torch's CPU wheel and the rest (~1-2 min on a fresh machine), a later one takes seconds.
pip_install() {
    local start=$SECONDS
    echo "setup: pip is installing $req and syncwise (first time ~1-2 min: torch's CPU wheel is ~200 MB; then seconds) ..."
    run "$py" -m pip install -q ${pip_args[@]+"${pip_args[@]}"} "$@"
    [ "$dry" = 1 ] || echo "setup: installed in $((SECONDS - start)) s"
}

if [ "$SYNCWISE_MAKE_VENV" = 1 ] && ! "$py" -m pip --version > /dev/null 2>&1; then
    base="${SYNCWISE_BASE_PYTHON:-python3}"
    if ! command -v "$base" > /dev/null; then
        echo "setup: no $base on PATH: install Python >= 3.10 (Debian/Ubuntu: apt-get install -y python3 python3-venv)" >&2
        exit 1
    fi
    if ! "$base" -c 'import ensurepip, venv' 2> /dev/null; then
        if [ "${SYNCWISE_SETUP_APT:-1}" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
            echo "setup: $base cannot make a virtual environment (no ensurepip): apt-get install -y python3-venv"
            apt-get install -y -q python3-venv > /dev/null 2>&1 \
                || { apt-get update -q > /dev/null 2>&1 && apt-get install -y -q python3-venv > /dev/null 2>&1; } || true
        fi
        if ! "$base" -c 'import ensurepip, venv' 2> /dev/null; then
            echo "setup: $base cannot make a virtual environment (no ensurepip): install python3-venv" \
                 "(sudo apt-get install -y python3-venv), or activate a virtual environment of your own and run again" >&2
            exit 1
        fi
    fi
    site=()
    if base_torch=$("$base" -c 'import importlib.metadata as m, torch; print(m.version("torch"))' 2> /dev/null); then
        site=(--system-site-packages)
        echo "setup: making $SYNCWISE_VENV with --system-site-packages ($base's torch $base_torch stays in use)"
    else
        echo "setup: making $SYNCWISE_VENV (a virtual environment; $base imports no torch)"
    fi
    "$base" -m venv ${site[@]+"${site[@]}"} "$SYNCWISE_VENV"
fi

# The installed torch's version as pip sees it (its metadata), if torch imports.
if torch_version=$("$py" -c 'import importlib.metadata as m, torch; print(m.version("torch"))' 2>/dev/null) \
        && [ -n "$torch_version" ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    "$py" - "$req" > "$tmp/requirements.txt" <<'PY'
import re
import sys
from pathlib import Path

TORCH = re.compile(r"^torch\s*(\[[^\]]*\])?\s*([<>=!~;@]|$)", re.IGNORECASE)  # torch, not torchvision


def lines(path: Path):
    for raw in path.read_text().splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()
        if not line:
            continue
        include = re.match(r"^(-r|--requirement)(\s+|=)?(\S+)$", line)
        if include:
            yield from lines(path.parent / include.group(3))
        elif not TORCH.match(line):
            yield line


print("\n".join(lines(Path(sys.argv[1]))))
PY
    echo "torch==$torch_version" > "$tmp/keep-torch.txt"
    echo "setup: keeping the installed torch $torch_version (not installing $req's torch pin)"
    if [ "$dry" = 1 ]; then
        echo "requirements without torch:" $(cat "$tmp/requirements.txt")
    fi
    pip_install -c "$tmp/keep-torch.txt" -r "$tmp/requirements.txt" -e .
else
    echo "setup: no torch importable by $py; installing $req as pinned (the CPU build of torch)"
    pip_install -r "$req" -e .
fi
