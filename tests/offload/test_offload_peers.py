"""PeerPool: ordered peers, breakers and health checks, against real in-process peers."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import pytest

from edge_batcher.config import OffloadSettings, PeerSettings
from edge_batcher.errors import DeadlineExceeded, InvalidInput
from edge_batcher.offload.client import PeerError
from edge_batcher.offload.peers import PeerPool
from tests.offload.conftest import TOKEN, assert_matches_local
from tests.support.ports import free_port
from tests.support.signals import windows


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def settings(*urls_or_servers, **kwargs) -> OffloadSettings:
    peers = []
    for i, target in enumerate(urls_or_servers):
        url = target if isinstance(target, str) else target.url
        peers.append(PeerSettings(url=url, name=f"peer{i + 1}", token=TOKEN))
    kwargs.setdefault("breaker_failures", 2)
    kwargs.setdefault("breaker_reset_s", 60.0)
    kwargs.setdefault("request_timeout_s", 5.0)
    kwargs.setdefault("health_interval_s", 60.0)
    return OffloadSettings(enabled=True, peers=peers, **kwargs)


async def wait_until(condition, timeout: float = 5.0) -> None:
    """Await a background task's effect (health checks run on their own schedule)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_infer_returns_outputs_and_the_peer_name(serve_peer, model_repo):
    server = await serve_peer()
    x = windows(5, seed=10)
    async with PeerPool(settings(server)) as pool:
        outputs, name = await pool.infer("vibration", {"signal": x}, timeout_s=5)
        assert name == "peer1"
        assert_matches_local(model_repo, x, outputs)
        assert pool.healthy_peer("vibration").name == "peer1"
        latency = pool.estimated_latency("vibration")
        assert latency is not None and latency > 0
        view = pool.view("vibration")
        assert view.peer_available and view.peer_latency_s == latency
        [status] = pool.status()
        assert status["name"] == "peer1" and status["url"] == server.url
        assert status["state"] == "closed" and status["healthy"] is True
        assert status["latency_s"]["vibration"] == pytest.approx(latency, abs=1e-6)
        assert status["breaker"]["successes"] == 1


async def test_peer_down_opens_the_breaker_and_recovery_closes_it(serve_peer, model_repo, caplog):
    """Down -> PeerError, breaker opens after N; the health check sees it; back on the same
    port -> the next check lets the breaker go half-open, one request closes it."""
    caplog.set_level(logging.INFO, logger="edge_batcher.offload")
    server = await serve_peer()
    x = windows(2, seed=11)
    clock = FakeClock()
    pool = PeerPool(settings(server, breaker_failures=3, breaker_reset_s=30.0), clock=clock)
    try:
        await pool.check_now()
        assert pool.status()[0]["healthy"] is True
        await pool.infer("vibration", {"signal": x}, timeout_s=5)

        await server.stop()
        breaker = pool.peers[0].breaker
        for expected_failures in (1, 2):
            with pytest.raises(PeerError, match=r"no offload peer could serve 'vibration': peer peer1: "):
                await pool.infer("vibration", {"signal": x}, timeout_s=5)
            assert breaker.consecutive_failures == expected_failures and breaker.state == "closed"
        await pool.check_now()  # a failed health check is the third failure
        assert pool.status()[0]["healthy"] is False
        assert breaker.state == "open"
        assert pool.healthy_peer("vibration") is None and pool.estimated_latency("vibration") is None
        assert not pool.view("vibration").peer_available
        with pytest.raises(PeerError, match="peer1: unhealthy"):
            await pool.infer("vibration", {"signal": x}, timeout_s=5)
        for _ in range(5):  # more failures do not log again
            await pool.check_now()

        await server.start()  # same port
        await pool.check_now()
        assert pool.status()[0]["healthy"] is True
        assert breaker.state == "half_open"  # long before breaker_reset_s
        outputs, name = await pool.infer("vibration", {"signal": x}, timeout_s=5)
        assert name == "peer1" and breaker.state == "closed"
        assert_matches_local(model_repo, x, outputs)
    finally:
        await pool.stop()
    logs = [r.getMessage() for r in caplog.records]
    assert sum("breaker opened" in m for m in logs) == 1
    assert sum("is unhealthy" in m for m in logs) == 1
    assert sum("breaker half-open" in m for m in logs) == 1
    assert sum("breaker closed" in m for m in logs) == 1
    assert sum("healthy again" in m for m in logs) == 1


async def test_open_breaker_goes_half_open_after_reset_without_health_checks(serve_peer):
    server = await serve_peer()
    clock = FakeClock()
    pool = PeerPool(settings(server, breaker_failures=1, breaker_reset_s=10.0), clock=clock)
    try:
        server.fail_status = 500
        with pytest.raises(PeerError, match="HTTP 500"):
            await pool.infer("vibration", {"signal": windows(1)}, timeout_s=5)
        assert pool.peers[0].breaker.state == "open"
        with pytest.raises(PeerError, match="peer1: breaker open"):
            await pool.infer("vibration", {"signal": windows(1)}, timeout_s=5)
        server.fail_status = None
        clock.t += 10.0
        assert pool.healthy_peer("vibration") is not None
        _, name = await pool.infer("vibration", {"signal": windows(1)}, timeout_s=5)
        assert name == "peer1" and pool.peers[0].breaker.state == "closed"
    finally:
        await pool.stop()


async def test_background_health_check_notices_down_and_up(serve_peer):
    server = await serve_peer()
    async with PeerPool(settings(server, health_interval_s=0.05, breaker_failures=2)) as pool:
        peer = pool.peers[0]
        await wait_until(lambda: peer.healthy is True)
        await server.stop()
        await wait_until(lambda: peer.healthy is False and peer.breaker.state == "open")
        await server.start()
        await wait_until(lambda: peer.healthy is True and peer.breaker.state == "half_open")
        await pool.infer("vibration", {"signal": windows(1)}, timeout_s=5)
        assert peer.breaker.state == "closed"


async def test_a_peer_400_does_not_open_the_breaker(serve_peer):
    server = await serve_peer()
    async with PeerPool(settings(server, breaker_failures=1)) as pool:
        for _ in range(5):
            with pytest.raises(InvalidInput, match=r"^peer peer1: input 'signal'"):
                await pool.infer("vibration", {"signal": np.zeros((2, 7), np.float32)}, timeout_s=5)
        assert pool.peers[0].breaker.state == "closed"
        assert pool.healthy_peer("vibration") is not None


async def test_fails_over_to_the_next_peer_in_order(serve_peer, model_repo):
    second = await serve_peer()
    dead = f"http://127.0.0.1:{free_port()}"
    x = windows(3, seed=12)
    async with PeerPool(settings(dead, second, breaker_failures=2)) as pool:
        for _ in range(3):
            outputs, name = await pool.infer("vibration", {"signal": x}, timeout_s=5)
            assert name == "peer2"
            assert_matches_local(model_repo, x, outputs)
        states = {s["name"]: s["state"] for s in pool.status()}
        assert states == {"peer1": "open", "peer2": "closed"}
        assert pool.healthy_peer("vibration").name == "peer2"


async def test_a_peer_without_the_model_is_skipped_until_it_has_it(serve_peer):
    first, second = await serve_peer(), await serve_peer()
    cfg = settings(first, second)
    cfg.peers[0].model_map = {"vibration": "vibration-v2"}  # peer1 has no such model
    async with PeerPool(cfg) as pool:
        _, name = await pool.infer("vibration", {"signal": windows(1)}, timeout_s=5)
        assert name == "peer2"
        assert pool.status()[0]["missing_models"] == ["vibration"]
        assert pool.peers[0].breaker.state == "closed" and pool.peers[0].breaker.failures == 0
        assert pool.healthy_peer("vibration").name == "peer2"
        cfg.peers[0].model_map.clear()  # peer1 gets the model
        await pool.check_now()
        assert pool.status()[0]["missing_models"] == []
        _, name = await pool.infer("vibration", {"signal": windows(1)}, timeout_s=5)
        assert name == "peer1"


async def test_no_peer_serves_the_model(serve_peer):
    server = await serve_peer()
    async with PeerPool(settings(server)) as pool:
        with pytest.raises(PeerError, match=r"no offload peer could serve 'other': peer peer1: unknown model"):
            await pool.infer("other", {"signal": windows(1)}, timeout_s=5)
        with pytest.raises(PeerError, match="peer1: does not serve 'other'"):
            await pool.infer("other", {"signal": windows(1)}, timeout_s=5)
        assert pool.healthy_peer("other") is None and pool.healthy_peer("vibration") is not None


async def test_timeout_counts_as_a_failure_and_the_deadline_covers_all_peers(serve_peer):
    slow1, slow2 = await serve_peer(), await serve_peer()
    slow1.delay_s = slow2.delay_s = 2.0
    async with PeerPool(settings(slow1, slow2, breaker_failures=1)) as pool:
        for peer in pool.peers:
            await peer.client.supports_binary()
        started = time.monotonic()
        with pytest.raises(PeerError, match=r"peer1: no answer .* within 0\.\d+ s"):
            await pool.infer("vibration", {"signal": windows(1)}, timeout_s=0.3)
        assert time.monotonic() - started < 1.0  # one deadline for the whole try, not per peer
        assert pool.peers[0].breaker.state == "open"


async def test_deadline_passed_is_not_a_peer_failure(serve_peer):
    server = await serve_peer()
    async with PeerPool(settings(server, breaker_failures=1)) as pool:
        with pytest.raises((DeadlineExceeded, PeerError)):
            await pool.infer("vibration", {"signal": windows(1)}, timeout_s=0)
        assert pool.peers[0].breaker.state == "closed"
    assert server.seen == []


async def test_cancelled_trial_hands_its_permit_back(serve_peer):
    server = await serve_peer()
    clock = FakeClock()
    pool = PeerPool(settings(server, breaker_failures=1, breaker_reset_s=5.0), clock=clock)
    try:
        server.fail_status = 503
        with pytest.raises(PeerError):
            await pool.infer("vibration", {"signal": windows(1)}, timeout_s=5)
        server.fail_status = None
        server.delay_s = 2.0
        clock.t += 5.0
        task = asyncio.ensure_future(pool.infer("vibration", {"signal": windows(1)}, timeout_s=5))
        await wait_until(lambda: not pool.peers[0].breaker.would_allow())  # the trial is out
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pool.peers[0].breaker.state == "half_open" and pool.peers[0].breaker.would_allow()
        server.delay_s = 0.0
        _, name = await pool.infer("vibration", {"signal": windows(1)}, timeout_s=5)
        assert pool.peers[0].breaker.state == "closed"
    finally:
        await pool.stop()


async def test_batches_over_max_rows_go_in_slices(serve_peer, model_repo):
    server = await serve_peer()
    x = windows(11, seed=13)
    async with PeerPool(settings(server, max_rows=4)) as pool:
        assert pool.max_rows == 4 and pool.view("vibration").max_rows == 4
        outputs, name = await pool.infer("vibration", {"signal": x}, timeout_s=5)
    assert name == "peer1"
    assert_matches_local(model_repo, x, outputs)
    infers = [p for _, p, _, _ in server.seen if p.endswith("/infer")]
    assert len(infers) == 3  # 4 + 4 + 3 rows


async def test_view_reports_the_backlog_settings(serve_peer):
    server = await serve_peer()
    pool = PeerPool(settings(server, offload_on_backlog=False, max_rows=16))
    view = pool.view("vibration")
    assert not view.on_backlog and view.max_rows == 16
    assert view.peer_available  # not checked yet: usable until a check says otherwise
    await pool.stop()


async def test_start_stop_without_peers():
    pool = PeerPool(OffloadSettings())
    await pool.start()
    assert pool.healthy_peer("x") is None and pool.status() == []
    with pytest.raises(PeerError, match="no peers configured"):
        await pool.infer("x", {"a": np.zeros((1, 1), np.float32)}, timeout_s=1)
    await pool.stop()


async def test_a_remote_model_s_declaration_is_compared_with_each_peer_s_metadata(serve_peer, caplog):
    from edge_batcher.types import TensorSpec

    server = await serve_peer()  # a real runtime serving vibration: signal FP32 [-1, 256]
    outputs = [TensorSpec("class_probs", "FP32", (-1, 4)), TensorSpec("class_id", "INT64", (-1,)),
               TensorSpec("anomaly_score", "FP32", (-1,))]
    async with PeerPool(settings(server)) as pool:
        pool.add_remote_model("vibration", [TensorSpec("signal", "FP32", (-1, 256))], outputs)
        await pool.check_now()
        [status] = pool.status()
        assert status["spec_mismatches"] == {} and "vibration" in pool.declared

        pool.add_remote_model("vibration", [TensorSpec("signal", "FP16", (-1, 256))], outputs)  # as after a reload
        await pool.check_now()
        await pool.check_now()  # compared once per peer: one warning, not one per round
        [status] = pool.status()
        assert status["spec_mismatches"] == {"vibration": ["input 'signal' is FP32 there, FP16 here"]}
        warnings = [r.getMessage() for r in caplog.records if "unlike its declaration" in r.getMessage()]
        assert len(warnings) == 1 and "peer1" in warnings[0] and "FP16 here" in warnings[0]

        pool.remove_remote_model("vibration")
        assert "vibration" not in pool.declared
