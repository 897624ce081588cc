#!/usr/bin/env bash
# Set up (the project's .venv/ unless a virtual environment is active; the CPU torch pinned to the build on local
# disk, unless a torch is already installed: a CUDA build stays; see scripts/setup.sh) and run the test suite in it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh requirements-dev.txt
source scripts/python.sh
syncwise_activate
# A one-machine Slurm (scripts/slurm-local.sh: apt-get install slurm-wlm munge, slurmctld + slurmd) so that
# tests/test_launch_slurm.py submits real jobs: ~15 s to install and start plus ~36 s of test on 2 cores
# (docs/launch.md). Best-effort: without apt or root that test skips, with the reason. SYNCWISE_TEST_SLURM=0 skips it.
if [ "${SYNCWISE_TEST_SLURM:-1}" = 1 ]; then
    if timeout 300 bash scripts/slurm-local.sh; then
        export SYNCWISE_TEST_SLURM=1
    else
        export SYNCWISE_TEST_SLURM=0
        echo "test.sh: no local Slurm (see above); the real-Slurm test will skip" >&2
    fi
fi
# Two pytest workers (pytest-xdist): many tests wait (on a timeout, a slow link, a subprocess's start) or run one
# single-threaded process, so a second worker fills the other core. Tests that share a machine-wide resource (the
# network lab, the local Slurm) take turns (tests/conftest.py: a file lock). SYNCWISE_TEST_WORKERS=0: serial.
"$SYNCWISE_PYTHON" -m pytest -q -n "${SYNCWISE_TEST_WORKERS:-2}" --durations=25 "$@"
