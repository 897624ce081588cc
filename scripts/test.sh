#!/usr/bin/env bash
# Set up (CPU torch pinned to the build on local disk) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -r requirements-dev.txt -e .
python3 -m pytest -q "$@"
