"""Listening sockets for the HTTP API: the local Unix socket and optional TCP.

The Unix socket is created with the configured mode (0660 by default: the service's group may
connect, nobody else). A socket file left by a crashed daemon is replaced, but only after
checking that nothing answers on it; a live daemon or a non-socket file at the path stops
start-up with a clear error instead of being deleted.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
from pathlib import Path

from ..errors import ConfigError

log = logging.getLogger(__name__)


def bind_unix_socket(path: Path, mode: int = 0o660) -> socket.socket:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o777 & ~mode)  # the file is born with `mode`: no window with wider access
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot create Unix socket {path}: {exc.strerror}") from exc
    finally:
        os.umask(old_umask)
    os.chmod(path, mode)
    sock.listen(512)
    sock.setblocking(False)
    return sock


def _remove_stale_socket(path: Path) -> None:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise ConfigError(f"cannot check existing socket {path}: {exc.strerror}") from exc
        log.warning("removing stale socket %s left by a previous run", path)
        path.unlink(missing_ok=True)
        return
    finally:
        probe.close()
    raise ConfigError(f"another process is serving on {path}; stop it or choose another --unix-socket")


def bind_tcp_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.listen(512)
    sock.setblocking(False)
    return sock


def remove_socket_file(path: Path, inode: int) -> None:
    """Remove our socket file on exit, unless another process has replaced it since (the
    inode recorded at bind time no longer matches)."""
    try:
        if path.stat().st_ino == inode:
            path.unlink()
    except FileNotFoundError:
        pass
