"""The network lab: namespaces + bridge + tbf, real torchrun jobs across its nodes.

Lab tests need root and `ip netns`; they use their own prefix (`swlt`) and state directory, so they
never touch a lab someone else has running under the default prefix.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import syncwise
from syncwise.commands import cluster as cluster_cmd
from syncwise.errors import ConfigError, SyncwiseError
from syncwise.lab import cluster as lab
from syncwise.lab.launch import lab_torchrun
from syncwise.lab.sizing import equivalent_rate

from helpers import lab_unavailable

PREFIX = "swlt"


_SKIP = lab_unavailable()


def _sh(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def _root_snapshot() -> dict[str, str]:
    # Interface names/flags, routes and qdiscs of the root namespace: the lab must leave them alone.
    links = "\n".join(sorted(line.split("link/")[0] for line in _sh("ip", "-o", "link", "show").splitlines()))
    return {"links": links, "routes": _sh("ip", "route", "show"), "qdiscs": _sh("tc", "qdisc", "show")}


def _our_namespaces() -> list[str]:
    return [n for n in _sh("ip", "netns", "list").split() if n.startswith(PREFIX + "-")]


@pytest.fixture
def lab_env(tmp_path, monkeypatch):
    """An isolated state dir; always tears the test lab down, even when the test fails."""
    monkeypatch.setenv("SYNCWISE_LAB_DIR", str(tmp_path / "state"))
    before = _root_snapshot()
    yield tmp_path
    lab.down(PREFIX)
    assert _our_namespaces() == [] and not list(lab.NETNS_ETC.glob(f"{PREFIX}-*"))
    assert _root_snapshot() == before


# ------------------------------------------------------------------------ no root needed
def test_cluster_up_and_down_refuse_a_lab_a_job_is_using(tmp_path):
    """A job (train --lab, bench --lab, cluster run) holds the lab's lock; up/down refuse and change nothing."""
    env = {**os.environ, "SYNCWISE_LAB_DIR": str(tmp_path / "state")}
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from syncwise.lab.cluster import LabLock
        with LabLock("swlk", exclusive=False):
            print("held", flush=True)
            time.sleep(120)
        """)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        for argv in (["up", "--nodes", "2", "--bandwidth", "100mbit"], ["down"]):
            p = subprocess.run([sys.executable, "-m", "syncwise.cli", "cluster", "--prefix", "swlk", *argv],
                               capture_output=True, text=True, env=env, timeout=60)
            assert p.returncode == 2, p.stderr
            assert "the lab 'swlk' is in use by a running job" in p.stderr and "nothing was changed" in p.stderr
    finally:
        holder.kill()
        holder.wait()
    with lab.LabLock("swlk", exclusive=True):  # the holder gone, the kernel dropped its lock
        pass



def test_rates_are_validated():
    assert lab.parse_rate("100mbit") == 100_000_000
    assert lab.parse_rate("1GBIT") == 10**9
    assert lab.parse_rate("500kbit") == 500_000
    assert lab.parse_rate("2.5gbit") == 2_500_000_000
    assert lab.format_rate(2_500_000_000) == "2500mbit"
    for bad in ("100", "100mb", "fast", "-5mbit", "1kbit", "100 MB/s"):
        with pytest.raises(ConfigError) as e:
            lab.parse_rate(bad, "inter_node")
        assert "inter_node" in str(e.value) and repr(bad) in str(e.value) and "mbit" in str(e.value)
    # up() validates every input before touching the system, so this fails the same way without root.
    with pytest.raises(ConfigError, match="intra_node"):
        lab.up(2, "100mbit", intra_node="10 gigs", prefix=PREFIX)
    with pytest.raises(ConfigError, match="nodes"):
        lab.up(0, "100mbit", prefix=PREFIX)


def test_equivalent_rate_keeps_comm_compute_ratio():
    assert equivalent_rate("100gbit") == "20mbit"
    assert equivalent_rate("1tbit") == "200mbit"
    # Twice the tokens per step on the real cluster: twice the compute per byte -> twice the lab rate.
    assert equivalent_rate("100gbit", tokens_ratio=2.0) == "40mbit"
    with pytest.raises(ConfigError, match="slowdown"):
        equivalent_rate("100gbit", slowdown=0)


def test_non_root_gets_a_clear_error():
    with pytest.raises(SyncwiseError) as e:
        lab.check_supported(euid=65534)
    msg = str(e.value)
    assert "root" in msg and "65534" in msg and "sudo" in msg


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to drop to nobody")
def test_cli_as_nobody_exits_nonzero_with_message(tmp_path):
    src = str(Path(syncwise.__file__).resolve().parents[1])
    drop = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable]
    env = {**os.environ, "PYTHONPATH": src, "SYNCWISE_LAB_DIR": str(tmp_path)}
    probe = subprocess.run(drop + ["-c", "import os, syncwise.commands.cluster; print(os.geteuid())"],
                           capture_output=True, text=True, env=env, cwd="/")
    if probe.returncode != 0 or probe.stdout.strip() == "0":
        pytest.skip(f"cannot run syncwise as nobody here: {probe.stderr.strip()[-200:]}")
    for argv in (["up", "--nodes", "2", "--bandwidth", "100mbit"], ["down"]):
        proc = subprocess.run(drop + ["-m", "syncwise.commands.cluster", "--prefix", PREFIX, *argv],
                              capture_output=True, text=True, env=env, cwd="/")
        assert proc.returncode != 0
        assert "needs root" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not Path(tmp_path, f"{PREFIX}.json").exists()


# ---------------------------------------------------------------------------- lab tests


@pytest.mark.lab
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_up_status_down_leaves_nothing(lab_env):
    state = lab.up(2, "100mbit", intra_node="1gbit", prefix=PREFIX)
    assert sorted(_our_namespaces()) == sorted([f"{PREFIX}-sw", f"{PREFIX}-n0", f"{PREFIX}-n1"])
    # Nothing of the lab appears in the root namespace.
    assert PREFIX not in _sh("ip", "-o", "link", "show")

    got = lab.status(PREFIX)
    assert got is not None and got.to_dict() == state.to_dict()
    assert [n.address for n in got.nodes] == ["10.77.0.1", "10.77.0.2"]
    assert (got.inter_node, got.intra_node) == ("100mbit", "1gbit")
    stats = lab.qdisc_stats(got)
    for i in (0, 1):  # both directions of each link, and loopback, shaped in the kernel
        assert stats[i]["egress"]["rate_bps"] == 100_000_000
        assert stats[i]["ingress"]["rate_bps"] == 100_000_000
        assert stats[i]["lo"]["rate_bps"] == 1_000_000_000

    # The nodes reach each other over the bridge (TCP connect from node 1 to a listener on node 0).
    server = lab.exec_in(0, [sys.executable, "-c", "import socket; s=socket.create_server(('10.77.0.1', 29999)); "
                                                  "c,_=s.accept(); c.sendall(b'hi'); c.close()"], prefix=PREFIX)
    client = lab.exec_in(1, [sys.executable, "-c", "import socket, time\nfor _ in range(50):\n try:\n"
                                                  "  print(socket.create_connection(('10.77.0.1', 29999)).recv(2).decode()); break\n"
                                                  " except OSError: time.sleep(0.1)"],
                         prefix=PREFIX, stdout=subprocess.PIPE, text=True)
    assert client.communicate(timeout=30)[0].strip() == "hi"
    assert server.wait(timeout=10) == 0

    reshaped = lab.shape(inter_node="20mbit", prefix=PREFIX)
    assert reshaped.inter_node == "20mbit"
    assert lab.qdisc_stats(reshaped)[1]["ingress"]["rate_bps"] == 20_000_000

    # The CLI's status table reads the same state.
    assert cluster_cmd.main(["--prefix", PREFIX, "status"]) == 0
    assert cluster_cmd.main(["--prefix", PREFIX, "exec", "1", "--", "ip", "link", "show", f"{PREFIX}1"]) == 0
    assert cluster_cmd.main(["--prefix", PREFIX, "exec", "7", "--", "true"]) == 2  # no node 7

    lab.down(PREFIX)
    assert _our_namespaces() == []
    assert lab.status(PREFIX) is None
    assert not lab.state_path(PREFIX).exists()


@pytest.mark.lab
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_up_after_crash_cleans_first(lab_env):
    lab.up(1, "100mbit", prefix=PREFIX)
    # A crash: the lab and its state stay behind, plus a half-built node from an interrupted `up`.
    _sh("ip", "netns", "add", f"{PREFIX}-n5")
    with pytest.raises(SyncwiseError, match="damaged|gone"):
        _sh("ip", "netns", "delete", f"{PREFIX}-n0")
        lab.status(PREFIX)

    state = lab.up(2, "50mbit", prefix=PREFIX)
    assert sorted(_our_namespaces()) == sorted([f"{PREFIX}-sw", f"{PREFIX}-n0", f"{PREFIX}-n1"])
    assert lab.status(PREFIX).inter_node == "50mbit" and state.num_nodes == 2

    # State file left behind but namespaces gone (e.g. after a reboot): no lab.
    for ns in _our_namespaces():
        _sh("ip", "netns", "delete", ns)
    assert lab.status(PREFIX) is None


WORKER = textwrap.dedent("""
    import json, os, sys, time
    import torch
    import torch.distributed as dist
    from syncwise.comm import ops

    out_dir, nbytes, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if mode == "fail" and rank == 1:
        sys.exit(3)
    dist.init_process_group("gloo")
    ws = dist.get_world_size()
    x = torch.arange(1000, dtype=torch.float32) + rank
    ops.all_reduce(x)
    ok = torch.equal(x, ws * torch.arange(1000, dtype=torch.float32) + ws * (ws - 1) / 2)
    buf = torch.full((nbytes // 4,), float(rank + 1))
    dist.barrier()
    t0 = time.perf_counter()
    ops.all_reduce(buf)
    dt = time.perf_counter() - t0
    with open(os.path.join(out_dir, f"{mode}-rank{rank}.json"), "w") as f:
        json.dump({"ok": bool(ok) and bool((buf == ws * (ws + 1) / 2).all()), "time": dt,
                   "node": os.environ["SYNCWISE_LAB_NODE"], "ifname": os.environ["GLOO_SOCKET_IFNAME"],
                   "world": ws}, f)
    dist.destroy_process_group()
""")
MB8 = 8 << 20


def _job(tmp: Path, mode: str, nbytes: int = MB8, nproc: int | None = None) -> tuple[int, list[dict]]:
    script = tmp / "worker.py"
    script.write_text(WORKER)
    rc = lab_torchrun([str(script), str(tmp), str(nbytes), mode], nproc_per_node=nproc, script=True,
                      log_dir=tmp / f"logs-{mode}", timeout=120, prefix=PREFIX)
    results = [json.loads(p.read_text()) for p in sorted(tmp.glob(f"{mode}-rank*.json"))]
    return rc, results


@pytest.mark.lab
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_two_node_job_all_reduces_over_shaped_links(lab_env):
    tmp = lab_env
    state = lab.up(2, "50mbit", prefix=PREFIX)
    rc, shaped = _job(tmp, "shaped")
    assert rc == 0, (tmp / "logs-shaped" / "node1.log").read_text()[-2000:]
    assert len(shaped) == 2 and all(r["ok"] and r["world"] == 2 for r in shaped)
    # Every node's address has a name in the namespaces' /etc/hosts: c10d's per-connection warning is gone.
    for node in (0, 1):
        assert "hostname of the client socket cannot be retrieved" not in \
            (tmp / "logs-shaped" / f"node{node}.log").read_text()
    # One rank per node, each bound to its own node's veth.
    assert sorted((r["node"], r["ifname"]) for r in shaped) == [("0", f"{PREFIX}0"), ("1", f"{PREFIX}1")]
    # The payload crossed the shaped links: each node's veth carried at least its ring share (n=2: 1x).
    stats = lab.qdisc_stats(state)
    assert all(stats[i]["egress"]["bytes"] >= MB8 and stats[i]["ingress"]["bytes"] >= MB8 for i in (0, 1))

    lab.shape(inter_node="10gbit", prefix=PREFIX)
    rc, fast = _job(tmp, "fast")
    assert rc == 0 and all(r["ok"] for r in fast)

    t_shaped, t_fast = max(r["time"] for r in shaped), max(r["time"] for r in fast)
    wire_s = MB8 * 8 / 50e6  # a 2-rank ring all-reduce sends the full buffer each way per rank
    assert t_shaped >= 0.8 * wire_s, (t_shaped, wire_s)  # cannot beat the link (burst is 128 KiB)
    assert t_shaped >= 3 * t_fast, (t_shaped, t_fast)


@pytest.mark.lab
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_failed_node_stops_the_job(lab_env):
    lab.up(2, "1gbit", prefix=PREFIX)
    rc, results = _job(lab_env, "fail", nbytes=4096)
    assert rc != 0 and results == []
    # No agent or worker of this run survives (node 0's worker was blocked in rendezvous).
    left = [ns for ns in _our_namespaces() if _sh("ip", "netns", "pids", ns).strip()]
    assert left == []
    log1 = (lab_env / "logs-fail" / "node1.log").read_text()
    assert "exitcode  : 3" in log1 or "exit code 3" in log1 or "exitcode: 3" in log1


@pytest.mark.lab
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_intra_node_rate_shapes_loopback(lab_env):
    # One node, two processes: they talk over the namespace's loopback, shaped to 50 Mbit/s.
    lab.up(1, "10gbit", intra_node="50mbit", procs_per_node=2, prefix=PREFIX)
    rc, res = _job(lab_env, "intra")
    assert rc == 0 and len(res) == 2 and all(r["ok"] and r["node"] == "0" for r in res)
    assert max(r["time"] for r in res) >= 0.8 * MB8 * 8 / 50e6
    assert lab.qdisc_stats(lab.status(PREFIX))[0]["lo"]["bytes"] >= MB8
