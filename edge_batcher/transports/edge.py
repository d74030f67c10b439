"""One edge for every listener: the limits HTTP (Unix socket and TCP) and gRPC (TCP and Unix) share,
built once from `[server]` and handed to each transport, so that a new listener gets them by taking
an `EdgeLimits` instead of remembering each setting. Connections: `max_connections` counts every
listener against the descriptor budget (`descriptors.py`); with gRPC on, HTTP has half and each
gRPC address an equal share of the other half (each gRPC listener counts its own). Bytes in flight:
one `BodyBudget` for HTTP bodies and gRPC messages. Time: `idle_timeout_s` to start a request (HTTP
header, gRPC handshake) or stay idle, `body_timeout_s` for a body or message to arrive.
Authentication: one token, read once and checked before any payload is read; Unix sockets are
guarded by their file mode instead, with a warning when it admits every user.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..config import ServerSettings
from .auth import read_token
from .body_budget import BodyBudget
from .descriptors import FDS_PER_PEER, RESERVED_FDS, fit_connections
from .listeners import warn_if_open_to_all

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EdgeLimits:
    max_body_bytes: int
    body_timeout_s: float
    idle_timeout_s: float
    http_connections: int  # the HTTP listeners' one count (Unix socket and TCP)
    grpc_connections: int  # each gRPC listener's own count
    max_calls: int  # gRPC calls in progress at once
    budget: BodyBudget  # bytes of bodies and messages held at once, every transport
    token: str  # the bearer token TCP listeners ask for ("" when none is set)
    socket_mode: int  # every Unix socket's file mode


def build_edge(s: ServerSettings, *, offload_peers: int = 0) -> EdgeLimits:
    connections = fit_connections(s.max_connections, RESERVED_FDS + FDS_PER_PEER * offload_peers)
    http, grpc_each = connections, 0
    if s.grpc:
        http = max(1, connections // 2)
        grpc_each = max(1, (connections - http) // len(s.grpc))
        log.info("connections: %d for HTTP, %d for each of %d gRPC listener(s) ([server] max_connections %d)",
                 http, grpc_each, len(s.grpc), connections)
    mode = int(s.socket_mode, 8)
    warn_if_open_to_all(mode, "[server] socket_mode")
    return EdgeLimits(
        max_body_bytes=s.max_body_bytes,
        body_timeout_s=s.body_timeout_s,
        idle_timeout_s=s.idle_timeout_s,
        http_connections=http,
        grpc_connections=grpc_each,
        max_calls=s.max_connections,
        budget=BodyBudget(max_body_bytes=s.max_body_bytes, timeout_s=s.body_timeout_s,
                          max_inflight_bytes=s.max_inflight_body_bytes or 4 * s.max_body_bytes),
        token=read_token(s),
        socket_mode=mode,
    )
