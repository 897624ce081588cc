"""`syncwise report` and `syncwise doctor` on damaged run directories (issue 42, row 11): a generator of damages
(truncated or garbage metrics.jsonl, binary junk, rows and summaries of the wrong shape, missing files, a directory
where a file should be...) applied to a well-formed run; each command either works or says one line, never a
traceback."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from syncwise.cli import main

ROW = {"step": 1, "loss": 5.0, "step_time_s": 0.1, "compute_s": 0.07, "comm_exposed_s": 0.01, "data_wait_s": 0.01,
       "comm_bytes": 1000, "tokens_per_s": 1e4, "lr": 1e-3, "grad_norm": 1.0}


def _good(run: Path) -> None:
    run.mkdir(parents=True)
    rows = [dict(ROW, step=i, loss=5.0 - 0.1 * i) for i in range(1, 9)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"steps": 8, "final_loss": 4.2, "world_size": 1,
                                                  "mean_step_time_s": 0.1}))
    (run / "config.json").write_text(json.dumps({"train": {"steps": 8}, "data": {"seq_len": 16, "batch_size": 2}}))
    (run / "ranks").mkdir()
    (run / "ranks" / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "ranks" / "rank0.json").write_text(json.dumps({"rank": 0}))


def _dir_instead(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()
    p.mkdir()
    (p / "x").write_text("x")


def _metrics(run, text):
    (run / "metrics.jsonl").write_bytes(text if isinstance(text, bytes) else text.encode())


DAMAGES = {
    "metrics missing": lambda r: (r / "metrics.jsonl").unlink(),
    "metrics empty": lambda r: _metrics(r, ""),
    "metrics truncated mid-line": lambda r: _metrics(r, (r / "metrics.jsonl").read_bytes()[:150]),
    "metrics cut line in the middle": lambda r: _metrics(r, (r / "metrics.jsonl").read_text().replace('"loss"', '"lo', 1)),
    "metrics binary junk": lambda r: _metrics(r, os.urandom(4096)),
    "metrics invalid utf-8": lambda r: _metrics(r, b"\xff\xfe" + (r / "metrics.jsonl").read_bytes()),
    "metrics rows not objects": lambda r: _metrics(r, "[1, 2]\n\"step\"\n5\nnull\n"),
    "metrics step a string": lambda r: _metrics(r, json.dumps(dict(ROW, step="1")) + "\n"),
    "metrics numbers as strings": lambda r: _metrics(r, "".join(json.dumps({k: (str(v) if k != "step" else i)
                                                                            for k, v in ROW.items()}) + "\n"
                                                                for i in range(1, 4))),
    "metrics values are lists": lambda r: _metrics(r, "".join(json.dumps({k: ([v] if k != "step" else i)
                                                                          for k, v in ROW.items()}) + "\n"
                                                              for i in range(1, 4))),
    "metrics NaN and null": lambda r: _metrics(r, "".join(json.dumps(dict(ROW, step=i, loss=float("nan"),
                                                                          step_time_s=None)) + "\n"
                                                          for i in range(1, 4))),
    "metrics negative steps and huge numbers": lambda r: _metrics(r, json.dumps(dict(ROW, step=-5, step_time_s=1e308,
                                                                                     comm_bytes=10**40)) + "\n"),
    "metrics duplicate steps": lambda r: _metrics(r, (r / "metrics.jsonl").read_text() * 2),
    "metrics a directory": lambda r: _dir_instead(r / "metrics.jsonl"),
    "summary missing": lambda r: (r / "summary.json").unlink(),
    "summary a list": lambda r: (r / "summary.json").write_text("[1, 2]"),
    "summary a string": lambda r: (r / "summary.json").write_text('"done"'),
    "summary garbage": lambda r: (r / "summary.json").write_bytes(os.urandom(300)),
    "summary a directory": lambda r: _dir_instead(r / "summary.json"),
    "summary fields of the wrong type": lambda r: (r / "summary.json").write_text(json.dumps(
        {"steps": "eight", "final_loss": [1], "world_size": "x", "mean_step_time_s": {}, "live_recovery": 5,
         "checkpoints": "x", "preempted": 3})),
    "config not an object": lambda r: (r / "config.json").write_text("[]"),
    "config sections of the wrong type": lambda r: (r / "config.json").write_text(json.dumps(
        {"train": 5, "data": "x", "dist": [1], "parallel": None})),
    "config garbage": lambda r: (r / "config.json").write_bytes(b"\x00\x01{"),
    "config a directory": lambda r: _dir_instead(r / "config.json"),
    "ranks a file": lambda r: (shutil.rmtree(r / "ranks"), (r / "ranks").write_text("x")),
    "rank rows garbage": lambda r: (r / "ranks" / "rank0.jsonl").write_bytes(os.urandom(500)),
    "rank rows of the wrong shape": lambda r: (r / "ranks" / "rank1.jsonl").write_text(
        json.dumps({"step": "x", "step_time_s": "y"}) + "\n" + json.dumps({"step": 1, "step_time_s": 0.1,
                                                                           "comm_exposed_s": "z"}) + "\n"),
    "rank totals a list": lambda r: (r / "ranks" / "rank0.json").write_text("[1]"),
    "rank totals a directory": lambda r: _dir_instead(r / "ranks" / "rank0.json"),
    "report folder a file": lambda r: (r / "report").write_text("not a folder"),
    "run dir is a file": lambda r: (shutil.rmtree(r), r.write_text("x")),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_report_and_doctor_say_one_line_on_a_damaged_run(damage, tmp_path, capsys, monkeypatch):
    from syncwise.commands import report

    monkeypatch.setattr(report, "draw", lambda runs: b"png")  # the picture: test_report.py (seconds each)
    run = tmp_path / "run"
    _good(run)
    DAMAGES[damage](run)
    for argv in (["report", str(run)], ["doctor", str(run)]):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse
            code = e.code
        out, err = capsys.readouterr()
        assert "Traceback" not in err and "Traceback" not in out, (damage, argv, err)
        if code != 0:
            lines = [x for x in err.splitlines() if x.strip()]
            assert len(lines) == 1, (damage, argv, err)
            assert len(lines[0]) < 1000, (damage, argv)
