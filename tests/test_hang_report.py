"""A stopped rank is reported, not waited out: which collective, which group, which step, which rank."""
import json
import re
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from syncwise.comm import ops
from syncwise.comm.watchdog import Watchdog

TIMEOUT_S = 5


def test_report_names_silent_and_lagging_ranks_from_heartbeats(tmp_path):
    now = time.time()
    (tmp_path / "rank_00001.json").write_text(json.dumps({"step": 7, "phase": "optimizer step", "time": now - 30}))
    (tmp_path / "rank_00002.json").write_text(json.dumps({"step": 6, "phase": "data loading", "time": now}))
    dog = Watchdog(TIMEOUT_S, 0, 4, tmp_path)
    try:
        dog.at(8, "forward/backward (gradient sync)")
        stuck = ops.InFlight("all_gather", None, time.monotonic() - 12)
        text = dog.report(stuck)
    finally:
        dog.close()
    assert text.startswith("all_gather on process group 'default")
    assert "of step 8" in text and "waited 12 s" in text
    assert "rank 1 (silent for 30 s, last at step 7 (optimizer step))" in text
    assert "rank 3 (no heartbeat)" in text
    assert "Not at the same place: rank 2 is at step 6 (data loading)." in text
    assert json.loads((tmp_path / "rank_00000.json").read_text())["step"] == 0  # its own beat


@pytest.mark.slow
@pytest.mark.parametrize("stopped, compress", [(1, "topk:ratio=0.01"), (0, "powersgd:rank=2")])
def test_sigstopped_rank_is_reported_within_the_timeout(tmp_path, stopped, compress):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "syncwise.cli", "train", "--run-dir", str(run), "--nproc", "2", "--steps", "100000",
         "--preset", "tiny", "--data.seq_len=32", "--train.val_interval=0", "--train.val_batches=1",
         "--ckpt.interval=0", f"--dist.timeout_s={TIMEOUT_S}", "--compress", compress],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines = []
    threading.Thread(target=lambda: lines.extend((time.monotonic(), x) for x in proc.stderr), daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (run / "metrics.jsonl").exists():
            time.sleep(0.2)
        time.sleep(1)
        children = subprocess.run(["pgrep", "-s", str(proc.pid), "-f", "spawn_main"], capture_output=True,
                                  text=True).stdout.split()
        workers = sorted(int(p) for p in children)
        assert len(workers) == 2, children
        os.kill(workers[stopped], signal.SIGSTOP)  # spawned in local-rank order
        t0 = time.monotonic()
        while time.monotonic() < t0 + TIMEOUT_S + 60 and not any("did not complete" in x for _, x in lines):
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    reports = [(t - t0, x) for t, x in lines if "did not complete" in x]
    assert reports, "".join(x for _, x in lines)[-3000:]
    after, text = reports[0]
    # The old code never reported a stopped rank under compression (> 117 s), and 31-47 s after a 15 s timeout
    # without; the goal is timeout + 5 s (benchmarks/reliability.py measures it). Lenient here: CI shares cores.
    assert after < TIMEOUT_S + 15, (after, text)
    other = 1 - stopped
    assert text.startswith(f"syncwise: rank {other}: ")
    # The stop lands wherever rank `stopped` happens to be: usually inside the compressor's collectives (its own
    # group), sometimes in the step's small all-reduce on the default group, or in the stop flag's all-reduce on the
    # preemption group (read one step late: the collectives are timed to completion since issue 24, so a waiting
    # rank can find that one stuck first). Either way the group is named.
    assert re.search(r"^syncwise: rank \d: \w+ on process group '(compress|default|preemption) \[0, 1\]' during "
                     r".* of step \d+", text), text
    assert f"Did not arrive: rank {stopped} (silent for" in text
