"""What-if prices per-call overheads; doctor's picture and --follow on synthetic run directories (pure Python)."""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

from syncwise.cli import main
from syncwise.doctor import diagnose, load_run
from syncwise.doctor.follow import check, window_of
from syncwise.doctor.picture import render
from syncwise.plan.layout import Layout
from syncwise.plan.model import from_preset
from syncwise.plan.whatif import DDP_CALL_S, Measured, ddp_buckets, whatif

from test_doctor_arrivals import _write_run


def _measured(**kw) -> Measured:
    model = from_preset("small-dense").with_seq_len(64)
    return Measured(model=model, layout=Layout(dp_replicate=2), global_batch=16, seq_len=64, compute_s=0.2, **kw)


def test_ddp_buckets_follow_the_cap():
    model = from_preset("small-dense")
    tiny, mid, big = (ddp_buckets(model, cap) for cap in (0.001, 4.7, 25.0))
    assert tiny > 50 and big == 1 and 1 < mid < tiny          # one per tensor under a tiny cap


def test_bigger_buckets_are_predicted_faster_by_the_calls_they_save():
    w = whatif(_measured(bucket_cap_mb=0.001, grad_calls=57), 0.25, bucket_cap_mb=25.0)
    assert w.calls_before == 57 and w.calls_after < 2
    assert w.calls_delta_s < -50 * DDP_CALL_S
    assert w.step_after_s < 0.25


def test_smaller_buckets_pay_for_their_extra_calls():
    w = whatif(_measured(bucket_cap_mb=25.0), 0.25, bucket_cap_mb=0.001)
    assert w.calls_after > w.calls_before and w.calls_delta_s > 0


def test_a_second_collective_per_bucket_is_priced():
    w = whatif(_measured(bucket_cap_mb=0.001), 0.25, compress="powersgd:rank=4")
    assert w.calls_after == 2 * w.calls_before             # PowerSGD's P and Q all-reduces


def test_the_picture_is_self_contained_html_with_the_timeline_and_breakdown(tmp_path):
    run = _write_run(tmp_path / "r", 2, 12, {1: {s: 0.03 for s in range(1, 13)}})
    d = diagnose(load_run(run), predict=False)
    page = render(d)
    assert page.startswith("<!doctype html>") and "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")
    svgs = re.findall(r"<svg.*?</svg>", page, re.S)
    assert len(svgs) == 2
    for svg in svgs:
        ET.fromstring(svg)                                   # well-formed
    assert "last to arrive" in svgs[0] and "rank 1" in svgs[0]
    assert main(["doctor", str(run), "--html", str(tmp_path / "p.html")]) == 0
    written = (tmp_path / "p.html").read_text()
    assert written.count("<svg") == 2 and "rank 1 is a persistent compute straggler" in written


def test_follow_reads_a_live_run_and_names_a_straggler_from_its_recent_steps(tmp_path):
    late = {1: {s: 0.05 for s in range(31, 41)}}        # rank 1 slow from step 31 of 40
    run = _write_run(tmp_path / "r", 2, 40, late)
    (run / "summary.json").unlink()                     # still training
    whole = diagnose(load_run(run, live=True), predict=False)
    recent = diagnose(window_of(load_run(run, live=True), 12), predict=False)
    assert recent.top is not None and recent.top.cause == "straggler" and recent.top.details["rank"] == 1
    assert recent.parts["straggler_wait"] > whole.parts["straggler_wait"]
    look = check(run, window=12)
    assert look["cause"] == "straggler" and look["rank"] == 1 and not look["finished"]
    assert main(["doctor", str(run), "--follow", "--window", "2"]) == 2   # ConfigError: one line, exit 2


def test_follow_stops_when_the_run_finishes(tmp_path, capsys):
    run = _write_run(tmp_path / "r", 2, 20, {1: {s: 0.03 for s in range(1, 21)}})
    assert main(["doctor", str(run), "--follow", "--interval", "0.1", "--json", str(tmp_path / "f.jsonl")]) == 0
    assert "straggler" in capsys.readouterr().out
    looks = [json.loads(x) for x in (tmp_path / "f.jsonl").read_text().splitlines()]
    assert looks[-1]["finished"] and looks[-1]["rank"] == 1
