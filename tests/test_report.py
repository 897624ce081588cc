"""Where to look: the run directory named at the start, plain progress at a chosen interval, and `syncwise report`
(a PNG, an HTML page with the curves' data, a text comparison) -- all as a user runs them, in subprocesses."""
import base64
import json
import re
import subprocess
import sys

import matplotlib.image

TINY = ["--preset", "tiny", "--data.seq_len=32", "--train.val_batches=1", "--train.val_interval=3"]


def _syncwise(*argv):
    return subprocess.run([sys.executable, "-m", "syncwise.cli", *argv], capture_output=True, text=True, timeout=300)


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_runs_then_report(tmp_path):
    a, b = tmp_path / "fp32", tmp_path / "int8"
    p = _syncwise("train", "--run-dir", str(a), "--steps", "7", "--train.log_interval=3", *TINY)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    # The run directory comes first (one can tail its metrics or run doctor/report during the run) ...
    start = next(i for i, x in enumerate(lines) if x.startswith(f"run directory: {a}"))
    assert "metrics.jsonl" in lines[start] and "syncwise report" in lines[start]
    steps = [int(m.group(1)) for x in lines if (m := re.match(r"step\s+(\d+)/7", x))]
    assert start < next(i for i, x in enumerate(lines) if x.startswith("step "))
    # ... then the first step at once, every log_interval-th, validations (every 3rd) and the last
    assert steps == [1, 3, 6, 7], p.stdout
    p = _syncwise("train", "--run-dir", str(b), "--steps", "7", "--compress", "int8", *TINY)
    assert p.returncode == 0, p.stderr

    out = tmp_path / "report"
    r = _syncwise("report", str(a), str(b), "--out", str(out))
    assert r.returncode == 0, r.stderr
    # the text comparison: a header and a row per run, within one screen
    table = r.stdout.splitlines()
    assert table[0].split()[:3] == ["run", "steps", "loss"] and len(r.stdout.splitlines()) < 25
    assert table[1].startswith("fp32 ") and table[2].startswith("int8 ") and " 7 " in table[1]
    assert re.search(r"\d+(\.\d+)? (KB|MB)", table[2])  # bytes with a unit
    # one node: nothing crosses between nodes, and the comparison says so instead of splitting the bytes
    assert "cross-node/step" in table[0] and "one node" in table[1] and "one node" in table[2]
    assert json.loads((a / "summary.json").read_text())["comm_hops"].startswith("one node")
    # the picture, read back
    image = matplotlib.image.imread(out / "report.png")
    assert image.shape[:2] == (900, 1600)
    assert image[..., :3].std() > 0.05  # not a blank canvas
    # the page: the same picture embedded, and the curves' data
    page = (out / "report.html").read_text()
    embedded = re.search(r'src="data:image/png;base64,([^"]+)"', page).group(1)
    assert base64.b64decode(embedded) == (out / "report.png").read_bytes()
    data = json.loads(re.search(r'<script type="application/json" id="syncwise-data">(.*?)</script>', page,
                                re.S).group(1))
    runs = {x["name"]: x for x in data["runs"]}
    assert set(runs) == {"fp32", "int8"}
    for name, run in (("fp32", a), ("int8", b)):
        rows = _rows(run)
        curves = runs[name]["curves"]
        assert curves["step"] == [x["step"] for x in rows] == list(range(1, 8))
        assert curves["loss"] == [x["loss"] for x in rows]
        assert curves["val_step"] == [3, 6, 7]
        assert curves["train_time_s"][-1] == sum(x["step_time_s"] for x in rows)
    assert runs["int8"]["comm_bytes_per_step"] < runs["fp32"]["comm_bytes_per_step"]
    # Run again: its own report is replaced; someone else's file of that name is not.
    assert _syncwise("report", str(a), str(b), "--out", str(out)).returncode == 0
    other = tmp_path / "other"
    other.mkdir()
    (other / "report.html").write_text("<html>mine</html>")
    r = _syncwise("report", str(a), "--out", str(other))
    assert r.returncode == 2 and "'--out'" in r.stderr and (other / "report.html").read_text() == "<html>mine</html>"


def test_report_refuses_a_directory_that_is_not_a_run(tmp_path):
    r = _syncwise("report", str(tmp_path))
    assert r.returncode == 2 and "'RUN'" in r.stderr and "metrics.jsonl" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
