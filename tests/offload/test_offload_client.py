"""PeerClient against the real daemon HTTP app (in-process, on a loopback TCP port)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from edge_batcher.config import PeerSettings
from edge_batcher.errors import ConfigError, DeadlineExceeded, InvalidInput, ModelNotFound
from edge_batcher.offload.client import PeerClient, PeerError
from edge_batcher.transports.auth import tls_context
from tests.offload.conftest import TOKEN, assert_matches_local
from tests.support.signals import windows


def peer(server, **kwargs) -> PeerSettings:
    kwargs.setdefault("token", TOKEN)
    kwargs.setdefault("name", "edge-1")
    return PeerSettings(url=server.url, **kwargs)


def infers(server) -> list[tuple[str, bool]]:
    """(content type, had Inference-Header-Content-Length) of each infer the server saw."""
    return [(ct, hl) for method, path, ct, hl in server.seen if path.endswith("/infer")]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
async def test_infer_matches_local_onnxruntime(serve_peer, model_repo, binary):
    server = await serve_peer()
    x = windows(6, seed=1)
    async with PeerClient(peer(server, binary=binary), request_timeout_s=10) as client:
        assert await client.health()
        assert await client.model_ready("vibration")
        assert client.latency_estimate("vibration") is None
        out = await client.infer("vibration", {"signal": x}, timeout_s=10)
        assert_matches_local(model_repo, x, out)
        assert await client.supports_binary() is True  # edge-batcher advertises it
        latency = client.latency_estimate("vibration")
        assert latency is not None and 0 < latency < 10
        out2 = await client.infer("vibration", {"signal": x[:2]}, timeout_s=10)
        assert_matches_local(model_repo, x[:2], out2)
        assert client.latency_estimate("vibration") != latency  # the EWMA moved
    # The wire format really was the one asked for.
    assert infers(server) == [("application/octet-stream" if binary else "application/json", binary)] * 2


async def test_json_when_the_peer_does_not_advertise_binary(serve_peer, model_repo):
    server = await serve_peer()
    server.advertise_binary = False
    x = windows(3, seed=2)
    async with PeerClient(peer(server, binary=True), request_timeout_s=10) as client:
        out = await client.infer("vibration", {"signal": x}, timeout_s=10)
        assert await client.supports_binary() is False
    assert_matches_local(model_repo, x, out)
    assert infers(server) == [("application/json", False)]


async def test_model_map_names_the_peer_model(serve_peer, model_repo):
    server = await serve_peer()
    x = windows(2, seed=3)
    settings = peer(server, model_map={"vib-local": "vibration"})
    async with PeerClient(settings, request_timeout_s=10) as client:
        assert client.remote_name("vib-local") == "vibration"
        assert await client.model_ready("vib-local")
        out = await client.infer("vib-local", {"signal": x}, timeout_s=10)
        assert client.latency_estimate("vib-local") is not None  # kept under the local name
        assert client.latency_estimate("vibration") is None
    assert_matches_local(model_repo, x, out)
    assert ("POST", "/v2/models/vibration/infer") in [(m, p) for m, p, _, _ in server.seen]


async def test_token_from_token_file(serve_peer, model_repo, tmp_path):
    server = await serve_peer()
    (tmp_path / "token").write_text(TOKEN + "\n")
    settings = peer(server, token="", token_file=str(tmp_path / "token"))
    async with PeerClient(settings, request_timeout_s=10) as client:
        out = await client.infer("vibration", {"signal": windows(1)}, timeout_s=10)
    assert_matches_local(model_repo, windows(1), out)


def test_unreadable_token_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"edge-1: token_file: cannot read .*missing"):
        PeerClient(PeerSettings(url="http://127.0.0.1:1", name="edge-1", token_file=str(tmp_path / "missing")))


# --------------------------------------------------------------------------- authentication


async def test_tcp_requests_need_the_bearer_token_but_live_does_not(serve_peer):
    server = await serve_peer()
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                        {"Authorization": TOKEN}, {"Authorization": f"Bearer {TOKEN}x"}):
            for method, path in (("GET", "/v2/health/ready"), ("GET", "/v2"), ("GET", "/metrics"),
                                 ("POST", "/v2/models/vibration/infer"), ("GET", "/v2/nowhere")):
                async with s.request(method, server.url + path, headers=headers, data=b"{}") as r:
                    assert r.status == 401, (headers, path)
                    assert await r.json() == {"error": "missing or invalid bearer token"}
                    assert r.headers["WWW-Authenticate"].startswith("Bearer")
        async with s.get(server.url + "/v2/health/live") as r:
            assert r.status == 200 and (await r.json()) == {"live": True}
        for scheme in ("Bearer", "bearer"):
            async with s.get(server.url + "/v2/health/ready", headers={"Authorization": f"{scheme} {TOKEN}"}) as r:
                assert r.status == 200
    assert all(path != "/v2/models/vibration/infer" for _, path, _, _ in server.seen)  # never reached


async def test_unix_socket_requests_pass_without_a_token(runtime, serve_peer, tmp_path):
    server = await serve_peer()
    path = str(tmp_path / "eb.sock")
    web_runner = web.AppRunner(server.make_app(), access_log=None)
    await web_runner.setup()
    await web.UnixSite(web_runner, path).start()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as s:
            async with s.get("http://localhost/v2/health/ready") as r:
                assert r.status == 200
            async with s.get("http://localhost/v2/models/vibration") as r:
                assert r.status == 200 and (await r.json())["name"] == "vibration"
        async with aiohttp.ClientSession() as s:  # the same app over TCP still wants it
            async with s.get(server.url + "/v2/models/vibration") as r:
                assert r.status == 401
    finally:
        await web_runner.cleanup()


async def test_wrong_token_is_a_peer_error_and_unhealthy(serve_peer):
    server = await serve_peer()
    async with PeerClient(peer(server, token="nope"), request_timeout_s=10) as client:
        assert not await client.health()
        assert "HTTP 401" in client.last_error
        with pytest.raises(PeerError, match=r"peer edge-1 refused our credentials .*HTTP 401.*token") as info:
            await client.infer("vibration", {"signal": windows(1)}, timeout_s=10)
        assert info.value.breaker_failure and info.value.status == 502 and info.value.peer == "edge-1"


def test_bearer_middleware_refuses_an_empty_token():
    from edge_batcher.transports.auth import bearer_auth_middleware

    with pytest.raises(ConfigError, match="token"):
        bearer_auth_middleware("")


# --------------------------------------------------------------------------- TLS


async def test_tls_verified_against_ca_file(serve_peer, server_tls, tls_files, model_repo):
    cert, _ = tls_files
    server = await serve_peer(ssl_context=server_tls)
    assert server.url.startswith("https://")
    x = windows(4, seed=4)
    async with PeerClient(peer(server, ca_file=str(cert)), request_timeout_s=10) as client:
        assert await client.health()
        out = await client.infer("vibration", {"signal": x}, timeout_s=10)
    assert_matches_local(model_repo, x, out)
    # The system CAs do not know the self-signed certificate...
    async with PeerClient(peer(server), request_timeout_s=10) as client:
        assert not await client.health()
        with pytest.raises(PeerError, match="certificate"):
            await client.infer("vibration", {"signal": x}, timeout_s=10)
    # ...unless verification is turned off (testing only).
    async with PeerClient(peer(server, tls_insecure=True), request_timeout_s=10) as client:
        out = await client.infer("vibration", {"signal": x}, timeout_s=10)
    assert_matches_local(model_repo, x, out)


async def test_plain_http_to_a_tls_listener_fails_cleanly(serve_peer, server_tls):
    server = await serve_peer(ssl_context=server_tls)
    settings = PeerSettings(url=server.url.replace("https://", "http://"), name="edge-1", token=TOKEN)
    async with PeerClient(settings, request_timeout_s=2) as client:
        with pytest.raises(PeerError, match="peer edge-1"):
            await client.infer("vibration", {"signal": windows(1)}, timeout_s=2)


def test_tls_context_errors_name_the_file(tmp_path, tls_files):
    cert, key = tls_files
    with pytest.raises(ConfigError, match=r"tls_cert: .*nope\.pem not found"):
        tls_context(str(tmp_path / "nope.pem"), str(key))
    with pytest.raises(ConfigError, match=r"tls_key: .*nokey\.pem not found"):
        tls_context(str(cert), str(tmp_path / "nokey.pem"))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="not a PEM certificate and matching private key"):
        tls_context(str(garbage), str(key))
    with pytest.raises(ConfigError, match="not a PEM certificate"):
        tls_context(str(cert), str(cert))  # a certificate is not a key


def test_ca_file_errors_name_the_peer(tmp_path):
    with pytest.raises(ConfigError, match=r"edge-1: ca_file: .*not found"):
        PeerClient(PeerSettings(url="https://127.0.0.1:1", name="edge-1", ca_file=str(tmp_path / "ca.pem")))
    bad = tmp_path / "bad.pem"
    bad.write_text("junk")
    with pytest.raises(ConfigError, match=r"edge-1: ca_file: cannot load"):
        PeerClient(PeerSettings(url="https://127.0.0.1:1", name="edge-1", ca_file=str(bad)))


# --------------------------------------------------------------------------- errors


async def test_bad_input_is_invalid_input_with_the_peer_name(serve_peer):
    server = await serve_peer()
    async with PeerClient(peer(server), request_timeout_s=10) as client:
        with pytest.raises(InvalidInput, match=r"^peer edge-1: .*signal") as info:
            await client.infer("vibration", {"signal": np.zeros((2, 100), np.float32)}, timeout_s=10)
        assert info.value.status == 400 and info.value.peer == "edge-1"
        with pytest.raises(ModelNotFound, match=r"^peer edge-1: unknown model 'nope'") as info:
            await client.infer("nope", {"signal": windows(1)}, timeout_s=10)
        assert info.value.status == 404
        assert not await client.model_ready("nope")


@pytest.mark.parametrize("status, failure", [(500, True), (503, True), (429, True), (413, False)])
async def test_server_errors_are_peer_errors(serve_peer, status, failure):
    server = await serve_peer()
    server.fail_status = status
    async with PeerClient(peer(server), request_timeout_s=10) as client:
        with pytest.raises(PeerError, match=rf"peer edge-1: .*{status}.*injected failure") as info:
            await client.infer("vibration", {"signal": windows(1)}, timeout_s=10)
    assert info.value.breaker_failure is failure and info.value.status == 502


async def test_connection_refused_is_a_peer_error():
    settings = PeerSettings(url="http://127.0.0.1:1", name="gone")
    async with PeerClient(settings, request_timeout_s=5) as client:
        assert not await client.health()
        with pytest.raises(PeerError, match=r"peer gone: GET /v2: .*Connect") as info:
            await client.infer("vibration", {"signal": windows(1)}, timeout_s=5)
    assert info.value.breaker_failure


@pytest.mark.parametrize("timeout_s, request_timeout_s", [(0.2, 10.0), (10.0, 0.2)])
async def test_timeouts_are_honoured(serve_peer, timeout_s, request_timeout_s):
    server = await serve_peer()
    server.delay_s = 3.0
    async with PeerClient(peer(server), request_timeout_s=request_timeout_s) as client:
        assert await client.supports_binary()  # not slowed: only infer is
        started = time.monotonic()
        with pytest.raises(PeerError,
                           match=r"peer edge-1: no answer to POST /v2/models/vibration/infer within 0\.\d+ s"):
            await client.infer("vibration", {"signal": windows(1)}, timeout_s=timeout_s)
        elapsed = time.monotonic() - started
    assert 0.15 < elapsed < 1.5


async def test_deadline_already_passed_sends_nothing(serve_peer):
    server = await serve_peer()
    async with PeerClient(peer(server), request_timeout_s=10) as client:
        with pytest.raises(DeadlineExceeded):
            await client.infer("vibration", {"signal": windows(1)}, timeout_s=0)
    assert server.seen == []


async def test_pooled_connection_survives_a_server_restart(serve_peer, model_repo):
    """A kept-alive connection the peer closed is retried once on a fresh one."""
    server = await serve_peer()
    x = windows(2, seed=5)
    async with PeerClient(peer(server), request_timeout_s=10) as client:
        await client.infer("vibration", {"signal": x}, timeout_s=10)
        await server.stop()
        with pytest.raises(PeerError):
            await client.infer("vibration", {"signal": x}, timeout_s=10)
        await server.start()
        out = await client.infer("vibration", {"signal": x}, timeout_s=10)
    assert_matches_local(model_repo, x, out)


async def test_large_batches_take_the_off_loop_codec_path(serve_peer, model_repo):
    server = await serve_peer()
    x = windows(300, seed=6)  # 300 KiB of input: encoded/decoded on a worker thread
    async with PeerClient(peer(server), request_timeout_s=20) as client:
        out = await client.infer("vibration", {"signal": x}, timeout_s=20)
    assert out["class_probs"].shape == (300, 4)
    assert_matches_local(model_repo, x[:8], {k: v[:8] for k, v in out.items()})


async def test_cancellation_propagates(serve_peer):
    server = await serve_peer()
    server.delay_s = 3.0
    async with PeerClient(peer(server), request_timeout_s=10) as client:
        await client.supports_binary()
        task = asyncio.ensure_future(client.infer("vibration", {"signal": windows(1)}, timeout_s=10))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
