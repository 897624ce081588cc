"""Issue 42: nobody outside the job gets in (binding, admission, never unpickle) — docs/security.md.

Every endpoint a one-machine job starts must listen on loopback only: the tests look at the listening sockets
(psutil) and, where the host has a non-loopback address, try to connect to it.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import stat
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest
import torch

from syncwise.errors import SyncwiseError


def _listening(pids: set[int]) -> list[tuple[int, str, int]]:
    return [(c.pid, c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids]


def _outside(listening: list[tuple[int, str, int]]) -> list[tuple[int, str, int]]:
    """The sockets reachable from another machine: bound to a wildcard or a non-loopback address."""
    return [x for x in listening if not ipaddress.ip_address(x[1].split("%")[0]).is_loopback]


def _external_address() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None


def _reachable_from_outside(ports: list[int]) -> list[int]:
    host = _external_address()
    if host is None:
        return []
    out = []
    for port in ports:
        try:
            socket.create_connection((host, port), timeout=1).close()
            out.append(port)
        except OSError:
            pass
    return out


# -------------------------------------------------------------------------------------- row 1 + 3: binding
def _report_listeners():
    import torch.distributed as dist

    from syncwise.train.arguments import join_torchrun

    join_torchrun(torch.device("cpu"))
    t = torch.ones(1)
    dist.all_reduce(t)  # (gloo's pairs are up)
    dist.barrier()
    me = psutil.Process()
    pids = {me.pid, me.ppid()} | {p.pid for p in me.parent().children()}
    found = _listening(pids)
    dist.barrier()
    return found


def test_local_run_endpoints_listen_on_loopback_only():
    """The rendezvous TCPStore (the agent), the workers' TCPStore (rank 0) and gloo: loopback only."""
    from syncwise.launch import run_local

    found = run_local(_report_listeners, 2)
    listening = sorted(set(found[0]) | set(found[1]))
    assert listening, "no listening socket seen"
    assert _outside(listening) == []
    assert _reachable_from_outside([port for _, _, port in listening]) == []


def test_lighthouse_listens_on_loopback_only(tmp_path):
    pytest.importorskip("torchft")
    from syncwise.launch.ft import Lighthouse

    lh = Lighthouse(1, tmp_path / "lighthouse.log")
    try:
        port = int(lh.address.rsplit(":", 1)[1])
        listening = [x for x in _listening({lh.proc.pid}) if x[2] == port]
        assert listening and _outside(listening) == []
        assert _reachable_from_outside([port]) == []
        assert "127.0.0.1" in lh.address
    finally:
        lh.shutdown()


def test_replica_manager_store_and_heal_server_listen_on_loopback_only(tmp_path, monkeypatch):
    """A replica group's torchft ManagerServer (torchft binds it to [::]), its own store and its heal server."""
    pytest.importorskip("torchft")
    from torchft import Manager, ProcessGroupGloo

    from syncwise import bind
    from syncwise.launch.ft import Lighthouse
    from syncwise.train.live_recovery import _bind_host, _manager_bound_to, _transport

    lh = Lighthouse(1, tmp_path / "lighthouse.log")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lh.address)
    before = {x[2] for x in _listening({os.getpid()})}
    manager = None
    try:
        store = bind.tcp_store(_bind_host(), 0, is_master=True, wait_for_workers=False)
        with _manager_bound_to(_bind_host()):
            manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1,
                              load_state_dict=lambda sd: None, state_dict=lambda: {}, use_async_quorum=False,
                              replica_id="replica_0", store_addr=_bind_host(), store_port=store.port, rank=0,
                              world_size=1, lighthouse_addr=lh.address, hostname=_bind_host(),
                              timeout=timedelta(seconds=5), quorum_timeout=timedelta(seconds=5),
                              connect_timeout=timedelta(seconds=5),
                              checkpoint_transport=_transport(timedelta(seconds=5), b"s" * 64))
        new = [x for x in _listening({os.getpid()}) if x[2] not in before]
        assert len(new) >= 3, new  # the store, the manager, the heal server
        assert _outside(new) == []
        assert _reachable_from_outside([port for _, _, port in new]) == []
    finally:
        if manager is not None:
            manager.shutdown(wait=False)
        lh.shutdown()


def test_prometheus_listens_on_loopback_by_default():
    pytest.importorskip("prometheus_client")
    from syncwise.config import RunConfig
    from syncwise.bind import free_port
    from syncwise.metrics.sinks import PrometheusSink

    assert RunConfig().metrics.prometheus_bind == "127.0.0.1"
    port = free_port()
    sink = PrometheusSink(port)
    try:
        listening = [x for x in _listening({os.getpid()}) if x[2] == port]
        assert listening and _outside(listening) == []
        assert _reachable_from_outside([port]) == []
    finally:
        sink.close()


def test_prometheus_bind_is_validated(tmp_path, capsys):
    from syncwise.cli import main

    assert main(["train", "--run-dir", str(tmp_path / "run"), "--metrics.prometheus_bind=every-interface"]) == 2
    err = capsys.readouterr().err.strip()
    assert "metrics.prometheus_bind" in err and "every-interface" in err and len(err.splitlines()) == 1


def test_cluster_files_bind_the_lighthouse_by_the_rule():
    """The Slurm and Kubernetes files ask bind.py on the node, never [::] or 0.0.0.0."""
    import inspect

    from syncwise.launch import kubernetes, slurm

    for module in (slurm, kubernetes):
        text = inspect.getsource(module)
        assert "[::]" not in text and "0.0.0.0" not in text
        assert "syncwise.bind" in text


# -------------------------------------------------------------------------------------- row 2: the job's secret
def test_launcher_secret_is_owner_only(tmp_path):
    from syncwise.errors import ConfigError
    from syncwise.secret import create_secret, read_secret

    path = create_secret(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert create_secret(tmp_path) == path and read_secret(path) == path.read_text().strip().encode()
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="0600"):
        read_secret(path)


class _Payload:
    """Unpickling this runs code: it writes the marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def _serve(body: bytes) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/checkpoint/"


def _pickled(obj) -> bytes:
    import io

    from torch.distributed._serialization import _streaming_save

    buf = io.BytesIO()
    _streaming_save(obj, buf)
    return buf.getvalue()


def test_heal_transfer_round_trip_and_refusals(tmp_path):
    """The heal transport: the same secret heals; another secret is refused by the server and a server without the
    secret is refused by the receiver — before anything is loaded."""
    pytest.importorskip("torchft")
    from syncwise.train.heal_transport import fetch, transport

    secret, other = b"a" * 64, b"b" * 64
    server = transport(timedelta(seconds=5), "127.0.0.1", secret=secret)
    try:
        state = {"model": {"w": torch.arange(4.0)}, "trainer": {"step": 7, "name": "x"}}
        server.send_checkpoint([1], 7, state, timedelta(seconds=5))
        got = server.recv_checkpoint(0, server.metadata(), 7, timedelta(seconds=5))
        assert torch.equal(got["model"]["w"], torch.arange(4.0)) and got["trainer"] == {"step": 7, "name": "x"}
        with pytest.raises(SyncwiseError, match="refused"):
            fetch(f"{server.metadata()}7/full", 7, other, timedelta(seconds=5))
    finally:
        server.shutdown()


def test_heal_transfer_never_unpickles(tmp_path):
    """A rogue peer serving a pickled payload: unsigned, refused by its tag; signed with the job's secret (an insider),
    refused by weights_only. The marker file is never written."""
    pytest.importorskip("torchft")
    from syncwise.train.heal_transport import fetch, payload_tag

    marker = tmp_path / "marker"
    secret = b"a" * 64
    payload = _pickled({"model": _Payload(str(marker))})
    for body in (payload + b"\0" * 32, payload + payload_tag(secret, 3, payload)):
        server, url = _serve(body)
        try:
            with pytest.raises(SyncwiseError, match="refused"):
                fetch(f"{url}3/full", 3, secret, timedelta(seconds=5))
        finally:
            server.shutdown()
        assert not marker.exists()


def test_torchft_http_transport_would_unpickle(tmp_path):
    """What the heal transport replaces: torchft's HTTPTransport runs the planted payload (so the test above is a
    real refusal, not a payload that could not run anyway)."""
    pytest.importorskip("torchft")
    from torchft.checkpointing.http_transport import HTTPTransport

    marker = tmp_path / "marker"
    server, url = _serve(_pickled({"model": _Payload(str(marker))}))
    try:
        HTTPTransport._load_from_address(f"{url}3/full", timedelta(seconds=5))
    finally:
        server.shutdown()
    assert marker.exists()


MANAGER = """
import sys, time
from datetime import timedelta
from torchft import Manager, ProcessGroupGloo
from syncwise import bind
from syncwise.train.live_recovery import _bind_host, _manager_bound_to

store = bind.tcp_store(_bind_host(), 0, is_master=True, wait_for_workers=False)
with _manager_bound_to(_bind_host()):
    m = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1, load_state_dict=lambda sd: None,
                state_dict=lambda: {}, use_async_quorum=False, replica_id="replica_0", store_addr=_bind_host(),
                store_port=store.port, rank=0, world_size=1, lighthouse_addr=sys.argv[1], hostname=_bind_host(),
                timeout=timedelta(seconds=30), quorum_timeout=timedelta(seconds=60),
                connect_timeout=timedelta(seconds=30))
m.start_quorum()
m.wait_quorum()
print("in quorum", flush=True)
time.sleep(300)
"""


def test_torchft_lighthouse_dashboard_kills_a_replica_without_authentication(tmp_path):
    """What docs/security.md says torchft 0.2.0's lighthouse lets anyone who reaches it do: its dashboard's
    /status names every replica's id, and POST /replica/ID/kill makes that replica's process exit (through its
    manager's Kill) — no secret asked. Binding (loopback here) is what keeps it to this machine's users."""
    pytest.importorskip("torchft")
    import re
    import subprocess
    import sys
    import urllib.request

    from syncwise.launch.ft import Lighthouse

    lh = Lighthouse(1, tmp_path / "lighthouse.log")
    script = tmp_path / "manager.py"
    script.write_text(MANAGER)
    replica = subprocess.Popen([sys.executable, str(script), lh.address], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env={**os.environ, "TORCHFT_LIGHTHOUSE": lh.address})
    try:
        lines = []
        for line in replica.stdout:  # (torchft's log lines, then ours)
            lines.append(line)
            if line.startswith("in quorum"):
                break
        assert lines and lines[-1].startswith("in quorum"), "".join(lines)[-2000:]
        status = urllib.request.urlopen(f"{lh.address}/status", timeout=30).read().decode()
        ids = re.findall(r"replica_0:[0-9a-f-]+", status)
        assert ids, status[:2000]
        try:
            urllib.request.urlopen(urllib.request.Request(f"{lh.address}/replica/{ids[0]}/kill", method="POST"),
                                   timeout=30).read()
        except OSError:
            pass  # (the lighthouse's answer may fail: the manager's process ended under the call)
        assert replica.wait(timeout=120) == 1  # the replica's process exited: nobody was asked for a secret
    finally:
        if replica.poll() is None:
            replica.kill()
            replica.wait()
        lh.shutdown()


def test_quorum_with_a_replica_the_job_never_started_is_refused():
    """A member whose replica id is not one of replica_0 .. replica_{R-1} (something that joined the lighthouse)."""
    pytest.importorskip("torchft")
    from types import SimpleNamespace

    from syncwise.train.live_recovery import LiveRecovery

    lr = LiveRecovery(0, 2, "127.0.0.1:1")
    lr.manager = SimpleNamespace(errored=lambda: None, num_participants=lambda: 3, current_step=lambda: 5,
                                 _pg=SimpleNamespace(_global_ranks=[0, 1, 7]), _group_world_size=1)
    with pytest.raises(SyncwiseError, match=r"replica\(s\) \[7\]"):
        lr._after_quorum(6, 0.0, 5)


ADMITTED = """
import sys
from datetime import timedelta
from torchft import Manager, ProcessGroupGloo
from syncwise import bind
from syncwise.errors import SyncwiseError
from syncwise.train.live_recovery import LiveRecovery, _bind_host, _manager_bound_to

replica, secret = int(sys.argv[2]), sys.argv[3].encode()
store = bind.tcp_store(_bind_host(), 0, is_master=True, wait_for_workers=False)
with _manager_bound_to(_bind_host()):
    m = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=60)), min_replica_size=2, load_state_dict=lambda sd: None,
                state_dict=lambda: {}, use_async_quorum=False, replica_id=f"replica_{replica}", store_addr=_bind_host(),
                store_port=store.port, rank=0, world_size=1, lighthouse_addr=sys.argv[1], hostname=_bind_host(),
                timeout=timedelta(seconds=60), quorum_timeout=timedelta(seconds=120),
                connect_timeout=timedelta(seconds=60))
lr = LiveRecovery(replica, 2, sys.argv[1], secret=secret)
lr.manager = m
m.start_quorum()
try:
    lr._after_quorum(1, 0.0, m.current_step())
    print("admitted", lr._members(), flush=True)
except SyncwiseError as e:
    print("refused:", e, flush=True)
m.shutdown(wait=False)
"""


@pytest.mark.parametrize("second", ["the job's secret", "another secret"])
def test_a_quorum_member_without_the_jobs_secret_is_refused_before_gradients(tmp_path, second):
    """Two real torchft managers in one quorum through a real lighthouse: each member proves the job's secret
    (LiveRecovery._admit). With the same secret both are admitted; a member that joined under replica_1's name
    without it is named by replica 0, which refuses the quorum (torchft itself would have admitted it)."""
    pytest.importorskip("torchft")
    import subprocess
    import sys

    from syncwise.launch.ft import Lighthouse

    lh = Lighthouse(2, tmp_path / "lighthouse.log")
    script = tmp_path / "admitted.py"
    script.write_text(ADMITTED)
    secrets = ["s" * 32, "s" * 32 if second == "the job's secret" else "x" * 32]
    procs = [subprocess.Popen([sys.executable, str(script), lh.address, str(r), secrets[r]], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lh.shutdown()
    said = [next((line for line in out.splitlines() if line.startswith(("admitted", "refused"))), out[-2000:])
            for out in outs]
    if second == "the job's secret":
        assert said == ["admitted [0, 1]", "admitted [0, 1]"], said
    else:
        assert said[0].startswith("refused:") and "replica(s) [1] did not prove the job's secret" in said[0], said
        assert said[1].startswith("refused:") and "replica(s) [0] did not prove" in said[1], said


# -------------------------------------------------------------------------------------- row 2: integrations
def test_transformers_callback_refuses_a_pickled_compressor_checkpoint(tmp_path):
    """A planted ``checkpoint-N/syncwise_compress.pt`` whose unpickling would run code: refused, nothing run."""
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from syncwise.integrations.transformers import FILENAME, SyncwiseTrainerCallback

    marker = tmp_path / "marker"
    folder = tmp_path / "out" / "checkpoint-3"
    folder.mkdir(parents=True)
    torch.save({"format": "syncwise.compress/per-rank/1", "world_size": 1, "ranks": [_Payload(str(marker))]},
               folder / FILENAME)
    cb = SyncwiseTrainerCallback("powersgd:rank=2")
    args = SimpleNamespace(output_dir=str(tmp_path / "out"), world_size=1, process_index=0)
    with pytest.raises(SyncwiseError, match="refused"):
        cb.on_train_begin(args, SimpleNamespace(global_step=3), None, model=torch.nn.Linear(2, 2))
    assert not marker.exists()
