"""A run directory belongs to one run; finished runs, Ctrl-C and full disks end with a message, not a traceback."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import tmpfs

from syncwise.cli import main
from syncwise.errors import SyncwiseError
from syncwise.rundir import RunDirLock

TINY = ["--preset", "tiny", "--data.seq_len=32", "--train.val_interval=0", "--train.val_batches=1",
        "--ckpt.interval=2"]


def _syncwise(*args, **popen):
    return subprocess.Popen([sys.executable, "-m", "syncwise.cli", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_lock_refuses_a_second_owner_and_names_the_first(tmp_path, capsys):
    with RunDirLock(tmp_path / "run"):
        with pytest.raises(SyncwiseError, match=rf"in use by another syncwise run \(pid {os.getpid()} on"):
            RunDirLock(tmp_path / "run").acquire()
        assert main(["train", "--check", "--run-dir", str(tmp_path / "run"), "--preset", "tiny"]) == 2
        assert "in use by another syncwise run" in capsys.readouterr().err
    RunDirLock(tmp_path / "run").acquire().release()  # released with its owner


@pytest.mark.slow
def test_two_runs_started_together_into_one_directory(tmp_path):
    run = tmp_path / "run"
    args = ["--run-dir", str(run), "--nproc", "1", "--steps", "150", *TINY]
    first = _syncwise(*args)
    time.sleep(0.3)
    second = _syncwise(*args)
    outs = [p.communicate(timeout=240) for p in (first, second)]
    codes = sorted([first.returncode, second.returncode])
    assert codes == [0, 2], outs
    loser_err = outs[[first.returncode, second.returncode].index(2)][1]
    # Usually refused by the lock; on a loaded machine the second may start only after the first finished,
    # and is then refused because the directory holds a run. Either way nothing of the first is touched.
    assert ("in use by another syncwise run" in loser_err or "already holds a run" in loser_err) \
        and "Traceback" not in loser_err
    assert [r["step"] for r in _rows(run)] == list(range(1, 151))  # the survivor's run, whole
    assert json.loads((run / "summary.json").read_text())["steps"] == 150


def test_what_a_start_that_died_at_start_up_left_is_set_aside_and_the_run_starts(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "rank0.log").write_text("Traceback: the reason it died\n")
    (run / "config.json").write_text('{"model": {"preset": "mine"}}\n')
    (run / "metrics.jsonl").write_text("")  # opened, no row: no step finished
    assert main(["train", "--check", "--run-dir", str(run), "--nproc", "1", "--steps", "2", *TINY]) == 0
    assert "# note: " + f"{run} holds only what a start that never finished a step left (config.json, logs, " \
        "metrics.jsonl)" in capsys.readouterr().out
    assert main(["train", "--run-dir", str(run), "--nproc", "1", "--steps", "2", *TINY]) == 0
    err = capsys.readouterr().err
    (aside,) = (run / "failed-starts").iterdir()
    assert f"syncwise: {run} held only what a start that never finished a step left (config.json, logs, " \
        f"metrics.jsonl); moved it to {aside} (nothing deleted), starting afresh" in err.splitlines(), err
    assert (aside / "config.json").read_text() == '{"model": {"preset": "mine"}}\n'  # kept, byte for byte
    assert (aside / "logs" / "rank0.log").read_text() == "Traceback: the reason it died\n"
    assert [r["step"] for r in _rows(run)] == [1, 2]
    assert json.loads((run / "config.json").read_text())["model"]["preset"] == "tiny"


def test_a_directory_with_rows_checkpoints_or_files_of_its_own_is_still_refused(tmp_path, capsys):
    for name, make in [("rows", lambda r: (r / "metrics.jsonl").write_text('{"step": 1}\n')),
                       ("checkpoint", lambda r: (r / "checkpoints" / "step_00000002").mkdir(parents=True)),
                       ("rank rows", lambda r: ((r / "ranks").mkdir(), (r / "ranks" / "rank1.jsonl").write_text(
                           '{"step": 1}\n'))),
                       ("own file", lambda r: (r / "notes.txt").write_text("mine\n"))]:
        run = tmp_path / name
        run.mkdir()
        (run / "config.json").write_text("{}\n")
        make(run)
        before = sorted(p.relative_to(run) for p in run.rglob("*"))
        assert main(["train", "--run-dir", str(run), "--nproc", "1", "--steps", "2", *TINY]) == 2, name
        assert "already holds a run" in capsys.readouterr().err, name
        assert sorted(p.relative_to(run) for p in run.rglob("*") if p.name != ".syncwise.lock") == before, name


def test_a_build_that_crashes_leaves_nothing_that_blocks_the_rerun(tmp_path, capsys, monkeypatch):
    """A real start that dies before its first step (a Hugging Face model whose weights file is damaged: it passes
    --check, and transformers fails to read it while the workers build the model), then the fixed rerun into the
    same --run-dir; then a third start over that finished run is refused."""
    pytest.importorskip("transformers")
    folder, run = tmp_path / "llama", tmp_path / "run"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
        "max_position_embeddings": 64}))
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    corpus = tmp_path / "notes.txt"
    corpus.write_text("a line of the user's own notes\n" * 400)
    monkeypatch.chdir(tmp_path)
    args = ["train", "--run-dir", str(run), "--nproc", "1", "--model", f"hf:{folder}", "--data.corpus",
            str(corpus), "--data.seq_len=32", "--steps", "2", "--train.val_interval=0", "--train.val_batches=1"]
    with pytest.raises(Exception, match="header"):  # transformers' own error, raised while building the model
        main(args)
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip()
    capsys.readouterr()
    (folder / "model.safetensors").unlink()  # the fix: no weights file, the model starts from its config
    assert main(args) == 0
    err = capsys.readouterr().err
    (aside,) = (run / "failed-starts").iterdir()
    assert f"moved it to {aside} (nothing deleted), starting afresh" in err, err
    assert json.loads((aside / "config.json").read_text())["model"]["preset"] == f"hf:{folder}"
    assert [r["step"] for r in _rows(run)] == [1, 2]
    rows = (run / "metrics.jsonl").read_text()
    assert main(args) == 2  # a run that finished steps is never set aside
    assert "already holds a run" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == rows
    assert len(list((run / "failed-starts").iterdir())) == 1


def test_resume_auto_on_a_finished_run_says_so_and_keeps_its_files(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", "--run-dir", str(run), "--nproc", "1", *TINY]
    assert main([*args, "--steps", "4"]) == 0
    summary = (run / "summary.json").read_text()
    capsys.readouterr()
    assert main([*args, "--steps", "4", "--resume", "auto"]) == 0
    assert "already finished at step 4" in capsys.readouterr().err
    assert (run / "summary.json").read_text() == summary
    # A larger --steps continues the same run.
    assert main([*args, "--steps", "6", "--resume", "auto"]) == 0
    assert [r["step"] for r in _rows(run)] == list(range(1, 7))
    assert json.loads((run / "summary.json").read_text())["final_loss"] is not None


def _wait_for_rows(proc, run, n, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if (run / "metrics.jsonl").exists() and len(_rows(run)) >= n:
            return
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()


def test_ctrl_c_stops_after_the_step_saves_it_and_says_how_to_resume(tmp_path):
    """Ctrl-C as SIGTERM: the workers (under torchrun's agent, which forwards it) finish the step and save it."""
    run = tmp_path / "run"
    proc = _syncwise("--run-dir", str(run), "--nproc", "2", "--steps", "100000", *TINY, "--ckpt.interval=1000",
                     start_new_session=True)
    _wait_for_rows(proc, run, 5)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends to the whole foreground group
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "SignalException" not in err
    assert "press Ctrl-C again to stop at once" in err
    line = next(x for x in err.splitlines() if "stopped by Ctrl-C (SIGINT)" in x)
    last = max(r["step"] for r in _rows(run))
    assert f"after step {last}; checkpoint of step {last} saved" in line  # nothing trained is lost
    said = [x for x in (out + err).splitlines() if x.startswith("syncwise:") and f"after step {last}" in x]
    assert len(said) == 1, said  # said once (by the launcher), not by a worker too
    assert (run / "checkpoints" / f"step_{last:08d}").is_dir()
    assert f"syncwise train --run-dir {run} --resume auto" in line


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    run = tmp_path / "run"
    # From step 4 on every batch takes 3 s to arrive: the first Ctrl-C's stop-and-save cannot finish before the second.
    proc = _syncwise("--run-dir", str(run), "--nproc", "2", "--steps", "100000", *TINY,
                     "--inject-fault", "slowdata:ms=3000,step=4", start_new_session=True)
    _wait_for_rows(proc, run, 3)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(1.5)  # a second Ctrl-C, not the terminal's and the agent's copies of the first
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "SignalException" not in err
    line = next(x for x in err.splitlines() if "interrupted (SIGINT)" in x)
    assert "last checkpoint step 2" in line and f"syncwise train --run-dir {run} --resume auto" in line
    assert not (run / "preempted.json").exists()  # stopped at once: the first Ctrl-C's save never happened
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000002"]


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs: a tiny run fills it within a few checkpoints (needs root, as CI and the lab have)."""
    with tmpfs(tmp_path / "disk", "3m") as mnt:
        yield mnt


def test_full_disk_ends_with_syncwise_message_and_keeps_saved_checkpoints(small_disk):
    run = small_disk / "run"
    proc = _syncwise("--run-dir", str(run), "--nproc", "2", "--steps", "60", *TINY)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 2, err
    assert "Traceback" not in err and "JSONDecodeError: Expecting" not in err.split("could not read")[0]
    # torch.save may say "No space left on device" or only "unexpected pos ..."; the hint names the cause
    assert "saving the checkpoint of step" in err and "is full: 0.0 MiB free" in err
    from syncwise.checkpoint.storage import latest_valid
    assert latest_valid(run / "checkpoints") is not None  # what was saved before the disk filled is intact


def test_resume_continues_with_the_runs_saved_configuration(tmp_path, capsys):
    run = tmp_path / "run"
    base = ["train", "--run-dir", str(run), "--nproc", "1", *TINY]
    assert main([*base, "--steps", "4", "--compress", "powersgd:rank=2", "--train.lr=0.004"]) == 0
    # No --compress / --train.lr: the run's own settings continue (its PowerSGD state is in the checkpoints).
    assert main([*base, "--steps", "6", "--resume", "auto"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["compressor"] == "powersgd:rank=2" and summary["steps"] == 6
    saved = json.loads((run / "config.json").read_text())
    assert saved["compress"]["method"] == "powersgd:rank=2" and saved["train"]["lr"] == 0.004
    capsys.readouterr()
    # Changing the compressor on resume would drop its state: refused, naming the setting.
    assert main([*base, "--steps", "8", "--resume", "auto", "--compress", "none"]) == 2
    err = capsys.readouterr().err
    assert "compress.method='powersgd:rank=2', not 'none'" in err and "Traceback" not in err


def test_a_resumed_runs_summary_covers_every_step_of_the_run(tmp_path, capsys):
    """20 steps, then --resume auto --steps 30: summary.json's step time and bytes/step are those of steps 1-30."""
    run = tmp_path / "run"
    args = ["train", "--run-dir", str(run), "--nproc", "2", *TINY, "--ckpt.interval=0"]
    assert main([*args, "--steps", "20"]) == 0
    assert main([*args, "--steps", "30", "--resume", "auto"]) == 0
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(1, 31))
    summary = json.loads((run / "summary.json").read_text())
    steady = rows[3:]  # the first tenth of the run's steps is warm-up, as in any summary
    assert summary["steps"] == 30
    assert summary["mean_step_time_s"] == pytest.approx(sum(r["step_time_s"] for r in steady) / len(steady))
    assert summary["comm_bytes_per_step"] == pytest.approx(sum(r["comm_bytes"] for r in steady) / len(steady))


def test_resume_given_a_run_directory_points_to_run_dir_and_resume_auto(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), "--nproc", "1", "--steps", "2", *TINY]) == 0
    for given in (run, run / "checkpoints"):
        p = subprocess.run([sys.executable, "-m", "syncwise.cli", "train", "--resume", str(given), "--run-dir",
                            str(tmp_path / "new"), *TINY], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2
        err = p.stderr.strip()
        assert len(err.splitlines()) == 1 and "'resume'" in err and "manifest.json is missing" not in err, err
        assert f"to continue that run: --run-dir {run} --resume auto" in err
        assert not (tmp_path / "new").exists()
