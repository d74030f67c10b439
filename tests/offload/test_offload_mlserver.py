"""Offloading to a real MLServer 1.7+ (not another edge-batcher): its v2 HTTP API without the
binary extension, and its NumpyCodec's [n] -> [n, 1] outputs, which the daemon brings back to
the local model's shapes (offload/conform.py). Skips unless `make test` built .venv-mlserver."""

from __future__ import annotations

import asyncio

import pytest

from edge_batcher.client import AsyncClient
from tests.offload.conftest import assert_matches_local
from tests.offload.test_offload_two_daemons import edge_config, offloaded, tiny_budget
from tests.offload.test_remote_model import REMOTE_VIBRATION
from tests.support.mlserver_peer import MLSERVER, MLServerPeer
from tests.support.signals import windows

pytestmark = pytest.mark.skipif(not MLSERVER.exists(), reason=f"{MLSERVER} missing: `make test` installs it")


@pytest.fixture(scope="module")
def mlserver(model_repo, tmp_path_factory):
    peer = MLServerPeer(tmp_path_factory.mktemp("mlserver"), model_repo).start()
    yield peer
    peer.stop()


async def _concurrently(url: str, x, rows_each: int = 1):
    async with AsyncClient(url) as client:
        return await asyncio.gather(*(client.infer("vibration", {"signal": x[i:i + rows_each]})
                                      for i in range(0, len(x), rows_each)))


def test_a_remote_model_served_by_mlserver_answers_like_the_local_model(start_daemon, model_repo, mlserver, tmp_path):
    repo = tmp_path / "edge-engines"
    (repo / "vibration").mkdir(parents=True)
    (repo / "vibration" / "model.toml").write_text(REMOTE_VIBRATION)
    edge = start_daemon(edge_config(mlserver.port), repo=repo)
    x = windows(20, seed=41)
    answers = asyncio.run(_concurrently(edge.url, x))
    (big,) = asyncio.run(_concurrently(edge.url, x[:12], rows_each=12))  # more rows than a local batch
    for i, got in enumerate(answers):
        assert_matches_local(model_repo, x[i:i + 1], got)  # class_id and anomaly_score: [1], not [1, 1]
    assert_matches_local(model_repo, x[:12], big)
    assert offloaded(edge, "vibration") == {"remote_only/ok": 21}


def test_batches_that_do_not_fit_go_to_mlserver_and_match_local_results(start_daemon, model_repo, mlserver):
    edge = start_daemon(edge_config(mlserver.port, tiny_budget(model_repo)))
    x = windows(16, seed=42)
    answers = asyncio.run(_concurrently(edge.url, x))
    for i, got in enumerate(answers):
        assert_matches_local(model_repo, x[i:i + 1], got)
    assert offloaded(edge, "vibration") == {"does_not_fit/ok": 16}
    with edge.client() as client:
        assert client.stats("vibration")["model_stats"][0]["execution_count"] == 0
