#!/usr/bin/env bash
# Set up (the CPU torch pinned to the build on local disk, unless a torch is already installed: a CUDA build
# stays; see scripts/setup.sh) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh requirements-dev.txt
# SYNCWISE_TEST_SLURM=1: also set up a one-machine Slurm (scripts/slurm-local.sh: apt-get install slurm-wlm munge,
# slurmctld + slurmd) so tests/test_launch_slurm.py submits real jobs. Opt-in: ~15 s to install and start plus 35-50 s
# of test on 2 cores (docs/launch.md). Best-effort: a machine without apt or root only skips that test, with the reason.
if [ "${SYNCWISE_TEST_SLURM:-0}" = 1 ]; then
    timeout 300 bash scripts/slurm-local.sh || echo "test.sh: no local Slurm (see above); the real-Slurm test will skip" >&2
fi
python3 -m pytest -q "$@"
