"""A TCP proxy that passes on only the first N bytes a client sends (and all the server answers):
a real client library whose request stalls midway, as over a link that dies."""

from __future__ import annotations

import socket
import threading


class StallProxy:
    def __init__(self, upstream: tuple[str, int], forward_bytes: int):
        self.upstream = upstream
        self.forward_bytes = forward_bytes
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._closed = False

    def __enter__(self) -> StallProxy:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._closed = True
        self._listener.close()
        for s in self._sockets:
            s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, self.forward_bytes), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, None), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, limit: int | None) -> None:
        passed = 0
        try:
            while data := source.recv(65536):
                if limit is not None:
                    data = data[:max(limit - passed, 0)]  # the rest is read and dropped: the client is not blocked
                passed += len(data)
                if data:
                    sink.sendall(data)
        except OSError:
            pass
