#!/usr/bin/env bash
# Install a requirements file and syncwise (editable), keeping a torch that is already installed.
#
#   bash scripts/setup.sh requirements.txt        # what scripts/train.sh runs
#   bash scripts/setup.sh requirements-dev.txt    # what scripts/test.sh runs
#
# requirements.txt pins the CPU build `torch==2.13.0` (the wheel on this project's machines). On a GPU
# machine that would replace the user's CUDA torch, so when `import torch` already works, every requirement
# except torch is installed (`-r` includes followed) with the installed torch held by a constraint: pip keeps
# it, or stops with a resolution error (a torch older than pyproject's torch>=2.5) instead of swapping it.
# Without an importable torch, the file is installed as it is (the pinned CPU build).
#
# PYTHON (default python3) picks the interpreter; SYNCWISE_SETUP_DRY_RUN=1 prints the decision and the pip
# command (and the requirements it would install) instead of running it; SYNCWISE_SETUP_PIP_ARGS adds arguments to
# pip's (tests/test_devices.py passes "--dry-run --report FILE" to see what pip would install).
set -euo pipefail
cd "$(dirname "$0")/.."
req="${1:?usage: scripts/setup.sh REQUIREMENTS_FILE}"
py="${PYTHON:-python3}"
dry="${SYNCWISE_SETUP_DRY_RUN:-0}"
read -r -a pip_args <<< "${SYNCWISE_SETUP_PIP_ARGS:-}"

run() {
    if [ "$dry" = 1 ]; then
        echo "would run: $*"
    else
        "$@"
    fi
}

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
    run "$py" -m pip install -q ${pip_args[@]+"${pip_args[@]}"} -c "$tmp/keep-torch.txt" -r "$tmp/requirements.txt" -e .
else
    echo "setup: no torch importable by $py; installing $req as pinned (the CPU build of torch)"
    run "$py" -m pip install -q ${pip_args[@]+"${pip_args[@]}"} -r "$req" -e .
fi
