#!/usr/bin/env bash
# Set up and run the main job: `syncwise train` on the built-in default (2 workers, stdlib corpus).
# The set-up keeps a torch that is already installed (a CUDA build stays); see scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh requirements.txt
syncwise train "$@"
