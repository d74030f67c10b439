"""A model served by offload peers only (offload/remote_model.py's RemoteModel): backend "remote"
declared in model.toml with no model file on the edge, or a model listed in remote_only; every
request served by the peer (two real daemons on loopback for the end-to-end case, an in-process
peer port computing the same answers for the servable alone)."""

from __future__ import annotations

import asyncio
import shutil
import signal

import numpy as np
import pytest

from edge_batcher.client import ClientError
from edge_batcher.config import DaemonConfig, PeerSettings, load_model_config
from edge_batcher.engines.registry import create_engine
from edge_batcher.errors import ConfigError, InvalidInput, Overloaded, Unavailable
from edge_batcher.metrics import Metrics
from edge_batcher.offload.remote_model import RemoteModel, declared_specs
from edge_batcher.runtime import Runtime
from edge_batcher.types import InferRequest, TensorSpec
from tests.offload import test_offload_two_daemons
from tests.offload.conftest import assert_matches_local
from tests.offload.test_offload_two_daemons import (
    edge_config,
    offloaded,
    peer_config,
    peer_status,
)
from tests.scheduler.test_runner import PeerPort
from tests.scheduler.test_runner import config as rowsum_config
from tests.scheduler.test_runner import request as rowsum_request
from tests.support.ports import free_port
from tests.support.signals import windows

# The fixture (a peer with batches up to 16), overriding conftest's session-scoped one here.
peer_repo = test_offload_two_daemons.peer_repo

REMOTE_VIBRATION = """
backend = "remote"
description = "the vibration classifier, served by the peer"

[batching]
preferred_batch_sizes = [2, 4, 8]
max_queue_delay_ms = 2.0

[[inputs]]
name = "signal"
datatype = "FP32"
shape = [-1, 256]

[[outputs]]
name = "class_probs"
datatype = "FP32"
shape = [-1, 4]

[[outputs]]
name = "class_id"
datatype = "INT64"
shape = [-1]

[[outputs]]
name = "anomaly_score"
datatype = "FP32"
shape = [-1]
"""


def runtime_config(repo) -> DaemonConfig:
    """An in-process Runtime's configuration: this repository, a fixed 1 GiB memory budget."""
    config = DaemonConfig()
    config.models.repository = str(repo)
    config.memory.probe = "fixed"
    config.memory.budget_mb = 1024
    return config


@pytest.fixture
def remote_repo(tmp_path):
    """The edge's repository: the vibration model as model.toml alone, no model.onnx."""
    repo = tmp_path / "edge-engines"
    (repo / "vibration").mkdir(parents=True)
    (repo / "vibration" / "model.toml").write_text(REMOTE_VIBRATION)
    return repo


def test_a_remote_model_is_validated_batched_and_served_by_the_peer(start_daemon, model_repo, peer_repo, remote_repo):
    port = free_port()
    peer = start_daemon(peer_config(port) + '[models]\nload = ["vibration"]\n', repo=peer_repo)
    # The breaker stays open once opened (30 s), so the last requests below see "no peer".
    config = edge_config(port).replace("breaker_reset_s = 0.5", "breaker_reset_s = 30")
    assert "breaker_reset_s = 30" in config
    edge = start_daemon(config, repo=remote_repo)
    x = windows(10, seed=31)
    with edge.client() as client:
        meta = client.model_metadata("vibration")
        assert meta["inputs"] == [{"name": "signal", "datatype": "FP32", "shape": [-1, 256]}]
        assert [o["name"] for o in meta["outputs"]] == ["class_probs", "class_id", "anomaly_score"]
        answers = [client.infer("vibration", {"signal": x[i:i + 1]}) for i in range(len(x))]
        big = client.infer("vibration", {"signal": x})  # 10 rows > max batch 8: still the peer's
        # Checked on the edge against the declared specs, before anything goes to the peer.
        with pytest.raises(ClientError) as bad_shape:
            client.infer("vibration", {"signal": np.zeros((1, 100), np.float32)})
        with pytest.raises(ClientError) as bad_type:
            client.infer("vibration", {"signal": np.zeros((1, 256), np.float64)})
        stats = client.stats("vibration")["model_stats"][0]
    for i, got in enumerate(answers):
        assert_matches_local(model_repo, x[i:i + 1], got)
    assert_matches_local(model_repo, x, big)
    assert bad_shape.value.status == 400 and "signal" in bad_shape.value.message and "256" in bad_shape.value.message
    assert bad_type.value.status == 400 and "FP64" in bad_type.value.message
    assert stats["offloaded"] == {"remote_only/ok": len(x) + 1}
    assert stats["execution_count"] == 0  # nothing ran on the edge
    with peer.client() as direct:
        assert direct.stats("vibration")["model_stats"][0]["inference_count"] == 2 * len(x)  # nothing bad reached it
    assert "nothing to warm up" in edge.log_text()
    assert "model vibration loaded: runs on offload peers only" in edge.log_text()
    assert peer_status(edge)[0]["spec_mismatches"] == {}  # the declaration matches the peer's metadata

    # Without the peer, a clear 503 at once rather than a timeout: first the failed offloads
    # (until the breaker opens), then "no peer" without trying, for any size of request.
    peer.proc.send_signal(signal.SIGKILL)
    peer.proc.wait()
    errors = []
    with edge.client() as client:
        for rows in (1, 10, 1, 10, 1, 10):
            with pytest.raises(ClientError) as down:
                client.infer("vibration", {"signal": x[:rows]}, timeout_ms=3000)
            errors.append(down.value)
    assert all(e.status == 503 for e in errors), errors
    assert "offload to the peer failed" in errors[0].message and "the model is remote-only" in errors[0].message
    assert "remote-only and no peer is available" in errors[-1].message  # 10 rows, breaker open
    assert "remote-only and no peer is available" in errors[-2].message  # 1 row, breaker open
    assert offloaded(edge, "vibration")["remote_only/ok"] == len(x) + 1


def test_a_remote_model_without_offload_peers_stops_start_up(remote_repo):
    config = runtime_config(remote_repo)

    async def start() -> None:
        runtime = Runtime(config)
        try:
            await runtime.start()
        finally:
            await runtime.close()

    with pytest.raises(ConfigError, match=r"model 'vibration' has backend 'remote'.*\[offload\] must be enabled"):
        asyncio.run(start())


def test_reloaded_as_a_local_model_it_stops_being_remote_only(remote_repo, model_repo):
    """SIGHUP's reload: the model gets its file and a local backend; it then runs here (the
    only peer is down) and is no longer sent to peers."""
    config = runtime_config(remote_repo)
    config.offload.enabled = True
    config.offload.peers = [PeerSettings(url=f"http://127.0.0.1:{free_port()}")]  # nothing listens there
    x = windows(1, seed=3)

    async def run():
        runtime = Runtime(config)
        await runtime.start()
        try:
            before = isinstance(runtime.runner("vibration"), RemoteModel), "vibration" in runtime.offload.declared
            shutil.copy(model_repo / "vibration" / "model.onnx", remote_repo / "vibration" / "model.onnx")
            shutil.copy(model_repo / "vibration" / "model.toml", remote_repo / "vibration" / "model.toml")
            changes = await runtime.reload()
            after = isinstance(runtime.runner("vibration"), RemoteModel), "vibration" in runtime.offload.declared
            response = await runtime.infer(InferRequest("vibration", {"signal": x}))
            return before, changes, after, response
        finally:
            await runtime.close()

    before, changes, after, response = asyncio.run(run())
    assert before == (True, True)
    assert changes["changed"] == ["vibration"]
    assert after == (False, False)
    assert_matches_local(model_repo, x, response.outputs)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.split("[[inputs]]")[0] + "[[outputs]]" + t.split("[[outputs]]", 1)[1],
         r"no model file to read inputs from: declare each one as \[\[inputs\]\]"),
        (lambda t: t.replace('datatype = "FP32"\nshape = [-1, 256]', "shape = [-1, 256]"),
         r"\[\[inputs\]\] 'signal': datatype: expected one of"),
        (lambda t: t.replace("shape = [-1, 256]", "shape = [-1, 0]"),
         r"\[\[inputs\]\] 'signal': shape: expected the whole shape"),
        (lambda t: t.replace('name = "class_id"', 'name = "class_probs"'), r"\[\[outputs\]\] names a tensor twice"),
    ],
)
def test_remote_specs_must_be_declared_whole(tmp_path, change, message):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.toml").write_text(change(REMOTE_VIBRATION))
    with pytest.raises(ConfigError, match=message) as info:
        declared_specs(load_model_config(tmp_path / "m"))
    assert str(tmp_path / "m" / "model.toml") in str(info.value)


def test_backend_remote_has_no_engine_to_create(remote_repo):
    with pytest.raises(ConfigError, match="backend 'remote' has no engine on this device: the model runs on offload"):
        create_engine(load_model_config(remote_repo / "vibration"))


async def test_a_model_listed_remote_only_is_checked_against_the_peers_too(serve_peer, model_repo):
    from tests.offload.conftest import TOKEN

    server = await serve_peer()
    config = runtime_config(model_repo)
    config.models.load = ["vibration"]
    config.models.warmup = False
    config.offload.enabled = True
    config.offload.remote_only = ["vibration"]
    config.offload.peers = [PeerSettings(url=server.url, name="peer", token=TOKEN)]
    runtime = Runtime(config)
    await runtime.start()
    try:
        # Its specs come from its model file; nothing of it stays loaded or counts in the budget.
        assert isinstance(runtime.runner("vibration"), RemoteModel)
        assert runtime.runner("vibration").inputs == [TensorSpec("signal", "FP32", (-1, 256))]
        assert runtime.budget.resident == 0
        assert set(runtime.offload.declared) == {"vibration"}
        [status] = runtime.offload.status()
        assert status["spec_mismatches"] == {}
        response = await runtime.infer(InferRequest("vibration", {"signal": windows(1, seed=8)}))
        assert runtime.runner("vibration").statistics()["offloaded"] == {"remote_only/ok": 1}
        assert_matches_local(model_repo, windows(1, seed=8), response.outputs)
    finally:
        await runtime.close()


# ------------------------------------------------------------------ the servable alone

ROWSUM_SPECS = [TensorSpec("x", "FP32", (-1, 4))], [TensorSpec("y", "FP32", (-1,))]


async def started(peer, **batching) -> RemoteModel:
    model = RemoteModel(rowsum_config(**batching), *ROWSUM_SPECS, peer, Metrics())
    await model.start()
    return model


async def test_each_request_goes_to_the_peer_checked_and_counted():
    peer = PeerPort()
    model = await started(peer)
    x, req = rowsum_request(rows=3)
    out = await model.infer(req)
    np.testing.assert_allclose(out.outputs["y"], x.sum(axis=1), rtol=1e-6)
    with pytest.raises(InvalidInput, match="x"):
        await model.infer(InferRequest("rowsum", {"x": np.zeros((1, 3), np.float32)}))
    with pytest.raises(InvalidInput, match="100 rows, more than model 'rowsum' sends to a peer in one request"):
        await model.infer(rowsum_request(rows=100)[1])  # over max_rows (64) and max_batch_size
    assert peer.calls == [3]  # nothing invalid reached the peer
    stats = model.statistics()
    assert stats["offloaded"] == {"remote_only/ok": 1} and stats["execution_count"] == 0
    assert stats["inference_stats"]["success"]["count"] == 1 and stats["inference_count"] >= 1


async def test_without_a_peer_or_when_it_fails_the_answer_is_a_503():
    peer = PeerPort(available=False)
    model = await started(peer)
    with pytest.raises(Unavailable, match="'rowsum' is remote-only and no peer is available"):
        await model.infer(rowsum_request()[1])
    peer.available, peer.fail = True, True
    with pytest.raises(Unavailable, match="offload to the peer failed .*peer is down.* and the model is remote-only"):
        await model.infer(rowsum_request()[1])
    stats = model.statistics()
    assert stats["offloaded"] == {"remote_only/failed": 1} and stats["inference_stats"]["fail"]["count"] == 1


async def test_a_peer_s_4xx_verdict_is_passed_on_as_is():
    class StrictPeer(PeerPort):
        async def infer(self, model, inputs, timeout_s, *, conform_to=None):
            raise InvalidInput("the peer takes at most 2 rows")

    model = await started(StrictPeer())
    with pytest.raises(InvalidInput, match="the peer takes at most 2 rows"):
        await model.infer(rowsum_request(rows=3)[1])


async def test_drain_waits_for_requests_on_their_way_and_refuses_new_ones():
    class SlowPeer(PeerPort):
        async def infer(self, model, inputs, timeout_s, *, conform_to=None):
            await asyncio.sleep(0.2)
            return await super().infer(model, inputs, timeout_s)

    model = await started(SlowPeer(), queue_capacity=1)
    x, req = rowsum_request()
    answer = asyncio.ensure_future(model.infer(req))
    await asyncio.sleep(0.05)  # on its way to the peer
    assert len(model.queue) == 1
    with pytest.raises(Overloaded, match="queue_capacity 1"):
        model.refuse_if_full()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await model.drain(timeout=5.0)
    assert loop.time() - t0 < 1.0 and len(model.queue) == 0
    np.testing.assert_allclose((await answer).outputs["y"], x.sum(axis=1), rtol=1e-6)
    with pytest.raises(Unavailable, match="draining"):
        await model.infer(rowsum_request()[1])
    await model.close()
