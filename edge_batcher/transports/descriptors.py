"""The file-descriptor budget: client connections on every listener must fit RLIMIT_NOFILE
(systemd's LimitNOFILE, a shell's `ulimit -n`) beside the daemon's own descriptors, or accept()
fails with EMFILE and the whole daemon goes deaf (issue 31: "Too many open files" logged 677,623
times while even the Unix socket timed out). At start the soft limit is raised as far as the
hard limit allows to fit `[server] max_connections` plus `RESERVED_FDS` and `FDS_PER_PEER` per
offload peer; where even the hard limit is too low, the daemon serves fewer connections and says
so in one warning line, and a limit too low for a single connection stops start-up. asyncio
accepts as many connections per loop turn as the listen() backlog it is given, each holding a
descriptor until it is admitted or closed, so listeners take `ACCEPT_BATCH` per turn while the
kernel's queue stays `LISTEN_QUEUE` deep (`serve_with_small_accept_batches`). Should descriptors
run out anyway, asyncio's accept errors are summarised in one line per interval
(`summarise_accept_errors`) instead of a traceback per attempt.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from typing import Any

from ..errors import ConfigError

log = logging.getLogger(__name__)

# The daemon's own descriptors besides client connections. Measured: 19 with the demo models,
# HTTP on TCP and two gRPC listeners on CPU; a GPU adds its device nodes, refused connections
# being answered hold theirs briefly (http_connections.MAX_REFUSALS_ANSWERING).
RESERVED_FDS = 128
FDS_PER_PEER = 32  # an offload peer's connection pool (offload/client.py: limit=32)
# A connection refused beyond max_connections still holds its descriptor until the next loop turn
# or two: with asyncio's batch as large as the kernel's queue (1,024 on the gRPC port), a flood
# accepted a thousand at once and hit EMFILE below a 1,024 limit (a CI run under load).
ACCEPT_BATCH = 16  # per listener and loop turn: 4 listeners' batches fit in RESERVED_FDS
LISTEN_QUEUE = 1024  # connections the kernel queues before accept(): a burst waits, not refused
ACCEPT_ERROR_LOG_INTERVAL_S = 10.0
ACCEPT_ERROR = "socket.accept() out of system resource"  # asyncio's message (selector_events.py)


def fit_connections(wanted: int, reserved: int) -> int:
    """How many client connections the descriptor limit allows, at most `wanted`, after raising
    the soft limit toward what `wanted + reserved` needs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + reserved
    if soft != resource.RLIM_INFINITY and soft < need:
        raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
        if raised > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            log.info("descriptor limit raised from %d to %d for %d connections ([server] max_connections)",
                     soft, raised, wanted)
            soft = raised
    if soft == resource.RLIM_INFINITY or soft >= need:
        return wanted
    fits = soft - reserved
    if fits < 1:
        raise ConfigError(
            f"the descriptor limit ({soft}: LimitNOFILE in the systemd unit, `ulimit -n` in a shell) leaves no room "
            f"for client connections beside the {reserved} the daemon keeps for itself; raise it to at least {need}"
        )
    log.warning(
        "[server] max_connections %d does not fit the descriptor limit %d (hard limit %s) beside the %d the daemon "
        "keeps for itself: serving at most %d connections; raise LimitNOFILE (systemd) or `ulimit -n` to %d",
        wanted, soft, "unlimited" if hard == resource.RLIM_INFINITY else hard, reserved, fits, need,
    )
    return fits


def serve_with_small_accept_batches(sock: socket.socket) -> None:
    """After asyncio started serving `sock` with backlog=ACCEPT_BATCH (its accept batch and
    listen() queue both): deepen the kernel's queue again; asyncio's batch stays small."""
    sock.listen(LISTEN_QUEUE)


def summarise_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio logs a traceback for every accept() that fails for want of descriptors; keep one
    warning line per ACCEPT_ERROR_LOG_INTERVAL_S with the count instead (other errors as before)."""
    previous = loop.get_exception_handler()
    state = {"next_log": 0.0, "count": 0}

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != ACCEPT_ERROR:
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        state["count"] += 1
        now = loop.time()
        if now >= state["next_log"]:
            log.warning("accept() failed %d time(s) for want of descriptors (%s): raise LimitNOFILE or lower "
                        "[server] max_connections; summarised every %.0f s",
                        state["count"], context.get("exception"), ACCEPT_ERROR_LOG_INTERVAL_S)
            state["count"] = 0
            state["next_log"] = now + ACCEPT_ERROR_LOG_INTERVAL_S

    loop.set_exception_handler(handler)
