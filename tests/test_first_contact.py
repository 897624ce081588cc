"""Issue 43 row 7: the command line validates before it imports torch — a mistake is one line, at once.

Not a time assertion: each case runs in a fresh interpreter and asserts that torch was never imported (the 5–15 s
of the issue were torch's import; without it the answer takes a fraction of a second)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")
PROBE = ("import sys; from syncwise.cli import main; rc = main(sys.argv[1:]); "
         "print('rc', rc, 'torch', 'torch' in sys.modules)")


@pytest.mark.parametrize("argv, says", [
    (["train", "--bad.key=1"], "'bad.key'"),
    (["train", "--train.steps=abc"], "'train.steps'"),
    (["train", "--compress=powersdg"], "'compress.method'"),
    (["doctor", "/nonexistent/syncwise-run"], "does not exist"),
    (["report", "/nonexistent/syncwise-run"], "'RUN'"),
    (["train", "--stpes", "10"], "did you mean --steps"),
    (["train", "--parallel.tp=abc"], "'parallel.tp'"),
    (["train", "--inject-fault", "kill:rank=x"], "'inject_fault'"),  # parsed before the compressor's instance
])
def test_a_cli_mistake_is_one_line_without_importing_torch(argv, says):
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120, env=env)
    assert p.stdout.strip().endswith("rc 2 torch False"), (p.stdout, p.stderr)
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and says in err[0], p.stderr
