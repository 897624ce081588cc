#!/usr/bin/env bash
# Set up and run the main job: `syncwise train` on the built-in default (2 workers, stdlib corpus).
# The set-up makes the project's .venv/ (unless a virtual environment is active) and keeps a torch that is already
# installed (a CUDA build stays); see scripts/setup.sh. syncwise then runs from that environment.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh requirements.txt
source scripts/python.sh
syncwise_activate
"$SYNCWISE_PYTHON" -m syncwise.cli train "$@"
