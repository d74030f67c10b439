"""Plain HTTP over a Unix socket, for sending bodies no client library would produce."""

from __future__ import annotations

import http.client
import json
import socket


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 30.0):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def request(path, method: str, url: str, body: bytes | str | None = None, headers: dict | None = None,
            timeout: float = 30.0):
    """Returns (status, parsed JSON body or text)."""
    conn = UnixConnection(str(path), timeout)
    try:
        if isinstance(body, str):
            body = body.encode()
        conn.request(method, url, body=body, headers=headers or {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        try:
            return resp.status, json.loads(data)
        except ValueError:
            return resp.status, data.decode(errors="replace")
    finally:
        conn.close()
