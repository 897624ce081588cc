"""`syncwise bench`: a tiny real run on local gloo workers, and its validation errors."""
import json
import math

import pytest

from syncwise.cli import main
from syncwise.commands.bench import combine_rounds, split_configs

FIELDS = ("name", "steps_per_s", "parallel_efficiency", "comm_bytes_per_step", "final_loss", "final_val_loss",
          "compression_ratio", "peak_mem_mb", "mean_step_time_s", "comm_exposed_share", "bandwidth", "world_size")


def test_tiny_local_bench_writes_rows_runs_and_plot(tmp_path, capfd):
    out = tmp_path / "bench"
    code = main(["bench", "--preset", "tiny", "--steps", "6", "--configs",
                 "compute-only,none,topk:ratio=0.05,powersgd:rank=2,start_iter=3,powersgd:rank=2",
                 "--out-dir", str(out), "--json", str(tmp_path / "rows.json"),
                 "--set", "data.seq_len=32", "--set", "train.val_batches=1"])
    assert code == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    for r in rows.values():
        assert all(f in r for f in FIELDS), sorted(set(FIELDS) - set(r))
        assert r["error"] is None
        # a ratio of two timed runs: above 1 whenever the machine was busier during the compute-only run (measured
        # 1.64 under load), so only its sign and finiteness hold at any speed
        assert 0 < r["parallel_efficiency"] < math.inf
        assert r["steps_per_s"] > 0 and r["final_loss"] > 0 and r["final_val_loss"] > 0
        # Each configuration's run directory is kept for inspection.
        assert len((out / r["run_dir"].split("/")[-1] / "metrics.jsonl").read_text().splitlines()) == 6
    assert list(rows) == ["compute-only", "compute-only-shared", "none", "topk:ratio=0.05",
                          "powersgd:rank=2,start_iter=3", "powersgd:rank=2"]
    co, base, topk = rows["compute-only"], rows["none"], rows["topk:ratio=0.05"]
    assert co["world_size"] == 1 and co["comm_bytes_per_step"] == 0 and co["parallel_efficiency"] == 1.0
    # the shared-CPU reference: 2 independent workers at once, each trained alone (world size 1)
    shared = rows["compute-only-shared"]
    assert shared["world_size"] == 1 and shared["parallel_efficiency_shared_cpu"] == 1.0
    assert len(list((out / "compute-only-shared").glob("worker*/summary.json"))) == 2
    assert 0 < base["parallel_efficiency_shared_cpu"] < math.inf
    assert base["world_size"] == topk["world_size"] == 2 and base["bandwidth"] == "loopback"
    assert base["compression_ratio"] == 1.0
    assert topk["compression_ratio"] > 1 and topk["comm_bytes_per_step"] < base["comm_bytes_per_step"]
    assert (tmp_path / "rows.png").stat().st_size > 10_000  # loss vs wall-clock, one curve per configuration
    # PowerSGD's warm-up (start_iter steps of full gradients) is reported apart from its steady state ...
    warm = json.loads((out / rows["powersgd:rank=2,start_iter=3"]["run_dir"].split("/")[-1] / "summary.json").read_text())
    assert warm["warmup_steps"] == 3 and "warning" not in warm
    assert warm["warmup_comm_bytes_per_step"] == pytest.approx(base["comm_bytes_per_step"], rel=0.05)
    assert rows["powersgd:rank=2,start_iter=3"]["compression_ratio"] > 2
    # ... and a run that never left it (default start_iter=10 > 6 steps) says so instead of a silent ratio 1.0
    never = rows["powersgd:rank=2"]
    assert never["compression_ratio"] == pytest.approx(1.0, rel=0.05) and "never left the warm-up" in never["warning"]
    out_text = capfd.readouterr().out
    assert "warning: powersgd:rank=2: the run never left the warm-up of powersgd:rank=2 (10 steps" in " ".join(
        out_text.split())
    # Only the bench's own lines and table: each run's progress and summary table are in its console.log.
    assert "syncwise train — summary" not in out_text and "compute-only" in out_text
    assert len(out_text.splitlines()) < 60, out_text
    assert "syncwise train — summary" in (out / "none" / "console.log").read_text()


def test_repeat_alternates_the_order_and_reports_paired_means(tmp_path):
    out = tmp_path / "bench"
    code = main(["bench", "--preset", "tiny", "--steps", "4", "--configs", "none", "--repeat", "2",
                 "--out-dir", str(out), "--json", str(tmp_path / "rows.json"),
                 "--set", "data.seq_len=32", "--set", "train.val_batches=1"])
    assert code == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    assert list(rows) == ["compute-only", "compute-only-shared", "none"]  # still one row per configuration
    base = rows["none"]
    assert base["repeats"] == 2 and base["failed_rounds"] == [] and base["error"] is None
    assert [r["run_dir"] for r in base["rounds"]] == [str(out / "round1" / "none"), str(out / "round2" / "none")]
    effs = [r["parallel_efficiency"] for r in base["rounds"]]
    # each round's efficiency is against its own compute-only run; the row holds their mean and range
    assert base["parallel_efficiency"] == pytest.approx(sum(effs) / 2)
    assert base["parallel_efficiency_min"] == min(effs) and base["parallel_efficiency_max"] == max(effs)
    times = [r["mean_step_time_s"] for r in base["rounds"]]
    assert base["steps_per_s"] == pytest.approx(2 / sum(times))
    assert rows["compute-only"]["parallel_efficiency"] == 1.0

    def finished(round_, name):
        return (out / round_ / name / "summary.json").stat().st_mtime

    # round 1 runs the references first, round 2 last: a drift of the machine's speed hits both alike
    assert finished("round1", "compute-only") < finished("round1", "none")
    assert finished("round2", "none") < finished("round2", "compute-only")


@pytest.mark.parametrize("argv, field", [
    (["--configs", "none,zip"], "configs"),
    (["--configs", "topk:ratio=2"], "configs"),
    (["--configs", "torch-powersgd:rnak=4"], "configs"),
    (["--configs", "none,none"], "configs"),
    (["--configs", "compute-only"], "configs"),
    (["--steps", "0"], "steps"),
    (["--repeat", "0"], "repeat"),
    (["--preset", "gigantic"], "model.preset"),
    (["--lab", "--bandwidth", "100mbps"], "bandwidth"),
    (["--lab", "--nodes", "1"], "nodes"),
    (["--bandwidth", "100mbit"], "bandwidth"),
    (["--nproc", "1"], "nproc"),
    (["--set", "train.lr"], "set"),
    (["--set", "compress.method=fp16"], "set"),
    (["--set", "train.val_batches=lots"], "train.val_batches"),
])
def test_bad_input_fails_before_anything_runs(argv, field, tmp_path, capsys):
    code = main(["bench", "--out-dir", str(tmp_path / "b"), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert f"'{field}'" in err and "accepted" in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()  # no run directory, no lab, no worker


def test_refuses_to_overwrite_a_previous_bench(tmp_path, capsys):
    (tmp_path / "b" / "none").mkdir(parents=True)
    (tmp_path / "b" / "none" / "summary.json").write_text("{}")
    assert main(["bench", "--configs", "none", "--out-dir", str(tmp_path / "b")]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_config_list_keeps_options_with_their_spec():
    assert split_configs("none,topk:ratio=0.01,momentum=0.9,powersgd:rank=4") == [
        "none", "topk:ratio=0.01,momentum=0.9", "powersgd:rank=4"]


def test_a_round_that_failed_leaves_the_others_mean():
    def row(name, eff, t, error=None):
        return {"name": name, "run_dir": f"/r/{name}", "error": error, "steps": 80, "world_size": 2,
                "parallel_efficiency": eff, "mean_step_time_s": t, "final_val_loss": 2.0 if eff else None}

    rounds = [[row("none", 0.5, 2.0), row("fp8", 0.9, 1.0)],
              [row("none", 0.4, 2.5), row("fp8", None, None, error="the lab job failed")],
              [row("none", 0.6, 1.5), row("fp8", 0.8, 1.2)]]
    none, fp8 = combine_rounds(rounds)
    assert none["parallel_efficiency"] == pytest.approx(0.5) and none["failed_rounds"] == []
    assert none["steps"] == 80 and none["world_size"] == 2  # settings are not averaged
    assert fp8["failed_rounds"] == [2] and fp8["error"] is None
    assert fp8["parallel_efficiency"] == pytest.approx(0.85)  # the rounds that ran
    assert (fp8["parallel_efficiency_min"], fp8["parallel_efficiency_max"]) == (0.8, 0.9)
    assert fp8["steps_per_s"] == pytest.approx(1 / 1.1)
    assert [r["error"] for r in fp8["rounds"]] == [None, "the lab job failed", None]
