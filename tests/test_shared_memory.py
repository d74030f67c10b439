"""Triton's system shared memory against a real daemon: tritonclient's shared memory utilities
with tritonclient.http over TCP, edge-batcher's own client over the Unix socket, shm requests
batched with others, hostile and malformed registrations and requests (4xx, the daemon keeps
serving), a region unregistered while a request uses it, a client that dies holding one, and
no descriptor or mapping left behind after 10,000 register/unregister cycles."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from edge_batcher.client import ClientError, RegionInput, SharedMemoryRegion
from edge_batcher.client_shared_memory import output_reader
from edge_batcher.errors import InvalidInput
from tests.support import rawhttp
from tests.support.daemon import DaemonProcess
from tests.support.frames import expected_brightness, expected_channel_mean
from tests.support.models import ROOT, _tool
from tests.support.ports import free_port

th = pytest.importorskip("tritonclient.http")
tshm = pytest.importorskip("tritonclient.utils.shared_memory")

TOKEN = "shm-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FRAME = (480, 640, 3)
FRAME_BYTES = 480 * 640 * 3


@pytest.fixture(scope="module")
def frames_repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("frames_engines")
    build = _tool("build_frames_model").build
    # Requests wait for company even when the model is idle: concurrent ones meet in a batch
    # within 20 ms, and a lone one on frames_slow waits 1.5 s, time to unregister its region.
    build(repo, "frames", delay_ms=20.0, dispatch_when_idle=False)
    build(repo, "frames_slow", delay_ms=1500.0, dispatch_when_idle=False)
    return repo


@pytest.fixture(scope="module")
def shm_daemon(tmp_path_factory, frames_repo):
    home = tmp_path_factory.mktemp("shm_daemon")
    token = home / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    port = free_port()
    d = DaemonProcess(home, f'[server]\nhttp = "127.0.0.1:{port}"\ntoken_file = "{token}"\nshm_max_regions = 8\n',
                      repo=frames_repo)
    d.start().wait_ready()
    d.tcp = f"127.0.0.1:{port}"
    yield d
    assert d.stop() == 0


def frame(value: int) -> np.ndarray:
    rng = np.random.default_rng(value)
    return rng.integers(0, 256, (1, *FRAME), dtype=np.uint8)


def key() -> str:
    return f"/eb-test-{uuid.uuid4().hex[:12]}"


def shm_maps(pid: int) -> list[str]:
    return [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/dev/shm/" in line]


def test_tritonclient_http_with_its_shared_memory_utilities(shm_daemon):
    client = th.InferenceServerClient(shm_daemon.tcp)
    x = np.concatenate([frame(1), frame(2)])
    k_in, k_out = key(), key()
    h_in = tshm.create_shared_memory_region("in", k_in, x.nbytes)
    h_out = tshm.create_shared_memory_region("out", k_out, 64)
    try:
        tshm.set_shared_memory_region(h_in, [x])
        client.register_system_shared_memory("in", k_in, x.nbytes, headers=AUTH)
        client.register_system_shared_memory("out", k_out, 64, headers=AUTH)
        assert client.get_system_shared_memory_status(headers=AUTH) == [
            {"name": "in", "key": k_in, "offset": 0, "byte_size": x.nbytes},
            {"name": "out", "key": k_out, "offset": 0, "byte_size": 64}]
        assert client.get_system_shared_memory_status("out", headers=AUTH)[0]["name"] == "out"

        frames = th.InferInput("frames", list(x.shape), "UINT8")
        frames.set_shared_memory("in", x.nbytes)
        brightness = th.InferRequestedOutput("brightness")
        brightness.set_shared_memory("out", 8, offset=16)
        channels = th.InferRequestedOutput("channel_mean", binary_data=True)
        result = client.infer("frames", [frames], outputs=[brightness, channels], headers=AUTH)

        out = result.get_output("brightness")
        assert out["shape"] == [2] and out["datatype"] == "FP32" and "data" not in out
        # Triton lists it so: its C++ client (perf_analyzer) wants binary_data_size in any parameters
        assert "parameters" not in out
        got = tshm.get_contents_as_numpy(h_out, np.float32, [2], offset=16)
        np.testing.assert_allclose(got, expected_brightness(x), rtol=1e-4)
        np.testing.assert_allclose(result.as_numpy("channel_mean"), expected_channel_mean(x), rtol=1e-4)

        client.unregister_system_shared_memory("in", headers=AUTH)
        assert [r["name"] for r in client.get_system_shared_memory_status(headers=AUTH)] == ["out"]
        client.unregister_system_shared_memory(headers=AUTH)
        assert client.get_system_shared_memory_status(headers=AUTH) == []
    finally:
        tshm.destroy_shared_memory_region(h_in)
        tshm.destroy_shared_memory_region(h_out)


def test_cuda_shared_memory_without_a_usable_gpu_is_refused_with_the_reason(shm_daemon):
    """The daemon's real CUDA path: here no binding or GPU (refused, naming why); on a GPU machine
    the zero handle is no IPC handle (refused, naming that). tests/test_cuda_shared_memory*.py
    cover registration that succeeds."""
    client = th.InferenceServerClient(shm_daemon.tcp)
    assert client.get_cuda_shared_memory_status(headers=AUTH) == []
    zero_handle = base64.b64encode(bytes(64)).decode()
    status, body = rawhttp.request(shm_daemon.socket, "POST", "/v2/cudasharedmemory/region/gpu/register",
                                   f'{{"raw_handle": {{"b64": "{zero_handle}"}}, "device_id": 0, "byte_size": 16}}')
    assert status == 400
    assert ("needs a discrete CUDA GPU" in body["error"] and "system shared memory" in body["error"]
            or "cannot open the CUDA IPC handle" in body["error"]), body
    status, body = rawhttp.request(shm_daemon.socket, "POST", "/v2/cudasharedmemory/region/gpu/register",
                                   '{"raw_handle": {"b64": "AAAA"}, "device_id": 0, "byte_size": 16}')
    assert status == 400 and "64 bytes of a cudaIpcMemHandle_t" in body["error"], body
    assert rawhttp.request(shm_daemon.socket, "POST", "/v2/cudasharedmemory/unregister")[0] == 200
    assert client.get_cuda_shared_memory_status(headers=AUTH) == []


def test_the_project_client_over_the_unix_socket(shm_daemon):
    x = frame(3)
    with SharedMemoryRegion("cam", key(), FRAME_BYTES + 64) as region, shm_daemon.client() as client:
        client.register_region(region)
        assert client.region_status("cam") == [{"name": "cam", "key": region.key, "offset": 0,
                                                "byte_size": FRAME_BYTES + 64}]
        response = client.infer_with_regions(
            "frames", {"frames": region.put(x)},
            output_regions={"channel_mean": region.output(offset=FRAME_BYTES, byte_size=12)},
            outputs=["brightness"])
        np.testing.assert_allclose(response.outputs["channel_mean"], expected_channel_mean(x), rtol=1e-4)
        np.testing.assert_allclose(response.outputs["brightness"], expected_brightness(x), rtol=1e-4)
        client.unregister_region("cam")
        assert client.region_status() == []


def test_the_client_reads_outputs_listed_without_data_from_the_regions_it_named():
    # The response names an output in a region by name, datatype and shape alone (as Triton's):
    # the client finds it where its request asked, sized by the shape (BYTES: its prefixes).
    words = [b"ok", b"lamp on"]
    framed = b"".join(len(w).to_bytes(4, "little") + w for w in words)
    with SharedMemoryRegion("out", key(), 64) as region:
        region.view(8, len(framed))[:] = framed
        region.view(40, 8)[:] = np.array([1.5, -2.0], np.float32).tobytes()
        read = output_reader({"label": region.output(8, 32), "score": region.output(40, 8),
                              "small": region.output(40, 4)})
        assert read("label", "BYTES", [2], {}, "output 'label'").tolist() == words
        np.testing.assert_array_equal(read("score", "FP32", [2], {}, "output 'score'"), [1.5, -2.0])
        with pytest.raises(InvalidInput, match="needs 8 bytes, more than the 4"):
            read("small", "FP32", [2], {}, "output 'small'")
        with pytest.raises(InvalidInput, match="named no region for it"):
            read("other", "FP32", [2], {}, "output 'other'")


def test_the_async_client_batches_region_requests_and_answers_each_its_own(shm_daemon):
    import asyncio

    from edge_batcher.client import AsyncClient

    async def main() -> None:
        xs = [frame(200 + i) for i in range(4)]
        with SharedMemoryRegion("acam", key(), 4 * (FRAME_BYTES + 4)) as region:
            async with AsyncClient(shm_daemon.url) as client:
                await client.register_region(region)
                assert [r["name"] for r in await client.region_status("acam")] == ["acam"]
                calls = [client.infer_with_regions(
                    "frames", {"frames": region.put(x, offset=i * FRAME_BYTES)},
                    output_regions={"brightness": region.output(4 * FRAME_BYTES + 4 * i, 4)})
                    for i, x in enumerate(xs)]
                responses = await asyncio.gather(*calls)
                for x, response in zip(xs, responses, strict=True):
                    np.testing.assert_allclose(response.outputs["brightness"], expected_brightness(x), rtol=1e-4)
                with pytest.raises(ClientError, match="out of range|past|beyond|exceeds") as refused:
                    await client.infer_with_regions("frames", {"frames": region.put(xs[0], offset=0)},
                                                    output_regions={"brightness": region.output(
                                                        4 * (FRAME_BYTES + 4) - 2, 4)})
                assert refused.value.status == 400
                await client.unregister_region("acam")
                assert await client.region_status() == []

    asyncio.run(main())


def _one_client(url: str, i: int) -> tuple[int, np.ndarray]:
    from edge_batcher.client import Client

    x = frame(100 + i)
    with SharedMemoryRegion(f"c{i}", key(), FRAME_BYTES + 4) as region, Client(url) as client:
        client.register_region(region)
        try:
            out = client.infer_with_regions("frames", {"frames": region.put(x)},
                                            output_regions={"brightness": region.output(FRAME_BYTES, 4)})
            return i, np.array(out.outputs["brightness"])  # a copy: the region goes away
        finally:
            client.unregister_region(region.name)


def test_shm_requests_are_batched_and_each_gets_its_own_rows(shm_daemon):
    with shm_daemon.client() as client:
        before = client.stats("frames")["model_stats"][0]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: _one_client(shm_daemon.url, i), range(8)))
    for i, got in results:
        np.testing.assert_allclose(got, expected_brightness(frame(100 + i)), rtol=1e-4)
    with shm_daemon.client() as client:
        stats = client.stats("frames")["model_stats"][0]
    requests = stats["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"]
    batches = stats["execution_count"] - before["execution_count"]
    assert requests == 8 and batches < 8, f"8 concurrent shm requests never shared a batch: {stats['batch_stats']}"


@pytest.mark.parametrize("body, match", [
    ('{"key": "/../../etc/passwd", "byte_size": 16}', "not a POSIX shm name"),
    ('{"key": "/a/b", "byte_size": 16}', "not a POSIX shm name"),
    ('{"key": "/eb-test-never-created", "byte_size": 16}', "no shm object"),
    ('{"key": "/x"}', "needs \\\"key\\\" and \\\"byte_size\\\""),
    ('{"key": "/x", "byte_size": -5}', "byte_size must be an integer >= 0"),
    ('[1, 2]', "must be a JSON object"),
    ('{"key": ', "not JSON"),
])  # fmt: skip
def test_hostile_and_malformed_registrations_are_400(shm_daemon, body, match):
    status, answer = rawhttp.request(shm_daemon.socket, "POST", "/v2/systemsharedmemory/region/r/register", body)
    assert status == 400 and match.replace("\\", "") in answer["error"], answer
    assert shm_daemon.client().ready()


def test_bad_requests_naming_regions_are_400_and_the_daemon_keeps_serving(shm_daemon):
    x = frame(4)
    with SharedMemoryRegion("bad", key(), FRAME_BYTES) as region, shm_daemon.client() as client:
        client.register_region(region)
        with pytest.raises(ClientError, match="already registered") as exc:
            client.register_region(region)
        assert exc.value.status == 400
        cases = {
            "no shared memory region 'ghost'": {"frames": RegionInput("ghost", "UINT8", list(x.shape), 0, x.nbytes)},
            "beyond region 'bad'": {"frames": RegionInput("bad", "UINT8", list(x.shape), 16, x.nbytes)},
            "does not match shape": {"frames": RegionInput("bad", "UINT8", [2, *FRAME], 0, x.nbytes)},
        }
        for match, inputs in cases.items():
            with pytest.raises(ClientError, match=match) as exc:
                client.infer_with_regions("frames", inputs)
            assert exc.value.status == 400
        with pytest.raises(ClientError, match="is 12 bytes, more than its shared_memory_byte_size 4") as exc:
            client.infer_with_regions("frames", {"frames": region.put(x)},
                                      output_regions={"channel_mean": region.output(0, 4)})
        assert exc.value.status == 400
        with pytest.raises(ClientError, match="beyond region 'bad'") as exc:  # refused before the model runs
            client.infer_with_regions("frames", {"frames": region.put(x)},
                                      output_regions={"channel_mean": region.output(FRAME_BYTES - 4, 12)})
        client.unregister_region("bad")
        np.testing.assert_allclose(client.infer("frames", {"frames": x})["brightness"], expected_brightness(x),
                                   rtol=1e-4)


def test_a_region_unregistered_while_a_request_uses_it(shm_daemon):
    x = frame(5)
    with SharedMemoryRegion("busy", key(), FRAME_BYTES) as region, shm_daemon.client() as client:
        client.register_region(region)
        placed = region.put(x)
        result: dict = {}
        request = threading.Thread(target=lambda: result.update(
            out=shm_daemon.client().infer_with_regions("frames_slow", {"frames": placed})))
        request.start()
        time.sleep(0.5)  # the request is waiting 1.5 s in the queue, holding the region
        client.unregister_region("busy")  # answered at once
        assert client.region_status() == []
        assert any(region.key in line for line in shm_maps(shm_daemon.proc.pid))  # still mapped for it
        request.join(10)
        np.testing.assert_allclose(result["out"].outputs["brightness"], expected_brightness(x), rtol=1e-4)
        assert _unmapped(shm_daemon.proc.pid, region.key)  # once the request has ended
        with pytest.raises(ClientError, match="no shared memory region 'busy'"):
            client.infer_with_regions("frames", {"frames": placed})


def _unmapped(pid: int, key: str, within_s: float = 2.0) -> bool:
    """Whether the daemon no longer maps `key`, allowing for the answer to reach us a moment
    before the handler that held the region returns."""
    deadline = time.monotonic() + within_s
    while any(key in line for line in shm_maps(pid)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


CHILD = """
import os, signal, sys, numpy as np
sys.path.insert(0, {root!r})
from edge_batcher.client import Client, SharedMemoryRegion
region = SharedMemoryRegion("orphan", {key!r}, {size})
with Client({url!r}) as client:
    client.register_region(region)
region.put(np.full({shape}, 9, dtype=np.uint8))
os.unlink("/dev/shm/" + {key!r}.lstrip("/"))  # the worst case: the object is gone from /dev/shm too
print("registered", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_client_that_dies_holding_a_region(shm_daemon):
    k = key()
    code = CHILD.format(root=str(ROOT), key=k, size=FRAME_BYTES, url=shm_daemon.url, shape=(1, *FRAME))
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL and "registered" in child.stdout, child.stderr
    with shm_daemon.client() as client:
        out = client.infer_with_regions("frames", {"frames": RegionInput("orphan", "UINT8", [1, *FRAME], 0,
                                                                         FRAME_BYTES)})
        assert out.outputs["brightness"][0] == pytest.approx(9.0)  # the daemon's mapping stays valid
        client.unregister_region("orphan")
    assert _unmapped(shm_daemon.proc.pid, k)  # and is released on unregister


def test_no_descriptor_or_mapping_leaks_after_10000_register_unregister_cycles(shm_daemon):
    pid = shm_daemon.proc.pid
    with SharedMemoryRegion("cycle", key(), 4096) as region, shm_daemon.client() as client:
        client.register_region(region)
        client.unregister_region("cycle")  # anything lazily opened on first use is open now
        fds, maps = len(os.listdir(f"/proc/{pid}/fd")), len(Path(f"/proc/{pid}/maps").read_text().splitlines())
        for _ in range(10_000):
            client.register_region(region)
            client.unregister_region("cycle")
        assert len(os.listdir(f"/proc/{pid}/fd")) <= fds
        assert len(Path(f"/proc/{pid}/maps").read_text().splitlines()) <= maps + 8  # the allocator may grow
        assert shm_maps(pid) == []


def test_a_daemon_stopping_with_regions_registered_drains_and_exits_cleanly(tmp_path, frames_repo):
    d = DaemonProcess(tmp_path / "d", "", repo=frames_repo)
    d.start().wait_ready()
    x = frame(6)
    try:
        with SharedMemoryRegion("left", key(), FRAME_BYTES) as region, d.client() as client:
            client.register_region(region)
            placed = region.put(x)
            result: dict = {}
            request = threading.Thread(target=lambda: result.update(
                out=d.client().infer_with_regions("frames_slow", {"frames": placed})))
            request.start()
            time.sleep(0.5)  # in the queue, holding the region, when the stop comes
            d.proc.send_signal(signal.SIGTERM)
            request.join(10)
            np.testing.assert_allclose(result["out"].outputs["brightness"], expected_brightness(x), rtol=1e-4)
            assert d.proc.wait(30) == 0  # drained, regions unmapped, stopped
    finally:
        d.stop()
    assert "Traceback" not in d.log_text()
