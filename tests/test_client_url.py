"""Client URL parsing only; the clients themselves are tested end-to-end against the daemon."""

from __future__ import annotations

import pytest

from edge_batcher.client import DEFAULT_URL, AsyncClient, Client, ClientError, Endpoint, parse_url


def test_default_url_is_the_daemon_socket() -> None:
    ep = parse_url(DEFAULT_URL)
    assert ep == Endpoint("unix", "localhost", None, "/run/edge-batcher/edge-batcher.sock")
    assert ep.base_url == "http://localhost"


@pytest.mark.parametrize(
    "url, expected",
    [
        ("unix:///tmp/eb.sock", Endpoint("unix", "localhost", None, "/tmp/eb.sock")),
        ("unix:/tmp/eb.sock", Endpoint("unix", "localhost", None, "/tmp/eb.sock")),
        ("unix://run/eb.sock", Endpoint("unix", "localhost", None, "run/eb.sock")),
        ("http://127.0.0.1:8000", Endpoint("http", "127.0.0.1", 8000, None)),
        ("http://jetson.local:8000/", Endpoint("http", "jetson.local", 8000, None)),
        ("http://jetson.local", Endpoint("http", "jetson.local", 80, None)),
        ("https://gw.example", Endpoint("https", "gw.example", 443, None)),
        ("http://[::1]:9000/edge/", Endpoint("http", "::1", 9000, None, "/edge")),
    ],
)
def test_parse_url(url: str, expected: Endpoint) -> None:
    assert parse_url(url) == expected


def test_base_url() -> None:
    assert parse_url("http://h:1/p").base_url == "http://h:1/p"
    assert parse_url("https://h").base_url == "https://h:443"
    assert parse_url("http://[::1]:9000").base_url == "http://[::1]:9000"


@pytest.mark.parametrize(
    "url, words",
    [
        ("", "non-empty"),
        ("unix://", "names no socket path"),
        ("localhost:8000", "unsupported scheme"),
        ("ftp://host", "unsupported scheme"),
        ("http://", "names no host"),
        ("http://host:notaport", "invalid port"),
        ("http://host:8000/?x=1", "query or fragment"),
        ("http://user:pw@host:8000", "token="),
    ],
)
def test_parse_url_rejects(url: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_url(url)


def test_clients_parse_at_construction() -> None:
    with Client("http://127.0.0.1:1", token="t") as client:
        assert client.endpoint.port == 1
    assert AsyncClient("unix:///tmp/x.sock").endpoint.socket_path == "/tmp/x.sock"
    with pytest.raises(ValueError):
        Client("tcp://nope")


def test_client_error_carries_status_and_message() -> None:
    err = ClientError(404, "no model 'x'")
    assert (err.status, err.message) == (404, "no model 'x'")
    assert str(err) == "HTTP 404: no model 'x'"


def test_unreachable_daemon_is_not_live(tmp_path) -> None:
    with Client(f"unix://{tmp_path}/missing.sock", timeout=1.0) as client:
        assert client.live() is False
        assert client.ready() is False


def test_default_url_prefers_the_service_socket_else_the_serve_default(tmp_path) -> None:
    from edge_batcher.client import default_url
    from edge_batcher.config import resolve_socket_path

    service = tmp_path / "edge-batcher.sock"
    assert default_url(f"unix://{service}") == f"unix://{resolve_socket_path('auto')}"  # no service socket
    service.touch()
    assert default_url(f"unix://{service}") == f"unix://{service}"
    assert Client().endpoint.socket_path in (str(resolve_socket_path("auto")), "/run/edge-batcher/edge-batcher.sock")
