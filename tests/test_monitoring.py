"""[metrics]: during a live `syncwise train`, the Prometheus endpoint is scraped and W&B (offline) records the run;
both are cross-checked with metrics.jsonl."""
import json
import re
import struct
import threading
import urllib.request
from pathlib import Path

import pytest

from syncwise.cli import main
from syncwise.launch import free_port


def _parse(text):
    """{metric name: value} from Prometheus' text format (one rank per endpoint: labels dropped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            out[name_labels.split("{")[0]] = float(value)
    return out


def _wandb_records(path):
    """Protobuf records of a W&B offline run file (``run-ID.wandb``): wandb's LevelDB-log framing, read here
    because wandb ships no reader (7-byte file header ':W&B' 0xBEE1 v0; 32 KiB blocks; 7-byte record headers
    crc32, length, type FULL=1 FIRST=2 MIDDLE=3 LAST=4)."""
    data = open(path, "rb").read()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, (ident, magic)
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left  # a block's tail too short for a header is padding
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            yield buf


def _wandb_history_and_config(run_dir):
    from wandb.proto import wandb_internal_pb2 as pb

    files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    history, config = {}, {}
    for data in _wandb_records(files[0]):
        record = pb.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            item = {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            if "step" in item:  # a syncwise row (wandb adds rows of its own, e.g. system metrics)
                history[int(item["step"])] = item
        elif kind in ("run", "config"):
            update = record.run.config.update if kind == "run" else record.config.update
            config.update({i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in update})
    return history, config


def test_live_run_prometheus_and_wandb_match_metrics_jsonl(tmp_path, monkeypatch):
    pytest.importorskip("prometheus_client")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # workers inherit it: nothing leaves the machine
    monkeypatch.setenv("WANDB_SILENT", "true")
    port, run_dir = free_port(), tmp_path / "run"
    scrapes, done = [], threading.Event()

    def scrape():
        while not done.is_set():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    parsed = _parse(r.read().decode())
                if "syncwise_step" in parsed:
                    scrapes.append(parsed)
            except OSError:
                pass  # not up yet, or already down
            done.wait(0.05)

    poller = threading.Thread(target=scrape, daemon=True)
    poller.start()
    try:
        # slowdata keeps each step >= 150 ms, so the poller sees the endpoint during the run
        code = main(["train", "--nproc", "2", "--preset", "tiny", "--steps", "8", "--run-dir", str(run_dir),
                     "--data.seq_len=32", f"--metrics.prometheus_port={port}", "--metrics.wandb=true", "--inject_fault=slowdata:ms=150",
                     "--ckpt.interval=4", "--ckpt.async_save=false"])
    finally:
        done.set()
        poller.join()
    assert code == 0
    rows = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert scrapes, "the endpoint was never up with a step during the run"
    assert all(r["comm_bytes"] > 0 for r in rows.values())  # 2 workers: real gradient all-reduces
    for s in scrapes:
        row = rows[int(s["syncwise_step"])]  # each scrape shows one whole row of metrics.jsonl
        for key in ("loss", "tokens_per_s", "compute_s", "comm_exposed_s", "data_wait_s", "step_time_s", "lr"):
            assert s[f"syncwise_{key}"] == pytest.approx(row[key], rel=1e-12), key
        assert s["syncwise_data_wait_s"] >= 0.1  # the injected starved loader shows as data wait
        assert s["syncwise_restarts"] == 0 and s["syncwise_checkpoint_age_s"] >= 0
        assert s["syncwise_sent_bytes_total"] == sum(rows[i]["comm_bytes"] for i in range(1, int(s["syncwise_step"]) + 1))
    # the Grafana dashboard in examples/ asks only for metrics the endpoint serves (MFU needs a known peak: GPUs)
    dashboard = (Path(__file__).resolve().parents[1] / "examples" / "monitoring" / "grafana-syncwise.json").read_text()
    asked = set(re.findall(r"syncwise_[a-z_]+", dashboard)) - {"syncwise_train"}
    served = set().union(*scrapes) | {"syncwise_mfu"}
    assert asked and asked <= served, asked - served
    # W&B: the same series, step by step, and the resolved config
    history, config = _wandb_history_and_config(run_dir)
    assert sorted(history) == sorted(rows)
    for step, row in rows.items():
        for key in ("loss", "tokens_per_s", "comm_bytes", "compute_s", "comm_exposed_s", "data_wait_s"):
            assert history[step][key] == pytest.approx(row[key], rel=1e-12), (step, key)
    assert config["train"]["steps"] == 8 and config["metrics"]["prometheus_port"] == port
    # the server is gone once the run ends
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_prometheus_port_is_validated(tmp_path, capsys):
    assert main(["train", "--run-dir", str(tmp_path / "run"), "--metrics.prometheus_port=80"]) == 2
    err = capsys.readouterr().err
    assert "metrics.prometheus_port" in err and "1024 to 65535" in err


def test_step_rows_carry_a_timestamp(tmp_path):
    """metrics.jsonl and the rank logs stamp each row with its Unix time (live_recovery reads stalls from it)."""
    import time as _time

    from syncwise.metrics.logger import MetricsLogger, read_jsonl
    from syncwise.metrics.ranklog import RankLog

    row = {"step": 1, "loss": 1.0, "tokens_per_s": 1.0, "comm_exposed_s": 0.0, "step_time_s": 0.1}
    before = _time.time()
    logger = MetricsLogger(tmp_path, 1, tensorboard=False, show=False)
    ranklog = RankLog(tmp_path, rank=1, world_size=2)
    logger.log_step(dict(row))
    ranklog.log_step(dict(row))
    ranklog.finish({})
    logger._file.close()
    for rows in (read_jsonl(tmp_path / "metrics.jsonl"), read_jsonl(tmp_path / "ranks" / "rank1.jsonl")):
        assert len(rows) == 1 and before <= rows[0]["time"] <= _time.time() + 1


def test_a_full_disk_under_the_rank_log_warns_once_and_training_goes_on(tmp_path, caplog):
    """A diagnostics log never ends a run nor hides the error that does (the checkpoint's full-disk message): a
    write that fails with ENOSPC (/dev/full) warns once; later steps and the run's end write nothing and raise
    nothing."""
    from syncwise.metrics.ranklog import RankLog

    ranklog = RankLog(tmp_path, rank=0, world_size=1)
    ranklog._file.close()
    ranklog._file = open("/dev/full", "a")  # every flush fails with ENOSPC, as on a full disk
    with caplog.at_level("WARNING", logger="syncwise.metrics.ranklog"):
        for step in range(1, 4000):  # enough rows to fill the buffer and force writes
            ranklog.log_step({"step": step, "loss": 1.0})
        ranklog.finish({"steps": 3999})
    assert len([r for r in caplog.records if "rank log" in r.getMessage()]) == 1
    assert not (tmp_path / "ranks" / "rank0.json").exists()
