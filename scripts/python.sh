# Sourced by scripts/setup.sh, train.sh and test.sh (from the repository root): which Python the project runs under.
#
#   PYTHON set          that interpreter, as it is (no virtual environment is made; tests/test_devices.py uses this)
#   VIRTUAL_ENV set     the active virtual environment's python (yours: nothing is created)
#   otherwise           the project's own virtual environment, SYNCWISE_VENV (default .venv/, gitignored), which
#                       scripts/setup.sh creates; train.sh and test.sh then run syncwise / pytest from it.
#
# Sets SYNCWISE_PYTHON and SYNCWISE_MAKE_VENV (1: the project venv is ours to create), and syncwise_activate puts the
# chosen environment's bin/ first on PATH (so `syncwise` and the workers' `python` are the environment's).
if [ -n "${PYTHON:-}" ]; then
    SYNCWISE_PYTHON="$PYTHON"
    SYNCWISE_MAKE_VENV=0
elif [ -n "${VIRTUAL_ENV:-}" ]; then
    SYNCWISE_PYTHON="$VIRTUAL_ENV/bin/python"
    SYNCWISE_MAKE_VENV=0
else
    SYNCWISE_VENV="$(mkdir -p "${SYNCWISE_VENV:-.venv}" && cd "${SYNCWISE_VENV:-.venv}" && pwd)"
    SYNCWISE_PYTHON="$SYNCWISE_VENV/bin/python"
    SYNCWISE_MAKE_VENV=1
fi

syncwise_activate() {
    if [ "$SYNCWISE_MAKE_VENV" = 1 ]; then
        export VIRTUAL_ENV="$SYNCWISE_VENV"
        export PATH="$SYNCWISE_VENV/bin:$PATH"
    fi
}
