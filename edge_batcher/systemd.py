"""systemd integration without libsystemd: readiness notification, watchdog, socket activation, logging.

Everything here is stdlib-only and degrades to a no-op when the daemon is not run by systemd
(a developer's terminal, a container, the test suite), so the daemon can call it unconditionally.

Protocols implemented (see sd_notify(3), sd_listen_fds(3), sd_watchdog_enabled(3), systemd.exec(5)):

- ``$NOTIFY_SOCKET``: an AF_UNIX datagram socket; each notification is ONE datagram of
  newline-separated ``KEY=value`` assignments. A leading ``@`` means the Linux abstract namespace
  (the ``@`` is replaced by a NUL byte). With ``NotifyAccess=main`` systemd only accepts datagrams
  sent by the main PID -- any thread of the daemon process is fine, a forked child is not.
- ``$WATCHDOG_USEC`` / ``$WATCHDOG_PID``: the service must send ``WATCHDOG=1`` at least that often;
  the usual practice (and what :func:`watchdog_interval` returns) is every half period.
- ``$LISTEN_PID`` / ``$LISTEN_FDS`` / ``$LISTEN_FDNAMES``: sockets passed by a ``.socket`` unit,
  starting at fd 3 (``SD_LISTEN_FDS_START``).
- ``$JOURNAL_STREAM``: ``<st_dev>:<st_ino>`` of the stream journald connected to stdout/stderr; when it
  matches stderr, a ``<N>`` prefix on each line sets the syslog priority of that line.

The daemon's event loop is responsible for *calling* :meth:`Notifier.watchdog` on a timer; nothing
here starts threads or timers, and nothing happens at import time.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

__all__ = [
    "SD_LISTEN_FDS_START",
    "Notifier",
    "watchdog_interval",
    "listen_fds",
    "listen_fds_with_names",
    "under_journald",
    "JournaldFormatter",
    "JsonFormatter",
    "configure_logging",
    "LOG_LEVELS",
    "LOG_FORMATS",
]

logger = logging.getLogger(__name__)

SD_LISTEN_FDS_START = 3

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("auto", "plain", "journald", "json")


# --------------------------------------------------------------------------------------------
# sd_notify
# --------------------------------------------------------------------------------------------


class Notifier:
    """sd_notify over ``$NOTIFY_SOCKET`` datagrams; a no-op when the variable is unset.

    Each call opens a short-lived datagram socket (as libsystemd does), so a Notifier can be
    shared between threads without locking. Sending never raises: a failure is logged at DEBUG
    and reported by the ``False`` return value, because a lost status line must never take the
    daemon down.
    """

    def __init__(self, address: str | None, *, timeout: float = 1.0):
        """``address`` is the raw ``$NOTIFY_SOCKET`` value (``/path`` or ``@abstract``), or None.

        ``timeout`` bounds how long a send may block when systemd's receive queue is full, so
        a watchdog ping sent from the event loop cannot stall it indefinitely.
        """
        self._address: str | bytes | None = None
        self._timeout = timeout
        if address:
            if address.startswith("@"):
                # Abstract namespace: leading NUL, the rest is the name (not NUL-terminated).
                self._address = b"\0" + address[1:].encode()
            elif address.startswith("/"):
                self._address = address
            else:
                # e.g. "vsock:..." (systemd >= 253, for VMs): not a transport this daemon uses.
                logger.warning("NOTIFY_SOCKET=%r is not a Unix socket address; sd_notify disabled", address)
        self.address = address

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Notifier:
        """Build from ``$NOTIFY_SOCKET``; disabled when it is unset or empty."""
        return cls(environ.get("NOTIFY_SOCKET") or None)

    @property
    def enabled(self) -> bool:
        """True when there is a notification socket to send to (i.e. we run under Type=notify)."""
        return self._address is not None

    def notify(self, **fields: Any) -> bool:
        """Send ``KEY=value`` lines in one datagram, e.g. ``notify(READY=1, STATUS="loading")``.

        Returns True when the datagram was sent, False when disabled or the send failed.
        ``True``/``False`` values are sent as ``1``/``0``; newlines inside a value are replaced by
        spaces because a newline would start a new assignment in the protocol.
        """
        if self._address is None or not fields:
            return False
        lines = []
        for key, value in fields.items():
            if isinstance(value, bool):
                value = int(value)
            text = str(value).replace("\r", " ").replace("\n", " ")
            lines.append(f"{key}={text}\n")
        payload = "".join(lines).encode("utf-8")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(self._timeout)
                sock.sendto(payload, self._address)
        except OSError as exc:
            logger.debug("sd_notify to %r failed: %s (payload %r)", self.address, exc, payload)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """``READY=1``: start-up finished; systemd now considers the service started."""
        return self.notify(READY=1, **_status(status))

    def reloading(self, status: str | None = None) -> bool:
        """``RELOADING=1`` (send ``ready()`` when the reload is done).

        ``MONOTONIC_USEC`` is included because systemd >= 253 (Type=notify-reload) requires it;
        older versions ignore it.
        """
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify(RELOADING=1, MONOTONIC_USEC=usec, **_status(status))

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``: graceful shutdown began (systemd shows the unit as deactivating)."""
        return self.notify(STOPPING=1, **_status(status))

    def status(self, text: str) -> bool:
        """``STATUS=...``: free-form line shown by ``systemctl status``."""
        return self.notify(STATUS=text)

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: keep-alive ping; send every :func:`watchdog_interval` seconds."""
        return self.notify(WATCHDOG=1)

    def extend_timeout(self, seconds: float) -> bool:
        """``EXTEND_TIMEOUT_USEC``: ask for ``seconds`` more before the start/stop timeout fires.

        Each message (re)sets the deadline to *now + seconds*, so a long engine build can send it
        periodically. Supported by systemd >= 236.
        """
        if not seconds > 0:
            raise ValueError(f"extend_timeout needs a positive number of seconds, got {seconds!r}")
        return self.notify(EXTEND_TIMEOUT_USEC=int(seconds * 1_000_000))

    def __repr__(self) -> str:
        return f"Notifier(address={self.address!r}, enabled={self.enabled})"


def _status(status: str | None) -> dict[str, str]:
    return {} if status is None else {"STATUS": status}


# --------------------------------------------------------------------------------------------
# Watchdog
# --------------------------------------------------------------------------------------------


def watchdog_interval(environ: Mapping[str, str] = os.environ, pid: int | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings: half of ``$WATCHDOG_USEC``, or None when not enabled.

    Like sd_watchdog_enabled(3): when ``$WATCHDOG_PID`` is set it must equal our PID (``pid`` or
    ``os.getpid()``), otherwise the watchdog is meant for another process. Malformed or
    non-positive values count as "not enabled".
    """
    raw_usec = environ.get("WATCHDOG_USEC")
    if not raw_usec:
        return None
    try:
        usec = int(raw_usec)
    except ValueError:
        logger.debug("ignoring malformed WATCHDOG_USEC=%r", raw_usec)
        return None
    if usec <= 0:
        return None
    raw_pid = environ.get("WATCHDOG_PID")
    if raw_pid:
        try:
            target = int(raw_pid)
        except ValueError:
            logger.debug("ignoring malformed WATCHDOG_PID=%r", raw_pid)
            return None
        if target != (os.getpid() if pid is None else pid):
            return None
    return usec / 2 / 1_000_000


# --------------------------------------------------------------------------------------------
# Socket activation
# --------------------------------------------------------------------------------------------

_LISTEN_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


def listen_fds_with_names(
    environ: MutableMapping[str, str] = os.environ, pid: int | None = None, unset: bool = True
) -> list[tuple[str, socket.socket]]:
    """Like :func:`listen_fds`, paired with the ``FileDescriptorName=`` of each socket.

    Names come from ``$LISTEN_FDNAMES`` (colon-separated); a missing name is ``"unknown"``, as in
    sd_listen_fds_with_names(3). The default name systemd assigns is the socket unit's name.
    """
    raw_pid = environ.get("LISTEN_PID")
    raw_fds = environ.get("LISTEN_FDS")
    raw_names = environ.get("LISTEN_FDNAMES")
    if unset:
        # sd_listen_fds(3) unsets them whether or not the call succeeds, so child processes
        # never mistake our sockets for theirs.
        for name in _LISTEN_VARS:
            environ.pop(name, None)
    if not raw_pid or not raw_fds:
        return []
    try:
        target = int(raw_pid)
        count = int(raw_fds)
    except ValueError:
        logger.warning("ignoring malformed LISTEN_PID=%r / LISTEN_FDS=%r", raw_pid, raw_fds)
        return []
    if target != (os.getpid() if pid is None else pid):
        return []  # the sockets were meant for another process (e.g. our parent)
    if count <= 0:
        return []
    names = raw_names.split(":") if raw_names else []
    result: list[tuple[str, socket.socket]] = []
    for index, fd in enumerate(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count)):
        name = names[index] if index < len(names) and names[index] else "unknown"
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFD)
            fcntl.fcntl(fd, fcntl.F_SETFD, flags | fcntl.FD_CLOEXEC)
            # fileno= auto-detects family/type/proto; raises OSError(ENOTSOCK) for FIFOs etc.
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            logger.warning("passed fd %d (%s) is not a usable socket, skipped: %s", fd, name, exc)
            continue
        result.append((name, sock))
    return result


def listen_fds(
    environ: MutableMapping[str, str] = os.environ, pid: int | None = None, unset: bool = True
) -> list[socket.socket]:
    """Sockets passed by systemd socket activation (fds 3 .. 3+$LISTEN_FDS-1), in order.

    Returns ``[]`` unless ``$LISTEN_PID`` equals our PID (``pid`` or ``os.getpid()``). Each fd gets
    FD_CLOEXEC and is wrapped in a ``socket.socket`` that now owns it. With ``unset=True`` the
    ``LISTEN_*`` variables are removed from ``environ``. A daemon that receives its listening
    socket this way must not unlink the socket path on shutdown: the ``.socket`` unit owns it.
    """
    return [sock for _, sock in listen_fds_with_names(environ, pid=pid, unset=unset)]


# --------------------------------------------------------------------------------------------
# Logging
# --------------------------------------------------------------------------------------------


def under_journald(environ: Mapping[str, str] = os.environ, fd: int | None = None) -> bool:
    """True when stderr (or ``fd``) is the stream journald connected, per ``$JOURNAL_STREAM``.

    systemd sets ``JOURNAL_STREAM=<st_dev>:<st_ino>`` (decimal) for StandardOutput/StandardError=
    journal; comparing with fstat() avoids being fooled by an inherited variable after the stream
    was redirected elsewhere (systemd.exec(5)).
    """
    raw = environ.get("JOURNAL_STREAM")
    if not raw:
        return False
    try:
        dev_text, ino_text = raw.split(":", 1)
        dev, ino = int(dev_text), int(ino_text)
    except ValueError:
        return False
    try:
        if fd is None:
            if sys.stderr is None:
                return False
            fd = sys.stderr.fileno()
        st = os.fstat(fd)
    except (OSError, ValueError, AttributeError):
        # No real stderr (closed, replaced by an in-memory stream, ...).
        return False
    return st.st_dev == dev and st.st_ino == ino


def _syslog_priority(levelno: int) -> int:
    if levelno >= logging.CRITICAL:
        return 2  # crit
    if levelno >= logging.ERROR:
        return 3  # err
    if levelno >= logging.WARNING:
        return 4  # warning
    if levelno >= logging.INFO:
        return 6  # info
    return 7  # debug


class JournaldFormatter(logging.Formatter):
    """Prefix every line with ``<N>`` (syslog priority) so journald records the level.

    journald splits a stream into one entry per line, so continuation lines (tracebacks) get the
    prefix too, otherwise they would be filed at the default priority. No timestamp: journald
    adds its own.
    """

    def __init__(self, fmt: str | None = "%(name)s: %(message)s", datefmt: str | None = None):
        super().__init__(fmt, datefmt)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        prefix = f"<{_syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in text.split("\n"))


# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD_ATTRS = frozenset(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",  # Python >= 3.12
}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (ISO 8601, UTC), ``level``, ``logger``, ``message``,
    ``exc``/``stack`` when present, and every field passed with ``extra=``.

    An ``extra`` key that collides with one of the fixed keys is kept as ``extra_<key>``; values
    that are not JSON-serialisable are written with ``str()``.
    """

    _FIXED = ("ts", "level", "logger", "message", "exc", "stack")

    def format(self, record: logging.LogRecord) -> str:
        ts = _dt.datetime.fromtimestamp(record.created, tz=_dt.timezone.utc)
        doc: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exc"] = record.exc_text
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        for key, value in record.__dict__.items():
            if key in _STANDARD_ATTRS or key.startswith("_"):
                continue
            doc[f"extra_{key}" if key in self._FIXED else key] = value
        return json.dumps(doc, default=str, ensure_ascii=False)


_PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str = "INFO", fmt: str = "auto") -> None:
    """Install one stderr handler on the root logger.

    ``level``: one of DEBUG, INFO, WARNING, ERROR, CRITICAL (any case).
    ``fmt``: ``plain`` (``2026-01-01 12:00:00,123 INFO edge_batcher.x: message``), ``journald``
    (``<6>edge_batcher.x: message``), ``json``, or ``auto`` = journald when :func:`under_journald`
    else plain. Calling it again replaces the handler it installed before (other handlers, e.g.
    pytest's, are left alone). Raises ValueError naming the valid values.
    """
    if not isinstance(level, str) or level.upper() not in LOG_LEVELS:
        raise ValueError(f"invalid log level {level!r}: expected one of {', '.join(LOG_LEVELS)}")
    if fmt not in LOG_FORMATS:
        raise ValueError(f"invalid log format {fmt!r}: expected one of {', '.join(LOG_FORMATS)}")
    if fmt == "auto":
        fmt = "journald" if under_journald() else "plain"
    formatter: logging.Formatter
    if fmt == "journald":
        formatter = JournaldFormatter()
    elif fmt == "json":
        formatter = JsonFormatter()
    else:
        formatter = logging.Formatter(_PLAIN_FORMAT)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    handler._edge_batcher_handler = True  # type: ignore[attr-defined]  # marks ours for replacement
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_edge_batcher_handler", False):
            root.removeHandler(old)
            old.close()
    root.addHandler(handler)
    root.setLevel(level.upper())
