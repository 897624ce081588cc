"""`syncwise launch slurm`: the generated sbatch script, and that script run by a real Slurm.

The real-Slurm test uses a single-machine Slurm (``scripts/slurm-local.sh``: slurmctld + slurmd on this host,
munge). ``bash scripts/test.sh`` (CI) sets Slurm up first and then sets ``SYNCWISE_TEST_SLURM=1``; a plain pytest
run needs that variable set by hand (the test then starts Slurm itself when none is up: apt-get install slurm-wlm
munge, root); where Slurm cannot be started it is skipped with the reason. It submits the generated script twice — a run
left alone, and a run that gets ``scancel --signal=USR1`` mid-way, stops and saves, requeues itself and finishes
— and compares the two loss curves bit for bit.
"""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from syncwise.cli import main

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "slurm-local.sh"


def cluster_toml(path: Path, shared: Path, **launch) -> Path:
    """A 1-node × 2-worker CPU cluster (the lab's accelerator) with launch tables for this machine's Slurm."""
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in launch.items())
    path.write_text(f"""nodes = 1
gpus_per_node = 2
[accelerator]
name = "cpu-lab"
[launch]
shared_dir = {json.dumps(str(shared))}
grace_s = 40
max_restarts = 0
python = {json.dumps(sys.executable)}
env = {{ PYTHONPATH = {json.dumps(str(ROOT / "src"))} }}
{extra}[slurm]
partition = "debug"
time = "00:15:00"
cpus_per_task = 2
""")
    return path


RUN_TOML = """[model]
preset = "tiny"
[data]
seq_len = 128
batch_size = 24
[train]
steps = 10
deterministic = true
val_interval = 0
val_batches = 1
[ckpt]
interval = "4"
"""


def test_script_has_one_agent_per_node_rendezvous_requeue_and_the_signal(tmp_path):
    cluster = cluster_toml(tmp_path / "c.toml", tmp_path / "shared", min_nodes=1, max_nodes=1,
                           nccl_socket_ifname="^docker,lo", gloo_socket_ifname="eth0")
    (tmp_path / "run.toml").write_text(RUN_TOML)
    assert main(["launch", "slurm", "--cluster", str(cluster), "--config", str(tmp_path / "run.toml"),
                 "--out", str(tmp_path / "out"), "--name", "demo"]) == 0
    text = (tmp_path / "out" / "demo.sbatch").read_text()
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0  # valid bash
    for line in ["#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1", "#SBATCH --requeue", "#SBATCH --signal=USR1@40",
                 "#SBATCH --open-mode=append", "#SBATCH --partition=debug", "#SBATCH --time=00:15:00",
                 "export NCCL_SOCKET_IFNAME='^docker,lo'", "export GLOO_SOCKET_IFNAME=eth0",
                 'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)', 'scontrol requeue "$SLURM_JOB_ID"']:
        assert line in text, line
    assert "--gpus-per-node" not in text  # a CPU cluster asks for no GPUs
    srun = text[text.index("srun "):text.index("code=$?")]
    for arg in ["--nnodes=1:1", "--nproc-per-node=2", "--rdzv-backend=c10d", '--rdzv-endpoint="$HEAD_NODE:$RDZV_PORT"',
                "--max-restarts=0", "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout=40",
                "-m syncwise.commands.worker", "--resume auto", "syncwise.launch.agent"]:
        assert arg in srun, arg
    # The embedded run configuration is the validated one, with the trainer's grace inside the scheduler's.
    embedded = text[text.index("<<'SYNCWISE_RUN_TOML'\n") + 22:text.index("\nSYNCWISE_RUN_TOML\n")]
    import tomllib

    run = tomllib.loads(embedded)
    assert run["model"]["preset"] == "tiny" and run["resume"] == "auto"
    assert run["run_dir"] == str(tmp_path / "shared" / "runs" / "demo")
    assert 0 < run["ckpt"]["preempt_grace_s"] < 40


def test_elastic_range_and_gpus_reach_the_script(tmp_path):
    cluster = tmp_path / "c.toml"
    cluster.write_text("""nodes = 4
gpus_per_node = 8
[launch]
shared_dir = "/shared/sw"
min_nodes = 2
max_nodes = 4
max_restarts = 5
grace_s = 300
[slurm]
time = "2-00:00:00"
sbatch = ["--qos=high", "--exclusive"]
""")
    (tmp_path / "run.toml").write_text("[model]\npreset = \"small\"\n")
    assert main(["launch", "slurm", "--cluster", str(cluster), "--config", str(tmp_path / "run.toml"),
                 "--out", str(tmp_path)]) == 0
    text = (tmp_path / "run.sbatch").read_text()
    assert "#SBATCH --nodes=2-4" in text and "#SBATCH --gpus-per-node=8" in text and "--nnodes=2:4" in text
    assert "--max-restarts=5" in text and "#SBATCH --signal=USR1@300" in text and "#SBATCH --qos=high" in text
    assert "#SBATCH --exclusive" in text


def test_live_recovery_script_runs_the_lighthouse_and_one_replica_group_per_node(tmp_path):
    """[ft] replicas = 3: 3 nodes, --no-kill, the lighthouse a step of its own on the first node, each replica group
    a step on its own node with its own rendezvous and ft.replica_restarts, relaunched by the script up to
    launch.max_restarts times, and the replica groups' metrics merged at the end."""
    pytest.importorskip("torchft", reason="live recovery needs torchft (requirements-dev.txt)")
    cluster = cluster_toml(tmp_path / "c.toml", tmp_path / "shared", min_nodes=3, max_nodes=3)
    cluster.write_text(cluster.read_text().replace("nodes = 1\n", "nodes = 3\n", 1)
                       .replace("max_restarts = 0\n", "max_restarts = 2\n"))
    (tmp_path / "run.toml").write_text(RUN_TOML + "[ft]\nreplicas = 3\nmin_replicas = 2\nreplica_restarts = 4\n"
                                       "timeout_s = 12\n")
    assert main(["launch", "slurm", "--cluster", str(cluster), "--config", str(tmp_path / "run.toml"),
                 "--out", str(tmp_path / "out"), "--name", "ft"]) == 0
    text = (tmp_path / "out" / "ft.sbatch").read_text()
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0  # valid bash
    assert "#SBATCH --nodes=3" in text and "#SBATCH --no-kill" in text
    lighthouse = text[text.index("srun --nodes=1 --ntasks=1 --overlap"):text.index("LIGHTHOUSE=$!")]
    assert '-w "$HEAD_NODE"' in lighthouse and "torchft_lighthouse --min_replicas=2" in lighthouse
    # bound by bind.py's rule on the head node (its own address), never every interface (issue 42)
    assert '-m syncwise.bind --nodes 3 --port "$LIGHTHOUSE_PORT" -- torchft_lighthouse' in lighthouse
    assert "[::]" not in text and "0.0.0.0" not in text
    assert 'export SYNCWISE_SECRET_FILE="$(' in text and "-m syncwise.secret \"$RUN_DIR\")\" || exit 1" in text
    assert "LIGHTHOUSE_PORT=$(( RDZV_PORT + 1000 ))" in text
    assert 'export TORCHFT_LIGHTHOUSE="http://$HEAD_NODE:$LIGHTHOUSE_PORT"' in text
    assert "export SYNCWISE_FT_REPLICAS=3" in text and "export SYNCWISE_FT_MIN_REPLICAS=2" in text
    assert "export SYNCWISE_FT_TIMEOUT_S=12.0" in text
    step = text[text.index("SYNCWISE_FT_REPLICA=$r SYNCWISE_FT_FIRST_ATTEMPT=$(( FIRST + attempt * 5 ))"):text.index("rc=$?")]
    for arg in ['-w "$NODE"', "--nnodes=1 ", "--nproc-per-node=2", '--rdzv-endpoint="$NODE:$RDZV_PORT"',
                '--rdzv-id="syncwise-$SLURM_JOB_ID-r$r"', "--max-restarts=4", "-m syncwise.commands.worker"]:
        assert arg in step, arg
    assert '[ "$attempt" -ge 2 ]' in text  # the script relaunches a failed replica step launch.max_restarts times
    assert 'for r in $(seq 0 2); do replica "$r" & PIDS+=($!); done' in text
    assert "merge_metrics" in text and '"$RUN_DIR" 10' in text
    import tomllib

    run = tomllib.loads(text[text.index("<<'SYNCWISE_RUN_TOML'\n") + 22:text.index("\nSYNCWISE_RUN_TOML\n")])
    assert run["ft"]["replicas"] == 3 and run["dist"]["nnodes"] == "1" and run["dist"]["max_restarts"] == 0


def test_live_recovery_needs_one_node_per_replica_group(tmp_path, capsys):
    pytest.importorskip("torchft", reason="live recovery needs torchft (requirements-dev.txt)")
    cluster = cluster_toml(tmp_path / "c.toml", tmp_path / "shared", min_nodes=1, max_nodes=1)
    (tmp_path / "run.toml").write_text(RUN_TOML + "[ft]\nreplicas = 2\n")
    assert main(["launch", "slurm", "--cluster", str(cluster), "--config", str(tmp_path / "run.toml"),
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'ft.replicas': 2" in err[0] and "one replica group per node" in err[0]
    assert not (tmp_path / "out").exists()  # nothing written


# --------------------------------------------------------------------------------------------- a real Slurm
def _slurm_or_skip() -> None:
    if os.environ.get("SYNCWISE_TEST_SLURM") != "1":
        pytest.skip("SYNCWISE_TEST_SLURM is not 1: scripts/test.sh sets it once scripts/slurm-local.sh has started a "
                    "local Slurm (its output says why it could not); under plain pytest set it by hand (35-50 s)")
    if subprocess.run(["bash", str(SETUP), "--check"], capture_output=True).returncode == 0:
        return
    proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        pytest.skip(f"cannot start a local Slurm: {reason}")


def _job(job_id: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _rows(run_dir: Path) -> list:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _submit(tmp_path: Path, cluster: Path, name: str) -> str:
    out = subprocess.run([sys.executable, "-m", "syncwise.cli", "launch", "slurm", "--cluster", str(cluster),
                          "--config", str(tmp_path / "run.toml"), "--out", str(tmp_path / "out"), "--name", name,
                          "--submit"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr
    m = re.search(r"Submitted batch job (\d+)", out.stdout)
    assert m, out.stdout
    return m.group(1)


@pytest.mark.slow
def test_real_slurm_runs_the_script_and_a_preempted_job_requeues_and_finishes_identically(tmp_path):
    _slurm_or_skip()
    shared = tmp_path / "shared"
    shared.mkdir()  # the cluster's shared path, mounted here
    cluster = cluster_toml(tmp_path / "c.toml", shared)
    (tmp_path / "run.toml").write_text(RUN_TOML)
    jobs = {name: _submit(tmp_path, cluster, name) for name in ("straight", "preempted")}
    runs = {name: shared / "runs" / name for name in jobs}
    deadline = time.monotonic() + 420
    signalled = False

    def report(what: str) -> str:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((shared / "logs").glob("*.out")))
        return (f"{what}\n" + "\n".join(f"{n}: {_job(j)}" for n, j in jobs.items()) + "\n" + logs)

    try:
        while time.monotonic() < deadline:
            if not signalled and len(_rows(runs["preempted"])) >= 2:
                subprocess.run(["scancel", "--signal=USR1", jobs["preempted"]], check=True)
                signalled = True
            states = {n: _job(j).get("JobState") for n, j in jobs.items()}
            if any(s in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY") for s in states.values()):
                pytest.fail(report(f"a job ended badly: {states}"))
            if signalled and all(s == "COMPLETED" for s in states.values()):
                break
            time.sleep(0.2)
        else:
            pytest.fail(report("the jobs did not finish within 420 s"))
    finally:
        subprocess.run(["scancel", *jobs.values()], capture_output=True)
    straight, preempted = _rows(runs["straight"]), _rows(runs["preempted"])
    assert [r["step"] for r in straight] == list(range(1, 11))
    assert [r["step"] for r in preempted] == list(range(1, 11)), report("one row per step")  # exactly once each
    assert [r["loss"] for r in preempted] == [r["loss"] for r in straight]  # bit-identical curve
    assert int(_job(jobs["preempted"])["Restarts"]) == 1 and int(_job(jobs["straight"])["Restarts"]) == 0
    log = (shared / "logs" / f"preempted-{jobs['preempted']}.out").read_text()
    assert "preempted (SIGUSR1) after step" in log and "requeueing job" in log, log[-3000:]
    assert "resumed from step" in log
    assert not (runs["preempted"] / "preempted.json").exists()  # the finished attempt cleared it
    assert json.loads((runs["preempted"] / "summary.json").read_text())["steps"] == 10
