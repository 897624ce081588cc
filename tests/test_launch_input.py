"""`syncwise launch`: bad cluster or run input is one clear line naming the field and the value, and nothing is
written or submitted; an existing file is never overwritten without --force; --submit without the scheduler's
command says so (exit 2), no traceback."""
import pytest

from syncwise.cli import main

CLUSTER = """nodes = 2
gpus_per_node = 2
[accelerator]
name = "cpu-lab"
[launch]
shared_dir = "/shared/sw"
grace_s = 60
[slurm]
partition = "debug"
time = "01:00:00"
[kubernetes]
image = "example/syncwise:1"
"""
RUN = '[model]\npreset = "tiny"\n[train]\nsteps = 20\n'


def _launch(tmp_path, capsys, cluster=CLUSTER, run=RUN, scheduler="slurm", extra=()):
    (tmp_path / "c.toml").write_text(cluster)
    (tmp_path / "run.toml").write_text(run)
    code = main(["launch", scheduler, "--cluster", str(tmp_path / "c.toml"), "--config", str(tmp_path / "run.toml"),
                 "--out", str(tmp_path / "out"), *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("change, field, value", [
    (('shared_dir = "/shared/sw"', 'shared_dir = "shared/sw"'), "launch.shared_dir", "'shared/sw'"),
    (("grace_s = 60", "grace_s = 60\nmax_nodes = 3"), "launch.max_nodes", "3"),
    (("grace_s = 60", "grace_s = 60\nmin_nodes = 2\nmax_nodes = 1"), "launch.max_nodes", "1"),
    (("grace_s = 60", "grace_s = 7200"), "launch.grace_s", "7200"),
    (('time = "01:00:00"', 'time = "1 hour"'), "slurm.time", "'1 hour'"),
    (("grace_s = 60", 'grace_s = 60\nnccl_socket_ifname = "eth0; rm -rf /"'), "launch.nccl_socket_ifname",
     "'eth0; rm -rf /'"),
    (('partition = "debug"', 'partition = "debug"\nqueue = "x"'), "slurm.queue", "'x'"),
    (("grace_s = 60", 'grace_s = 60\nenv = { "1BAD" = "x" }'), "launch.env.1BAD", "'x'"),
    (("grace_s = 60", "grace_s = true"), "launch.grace_s", "True"),
    (("nodes = 2", "nodes = 2\nracks = 4"), "cluster.racks", "4"),
    (("nodes = 2\n", "nodes = 0\n"), "cluster.nodes", "0"),
])
def test_bad_cluster_input_names_field_and_value_and_writes_nothing(tmp_path, capsys, change, field, value):
    code, out, err = _launch(tmp_path, capsys, cluster=CLUSTER.replace(*change))
    assert code == 2, (out, err)
    assert f"'{field}': {value}" in err and "accepted:" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("run, field", [
    ('[train]\nlr = -1.0\n', "train.lr"),
    ('[train]\nsteps = 10\nstpes = 3\n', "train.stpes"),
    ('[model]\npreset = "huge"\n', "model.preset"),
    ('[dist]\nlab = true\n', "dist.lab"),
    ('[dist]\nnproc = 4\n', "dist.nproc"),
    ('[dist]\nbackend = "nccl"\n', "dist.backend"),
    ('[parallel]\ntp = 3\n', "parallel"),  # 3 does not divide 2 or 4 workers
    ('[compress]\nmethod = "zip"\n', "compress.method"),
    ('[model\n', "--config"),
])
def test_bad_run_config_is_refused_before_anything_is_written(tmp_path, capsys, run, field):
    code, out, err = _launch(tmp_path, capsys, run=run)
    assert code == 2 and f"'{field}" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_kubernetes_needs_an_image_and_a_valid_name(tmp_path, capsys):
    code, _, err = _launch(tmp_path, capsys, cluster=CLUSTER.replace('image = "example/syncwise:1"', ""),
                           scheduler="k8s")
    assert code == 2 and "'kubernetes.image'" in err
    code, _, err = _launch(tmp_path, capsys, scheduler="k8s", extra=["--name", "My_Run"])
    assert code == 2 and "'--name': 'My_Run'" in err
    code, _, err = _launch(tmp_path, capsys, cluster=CLUSTER + 'namespace = "Team A"\n', scheduler="k8s")
    assert code == 2 and "'kubernetes.namespace': 'Team A'" in err
    assert not (tmp_path / "out").exists()


def test_submit_needs_the_shared_path_here(tmp_path, capsys):
    code, _, err = _launch(tmp_path, capsys, extra=["--submit"])  # /shared/sw is not mounted on this machine
    assert code == 2 and "'launch.shared_dir': '/shared/sw'" in err and not (tmp_path / "out").exists()


def test_existing_files_are_never_overwritten_without_force(tmp_path, capsys):
    assert _launch(tmp_path, capsys)[0] == 0
    script = tmp_path / "out" / "run.sbatch"
    script.write_text("# edited by hand\n")
    code, _, err = _launch(tmp_path, capsys)
    assert code == 2 and "'--out'" in err and "run.sbatch" in err and "--force" in err
    assert script.read_text() == "# edited by hand\n"
    assert _launch(tmp_path, capsys, extra=["--force"])[0] == 0
    assert script.read_text().startswith("#!/bin/bash")


@pytest.mark.parametrize("scheduler, tool", [("slurm", "sbatch"), ("k8s", "kubectl")])
def test_submit_without_the_scheduler_command_says_so(tmp_path, capsys, monkeypatch, scheduler, tool):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither sbatch nor kubectl here
    (tmp_path / "shared").mkdir()
    cluster = CLUSTER.replace('"/shared/sw"', f'"{tmp_path / "shared"}"')
    code, out, err = _launch(tmp_path, capsys, cluster=cluster, scheduler=scheduler, extra=["--submit"])
    assert code == 2 and f"{tool} is not on PATH" in err and "nothing was submitted" in err
    assert "Traceback" not in err and any((tmp_path / "out").iterdir())  # the file is written, ready to submit


def _subprocess(*argv):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "syncwise.cli", *argv], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("example", ["a100-8x2-roce", "h100-8x4-ib", "l40s-4x4-eth"])
@pytest.mark.parametrize("scheduler, suffix", [("slurm", "sbatch"), ("k8s", "yaml")])
def test_every_gpu_example_cluster_file_can_be_launched(tmp_path, example, scheduler, suffix):
    from pathlib import Path

    cluster = Path(__file__).resolve().parents[1] / "examples" / "clusters" / f"{example}.toml"
    (tmp_path / "run.toml").write_text(RUN)
    p = _subprocess("launch", scheduler, "--cluster", str(cluster), "--config", str(tmp_path / "run.toml"),
                    "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "out" / f"run.{suffix}").stat().st_size > 500


def test_a_missing_value_is_named_missing_not_none(tmp_path, capsys):
    code, out, err = _launch(tmp_path, capsys, cluster=CLUSTER.replace('shared_dir = "/shared/sw"\n', ""))
    assert code == 2 and "missing value for 'launch.shared_dir'" in err and "None" not in err, err
    p = _subprocess("plan", "--cluster", str(tmp_path / "c.toml"), "--model", "tiny", "--seq-len", "64")
    assert p.returncode == 2 and "missing value for '--global-batch'" in p.stderr and "None" not in p.stderr, p.stderr


def test_the_sbatch_header_names_the_cluster_once(tmp_path):
    (tmp_path / "x").mkdir()  # a file named cluster.toml: its name (the stem) is "cluster"
    (tmp_path / "x" / "cluster.toml").write_text(CLUSTER)
    (tmp_path / "x" / "run.toml").write_text(RUN)
    assert main(["launch", "slurm", "--cluster", str(tmp_path / "x" / "cluster.toml"), "--config",
                 str(tmp_path / "x" / "run.toml"), "--out", str(tmp_path / "x" / "out")]) == 0
    script = (tmp_path / "x" / "out" / "run.sbatch").read_text()
    assert "cluster: cluster:" not in script and "# cluster: 2 × 2 cpu-lab" in script
    assert f"(cluster file {tmp_path / 'x' / 'cluster.toml'})" in script
