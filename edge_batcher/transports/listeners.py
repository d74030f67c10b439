"""Listening sockets for the HTTP API: the local Unix socket and optional TCP.

The Unix socket is created with the configured mode (0660 by default: the service's group may
connect, nobody else; a mode that lets every local user connect is warned about, since the
socket needs no token). A socket file left by a crashed daemon is replaced, but only after
checking that nothing answers on it; a live daemon or a non-socket file at the path stops
start-up with a clear error instead of being deleted. A path the system cannot bind (longer
than sun_path allows, a directory that cannot be created) stops start-up with one line naming
it; `check_unix_socket_path` says so for gRPC's sockets too.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
from pathlib import Path

from ..errors import ConfigError
from .descriptors import LISTEN_QUEUE

log = logging.getLogger(__name__)


# sun_path holds 108 bytes on Linux, the terminating NUL included.
MAX_UNIX_PATH_BYTES = 107


def warn_if_open_to_all(mode: int, where: str) -> None:
    """One warning line when a Unix socket's mode lets every local user connect (no token is asked there)."""
    if mode & 0o002:
        log.warning("%s: socket mode %04o lets every local user connect, and the Unix socket asks for no token; "
                    "0660 (the service's group) is the default", where, mode)


def check_unix_socket_path(path: Path, where: str) -> None:
    """Make the socket's directory and check the path fits sun_path; ConfigError naming what is wrong."""
    size = len(os.fsencode(path))
    if size > MAX_UNIX_PATH_BYTES:
        raise ConfigError(f"{where}: Unix socket path {path} is {size} bytes, longer than the "
                          f"{MAX_UNIX_PATH_BYTES} the system allows; choose a shorter path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot create the directory {path.parent} of Unix socket {path}: "
                          f"{exc.strerror or exc}") from None


def bind_unix_socket(path: Path, mode: int = 0o660) -> socket.socket:
    path = Path(path)
    check_unix_socket_path(path, "[server] unix_socket")
    remove_stale_socket(path, "choose another --unix-socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o777 & ~mode)  # the file is born with `mode`: no window with wider access
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot create Unix socket {path}: {exc.strerror or exc}") from None
    finally:
        os.umask(old_umask)
    os.chmod(path, mode)
    sock.listen(LISTEN_QUEUE)
    sock.setblocking(False)
    return sock


def remove_stale_socket(path: Path, alternative: str) -> None:
    """Remove the socket file an earlier run left at `path`; refuse when something still
    accepts connections there (another daemon) or the file is not a socket."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"cannot check existing socket {path}: {exc.strerror or exc}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise ConfigError(f"cannot check existing socket {path}: {exc.strerror or exc}") from None
        log.warning("removing stale socket %s left by a previous run", path)
        path.unlink(missing_ok=True)
        return
    finally:
        probe.close()
    raise ConfigError(f"another process is serving on {path}; stop it or {alternative}")


def bind_tcp_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(LISTEN_QUEUE)
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
