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
