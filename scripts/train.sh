#!/usr/bin/env bash
# Set up and run the main job: `syncwise train` on the built-in default (2 workers, stdlib corpus).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -r requirements.txt -e .
syncwise train "$@"
