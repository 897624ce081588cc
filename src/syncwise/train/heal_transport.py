"""Live recovery's heal transfer: a replica's state to a healing peer over HTTP, bound, authenticated, never
unpickled (docs/security.md).

torchft's own ``HTTPTransport`` listens on every interface (``[::]``), serves anyone who asks, and loads what it
receives with ``torch.load(weights_only=False)`` — a peer (or anyone who can answer in its place) runs code in the
healing replica. This transport keeps torchft's protocol (the Manager asks ``metadata()``, ``send_checkpoint``,
``recv_checkpoint``, ``disallow_checkpoint``) and changes what it must:

- it listens on the job's address only (bind.py: loopback for a job on one machine);
- with the job's secret (secret.py) a request carries ``X-Syncwise-Auth: HMAC(secret, step)``, refused
  (403) without it, and the response ends with ``HMAC(secret, step, payload)``: the receiver checks it before it
  reads a byte of the payload, so a server that does not hold the secret cannot hand it anything;
- the payload is loaded with ``weights_only=True`` (tensors and plain data only: the train state's components are
  plain data, see checkpoint/state.py), so even a payload signed with the secret cannot run code.
"""
from __future__ import annotations

import hmac
import io
import socket
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

from ..errors import SyncwiseError
from ..bind import hostport
from ..secret import sign

AUTH_HEADER = "X-Syncwise-Auth"
TAG_BYTES = 32


def _load_weights_only(payload: bytes) -> Any:
    import warnings

    from torch.distributed._serialization import _streaming_load

    with warnings.catch_warnings():  # (torch warns that tensors over a read-only buffer are writable: each is new)
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return _streaming_load(io.BytesIO(payload), weights_only=True)


def _save(obj: Any, f: Any) -> None:
    from torch.distributed._serialization import _streaming_save

    _streaming_save(obj, f)


class _Signer:
    """A write-only file that signs what passes through it."""

    def __init__(self, out: Any, secret: Optional[bytes], step: int):
        import hashlib

        self.out = out
        self.mac = hmac.new(secret or b"", digestmod=hashlib.sha256)
        self.mac.update(b"syncwise-heal\0" + str(step).encode() + b"\0")

    def write(self, data: Any) -> int:
        self.mac.update(data)
        self.out.write(data)
        return len(data)

    def flush(self) -> None:
        self.out.flush()


def payload_tag(secret: Optional[bytes], step: int, payload: bytes) -> bytes:
    """The tag a server appends to a step's payload (HMAC-SHA256 keyed by the job's secret)."""
    import hashlib

    mac = hmac.new(secret or b"", digestmod=hashlib.sha256)
    mac.update(b"syncwise-heal\0" + str(step).encode() + b"\0")
    mac.update(payload)
    return mac.digest()


def request_auth(secret: Optional[bytes], step: int) -> str:
    return sign(secret, b"syncwise-heal-request", str(step).encode()).hex()


class HealTransport:
    """torchft's ``CheckpointTransport`` protocol over HTTP on ``host`` (advertised as ``advertise``), keyed by
    ``secret`` (None: unauthenticated, still never unpickled). Built by :func:`transport`, which makes it a
    subclass of torchft's CheckpointTransport."""

    def __init__(self, timeout: timedelta, host: str, advertise: Optional[str] = None,
                 secret: Optional[bytes] = None):
        from torchft.checkpointing._rwlock import RWLock

        self._timeout, self._secret = timeout, secret
        self._lock = RWLock(timeout=timeout.total_seconds())
        self._disallowed = False
        self._step = -1
        self._state: Any = None
        self.disallow_checkpoint()  # (nothing served before the first send_checkpoint)
        transport = self

        class Handler(BaseHTTPRequestHandler):
            timeout = transport._timeout.total_seconds()

            def log_message(self, *args: Any) -> None:  # (no line per request on stderr)
                pass

            def do_GET(self) -> None:
                parts = self.path.split("/")
                if len(parts) != 4 or parts[1] != "checkpoint" or not parts[2].lstrip("-").isdigit():
                    self.send_error(400, "expected /checkpoint/STEP/full")
                    return
                step = int(parts[2])
                given = self.headers.get(AUTH_HEADER, "")
                if transport._secret is not None and not hmac.compare_digest(
                        given.encode(), request_auth(transport._secret, step).encode()):
                    self.send_error(403, "not signed with this job's secret")
                    return
                try:
                    with transport._lock.r_lock():
                        if step != transport._step:
                            self.send_error(400, f"serving step {transport._step}, not {step}")
                            return
                        self.send_response(200)
                        self.send_header("Content-type", "application/octet-stream")
                        self.end_headers()
                        signer = _Signer(self.wfile, transport._secret, step)
                        _save(transport._state, signer)
                        self.wfile.write(signer.mac.digest())
                except Exception as e:  # (a timeout on the lock, a closed connection)
                    try:
                        self.send_error(500, str(e)[:200])
                    except Exception:
                        pass

        class Server(ThreadingHTTPServer):
            address_family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
            daemon_threads = True
            request_queue_size = 1024

        self._server = Server((host, 0), Handler)
        self._advertise = advertise or host
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="syncwise-heal-server")
        self._thread.start()

    # ------------------------------------------------------------------------------ torchft's transport protocol
    def metadata(self) -> str:
        return f"http://{hostport(self._advertise, self._server.socket.getsockname()[1])}/checkpoint/"

    def address(self) -> str:
        return self.metadata()

    def disallow_checkpoint(self) -> None:
        if not self._disallowed:
            self._disallowed = True
            self._lock.w_acquire()

    def allow_checkpoint(self, step: int) -> None:
        self._step = step
        if self._disallowed:
            self._disallowed = False
            self._lock.w_release()

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        from torch.utils._pytree import tree_flatten, tree_unflatten

        values, spec = tree_flatten(state_dict)
        values = [v.cpu() if hasattr(v, "device") and getattr(v.device, "type", "cpu") != "cpu" else v
                  for v in values]
        self._state = tree_unflatten(values, spec)
        self.allow_checkpoint(step)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        return fetch(f"{metadata}{step}/full", step, self._secret, timeout)

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()


def fetch(url: str, step: int, secret: Optional[bytes], timeout: timedelta) -> Any:
    """A peer's state for ``step`` from ``url``: signed request, tag checked before anything is read, loaded with
    ``weights_only=True``. Raises SyncwiseError (one line) on a refused, unsigned or unloadable payload."""
    request = urllib.request.Request(url, headers={AUTH_HEADER: request_auth(secret, step)})
    try:
        with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as f:
            body = f.read()
    except urllib.error.HTTPError as e:
        raise SyncwiseError(f"live recovery: the heal transfer from {url} was refused ({e.code} {e.reason})") from None
    except OSError as e:
        raise SyncwiseError(f"live recovery: the heal transfer from {url} failed: {e}") from None
    payload, tag = body[:-TAG_BYTES], body[-TAG_BYTES:]
    if len(body) < TAG_BYTES or not hmac.compare_digest(tag, payload_tag(secret, step, payload)):
        raise SyncwiseError(f"live recovery: the heal transfer from {url} is not signed with this job's secret "
                            "(or was damaged); refused, nothing of it was loaded")
    try:
        return _load_weights_only(payload)
    except Exception as e:  # (pickle.UnpicklingError: an object that is not a tensor or plain data)
        raise SyncwiseError(f"live recovery: the heal transfer from {url} holds more than tensors and plain data; "
                            f"refused (weights_only): {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}"
                            ) from None


def transport(timeout: timedelta, host: str, advertise: Optional[str] = None,
              secret: Optional[bytes] = None) -> Any:
    """A :class:`HealTransport` that is also a torchft ``CheckpointTransport`` (what ``Manager`` accepts)."""
    from torchft.checkpointing.transport import CheckpointTransport

    cls = type("SyncwiseHealTransport", (HealTransport, CheckpointTransport), {})
    return cls(timeout, host, advertise=advertise, secret=secret)
