"""How many bytes wait in a connection's kernel socket queues, for decisions about a client: what
it sent that the loop has not read yet (an idle connection may be evicted only when nothing is
waiting), and what we sent that it has not read yet (a write stall is a client that reads
nothing). Both are 0 where the transport has no socket to ask.
"""

from __future__ import annotations

import asyncio
import fcntl
import termios


def unread_bytes(transport: asyncio.BaseTransport | None) -> int:
    """Bytes the client sent that the loop has not read from the socket yet."""
    return _queued(transport, termios.FIONREAD)


def unsent_bytes(transport: asyncio.BaseTransport | None) -> int:
    """Bytes in the socket's send queue that the client has not read yet (on a Unix socket, the
    kernel's memory for them, which falls as the client reads)."""
    return _queued(transport, termios.TIOCOUTQ)


def _queued(transport: asyncio.BaseTransport | None, request: int) -> int:
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return 0
    try:
        return int.from_bytes(fcntl.ioctl(sock.fileno(), request, b"\0\0\0\0"), "little")
    except OSError:
        return 0
