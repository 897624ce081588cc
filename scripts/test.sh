#!/usr/bin/env bash
# Set up (the CPU torch pinned to the build on local disk, unless a torch is already installed: a CUDA build
# stays; see scripts/setup.sh) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh requirements-dev.txt
python3 -m pytest -q "$@"
