"""A live-recovery run writes its metrics.jsonl as it goes, and what its start-up line suggests works on it while it
trains; a replica group that fails for good fails the launch (docs/live-recovery.md, *The run's files*).

The launcher tests run the real launcher (torchft's lighthouse, one real torchrun agent per replica group) on small
scripts that stand in for a replica group's workers: each writes rows into its attempt's own metrics.jsonl, as the
trainer does, and waits for the test where the test must look (no timing decides the outcome). The end-to-end test
is `syncwise train --ft.replicas=2` on the tiny preset, held still by stopping its lighthouse (SIGSTOP: every
replica then waits in its next quorum, so the run cannot end while the test looks)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torchft")

from syncwise.launch import ft  # noqa: E402

WAIT_S = 180  # a loaded machine's worst case for a step to reach the file; the outcome never depends on it

REPLICA = '''
import json, os, pathlib, sys, time
run_dir, gate, fail = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3:]
r = int(os.environ["SYNCWISE_FT_REPLICA"])
if str(r) in fail:
    sys.exit(1)  # this group dies on every start (its port taken, say)
attempt = int(os.environ.get("SYNCWISE_FT_FIRST_ATTEMPT", "0")) + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
d = run_dir / "ft" / f"replica{r}.{attempt}"
d.mkdir(parents=True, exist_ok=True)
row = lambda step: json.dumps({"step": step, "step_time_s": 0.1, "loss": 5.0 - step / 10, "replica": r}) + "\\n"
with open(d / "metrics.jsonl", "a", buffering=1) as f:
    for step in (1, 2, 3):
        f.write(row(step))
    while not gate.exists():  # the test looks at the run's metrics.jsonl here
        time.sleep(0.05)
    f.write(row(4))
(d / "summary.json").write_text(json.dumps({"steps": 4, "final_loss": 4.6, "live_recovery": {"replica": r}}))
'''


def _rows(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def _wait_for(predicate, what: str, alive=lambda: True):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and alive():
        if predicate():
            return
        time.sleep(0.05)
    pytest.fail(f"{what} did not happen (within {WAIT_S} s, while the run was alive)")


def test_the_launcher_appends_each_step_while_the_replica_groups_run(tmp_path):
    """Both groups logged steps 1-3 and wait: the run's metrics.jsonl already holds them, one row per step with its
    attempt, while run_replicas still waits for the groups (before: no file until the merge at the end); step 4,
    logged as the groups end, is in it when run_replicas returns; merge_metrics then keeps one row per step."""
    script, gate, run_dir = tmp_path / "replica.py", tmp_path / "gate", tmp_path / "run"
    script.write_text(REPLICA)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.setdefault(
        "codes", ft.run_replicas([str(script), str(run_dir), str(gate)], run_dir, replicas=2, nproc=1, restarts=0)))
    runner.start()
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait_for(lambda: len(_rows(metrics)) >= 3, "rows in the run's metrics.jsonl", runner.is_alive)
        mid_run = _rows(metrics)
        assert runner.is_alive() and not (run_dir / "summary.json").exists()  # the run is still going
        assert [r["step"] for r in mid_run] == [1, 2, 3] and {r["attempt"] for r in mid_run} == {0}
    finally:
        gate.touch()
        runner.join(timeout=WAIT_S)
    assert result["codes"] == [0, 0]
    assert [r["step"] for r in _rows(metrics)] == [1, 2, 3, 4]  # the last rows, copied as the groups ended
    summary = ft.merge_metrics(run_dir, 4)
    assert [r["step"] for r in _rows(metrics)] == [1, 2, 3, 4] and summary["live_recovery"]["steps_missing"] == []
    assert not list(run_dir.glob("*.merging"))


def test_live_rows_keep_a_resumed_runs_earlier_rows_and_skip_damaged_lines(tmp_path):
    """LiveRows on a run directory that already holds rows (an earlier launch of a resumed run): those stay as they
    are and only later steps are appended; a damaged line in an attempt's file is skipped, not the rows after it;
    a line still being written waits for its end."""
    run_dir = tmp_path / "run"
    (run_dir / "ft" / "replica0.1").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "attempt": 0}) + "\n" for s in (1, 2)))
    own = run_dir / "ft" / "replica0.1" / "metrics.jsonl"
    own.write_text(json.dumps({"step": 2}) + "\n" + '{"step": 3, "lo\n' + json.dumps({"step": 4}) + "\n"
                   + '{"step": 5')
    rows = ft.LiveRows(run_dir)
    assert rows.poll() == 1
    with open(own, "a") as f:
        f.write("}\n")
    assert rows.poll() == 1
    rows.close()
    got = _rows(run_dir / "metrics.jsonl")
    assert [(r["step"], r["attempt"]) for r in got] == [(1, 0), (2, 0), (4, 1), (5, 1)]


def test_a_replica_group_that_dies_on_every_start_fails_the_launch_and_is_named_in_summary(tmp_path):
    """Replica 1 exits 1 on its start and its one restart; replica 0 trains every step. The launch is no silent
    success: one line names replica 1 and its exit code, the CLI's exit code is not 0 (SyncwiseError: 2), and
    summary.json on disk holds failed_replicas, the exit codes and the steps its shard skipped."""
    from syncwise.errors import SyncwiseError
    from syncwise.launch.run import Job, Live, Worker, run_training

    script, gate, run_dir = tmp_path / "replica.py", tmp_path / "gate", tmp_path / "run"
    script.write_text(REPLICA)
    gate.touch()
    job = Job(nproc=1, live=Live(replicas=2, restarts=1), run_dir=str(run_dir))
    with pytest.raises(SyncwiseError) as e:
        run_training(job, Worker(argv=[str(script), str(run_dir), str(gate), "1"]), 4)
    text = str(e.value)
    assert "replica1 (exit code 1" in text and "failed for good" in text and len(text.splitlines()) == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["live_recovery"]["failed_replicas"] == {"replica1": 1}
    assert summary["live_recovery"]["exit_codes"] == [0, 1]
    assert summary["live_recovery"]["data_skipped_by_replica"] == {"replica1": ["1-4"]}
    assert [r["step"] for r in _rows(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    assert getattr(e.value, "exit_code", 2) != 0


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow
def test_a_live_recovery_run_has_rows_and_answers_its_start_up_hint_while_it_trains(tmp_path):
    """`syncwise train --ft.replicas=2`: once both replica groups trained a step, the test stops the lighthouse
    (SIGSTOP), so no replica gets past its next quorum and the run cannot end while the test looks. Then the run's
    metrics.jsonl holds rows (before: none until the end), and each command of the start-up line works on the live
    run: `syncwise report RUN_DIR` (steps so far), `syncwise doctor --follow RUN_DIR` (a diagnosis line; it ends
    by itself when the run finishes). After SIGCONT the run ends normally with one row per step."""
    steps = 12
    run_dir = tmp_path / "ft"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "syncwise.cli", "train", "--run-dir", str(run_dir), "--preset", "tiny", "--nproc", "1",
         "--steps", str(steps), "--data.seq_len=32", "--train.val_interval=0", "--train.val_batches=1",
         "--ckpt.interval=0", "--ft.replicas=2", "--ft.quorum_timeout_s=600", "--ft.timeout_s=60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    hint = proc.stdout.readline()
    output = [hint]
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    lighthouse = None
    follow = None
    try:
        # the hint names tail -f, doctor --follow and report on the run directory
        assert hint.startswith(f"run directory: {run_dir}") and f"syncwise doctor --follow {run_dir}" in hint
        assert f"syncwise report {run_dir}" in hint and f"tail -f {run_dir / 'metrics.jsonl'}" in hint

        def both_trained() -> bool:
            return all(_rows(d / "metrics.jsonl") for d in (run_dir / "ft").glob("replica*.0")) and \
                len(list((run_dir / "ft").glob("replica*.0"))) == 2
        _wait_for(both_trained, "a step trained by both replica groups", lambda: proc.poll() is None)
        lighthouse = next(p for p in _children(proc.pid) if "torchft_lighthouse" in _cmdline(p))
        os.kill(lighthouse, signal.SIGSTOP)  # every replica now waits in its next quorum: the run cannot end
        metrics = run_dir / "metrics.jsonl"
        _wait_for(lambda: _rows(metrics), "a row in the run's metrics.jsonl", lambda: proc.poll() is None)
        seen = _rows(metrics)
        assert proc.poll() is None and not (run_dir / "summary.json").exists()  # still running
        assert 0 < len(seen) < steps and [r["step"] for r in seen] == list(range(1, len(seen) + 1))

        report = subprocess.run([sys.executable, "-m", "syncwise.cli", "report", str(run_dir), "--out",
                                 str(tmp_path / "report")], capture_output=True, text=True, timeout=WAIT_S)
        assert report.returncode == 0, report.stderr
        table = report.stdout.splitlines()
        assert table[0].split()[:2] == ["run", "steps"] and table[1].split()[0] == run_dir.name

        follow = subprocess.Popen([sys.executable, "-m", "syncwise.cli", "doctor", "--follow", str(run_dir),
                                   "--interval", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first = follow.stdout.readline()  # its first look at the live run
        assert first.startswith("[") and " step " in first and "efficiency" in first, first
        assert proc.poll() is None and not (run_dir / "summary.json").exists()
    except BaseException:
        for p in (follow, proc):
            if p is not None and p.poll() is None:
                p.kill()
        raise
    finally:
        if lighthouse is not None:
            os.kill(lighthouse, signal.SIGCONT)
    assert proc.wait(timeout=600) == 0, "".join(output)[-3000:]
    assert follow.wait(timeout=WAIT_S) == 0  # doctor --follow ended by itself: the run finished
    rows = _rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert json.loads((run_dir / "summary.json").read_text())["live_recovery"]["steps_missing"] == []
