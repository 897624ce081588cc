"""[metrics]: the Prometheus endpoint scraped during a live `syncwise train`, values cross-checked with metrics.jsonl."""
import json
import threading
import urllib.request

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


def test_prometheus_endpoint_during_a_live_run_matches_metrics_jsonl(tmp_path):
    pytest.importorskip("prometheus_client")
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
                     "--data.seq_len=32", f"--metrics.prometheus_port={port}", "--inject_fault=slowdata:ms=150",
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
    # the server is gone once the run ends
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_prometheus_port_is_validated(tmp_path, capsys):
    assert main(["train", "--run-dir", str(tmp_path / "run"), "--metrics.prometheus_port=80"]) == 2
    err = capsys.readouterr().err
    assert "metrics.prometheus_port" in err and "1024 to 65535" in err
