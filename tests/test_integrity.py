"""Issue 42: nothing a run wrote is lost — checkpoints published by a paused writer, metrics.jsonl repair on resume."""
from __future__ import annotations

import json
import logging

import torch
from test_checkpoint import _model, _train_state

from syncwise.checkpoint import SmartCheckpointer, storage


def _publish(ck, ts, step):
    ck.save(step, ts)
    ck.wait()


def test_a_paused_writer_never_hides_newer_checkpoints(tmp_path, caplog):
    """Live recovery (shared directory): writer A decided to save step 5 and was paused; writer B published 10 and
    15 meanwhile. A's save of 5 is abandoned and nothing newer is set aside; --resume auto finds 15."""
    model = _model()
    ts, *_ = _train_state(model)
    a = SmartCheckpointer(tmp_path, interval=5, async_save=False, shared=True)
    b = SmartCheckpointer(tmp_path, interval=5, async_save=False, shared=True)
    _publish(b, ts, 10)
    _publish(b, ts, 15)
    with caplog.at_level(logging.WARNING, logger="syncwise.checkpoint"):
        _publish(a, ts, 5)  # A continues: its save of step 5 finishes now
    a.close()
    b.close()
    assert [p.name for p in storage.published_checkpoints(tmp_path)] == ["step_00000015", "step_00000010"]
    assert not list(tmp_path.glob("*.abandoned")) and not list(tmp_path.glob("*.partial"))
    assert "abandoning the checkpoint of step 5" in caplog.text
    assert storage.latest_valid(tmp_path).name == "step_00000015"


def test_a_writer_not_shared_still_abandons_a_save_older_than_one_published_meanwhile(tmp_path):
    """Without ``shared`` too: a later step published since this checkpointer started is never renamed aside."""
    model = _model()
    ts, *_ = _train_state(model)
    a = SmartCheckpointer(tmp_path, interval=5, async_save=False)
    b = SmartCheckpointer(tmp_path, interval=5, async_save=False)
    _publish(b, ts, 10)
    _publish(a, ts, 5)
    a.close()
    b.close()
    assert [p.name for p in storage.published_checkpoints(tmp_path)] == ["step_00000010"]
    assert not list(tmp_path.glob("*.abandoned"))


def test_resume_repair_keeps_every_valid_row_and_quarantines_a_damaged_line(tmp_path, capsys):
    """Line 4 of an 8-step run's metrics.jsonl cut in half: resuming at step 8 keeps rows 1-3 and 5-8 and moves
    the damaged line to metrics.jsonl.damaged with a warning (before: rows 4-8 were gone)."""
    from syncwise.metrics import MetricsLogger, read_jsonl

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 9)]
    lines[3] = lines[3][:9]
    path.write_text("\n".join(lines) + "\n")
    logger = MetricsLogger(tmp_path, total_steps=10, start_step=8, tensorboard=False, show=False, enabled=True)
    for s in (9, 10):
        logger._file.write(json.dumps({"step": s, "loss": 0.1}) + "\n")  # (as log_step writes it)
    logger.finish({"steps": 10})
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 5, 6, 7, 8, 9, 10]
    quarantined = (tmp_path / "metrics.jsonl.damaged").read_text()
    assert quarantined == f"4\t{lines[3]}\n"
    err = capsys.readouterr().err
    assert "1 damaged line(s) (line 4)" in err and "metrics.jsonl.damaged" in err


def test_a_replica_group_that_failed_for_good_is_named_in_summary_and_exit_code(tmp_path):
    """Replica 1 died on every restart (e.g. its port taken); replica 0 finished all steps: the run is not a
    silent success — summary.json names it and the launcher fails with one line (before: exit 0, nothing said)."""
    import pytest

    from syncwise.errors import SyncwiseError
    from syncwise.launch.ft import check_outcome

    summary = {"steps": 10, "live_recovery": {"data_skipped_by_replica": {"replica1": ["1-10"]}}}
    with pytest.raises(SyncwiseError, match=r"replica1 \(exit code 1") as e:
        check_outcome(summary, [0, 1], 10, tmp_path)
    assert len(str(e.value).splitlines()) == 1
    assert summary["live_recovery"]["failed_replicas"] == {"replica1": 1}
    ok = {"steps": 10, "live_recovery": {}}
    check_outcome(ok, [0, 0], 10, tmp_path)
    assert ok["live_recovery"]["failed_replicas"] == {}
