"""Issue 43 row 3: the figures a run prints add up — exposed communication never exceeds its total."""
import json

import pytest

from syncwise.cli import main


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("method", ["powersgd:rank=2,start_iter=2", "fp8"])
def test_a_compressed_runs_exposed_gradient_sync_never_exceeds_its_total(method, tmp_path):
    """A compressor on 2 gloo ranks, several buckets (PowerSGD past its warm-up on the worker thread; fp8 straight
    from the hook): on every row of metrics.jsonl and of each rank's log, ``comm_exposed_s_dp <= comm_s_dp``; the
    worker's codec seconds (``compress_s``) are part of that total."""
    run = tmp_path / "run"
    assert main(["train", "--nproc", "2", "--preset", "tiny", "--steps", "5", "--run-dir", str(run),
                 "--data.seq_len=32", "--train.val_batches=1", "--compress", method,
                 "--dist.bucket_cap_mb=0.05", "--dist.device=cpu"]) == 0
    ranks = [_rows(run / "ranks" / f"rank{r}.jsonl") for r in (0, 1)]
    for where, rows in [("metrics.jsonl", _rows(run / "metrics.jsonl")), ("rank0", ranks[0]), ("rank1", ranks[1])]:
        assert len(rows) == 5, where
        for r in rows:
            assert r["comm_exposed_s_dp"] <= r["comm_s_dp"], (where, r)
            if method.startswith("powersgd"):  # one bucket at a time on the worker: codec + collectives <= span
                assert r["compress_s"] <= r["comm_s_dp"], (where, r)
            assert r["comm_exposed_s"] <= r["step_time_s"], (where, r)
