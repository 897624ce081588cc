"""An emulated multi-node cluster on one host: network namespaces, a bridge, and tbf-shaped links.

Layout (prefix ``swlab``, N nodes)::

    netns swlab-sw :  bridge swlabbr  <- ports swlabp0 .. swlabp{N-1}   (tbf: bridge -> node i)
    netns swlab-n0 :  lo (tbf if intra_node) , swlab0 = 10.77.0.1/24    (tbf: node 0 -> bridge)
    netns swlab-n1 :  lo (tbf if intra_node) , swlab1 = 10.77.0.2/24    (tbf: node 1 -> bridge)

Every interface is created inside the lab's own namespaces, so the root namespace's interfaces,
routes and qdiscs are never touched; deleting the namespaces removes every veth, the bridge and
every qdisc. ``netem`` (delay/loss) is not available on the kernels this runs on, so links are
shaped in rate only, with ``tc qdisc ... tbf``, on both ends of each veth (both directions).

The lab's state (nodes, addresses, interface names, rates) lives in a JSON file
(``$SYNCWISE_LAB_DIR/<prefix>.json``, default ``/run/syncwise-lab``) so ``status`` and the
launcher can find a running lab from any process.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import ConfigError, SyncwiseError

#: The lab's default prefix; ``SYNCWISE_LAB_PREFIX`` names another lab for every syncwise command started with it
#: (``syncwise train --lab``, ``syncwise cluster``), so jobs can run on a lab other than the shared ``swlab``.
PREFIX = os.environ.get("SYNCWISE_LAB_PREFIX") or "swlab"
DEFAULT_SUBNET = "10.77.0.0/24"
MAX_NODES = 64
_STATE_DIR_ENV = "SYNCWISE_LAB_DIR"
_DEFAULT_STATE_DIR = "/run/syncwise-lab"

# tc's rate units (iproute2 uses SI multiples for kbit/mbit/...); byte units are deliberately not
# accepted, so "100mbit" can never be confused with 100 megabytes per second.
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)\s*$", re.IGNORECASE)
_RATE_ACCEPTED = "a rate like 500kbit, 100mbit, 1gbit (units: bit, kbit, mbit, gbit, tbit; 10kbit..10tbit)"
_SIZE_UNITS = {"b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*(b|k|kb|m|mb)?\s*$", re.IGNORECASE)
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_TIME_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s)\s*$", re.IGNORECASE)
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{1,7}$")


# ----------------------------------------------------------------------------------- values


def parse_rate(value: str | int, field: str = "bandwidth") -> int:
    """Parse a tc rate ('100mbit', '1gbit', '500kbit') into bits per second; ConfigError if invalid."""
    if isinstance(value, int) and not isinstance(value, bool):
        bps = value
    else:
        m = _RATE_RE.match(str(value))
        if not m:
            raise ConfigError(field, value, _RATE_ACCEPTED)
        bps = int(float(m.group(1)) * _RATE_UNITS[m.group(2).lower()])
    # Below ~10 kbit/s TCP's timers dominate; above 10 tbit/s tbf's 64-bit rate is meaningless here.
    if not 10_000 <= bps <= 10**13:
        raise ConfigError(field, value, _RATE_ACCEPTED)
    return bps


def format_rate(bps: int) -> str:
    """Render bits/s in tc's units, e.g. 100000000 -> '100mbit'."""
    for unit, mult in (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps >= mult and bps % mult == 0:
            return f"{bps // mult}{unit}"
    return f"{bps}bit"


def parse_size(value: str | int, field: str = "burst") -> int:
    """Parse a byte size ('256kb', '1mb', '65536') into bytes, as tc reads it (k = 1024)."""
    if isinstance(value, int) and not isinstance(value, bool):
        nbytes = value
    else:
        m = _SIZE_RE.match(str(value))
        if not m:
            raise ConfigError(field, value, "a size like 64kb, 256kb, 1mb (units: b, kb, mb)")
        nbytes = int(m.group(1)) * _SIZE_UNITS[(m.group(2) or "b").lower()]
    if not 2048 <= nbytes <= 64 * 1024**2:
        raise ConfigError(field, value, "a size between 2kb and 64mb")
    return nbytes


def parse_latency(value: str | float, field: str = "latency") -> float:
    """Parse tbf's queueing latency bound ('50ms', '1s', '500us') into seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        m = _TIME_RE.match(str(value))
        if not m:
            raise ConfigError(field, value, "a duration like 500us, 50ms, 1s")
        seconds = float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]
    if not 1e-4 <= seconds <= 10:
        raise ConfigError(field, value, "a duration between 100us and 10s")
    return seconds


def default_latency(bps: int) -> float:
    """tbf queue bound for a rate: room for ~2.5 MB (20 Mbit) of queued frames, between 50 ms and 1 s.

    A short queue drops packets of a bulk all-reduce at low rates and TCP then backs off: measured, a 64 MB
    all-reduce at 100mbit reached 0.915 of the link with a 50 ms queue and 0.946 with 200 ms.
    """
    return min(1.0, max(0.05, 20e6 / bps))


def default_burst(bps: int) -> int:
    """tbf bucket size for a rate: 4 ms of traffic, at least 128 KiB.

    The floor keeps a 64 KiB GSO super-packet (and lo's 64 KiB MTU) inside one bucket, which tbf
    needs to pass it at all; 4 ms of traffic keeps multi-gigabit rates accurate despite timer jitter.
    The burst is small next to the megabytes a large model's all-reduce moves, not next to a small one's (1 Gbit/s:
    500 KB, most of `tiny`'s 558 KB of fp32 gradients): the planner models the bucket (``Fabric.burst_bytes``,
    ``syncwise.plan.cost``), and ``syncwise plan --calibrate --lab`` and ``--compress auto`` pass it on.
    """
    return max(128 * 1024, int(bps / 8 * 0.004))


# ------------------------------------------------------------------------------------ state


@dataclass
class LabNode:
    """One emulated node: its namespace, address and the two ends of its link."""

    index: int
    namespace: str
    address: str
    ifname: str       # node-side veth, inside `namespace` (gloo binds here: GLOO_SOCKET_IFNAME)
    bridge_port: str  # bridge-side veth, inside the switch namespace


@dataclass
class LabState:
    """A running lab as persisted in its state file."""

    prefix: str
    nodes: list[LabNode]
    subnet: str
    switch_namespace: str
    bridge: str
    bandwidth: str
    inter_node: str
    inter_node_bps: int
    intra_node: str | None
    intra_node_bps: int | None
    burst: int
    latency: float
    procs_per_node: int = 1
    created: float = field(default_factory=time.time)

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return len(self.nodes)

    @property
    def namespaces(self) -> list[str]:
        """Every namespace the lab owns (switch first)."""
        return [self.switch_namespace] + [n.namespace for n in self.nodes]

    def node(self, index: int) -> LabNode:
        """The node with this index; ConfigError if out of range."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.nodes):
            raise ConfigError("node", index, f"a node index 0..{len(self.nodes) - 1}")
        return self.nodes[index]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LabState":
        """Inverse of to_dict."""
        d = dict(d)
        d["nodes"] = [LabNode(**n) for n in d["nodes"]]
        return cls(**d)


def state_path(prefix: str = PREFIX) -> Path:
    """Where the lab with this prefix keeps its state ($SYNCWISE_LAB_DIR/<prefix>.json)."""
    return Path(os.environ.get(_STATE_DIR_ENV, _DEFAULT_STATE_DIR)) / f"{prefix}.json"


def lock_path(prefix: str = PREFIX) -> Path:
    """The lab's lock file (kept: removing a lock file under a holder would let a second owner in)."""
    return state_path(prefix).with_suffix(".lock")


class LabLock:
    """A job's shared hold on a lab, or ``up``/``down``'s exclusive one (flock, as a run directory's lock):
    ``cluster up`` / ``down`` never tear down a lab a job is using. The kernel drops it when its holder exits."""

    def __init__(self, prefix: str, exclusive: bool):
        self.prefix, self.exclusive = prefix, exclusive
        self._fd: int | None = None

    def __enter__(self) -> "LabLock":
        import fcntl

        path = lock_path(self.prefix)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return self  # not root: what needs the lab says so itself (check_supported), with the fix
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if self.exclusive:
                raise SyncwiseError(f"the lab '{self.prefix}' is in use by a running job (syncwise train --lab, "
                                    "bench --lab or cluster run); nothing was changed. Wait for the job to end (or "
                                    "stop it), or use another --prefix for a second lab.") from None
            raise SyncwiseError(f"the lab '{self.prefix}' is being set up or taken down right now "
                                "(syncwise cluster up/down); run the job when that has finished.") from None
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None


def _write_state(state: LabState) -> None:
    path = state_path(state.prefix)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state.to_dict(), indent=2))
    tmp.replace(path)  # atomic: a reader never sees half a file


def _read_state(prefix: str) -> LabState | None:
    path = state_path(prefix)
    try:
        return LabState.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError) as e:
        raise SyncwiseError(f"the lab state file {path} is unreadable ({e}); run `syncwise cluster down` "
                            "to remove the lab and its state, then `syncwise cluster up` again.") from None


# ------------------------------------------------------------------------------ host checks


def check_supported(euid: int | None = None) -> None:
    """Raise SyncwiseError unless this process can build a lab (root, `ip netns`, `tc`)."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        raise SyncwiseError(
            "the network lab needs root: it creates network namespaces, a bridge and tc qdiscs "
            f"(this process runs as uid {euid}). Run the command as root, e.g. "
            "`sudo syncwise cluster up --nodes 2 --bandwidth 100mbit`, or in a container with "
            "CAP_NET_ADMIN and CAP_SYS_ADMIN.")
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            raise SyncwiseError(f"the network lab needs the `{tool}` command, which is not on PATH; "
                                f"install {pkg} (e.g. `apt-get install {pkg}`).")
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise SyncwiseError("`ip netns list` failed, so this system cannot create network namespaces "
                            f"({probe.stderr.strip() or 'no message'}). The lab needs a Linux kernel "
                            "with network namespaces and permission to create them (root or CAP_SYS_ADMIN).")


def _run(argv: Sequence[str]) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SyncwiseError(f"lab command failed: `{' '.join(argv)}`: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _in_ns(ns: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Namespaces on this host that belong to the lab with this prefix (`<prefix>-...`)."""
    out = _run(["ip", "netns", "list"])
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix + "-")]


def _validate_prefix(prefix: str) -> None:
    # Interface names are capped at 15 chars: "<prefix>p63" must fit.
    if not _PREFIX_RE.match(prefix):
        raise ConfigError("prefix", prefix, "2-8 lowercase letters/digits starting with a letter")


def _check_subnet(subnet: str, nodes: int) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.IPv4Network(subnet, strict=True)
    except ValueError:
        raise ConfigError("subnet", subnet, "an IPv4 network like 10.77.0.0/24") from None
    if net.num_addresses - 2 < nodes or not net.is_private:
        raise ConfigError("subnet", subnet, f"a private IPv4 network with room for {nodes} hosts")
    # The lab's namespaces are isolated, but overlapping a host route would make addresses ambiguous
    # to anyone reading logs or routing into the lab later: refuse it.
    for line in _run(["ip", "-4", "route", "show"]).splitlines():
        dest = line.split()[0] if line.strip() else ""
        if dest in ("default", ""):
            continue
        try:
            host_net = ipaddress.IPv4Network(dest, strict=False)
        except ValueError:
            continue
        if net.overlaps(host_net):
            raise ConfigError("subnet", subnet, f"a private network not overlapping the host route {dest}")
    return net


# -------------------------------------------------------------------------------- lifecycle


def _tbf(ns: str, dev: str, bps: int, burst: int, latency: float, verb: str = "add") -> list[str]:
    return _in_ns(ns, "tc", "qdisc", verb, "dev", dev, "root", "tbf", "rate", f"{bps}bit",
                  "burst", str(burst), "latency", f"{int(latency * 1e6)}us")


def up(nodes: int, bandwidth: str, inter_node: str | None = None, intra_node: str | None = None,
       procs_per_node: int = 1, burst: str | int | None = None, latency: str | float | None = None,
       subnet: str = DEFAULT_SUBNET, prefix: str = PREFIX) -> LabState:
    """Build an N-node lab whose links are shaped to ``inter_node`` (default ``bandwidth``) both ways.

    ``intra_node`` (optional) also shapes each node's loopback, which processes on the same node use
    to talk to each other. Any lab with the same prefix left by a crashed run is removed first.
    """
    if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
        raise ConfigError("nodes", nodes, f"an integer 1..{MAX_NODES}")
    if isinstance(procs_per_node, bool) or not isinstance(procs_per_node, int) or procs_per_node < 1:
        raise ConfigError("procs_per_node", procs_per_node, "an integer >= 1")
    _validate_prefix(prefix)
    with LabLock(prefix, exclusive=True):  # never over a lab a job is using
        return _up(nodes, bandwidth, inter_node, intra_node, procs_per_node, burst, latency, subnet, prefix)


def _up(nodes: int, bandwidth: str, inter_node: str | None, intra_node: str | None, procs_per_node: int,
        burst: str | int | None, latency: str | float | None, subnet: str, prefix: str) -> LabState:
    parse_rate(bandwidth, "bandwidth")
    inter_bps = parse_rate(inter_node if inter_node is not None else bandwidth,
                           "inter_node" if inter_node is not None else "bandwidth")
    intra_bps = parse_rate(intra_node, "intra_node") if intra_node is not None else None
    lat = parse_latency(latency) if latency is not None else None
    check_supported()
    net = _check_subnet(subnet, nodes)
    burst_b = parse_size(burst) if burst is not None else None

    _cleanup(prefix)  # a crashed run may have left namespaces and a state file behind

    hosts = net.hosts()
    sw = f"{prefix}-sw"
    state = LabState(
        prefix=prefix, subnet=str(net), switch_namespace=sw, bridge=f"{prefix}br",
        nodes=[LabNode(i, f"{prefix}-n{i}", str(next(hosts)), f"{prefix}{i}", f"{prefix}p{i}")
               for i in range(nodes)],
        bandwidth=format_rate(parse_rate(bandwidth)), inter_node=format_rate(inter_bps), inter_node_bps=inter_bps,
        intra_node=format_rate(intra_bps) if intra_bps else None, intra_node_bps=intra_bps,
        burst=burst_b or default_burst(inter_bps),
        latency=lat if lat is not None else default_latency(min(inter_bps, intra_bps or inter_bps)),
        procs_per_node=procs_per_node)
    try:
        _run(["ip", "netns", "add", sw])
        _run(_in_ns(sw, "ip", "link", "set", "lo", "up"))
        _run(_in_ns(sw, "ip", "link", "add", state.bridge, "type", "bridge"))
        _run(_in_ns(sw, "ip", "link", "set", state.bridge, "up"))
        for n in state.nodes:
            _run(["ip", "netns", "add", n.namespace])
            # Create the pair inside the switch namespace, then move one end: nothing ever
            # appears in the root namespace, even for an instant.
            _run(_in_ns(sw, "ip", "link", "add", n.bridge_port, "type", "veth", "peer", "name", n.ifname))
            _run(_in_ns(sw, "ip", "link", "set", n.ifname, "netns", n.namespace))
            _run(_in_ns(sw, "ip", "link", "set", n.bridge_port, "master", state.bridge))
            _run(_in_ns(sw, "ip", "link", "set", n.bridge_port, "up"))
            _run(_in_ns(n.namespace, "ip", "link", "set", "lo", "up"))
            _run(_in_ns(n.namespace, "ip", "addr", "add", f"{n.address}/{net.prefixlen}", "dev", n.ifname))
            _run(_in_ns(n.namespace, "ip", "link", "set", n.ifname, "up"))
            _run(_tbf(n.namespace, n.ifname, inter_bps, state.burst, state.latency))  # node -> bridge
            _run(_tbf(sw, n.bridge_port, inter_bps, state.burst, state.latency))      # bridge -> node
            if intra_bps:
                _run(_tbf(n.namespace, "lo", intra_bps, burst_b or default_burst(intra_bps), state.latency))
        _write_hosts(state)
        _write_state(state)
    except BaseException:
        _cleanup(prefix)
        raise
    return state


#: `ip netns exec NS` bind-mounts /etc/netns/NS/hosts over /etc/hosts when it exists (ip-netns(8)).
NETNS_ETC = Path("/etc/netns")


def _write_hosts(state: LabState) -> None:
    """Name every node's address in its namespace's /etc/hosts: c10d looks the peers' addresses up, and without a
    name for them (no DNS in a namespace) warns 'The hostname of the client socket cannot be retrieved' per
    connection."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             *(f"{n.address}\t{n.namespace}" for n in state.nodes),
             # c10d's store listens on both stacks: a peer's address arrives IPv4-mapped (::ffff:a.b.c.d)
             *(f"::ffff:{n.address}\t{n.namespace}" for n in state.nodes)]
    for n in state.nodes:
        d = NETNS_ETC / n.namespace
        d.mkdir(parents=True, exist_ok=True)
        (d / "hosts").write_text("\n".join(lines) + "\n")


def shape(inter_node: str | None = None, intra_node: str | None = None, prefix: str = PREFIX) -> LabState:
    """Change the rates of the running lab in place (tc qdisc replace); returns the new state."""
    state = status(prefix)
    if state is None:
        raise SyncwiseError(f"no lab '{prefix}' is running; start one with `syncwise cluster up`.")
    if inter_node is not None:
        bps = parse_rate(inter_node, "inter_node")
        state.inter_node, state.inter_node_bps = format_rate(bps), bps
        state.burst = default_burst(bps)
        state.latency = max(state.latency, default_latency(bps))  # a slower link needs a deeper queue
        for n in state.nodes:
            _run(_tbf(n.namespace, n.ifname, bps, state.burst, state.latency, "replace"))
            _run(_tbf(state.switch_namespace, n.bridge_port, bps, state.burst, state.latency, "replace"))
    if intra_node is not None:
        bps = parse_rate(intra_node, "intra_node")
        state.intra_node, state.intra_node_bps = format_rate(bps), bps
        for n in state.nodes:
            _run(_tbf(n.namespace, "lo", bps, default_burst(bps), state.latency, "replace"))
    _write_state(state)
    return state


def _cleanup(prefix: str) -> None:
    # Node namespaces first, switch last; deleting a namespace destroys its veths (and so their
    # peers), the bridge and every qdisc attached to them.
    names = sorted(list_namespaces(prefix), key=lambda n: n == f"{prefix}-sw")
    for ns in names:
        _run(["ip", "netns", "delete", ns])
    for etc in NETNS_ETC.glob(f"{prefix}-*"):  # the nodes' /etc/hosts (_write_hosts), also of namespaces gone
        shutil.rmtree(etc, ignore_errors=True)
    state_path(prefix).unlink(missing_ok=True)


def down(prefix: str = PREFIX) -> None:
    """Remove the lab: every namespace (hence veth, bridge and qdisc) it made, and its state file."""
    _validate_prefix(prefix)
    with LabLock(prefix, exclusive=True):  # not while a job uses it
        check_supported()
        _cleanup(prefix)
    left = list_namespaces(prefix)
    if left:
        raise SyncwiseError(f"could not remove lab namespaces {left}; a process may still hold them "
                            "(check `ip netns pids NAME`), stop it and run `syncwise cluster down` again.")


def status(prefix: str = PREFIX) -> LabState | None:
    """The running lab, or None if there is none. SyncwiseError if its namespaces are half gone."""
    state = _read_state(prefix)
    if state is None:
        return None
    present = set(list_namespaces(prefix))
    missing = [ns for ns in state.namespaces if ns not in present]
    if len(missing) == len(state.namespaces):
        return None  # state file from a lab whose namespaces are gone (e.g. after a reboot)
    if missing:
        raise SyncwiseError(f"the lab '{prefix}' is damaged: namespaces {missing} are gone. Run "
                            "`syncwise cluster down` and `syncwise cluster up` again.")
    return state


def require(prefix: str = PREFIX) -> LabState:
    """Like status(), but a SyncwiseError telling the user to start a lab if none is running."""
    state = status(prefix)
    if state is None:
        raise SyncwiseError("no network lab is running; start one with "
                            "`syncwise cluster up --nodes 2 --bandwidth 100mbit` (as root).")
    return state


def qdisc_stats(state: LabState) -> dict[int, dict[str, dict[str, Any]]]:
    """Per node, tbf counters of each shaped direction: {'egress'|'ingress'|'lo': {rate_bps, bytes, ...}}.

    'egress' is node -> bridge (the node's veth), 'ingress' is bridge -> node (the bridge port).
    """
    def one(ns: str, dev: str) -> dict[str, Any] | None:
        for q in json.loads(_run(_in_ns(ns, "tc", "-s", "-j", "qdisc", "show", "dev", dev)) or "[]"):
            if q.get("kind") == "tbf":
                return {"rate_bps": int(q.get("options", {}).get("rate", 0)) * 8, "bytes": q.get("bytes", 0),
                        "packets": q.get("packets", 0), "drops": q.get("drops", 0),
                        "overlimits": q.get("overlimits", 0)}
        return None

    out: dict[int, dict[str, dict[str, Any]]] = {}
    for n in state.nodes:
        entry = {"egress": one(n.namespace, n.ifname), "ingress": one(state.switch_namespace, n.bridge_port),
                 "lo": one(n.namespace, "lo")}
        out[n.index] = {k: v for k, v in entry.items() if v is not None}
    return out


# ---------------------------------------------------------------------------------- running


def node_command(state: LabState, node: int, argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """The argv that runs ``argv`` inside a node's namespace with ``env`` added (for logs and Popen)."""
    n = state.node(node)
    assigns = [f"{k}={v}" for k, v in (env or {}).items()]
    return ["ip", "netns", "exec", n.namespace, "env", f"SYNCWISE_LAB_NODE={n.index}", *assigns, *argv]


def exec_in(node: int, argv: Sequence[str], env: Mapping[str, str] | None = None, prefix: str = PREFIX,
            **popen_kwargs: Any) -> subprocess.Popen:
    """Start ``argv`` in a node's namespace (as ``subprocess.Popen``); the caller waits on it."""
    if not argv:
        raise ConfigError("argv", list(argv), "a non-empty command")
    state = require(prefix)
    return subprocess.Popen(node_command(state, node, argv, env), **popen_kwargs)
