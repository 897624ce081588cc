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
    # one source for tokens/s and the training time: the summary and `syncwise report` give the same figures
    from syncwise.commands.report import load_run

    summary, shown = json.loads((run / "summary.json").read_text()), load_run(run)
    assert shown["tokens_per_s"] == pytest.approx(summary["tokens_per_s"], rel=1e-6)
    assert shown["train_time_s"] == pytest.approx(summary["train_time_s"], rel=1e-9)
    assert shown["mean_step_time_s"] == pytest.approx(summary["mean_step_time_s"], rel=1e-9)


def test_the_progress_line_and_the_summary_legend_say_what_each_figure_is(capsys):
    from syncwise.metrics.logger import SUMMARY_LEGEND, comm_line

    row = {"comm_exposed_s": 0.042, "comm_bytes_dp": 21_900_000, "comm_s_dp": None, "comm_exposed_s_dp": 0.042}
    assert comm_line(row) == "comm 42 ms exposed (dp 42 of – ms, 21.9 MB sent)"
    for key in ("tokens_per_s", "train_time_s", "wall_time_s", "comm_bytes_per_step", "job_comm_bytes_per_step",
                "comm_s_per_step_", "per rank", "per job", "– = not measured"):
        assert key in SUMMARY_LEGEND, key
