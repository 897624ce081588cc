"""The job's secret: 32 random bytes in ``RUN_DIR/job.secret`` (owner-only, mode 0600), made by the launcher.

What it keys (docs/security.md): live recovery's heal transfers (a replica serves its state only to a request
signed with it, and a healing replica loads only a payload whose HMAC-SHA256 matches). A resumed run keeps its
run directory's secret. A cluster job reads it from the shared run directory (Slurm: the batch script makes it
before the first job step) or from a file the scheduler mounts (Kubernetes: a Secret volume), named by
``SYNCWISE_SECRET_FILE``.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import sys
from pathlib import Path
from typing import Optional

from .errors import ConfigError
from .rundir import RunDir

ENV_SECRET_FILE = "SYNCWISE_SECRET_FILE"


def create_secret(run_dir: str | Path) -> Path:
    """``RUN_DIR/job.secret``: made now (mode 0600, never readable by group or others) unless it exists; an
    existing one must be this user's and owner-only, else one line says so."""
    path = RunDir(run_dir).secret
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        check(path)
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def check(path: Path) -> None:
    """The secret file is a regular file of this user's, not readable or writable by group or others."""
    try:
        st = path.lstat()
    except OSError as e:
        raise ConfigError(ENV_SECRET_FILE, str(path), f"a readable secret file ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(ENV_SECRET_FILE, str(path), "a regular file owned by this user with mode 0600 (chmod 600 "
                          "it, or delete it: the launcher makes a new one)")


def read_secret(path: Optional[str | Path] = None) -> Optional[bytes]:
    """The secret's bytes from ``path`` (default: ``SYNCWISE_SECRET_FILE``); None when neither names a file."""
    path = path or os.environ.get(ENV_SECRET_FILE)
    if not path:
        return None
    path = Path(path)
    check(path)
    text = path.read_text().strip()
    if len(text) < 32:
        raise ConfigError(ENV_SECRET_FILE, str(path), "a file holding at least 32 characters of secret")
    return text.encode()


def sign(secret: Optional[bytes], *parts: bytes) -> bytes:
    """HMAC-SHA256 over ``parts`` (length-prefixed, so no two part lists sign alike) keyed by ``secret``."""
    mac = hmac.new(secret or b"", digestmod=hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return mac.digest()


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m syncwise.secret RUN_DIR``: make the run directory's secret (if missing); print its path."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m syncwise.secret RUN_DIR", file=sys.stderr)
        return 2
    print(create_secret(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
