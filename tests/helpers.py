"""Pieces several test modules share: whether the network lab can run here, a checkpointer whose saves stay in
flight until the test lets them finish, a model that fails at its third call, and a live-recovery run's rows and
final replica digests."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess

import pytest
from torch import nn

from syncwise.checkpoint import SmartCheckpointer


class FailsAtStep3(nn.Linear):
    """A user's model whose third forward raises: a run that fails after its first rows were logged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def forward(self, inputs):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("the user's bug at step 3")
        return super().forward(inputs)


def lab_unavailable() -> str | None:
    """Why the network lab cannot run on this machine (a skip reason), or None if it can."""
    if os.geteuid() != 0:
        return "the network lab needs root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` is not usable here"
    return None


@contextlib.contextmanager
def tmpfs(path, size: str):
    """A tmpfs of ``size`` (mount's spelling: '256k', '3m') mounted at ``path`` for the block's length: a disk that
    really fills up. Skips the test where mounting needs a root this process does not have."""
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


class GatedCheckpointer(SmartCheckpointer):
    """Publishes a save only once ``gate`` is set, so the test decides how long a save stays in flight."""

    def __init__(self, *args, gate, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = gate

    def _finish(self, *args, **kwargs):
        self.gate.wait(timeout=60)
        return super()._finish(*args, **kwargs)


def metrics_rows(run_dir) -> list[dict]:
    """A run's ``metrics.jsonl`` rows."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_replica_digests(live_summary: dict) -> dict:
    """Each replica's parameter digest at the end of its last attempt that trained (``summary.live_recovery``: an
    attempt started after the run had finished trains nothing and writes no summary)."""
    last: dict = {}
    for a in live_summary["attempts"]:
        if a["replica"] not in last or a["attempt"] > last[a["replica"]]["attempt"]:
            last[a["replica"]] = a
    return {r: a["param_digest"] for r, a in last.items()}
