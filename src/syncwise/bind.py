"""Where every endpoint of a job listens: one rule (:func:`bind_host`), used by every launcher (docs/security.md).

A syncwise job opens these listening sockets: the rendezvous TCPStore (torchrun's agent), the workers' TCPStore
(rank 0), gloo's pair sockets, torchft's lighthouse, each replica group's torchft manager and its heal
(checkpoint HTTP) server, and the Prometheus exporter. None of them authenticates a client (PyTorch's security
policy: distributed features are for trusted internal networks), so none of them may listen on an address that
does not need to be reached:

- a job on one machine: loopback (127.0.0.1) only — nothing outside the machine can connect;
- a job on several nodes: the node's own address (:func:`node_address`: what its host name resolves to, else the
  address of the interface of its default route) — never every interface (``0.0.0.0`` / ``[::]``).

``SYNCWISE_BIND_HOST`` overrides the rule (an address of this machine); the launchers put the chosen address
there, so the workers, the agent and the live-recovery code read one value. The Slurm and Kubernetes files ask
this module on each node (``python -m syncwise.bind``), so their lighthouse and agents follow the same rule.

torch's TCPStore has no bind option (its server listens on every interface); it accepts a socket already bound
and listening (``master_listen_fd``): :func:`tcp_store` passes one bound to the chosen address, and the
``syncwise-c10d`` rendezvous backend (torch's c10d backend with that store) does the same for the rendezvous.
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import sys
from datetime import timedelta
from typing import Any, Optional

ENV_BIND = "SYNCWISE_BIND_HOST"
LOOPBACK = "127.0.0.1"
RDZV_BACKEND = "syncwise-c10d"  # torch's c10d rendezvous, its store bound by this module's rule


def bind_host(nodes: int = 1) -> str:
    """THE rule: the address this job's endpoints listen on (and advertise) on this node. ``nodes``: how many
    machines the job spans (1: loopback). ``SYNCWISE_BIND_HOST`` wins when set."""
    explicit = os.environ.get(ENV_BIND, "").strip()
    if explicit:
        return explicit
    return LOOPBACK if nodes <= 1 else node_address()


def bind_host_for(max_nodes: int, *peers: str) -> str:
    """:func:`bind_host` for a process that knows its job by what it was given: the job spans several machines
    when it may have more than one node or any address it was given (the rendezvous, the lighthouse: HOST:PORT or
    http://HOST:PORT) is not loopback."""
    hosts = [_host_of(p) for p in peers if p]
    return bind_host(nodes=2 if max_nodes > 1 or any(not is_loopback(h) for h in hosts) else 1)


def _host_of(address: str) -> str:
    rest = address.split("://", 1)[-1].split("/", 1)[0]
    if rest.startswith("["):
        return rest[1:].split("]", 1)[0]
    return rest.rsplit(":", 1)[0] if rest.count(":") == 1 else rest


def node_address() -> str:
    """This node's own address as its peers reach it: the host name's address when that is not loopback, else the
    address of the interface that routes off the machine (a UDP 'connect' sends nothing)."""
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, proto=socket.IPPROTO_TCP):
            addr = info[4][0]
            if not ipaddress.ip_address(addr.split("%")[0]).is_loopback:
                return addr
    except (OSError, ValueError):
        pass
    for family, probe in ((socket.AF_INET, ("192.0.2.1", 9)), (socket.AF_INET6, ("2001:db8::1", 9))):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(probe)
                addr = s.getsockname()[0]
            if not ipaddress.ip_address(addr).is_loopback:
                return addr
        except OSError:
            continue
    return LOOPBACK


def hostport(host: str, port: int) -> str:
    """HOST:PORT with an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_interface() -> Optional[str]:
    """The name of the interface that carries 127.0.0.1 ('lo' on Linux), for GLOO_SOCKET_IFNAME."""
    try:
        found = interface_addresses()
    except OSError:
        return None
    return next((name for name, addrs in sorted(found.items()) if LOOPBACK in addrs), None)


def job_env(host: str, env: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The variables that carry the rule to a job's processes: SYNCWISE_BIND_HOST, and for a loopback job the
    collective libraries' socket interface (gloo's and NCCL's bootstrap sockets listen on it); values the user set
    are kept."""
    env = os.environ if env is None else env
    env[ENV_BIND] = host
    if is_loopback(host):
        lo = loopback_interface()
        if lo:
            env.setdefault("GLOO_SOCKET_IFNAME", lo)
            env.setdefault("NCCL_SOCKET_IFNAME", lo)
    return env


ENV_GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
ENV_NCCL_IFNAME = "NCCL_SOCKET_IFNAME"
ENV_GLOO_LAZY = "TORCH_GLOO_LAZY_INIT"


def interface_addresses() -> dict[str, list[str]]:
    """This machine's interfaces and their IP addresses (psutil when installed, else IPv4 by ioctl)."""
    try:
        import psutil

        return {name: [a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
                for name, addrs in psutil.net_if_addrs().items()}
    except ImportError:
        pass
    import fcntl
    import struct

    out: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                out[name] = [socket.inet_ntoa(raw[20:24])]
            except OSError:
                out[name] = []
    return out


def gloo_interface(env: "dict[str, str] | os._Environ", interfaces: dict[str, list[str]]) -> Optional[str]:
    """The ``GLOO_SOCKET_IFNAME`` a worker gets when its environment sets none (None: leave gloo to choose).

    Without it gloo binds to what the host name resolves to: on a machine whose ``/etc/hosts`` maps it to
    127.0.1.1 (Debian, Ubuntu) every rank advertises a loopback address and a multi-node start-up hangs. So:

    1. NCCL's interface when the job names one (``NCCL_SOCKET_IFNAME``): its exact names (``=eth0``) as given, a
       prefix (``eth``) as this machine's interfaces that start with it; an exclusion list (``^docker``) says
       nothing about which one to use and is skipped;
    2. else the interface that carries the bind rule's address (``SYNCWISE_BIND_HOST``, set by every launcher:
       loopback on one machine, the node's own address on several).
    """
    nccl = env.get(ENV_NCCL_IFNAME, "").strip()
    if nccl and not nccl.startswith("^"):
        names: list[str] = []
        for part in (p.strip() for p in nccl.split(",")):
            if part.startswith("="):
                names.append(part[1:])
            elif part:
                names += sorted(n for n in interfaces if n.startswith(part) and interfaces[n])
        names = [n for i, n in enumerate(names) if n and n not in names[:i]]
        if names:
            return ",".join(names)
    host = env.get(ENV_BIND, "").strip().strip("[]")
    if host:
        for name, addrs in sorted(interfaces.items()):
            if host in addrs:
                return name
    return None


def gloo_env(backend: str, env: "Optional[dict[str, str] | os._Environ]" = None,
             interfaces: Optional[dict[str, list[str]]] = None) -> dict[str, str]:
    """Set gloo's socket rule in a worker's environment before ``init_process_group`` (values the user set win);
    returns what it added. Both the worker (``CommContext``) and the Python API (``join_torchrun``) ask it, so every
    launcher — syncwise's, Slurm's, Kubernetes', a hand-run torchrun — gets it on each node with that node's
    interfaces.

    - ``GLOO_SOCKET_IFNAME``: :func:`gloo_interface`;
    - ``TORCH_GLOO_LAZY_INIT=1`` when the job's backend is NCCL (``backend`` as given to ``init_process_group``):
      each group's gloo half (devices.NCCL_PROCESS_GROUP) then connects a pair on its first use instead of a full
      mesh at creation (each rank: one listening socket per group, not one per group and peer), and a group
      whose gloo half never carries a collective never opens a connection. A gloo job keeps gloo's eager mesh:
      there every group carries the training's collectives anyway.
    """
    env = os.environ if env is None else env
    added: dict[str, str] = {}
    if not env.get(ENV_GLOO_IFNAME, "").strip():
        name = gloo_interface(env, interface_addresses() if interfaces is None else interfaces)
        if name:
            added[ENV_GLOO_IFNAME] = name
    if "nccl" in str(backend) and ENV_GLOO_LAZY not in env:
        added[ENV_GLOO_LAZY] = "1"
    env.update(added)
    return added


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: any free port) and listening."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    family, _, _, _, addr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        s.listen(1024)
    except OSError:
        s.close()
        raise
    return s


def free_port(host: Optional[str] = None) -> int:
    """A TCP port free on ``host`` (the rule's address) right now."""
    with contextlib.closing(listening_socket(host or bind_host(), 0)) as s:
        return s.getsockname()[1]


WILDCARD = "0.0.0.0"


def store_bind(host_name: str) -> str:
    """Where a store server whose clients are told ``host_name`` listens: that address itself (a literal address,
    or what the name resolves to here), so it is reachable exactly where it is advertised.

    One case has no single right address: a job that spans machines whose advertised host name resolves to loopback
    on this node (/etc/hosts mapping the node's own name to 127.0.0.1 or 127.0.1.1, as Debian does). The agents on
    this node connect to loopback, those on the others to the node's real address, and one socket cannot listen on
    both: the store then listens on every interface, as torch's own does, and says so in one line with the fix."""
    try:
        ipaddress.ip_address(host_name.strip("[]"))
        return host_name.strip("[]")
    except ValueError:
        pass
    try:
        addr = socket.getaddrinfo(host_name, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return bind_host()
    if is_loopback(addr) and not is_loopback(bind_host()):
        print(f"syncwise: {host_name!r} resolves to {addr} on this node but the job spans machines: its store listens "
              f"on every interface (so this node's agents and the others' both reach it). Map {host_name} to its "
              f"network address in /etc/hosts, or give the rendezvous endpoint as an address, to bind it to that "
              "address only (docs/security.md)", file=sys.stderr, flush=True)
        return WILDCARD
    return addr


def tcp_store(host_name: str, port: int, *args: Any, is_master: bool = False, bind: Optional[str] = None,
              **kwargs: Any) -> Any:
    """``torch.distributed.TCPStore`` whose server (``is_master``) listens on ``bind`` (default:
    :func:`store_bind` of ``host_name``) only, not on every interface. A client is a plain TCPStore."""
    import torch.distributed as dist

    if not is_master or kwargs.get("master_listen_fd") is not None:
        return dist.TCPStore(host_name, port, *args, is_master=is_master, **kwargs)
    bind = bind or store_bind(host_name)
    try:
        sock = listening_socket(bind, port)
    except OSError as e:  # (as TCPStore reports a port in use: torch's rendezvous retries as a client on it)
        raise RuntimeError(f"cannot listen on {hostport(bind, port)}: {e.strerror}") from None
    bound_port = sock.getsockname()[1]
    try:
        return dist.TCPStore(host_name, bound_port, *args, is_master=True, master_listen_fd=sock.detach(), **kwargs)
    except BaseException:
        sock.close()
        raise


def worker_store(timeout: Optional[timedelta] = None) -> Optional[Any]:
    """The workers' store for ``init_process_group(store=...)`` under torchrun (MASTER_ADDR/MASTER_PORT, RANK,
    WORLD_SIZE in the environment): rank 0's server bound by the rule; None when torchrun shares its agent's store
    (TORCHELASTIC_USE_AGENT_STORE) or the environment is incomplete (init_process_group's env:// then decides)."""
    need = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(k in os.environ for k in need) or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    kwargs: dict[str, Any] = {"timeout": timeout} if timeout else {}
    store = tcp_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=rank == 0,
                      wait_for_workers=False, **kwargs)
    return store


def store_kwargs(timeout: Optional[timedelta] = None) -> dict[str, Any]:
    """``init_process_group`` keyword arguments that give it :func:`worker_store` (rank 0's server bound by the
    rule) instead of env://'s store on every interface; {} when there is none to make."""
    store = worker_store(timeout)
    if store is None:
        return {}
    return {"store": store, "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


# ------------------------------------------------------------------------------- the rendezvous (torchrun's agent)
def _create_rendezvous(params: Any) -> Any:
    """torch's c10d rendezvous handler, its TCPStore server listening on the rule's address only."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    original = c10d.TCPStore
    c10d.TCPStore = tcp_store  # (only for this call: torch's own host/client logic around the store stays)
    try:
        backend, store = c10d.create_backend(params)
    finally:
        c10d.TCPStore = original

    class Backend(c10d.C10dRendezvousBackend):  # (torch checks that the handler carries the name it was asked by)
        @property
        def name(self) -> str:
            return RDZV_BACKEND

    backend.__class__ = Backend
    return create_handler(store, backend, params)


def register_rendezvous() -> str:
    """Make ``--rdzv-backend=syncwise-c10d`` known in this process (torchrun's agent); returns its name."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    registry.register(RDZV_BACKEND, _create_rendezvous)
    return RDZV_BACKEND


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m syncwise.bind [--nodes N]``: print the address this node's endpoints bind to.
    ``python -m syncwise.bind --nodes N --port P -- PROGRAM ARGS``: run PROGRAM with ``--bind=ADDR:P``
    appended (torchft's lighthouse in the Slurm and Kubernetes files)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m syncwise.bind", description=main.__doc__)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("program", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    host = bind_host(args.nodes)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        print(host)
        return 0
    os.execvp(program[0], [*program, f"--bind={hostport(host, args.port)}"])
    return 1  # (not reached)


if __name__ == "__main__":
    sys.exit(main())
