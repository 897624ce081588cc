"""A mistake on the command line is told before torch is imported (the import alone is seconds on 2 cores):
each case exits 2 with one line naming the field, and the process never loaded torch.
(`benchmarks/cli_latency.py` times the same cases.)"""
from __future__ import annotations

import subprocess
import sys

import pytest

CASES = [
    (["train", "--steps=-1"], "train.steps"),
    (["train", "--compress", "bogus"], "compress.method"),
    (["train", "--stpes", "10"], "did you mean --steps"),
    (["train", "--parallel.tp=abc"], "parallel.tp"),
    (["train", "--inject-fault", "kill:rank=x"], "inject_fault"),  # parsed before the compressor's instance
    (["doctor", "/nonexistent/syncwise-run"], "/nonexistent/syncwise-run"),
    (["report", "/nonexistent/syncwise-run"], "/nonexistent/syncwise-run"),
]
PROBE = ("import sys\nfrom syncwise.cli import main\nrc = main(sys.argv[1:])\n"
         "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', rc)")


@pytest.mark.parametrize("argv,named", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_command_line_mistake_is_one_line_without_torch(argv, named):
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.stdout.split() == ["NO-TORCH", "2"], (out.stdout, out.stderr)
    assert len(lines) == 1 and named in lines[0], lines
