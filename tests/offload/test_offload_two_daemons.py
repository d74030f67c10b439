"""Two real daemons on loopback: an edge device offloading to a peer over KServe v2 HTTP."""

from __future__ import annotations

import asyncio
import shutil
import signal
import threading
import time

import numpy as np
import pytest

from edge_batcher.client import AsyncClient, Client, ClientError
from tests.offload.conftest import TOKEN, assert_matches_local
from tests.support.faulty_engine import HELD, RELEASE_ENV
from tests.support.ports import free_port
from tests.support.signals import windows

MiB = 1 << 20


@pytest.fixture
def peer_repo(model_repo, tmp_path):
    """The peer is the bigger box: its vibration model also takes batches of 16."""
    repo = tmp_path / "peer-engines"
    repo.mkdir()
    for name in ("vibration", "faulty"):
        shutil.copytree(model_repo / name, repo / name)
    toml = repo / "vibration" / "model.toml"
    toml.write_text(toml.read_text().replace("preferred_batch_sizes = [2, 4, 8]",
                                             "preferred_batch_sizes = [2, 4, 8, 16]"))
    return repo


def peer_config(port: int) -> str:
    return f'[server]\nhttp = "127.0.0.1:{port}"\ntoken = "{TOKEN}"\n'


def edge_config(port: int, extra: str = "", health_interval_s: float = 5.0) -> str:
    return (
        f"{extra}\n[offload]\nenabled = true\nhealth_interval_s = {health_interval_s}\nbreaker_failures = 2\n"
        f"breaker_reset_s = 0.5\n[[offload.peers]]\nname = \"peer\"\nurl = \"http://127.0.0.1:{port}\"\n"
        f"token = \"{TOKEN}\"\n"
    )


def tiny_budget(model_repo) -> str:
    """Room for the vibration model's weights and half a batch of 2: every batch must go to the peer."""
    from edge_batcher.memory.estimator import OnnxFootprintEstimator

    f = OnnxFootprintEstimator(model_repo / "vibration" / "model.onnx").estimate(2)
    budget_mb = (f.weights + f.activations // 2) / MiB
    return f'[models]\nload = ["vibration"]\n[memory]\nprobe = "fixed"\nbudget_mb = {budget_mb!r}\n'


async def _burst(url: str, model: str, x: np.ndarray, **kwargs):
    async with AsyncClient(url) as client:
        return await asyncio.gather(*(client.infer(model, {"signal": x[i:i + 1]}, **kwargs) for i in range(len(x))),
                                    return_exceptions=True)


def peer_status(daemon) -> list[dict]:
    from tests.support import rawhttp

    return rawhttp.request(daemon.socket, "GET", "/v2/models/stats")[1]["offload_peers"]


def offloaded(daemon, model: str) -> dict:
    with daemon.client() as client:
        return client.stats(model)["model_stats"][0]["offloaded"]


def test_oversized_and_does_not_fit_batches_go_to_the_peer(start_daemon, model_repo, peer_repo):
    port = free_port()
    start_daemon(peer_config(port), repo=peer_repo)
    edge = start_daemon(edge_config(port, tiny_budget(model_repo)))
    x = windows(24, seed=11)
    results = asyncio.run(_burst(edge.url, "vibration", x))
    assert not [r for r in results if isinstance(r, BaseException)], results
    for i, r in enumerate(results):
        assert_matches_local(model_repo, x[i:i + 1], r)
    with edge.client() as client:
        big = client.infer("vibration", {"signal": x[:12]})  # 12 rows > the edge's max batch 8
        stats = client.stats("vibration")["model_stats"][0]
        with pytest.raises(ClientError) as too_big:  # more than a peer takes at once: not "no peer"
            client.infer("vibration", {"signal": windows(65, seed=3)})
    assert too_big.value.status == 400
    assert "than a peer takes in one request ([offload] max_rows 64)" in too_big.value.message
    assert_matches_local(model_repo, x[:12], big)
    assert stats["offloaded"]["does_not_fit/ok"] == 24 and stats["offloaded"]["too_large/ok"] == 1
    assert "offload peer peer (http://127.0.0.1:" in edge.log_text()
    assert stats["execution_count"] == 0  # nothing ran locally
    # answered by the peer, and counted as answered (issue 32: success stayed 0 after 20 offloads)
    assert stats["inference_stats"]["success"]["count"] == 25 and stats["inference_count"] == 24 + 12
    assert stats["inference_stats"]["queue"]["count"] == 0  # the peer's queue is the peer's
    from tests.support import rawhttp

    _, text = rawhttp.request(edge.socket, "GET", "/metrics")
    assert 'edge_batcher_offloaded_requests_total{model="vibration",reason="does_not_fit",outcome="ok"} 24' in text


def test_a_backlog_past_the_deadline_is_offloaded(start_daemon, model_repo, peer_repo, tmp_path):
    port = free_port()
    start_daemon(peer_config(port), repo=peer_repo)
    release = tmp_path / "release"
    edge = start_daemon(edge_config(port, '[models]\nload = ["faulty"]\n'), env={RELEASE_ENV: str(release)})
    held = windows(16, seed=1)
    held[:, 0] = HELD

    async def run():
        async with AsyncClient(edge.url) as client:
            # Two local batches held until the answers below are in (requests of 8 rows, full at
            # once) fill the edge's two batch slots...
            blockers = [asyncio.create_task(client.infer("faulty", {"signal": half}, timeout_ms=30000))
                        for half in (held[:8], held[8:])]
            for _ in range(300):
                if (await client.stats("faulty"))["model_stats"][0]["queue_depth"] == 0:
                    break
                await asyncio.sleep(0.01)
            # ...so requests due in 300 ms cannot be served locally in time: the peer takes them.
            # (Held rather than slept: a busy machine that sent them late would have found a slot free.)
            x = windows(12, seed=12)
            try:
                answers = await asyncio.gather(*(client.infer("faulty", {"signal": x[i:i + 1]}, timeout_ms=300)
                                                 for i in range(12)))
            finally:
                release.touch()
            await asyncio.gather(*blockers)
            return x, answers

    x, answers = asyncio.run(run())
    for i, r in enumerate(answers):
        assert_matches_local(model_repo, x[i:i + 1], r)
    assert offloaded(edge, "faulty").get("backlog/ok") == 12


def test_peer_killed_under_load_every_request_answered_and_breaker_cycles(start_daemon, model_repo, peer_repo):
    port = free_port()
    peer = start_daemon(peer_config(port), repo=peer_repo)
    edge = start_daemon(edge_config(port, tiny_budget(model_repo), health_interval_s=0.3))
    answers: list = []
    stop = threading.Event()

    def load() -> None:
        with edge.client() as client:
            x = windows(1, seed=5)
            while not stop.is_set():
                try:
                    answers.append(client.infer("vibration", {"signal": x}, timeout_ms=2000))
                except ClientError as exc:
                    answers.append(exc)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    peer.proc.send_signal(signal.SIGKILL)
    peer.proc.wait()
    time.sleep(1.5)
    peers = peer_status(edge)
    assert peers[0]["state"] in ("open", "half_open") and peers[0]["healthy"] is False
    stop.set()
    for t in threads:
        t.join()
    ok = [a for a in answers if isinstance(a, dict)]
    errors = [a for a in answers if not isinstance(a, dict)]
    assert ok, "nothing was served before the peer died"
    assert errors, "the peer's death went unnoticed"
    # Every failure is a clear error (this edge cannot run the model locally at all).
    for e in errors:
        assert e.status == 503, e
        assert ("offload to the peer failed" in e.message or "no batch size" in e.message
                or "does not fit" in e.message), e
    # The peer comes back on the same port: health checks see it, the breaker lets a trial
    # request through (half-open), the trial succeeds and the breaker closes.
    start_daemon(peer_config(port), repo=peer_repo)
    x = windows(2, seed=9)
    with edge.client() as client:
        for _ in range(100):
            try:
                out = client.infer("vibration", {"signal": x})
            except ClientError:
                time.sleep(0.1)
                continue
            if peer_status(edge)[0]["state"] == "closed":
                break
        assert peer_status(edge)[0]["state"] == "closed", peer_status(edge)
    assert_matches_local(model_repo, x, out)


def test_tcp_requires_the_token_and_the_unix_socket_does_not(start_daemon):
    port = free_port()
    peer = start_daemon(peer_config(port) + '[models]\nload = ["vibration"]\n')
    x = windows(1)
    with Client(f"http://127.0.0.1:{port}") as anonymous:
        with pytest.raises(ClientError) as info:
            anonymous.infer("vibration", {"signal": x})
        assert info.value.status == 401 and "bearer token" in info.value.message
        assert anonymous.live()  # liveness stays open for probes
    with Client(f"http://127.0.0.1:{port}", token="wrong") as wrong:
        with pytest.raises(ClientError) as info:
            wrong.infer("vibration", {"signal": x})
        assert info.value.status == 401
    with Client(f"http://127.0.0.1:{port}", token=TOKEN) as authorised:
        assert authorised.infer("vibration", {"signal": x})["class_id"].shape == (1,)
    with peer.client() as local:  # the Unix socket: file permissions, no token
        assert local.infer("vibration", {"signal": x})["class_id"].shape == (1,)


def test_http_without_a_token_refuses_to_start(tmp_path, model_repo):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "edge_batcher.cli", "serve", "--models", str(model_repo), "--unix-socket",
         str(tmp_path / "s.sock"), "--http", f"127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "needs a bearer token" in proc.stderr and "--token-file" in proc.stderr


def test_tritonclient_talks_to_the_daemon_tcp_endpoint(start_daemon, model_repo):
    httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the dev extra")
    port = free_port()
    start_daemon(peer_config(port) + '[models]\nload = ["vibration"]\n')
    headers = {"Authorization": f"Bearer {TOKEN}"}
    x = windows(3, seed=21)

    def call() -> list:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            assert client.is_server_ready(headers=headers)
            meta = client.get_model_metadata("vibration", headers=headers)
            assert meta["inputs"][0]["name"] == "signal"
            outs = []
            for binary in (False, True):
                inp = httpclient.InferInput("signal", list(x.shape), "FP32")
                inp.set_data_from_numpy(x, binary_data=binary)
                wanted = [httpclient.InferRequestedOutput(n, binary_data=binary)
                          for n in ("class_probs", "class_id", "anomaly_score")]
                result = client.infer("vibration", [inp], outputs=wanted, headers=headers)
                outs.append({n: result.as_numpy(n) for n in ("class_probs", "class_id", "anomaly_score")})
            return outs
        finally:
            client.close()

    # tritonclient is blocking (gevent underneath): run it on its own thread.
    outs: list = []
    t = threading.Thread(target=lambda: outs.extend(call()))
    t.start()
    t.join(60)
    assert len(outs) == 2
    for out in outs:
        assert_matches_local(model_repo, x, out)
