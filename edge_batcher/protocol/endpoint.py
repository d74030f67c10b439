"""Where a client of the KServe v2 HTTP API connects: ``unix:///path/to.sock``,
``http://host[:port][/prefix]`` or ``https://...`` parsed into an Endpoint. Shared by the
user-facing clients (edge_batcher/client.py) and the offload client that talks to peers."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Endpoint:
    """Where a client connects, parsed from its URL."""

    scheme: str  # "unix", "http" or "https"
    host: str  # "localhost" for unix sockets (only used for the Host header)
    port: int | None  # None for unix sockets
    socket_path: str | None  # set for unix sockets only
    base_path: str = ""  # URL path prefix without trailing slash, e.g. "/edge"

    @property
    def base_url(self) -> str:
        """An http(s) URL that the request paths are appended to (aiohttp needs one)."""
        if self.scheme == "unix":
            return "http://localhost"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.base_path}"


def parse_url(url: str) -> Endpoint:
    """Parse ``unix:///path/to.sock``, ``http://host[:port][/prefix]`` or ``https://...``.

    Raises ValueError with the reason, so a typo in a URL fails at construction time rather
    than on the first request.
    """
    if not isinstance(url, str) or not url:
        raise ValueError("client URL must be a non-empty string")
    if url.startswith("unix:"):
        path = url[len("unix://") :] if url.startswith("unix://") else url[len("unix:") :]
        if not path:
            raise ValueError(f"client URL {url!r} names no socket path")
        return Endpoint(scheme="unix", host="localhost", port=None, socket_path=path)

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(
            f"client URL {url!r}: unsupported scheme {parts.scheme!r}; use unix:///path, "
            f"http://host:port or https://host:port"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"client URL {url!r} must not have a query or fragment")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"client URL {url!r}: put credentials in token=, not in the URL")
    if not parts.hostname:
        raise ValueError(f"client URL {url!r} names no host")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"client URL {url!r} has an invalid port") from None
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    return Endpoint(
        scheme=parts.scheme,
        host=parts.hostname,
        port=port,
        socket_path=None,
        base_path=parts.path.rstrip("/"),
    )
