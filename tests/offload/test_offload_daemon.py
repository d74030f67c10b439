"""PeerClient and PeerPool against a real `edge-batcher serve` process listening on TCP.

The config also sets a bearer token: the client always sends it, so this test keeps passing
once the daemon enforces it on TCP.
"""

from __future__ import annotations

import numpy as np
import pytest

from edge_batcher.config import OffloadSettings, PeerSettings
from edge_batcher.errors import InvalidInput
from edge_batcher.offload.client import PeerClient
from edge_batcher.offload.peers import PeerPool
from tests.offload.conftest import TOKEN, assert_matches_local
from tests.support.ports import free_port
from tests.support.signals import windows


@pytest.fixture
def tcp_daemon(start_daemon):
    port = free_port()
    daemon = start_daemon(f'[server]\nhttp = "127.0.0.1:{port}"\ntoken = "{TOKEN}"\n[models]\nload = ["vibration"]\n')
    daemon.http_url = f"http://127.0.0.1:{port}"
    return daemon


async def test_peer_client_and_pool_against_a_daemon_process(tcp_daemon, model_repo):
    settings = PeerSettings(url=tcp_daemon.http_url, name="daemon", token=TOKEN)
    x = windows(8, seed=30)  # 8 rows: the model's largest preferred size
    for binary in (True, False):
        settings.binary = binary
        async with PeerClient(settings, request_timeout_s=10) as client:
            assert await client.health() and await client.model_ready("vibration")
            assert await client.supports_binary()
            assert_matches_local(model_repo, x, await client.infer("vibration", {"signal": x}, timeout_s=10))
            assert_matches_local(model_repo, x[:1], await client.infer("vibration", {"signal": x[:1]}, timeout_s=10))
            # More rows than the daemon's max_batch_size (8): its 400 comes back as InvalidInput.
            with pytest.raises(InvalidInput, match=r"^peer daemon: request has 9 rows, more than"):
                await client.infer("vibration", {"signal": windows(9)}, timeout_s=10)
    async with PeerPool(OffloadSettings(enabled=True, peers=[settings])) as pool:
        await pool.check_now()
        outputs, name = await pool.infer("vibration", {"signal": x[:2]}, timeout_s=10)
        assert name == "daemon"
        assert_matches_local(model_repo, x[:2], outputs)
        assert pool.status()[0]["healthy"] is True and pool.status()[0]["state"] == "closed"
    assert np.isfinite(outputs["anomaly_score"]).all()
