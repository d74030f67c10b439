"""Protection for the TCP listener: a bearer token and TLS.

The same aiohttp app serves the Unix socket and TCP. The Unix socket is protected by its file
mode (0660: the service's group), so requests that arrived on it pass without a token; requests
that arrived over TCP must carry ``Authorization: Bearer <token>`` (compared in constant time).
A missing or wrong token gets 401 ``{"error": "missing or invalid bearer token"}`` with a
``WWW-Authenticate: Bearer ...`` header.

One exception: ``GET /v2/health/live`` answers without a token, so liveness probes (systemd,
Kubernetes, a load balancer) need no secret. It says only "the process is up"; readiness
(``/v2/health/ready``, which lists the loaded models), metadata and inference all need the token.

``read_token(settings)`` reads the token once for every listener, with a warning when its file
is open to other local users; ``tls_context(cert, key)`` builds the server-side TLS context for
the TCP listener.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import ssl
import stat

from aiohttp import web

from ..config import ServerSettings, read_secret
from ..errors import ConfigError

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/v2/health/live"})
UNAUTHORIZED_MESSAGE = "missing or invalid bearer token"
REALM = "edge-batcher"


def arrived_over_unix_socket(request: web.Request) -> bool:
    """True when the request came in on a Unix domain socket (not TCP)."""
    transport = request.transport
    if transport is None:  # the connection is already gone
        return False
    sock = transport.get_extra_info("socket")
    if sock is not None:
        return sock.family == socket.AF_UNIX
    # No socket object (unusual transports): a Unix socket's sockname is a path (str).
    return isinstance(transport.get_extra_info("sockname"), str)


def bearer_auth_middleware(token: str):
    """An aiohttp middleware requiring ``Authorization: Bearer <token>`` on TCP requests."""
    if not token:
        raise ConfigError("[server] a bearer token is required to serve HTTP on TCP (token or token_file)")
    expected = token.encode()

    @web.middleware
    async def bearer_auth(request: web.Request, handler):
        if request.path in OPEN_PATHS or arrived_over_unix_socket(request):
            return await handler(request)
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected):
            return await handler(request)
        challenge = f'Bearer realm="{REALM}"'
        if scheme:  # RFC 6750: a credential was sent but is not valid
            challenge += ', error="invalid_token"'
        return web.json_response(
            {"error": UNAUTHORIZED_MESSAGE}, status=401, headers={"WWW-Authenticate": challenge}
        )

    return bearer_auth


def read_token(settings: ServerSettings) -> str:
    """The bearer token for TCP ("" when none is set): [server] token_file's first line, or token."""
    if settings.token_file:
        warn_if_open_to_others(settings.token_file)
    return read_secret(settings.token, settings.token_file, "[server] token")


def warn_if_open_to_others(path: str) -> None:
    """One warning line when users outside the file's owner and group may read or change it."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return  # reading it says what is wrong
    if mode & 0o006:
        what = " and ".join(verb for verb, bit in (("read", 0o004), ("change", 0o002)) if mode & bit)
        log.warning("[server] token_file %s has mode %04o: every local user can %s the bearer token; "
                    "chmod 0600 (or 0640 with the service's group)", path, mode, what)


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """Server-side TLS context for the TCP listener ([server] tls_cert / tls_key, PEM).

    Raises ConfigError naming the file when the certificate or key cannot be loaded.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(certfile=cert, keyfile=key)
    except FileNotFoundError as exc:
        missing = exc.filename or (cert if not _exists(cert) else key)
        which = "tls_cert" if missing == cert else "tls_key"
        raise ConfigError(f"[server] {which}: {missing} not found") from None
    except PermissionError as exc:
        raise ConfigError(f"[server] tls_cert/tls_key: cannot read {exc.filename or cert}: permission denied") from None
    except ssl.SSLError as exc:
        raise ConfigError(
            f"[server] tls_cert {cert} / tls_key {key}: not a PEM certificate and matching private key "
            f"({exc.reason or exc})"
        ) from None
    except OSError as exc:
        raise ConfigError(f"[server] tls_cert/tls_key: cannot load {cert} / {key}: {exc}") from None
    return context


def _exists(path: str) -> bool:
    try:
        with open(path, "rb"):
            return True
    except OSError:
        return False
