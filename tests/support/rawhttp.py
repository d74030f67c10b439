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


def connect(path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(path))
    return s


def read_response(s: socket.socket) -> tuple[int, dict | str]:
    """Status and parsed body of one response on a raw socket (it must close or give a length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response header: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), None)
    while length is None or len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode(errors="replace")
