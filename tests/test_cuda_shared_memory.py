"""Triton's CUDA shared memory over HTTP and gRPC, end to end in this process, against FakeCuda.

NOT a GPU: the daemon's parts (Runtime, the HTTP app, the gRPC server, one CUDA region registry)
run on a loop thread of the test process, with a CudaApi over FakeCuda; FakeCudaIpc plays the
clients that export device buffers, and tritonclient.http / tritonclient.grpc send the real
protocol over TCP: register, status, unregister, inputs and outputs in regions. The frames model
runs on ONNX Runtime's CPU EP, so each request in a region costs one device-to-host copy into the
host batch (counted), and an output in a region one host-to-device copy. Batches of 2, 4 and 8 are
made of requests whose inputs live in regions; answers equal the plain path's. What only a GPU
can show (a real IPC handle from another process, the CUDA EP's IOBinding of the device batch)
is tests/test_cuda_shared_memory_gpu.py's.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest
from aiohttp import web

from edge_batcher.config import DaemonConfig
from edge_batcher.engines.cuda_api import cuda_api_from
from edge_batcher.runtime import Runtime
from edge_batcher.shared_memory.cuda_regions import CudaDevices, CudaRegionRegistry, link_namespaces
from edge_batcher.shared_memory.regions import RegionLimits, RegionRegistry
from edge_batcher.transports.edge import build_edge
from edge_batcher.transports.http import create_app
from tests.fakes.fake_cuda import FakeCuda
from tests.fakes.fake_cuda_ipc import ExportedBuffer, FakeCudaIpc
from tests.support.frames import brightness_via_regions, expected_brightness, expected_channel_mean
from tests.support.models import _tool
from tests.support.mqtt import LoopThread
from tests.support.ports import free_port

th = pytest.importorskip("tritonclient.http")
tg = pytest.importorskip("tritonclient.grpc")
grpc_server = pytest.importorskip("edge_batcher.transports.grpc_v2.server", reason="the grpc extra is not installed")
from tritonclient.utils import InferenceServerException  # noqa: E402

FRAME = (32, 48, 3)
TOKEN = "cuda-shm-token"  # gRPC over TCP takes a bearer token (the HTTP app here has no auth middleware)
AUTH = {"authorization": f"Bearer {TOKEN}"}
DELAY_MS = 400.0  # long enough for N concurrent requests to meet in one batch of N


@dataclass
class Served:
    http: str
    grpc: str
    gpu: FakeCuda
    ipc: FakeCudaIpc
    cuda: CudaRegionRegistry


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = tmp_path_factory.mktemp("frames_engines")
    build = _tool("build_frames_model").build
    # Requests wait for company even when the model is idle (dispatch_when_idle off): N concurrent
    # ones meet in one batch, and a lone one on frames_slow waits 1.5 s, time to unregister meanwhile.
    build(repo, "frames", height=FRAME[0], width=FRAME[1], delay_ms=DELAY_MS, dispatch_when_idle=False)
    build(repo, "frames_slow", height=FRAME[0], width=FRAME[1], delay_ms=1500.0, dispatch_when_idle=False)
    gpu = FakeCuda()
    config = DaemonConfig()
    config.models.repository = str(repo)
    config.memory.probe = "fixed"
    config.memory.budget_mb = 4096
    config.server.grpc = [f"127.0.0.1:{free_port()}"]
    config.server.token = TOKEN
    lt = LoopThread()
    runtime = Runtime(config)
    lt.run(runtime.start(), timeout=120)
    system = RegionRegistry()
    cuda = CudaRegionRegistry(RegionLimits(max_regions=16, max_bytes=1 << 24),
                              CudaDevices(lambda: cuda_api_from(gpu)))
    link_namespaces(system, cuda)
    app = create_app(runtime, max_body_bytes=1 << 24, shared_memory=system, cuda_shared_memory=cuda)
    app_runner = web.AppRunner(app)
    lt.run(app_runner.setup())
    http_port = free_port()
    lt.run(web.TCPSite(app_runner, "127.0.0.1", http_port).start())
    grpc = grpc_server.GrpcServer(runtime, config.server.grpc, limits=build_edge(config.server), tls=None,
                                  shared_memory=system, cuda_shared_memory=cuda)
    grpc.bind()
    lt.run(grpc.start())
    yield Served(f"127.0.0.1:{http_port}", config.server.grpc[0], gpu, FakeCudaIpc(gpu), cuda)
    lt.run(grpc.stop(0))
    lt.run(app_runner.cleanup())
    lt.run(runtime.close(), timeout=60)
    cuda.close()  # the daemon does this at shutdown, after the drain
    assert gpu.open_ipc_mappings() == 0 and gpu.primary_retained == 0
    lt.close()


@pytest.fixture(autouse=True)
def nothing_left_registered(served):
    yield
    served.cuda.unregister(None)


def frame(seed: int, rows: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (rows, *FRAME), dtype=np.uint8)


def exported(served: Served, array: np.ndarray | None = None, nbytes: int = 0) -> ExportedBuffer:
    buffer = served.ipc.export(array.nbytes if array is not None else nbytes)
    if array is not None:
        buffer.put(array)
    return buffer


def plain_brightness(client, x: np.ndarray) -> np.ndarray:
    """The plain path's answer (data in the body), to compare the region path with."""
    frames = th.InferInput("frames", list(x.shape), "UINT8")
    frames.set_data_from_numpy(x, binary_data=True)
    return client.infer("frames", [frames]).as_numpy("brightness")


def test_tritonclient_http_register_status_infer_unregister(served):
    client = th.InferenceServerClient(served.http)
    x = frame(1, rows=2)
    src, dst = exported(served, x), exported(served, nbytes=64)
    client.register_cuda_shared_memory("in", src.b64, 0, x.nbytes)
    client.register_cuda_shared_memory("out", dst.b64, 0, 64)
    assert client.get_cuda_shared_memory_status() == [
        {"name": "in", "device_id": 0, "byte_size": x.nbytes}, {"name": "out", "device_id": 0, "byte_size": 64}]
    assert client.get_cuda_shared_memory_status("out") == [{"name": "out", "device_id": 0, "byte_size": 64}]

    frames = th.InferInput("frames", list(x.shape), "UINT8")
    frames.set_shared_memory("in", x.nbytes)
    brightness = th.InferRequestedOutput("brightness")
    brightness.set_shared_memory("out", 8, offset=16)
    channels = th.InferRequestedOutput("channel_mean", binary_data=True)
    result = client.infer("frames", [frames], outputs=[brightness, channels])

    out = result.get_output("brightness")
    assert out["shape"] == [2] and out["datatype"] == "FP32" and "data" not in out
    assert "parameters" not in out  # as Triton's: its C++ client wants binary_data_size in any parameters
    np.testing.assert_array_equal(dst.get(np.float32, (2,), offset=16), plain_brightness(client, x))
    np.testing.assert_allclose(dst.get(np.float32, (2,), offset=16), expected_brightness(x), rtol=1e-4)
    np.testing.assert_allclose(result.as_numpy("channel_mean"), expected_channel_mean(x), rtol=1e-4)

    client.unregister_cuda_shared_memory("in")
    assert [r["name"] for r in client.get_cuda_shared_memory_status()] == ["out"]
    client.unregister_cuda_shared_memory()
    assert client.get_cuda_shared_memory_status() == []
    assert served.gpu.open_ipc_mappings() == 0


@pytest.mark.parametrize("size", [2, 4, 8])
def test_requests_in_regions_are_batched_at_the_preferred_sizes_one_copy_each(served, size):
    """N clients, each with its input and output in CUDA regions of its own, meet in one batch
    of N; each request costs one device-to-host copy in (the CPU engine's host batch) and one
    host-to-device copy out, and gets its own rows, equal to the plain path's answer."""
    client = th.InferenceServerClient(served.http)
    xs = [frame(100 + i) for i in range(size)]
    plain = [plain_brightness(client, x) for x in xs]
    buffers = []
    for i, x in enumerate(xs):
        src, dst = exported(served, x), exported(served, nbytes=4)
        client.register_cuda_shared_memory(f"in{i}", src.b64, 0, x.nbytes)
        client.register_cuda_shared_memory(f"out{i}", dst.b64, 0, 4)
        buffers.append(dst)
    before_stats = _batch_counts(client)
    before = dict(served.gpu.counters)
    start = threading.Barrier(size)

    def one(i: int) -> None:
        c = th.InferenceServerClient(served.http)
        start.wait()
        brightness_via_regions(th, c, "frames", xs[i], f"in{i}", f"out{i}")

    with ThreadPoolExecutor(size) as pool:
        list(pool.map(one, range(size)))
    for i in range(size):
        np.testing.assert_array_equal(buffers[i].get(np.float32, (1,)), plain[i])
    after_stats = _batch_counts(client)
    assert {s: n - before_stats.get(s, 0) for s, n in after_stats.items() if n != before_stats.get(s, 0)} == {size: 1}
    copies = {k: served.gpu.counters[k] - before[k] for k in ("memcpy_dtoh", "memcpy_htod", "memcpy_dtod")}
    assert copies == {"memcpy_dtoh": size, "memcpy_htod": size, "memcpy_dtod": 0}


def test_outputs_go_into_cuda_regions_on_the_engines_thread_each_answered_alone(served, monkeypatch):
    """The host-to-device copy of an output into a CUDA region happens on the engine's worker
    thread once the batch has run, over HTTP and gRPC (no hop to a pool thread per request); an
    output larger than its region fails that request alone, with the 400 it had before, while
    the other request of the same batch gets its answer."""
    threads: list[str] = []
    copy = served.gpu.memcpy_htod

    def recording(dest, src):
        threads.append(threading.current_thread().name)
        return copy(dest, src)

    monkeypatch.setattr(served.gpu, "memcpy_htod", recording)
    x, y = frame(41), frame(42)
    http_client = th.InferenceServerClient(served.http)
    plain = plain_brightness(http_client, x)
    src, dst = exported(served, x), exported(served, nbytes=4)
    other_src, small = exported(served, y), exported(served, nbytes=4)
    http_client.register_cuda_shared_memory("in", src.b64, 0, x.nbytes)
    http_client.register_cuda_shared_memory("out", dst.b64, 0, 4)
    http_client.register_cuda_shared_memory("in2", other_src.b64, 0, y.nbytes)
    http_client.register_cuda_shared_memory("small", small.b64, 0, 4)

    def too_large() -> InferenceServerException:
        frames = th.InferInput("frames", list(y.shape), "UINT8")
        frames.set_shared_memory("in2", y.nbytes)
        out = th.InferRequestedOutput("channel_mean")  # 12 bytes
        out.set_shared_memory("small", 4)
        with pytest.raises(InferenceServerException) as exc:
            th.InferenceServerClient(served.http).infer("frames_slow", [frames], outputs=[out])
        return exc.value

    before = _batch_counts(http_client, "frames_slow")
    with ThreadPoolExecutor(2) as pool:  # frames_slow's 1.5 s queue delay puts both in one batch
        answered = pool.submit(brightness_via_regions, th, th.InferenceServerClient(served.http), "frames_slow",
                               x, "in", "out")
        refused = pool.submit(too_large)
        answered.result(timeout=30)
        error = refused.result(timeout=30)
    assert error.status() == "400" and "is 12 bytes, more than its shared_memory_byte_size 4" in error.message()
    after = _batch_counts(http_client, "frames_slow")
    assert after.get(2, 0) - before.get(2, 0) == 1  # one batch of both
    np.testing.assert_array_equal(dst.get(np.float32, (1,)), plain)

    dst.put(np.zeros(1, np.float32))
    brightness_via_regions(tg, tg.InferenceServerClient(served.grpc), "frames", x, "in", "out", headers=AUTH)
    np.testing.assert_array_equal(dst.get(np.float32, (1,)), plain)
    assert threads and all(name.startswith("engine-frames") for name in threads), threads


def _batch_counts(client, model: str = "frames") -> dict[int, int]:
    stats = client.get_inference_statistics(model)["model_stats"][0]
    return {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}


def test_tritonclient_grpc_register_status_infer_unregister(served):
    client = tg.InferenceServerClient(served.grpc)
    x = frame(7, rows=2)
    src, dst = exported(served, x), exported(served, nbytes=64)
    client.register_cuda_shared_memory("in", src.b64.encode(), 0, x.nbytes, headers=AUTH)  # tritonclient decodes it
    client.register_cuda_shared_memory("out", dst.b64.encode(), 0, 64, headers=AUTH)
    status = client.get_cuda_shared_memory_status(headers=AUTH, as_json=True)["regions"]
    assert status == {"in": {"name": "in", "byte_size": str(x.nbytes)}, "out": {"name": "out", "byte_size": "64"}}

    frames = tg.InferInput("frames", list(x.shape), "UINT8")
    frames.set_shared_memory("in", x.nbytes)
    brightness = tg.InferRequestedOutput("brightness")
    brightness.set_shared_memory("out", 8)
    channels = tg.InferRequestedOutput("channel_mean")
    result = client.infer("frames", [frames], outputs=[brightness, channels], headers=AUTH)
    out = result.get_output("brightness")  # in the region, not in the message
    assert out.datatype == "FP32" and list(out.shape) == [2] and not out.parameters
    assert result.get_response().raw_output_contents[1] == b""  # as Triton: one per output, empty in a region
    plain = plain_brightness(th.InferenceServerClient(served.http), x)
    np.testing.assert_array_equal(dst.get(np.float32, (2,)), plain)
    np.testing.assert_allclose(result.as_numpy("channel_mean"), expected_channel_mean(x), rtol=1e-4)

    client.unregister_cuda_shared_memory("in", headers=AUTH)
    assert list(client.get_cuda_shared_memory_status(headers=AUTH, as_json=True)["regions"]) == ["out"]
    client.unregister_cuda_shared_memory(headers=AUTH)
    assert client.get_cuda_shared_memory_status(headers=AUTH, as_json=True) == {}
    assert served.gpu.open_ipc_mappings() == 0


def _post(served: Served, path: str, body: dict | str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(served.http, timeout=30)
    try:
        conn.request("POST", path, body if isinstance(body, str) else json.dumps(body),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


def test_bad_registrations_are_400_naming_the_problem(served):
    good = exported(served, nbytes=64).b64
    cases = [
        ({"raw_handle": {"b64": good}, "device_id": 1, "byte_size": 64},
         "device_id 1 is not a CUDA device of this machine: it has 1"),
        ({"raw_handle": {"b64": "not base64!"}, "device_id": 0, "byte_size": 64}, "raw_handle.b64 is not base64"),
        ({"raw_handle": "AAAA", "device_id": 0, "byte_size": 64}, "raw_handle must be {\"b64\""),
        ({"raw_handle": {"b64": "AAAA"}, "device_id": 0, "byte_size": 64}, "64 bytes of a cudaIpcMemHandle_t"),
        ({"raw_handle": {"b64": exported(served, nbytes=8).b64.replace("F", "G", 1)}, "device_id": 0,
          "byte_size": 8}, "cannot open the CUDA IPC handle on device 0"),
        ({"raw_handle": {"b64": good}, "byte_size": 64}, "needs \"raw_handle\""),
        ({"raw_handle": {"b64": good}, "device_id": 0, "byte_size": 0}, "byte_size must be > 0"),
    ]
    for body, match in cases:
        status, answer = _post(served, "/v2/cudasharedmemory/region/r/register", body)
        assert status == 400 and match in answer["error"], (body, answer)
    assert served.cuda.status() == [] and served.gpu.open_ipc_mappings() == 0
    conn = http.client.HTTPConnection(served.http, timeout=30)
    conn.request("GET", "/v2/cudasharedmemory/region/ghost/status")
    response = conn.getresponse()
    assert response.status == 400 and "no CUDA shared memory region 'ghost'" in json.loads(response.read())["error"]
    conn.close()


def test_a_handle_in_libb64_lines_registers_as_triton_accepts_it(served):
    """perf_analyzer (Triton's C++ client) sends the handle's base64 broken into 72-character
    lines with a newline at the end, as libb64 writes it."""
    x = frame(5)
    b64 = exported(served, x).b64
    wrapped = "\n".join(b64[i:i + 72] for i in range(0, len(b64), 72)) + "\n"
    assert "\n" in wrapped.strip()  # a 64-byte handle is 88 characters: two lines
    status, answer = _post(served, "/v2/cudasharedmemory/region/wrapped/register",
                           {"raw_handle": {"b64": wrapped}, "device_id": 0, "byte_size": x.nbytes})
    assert status == 200, answer
    client = th.InferenceServerClient(served.http)
    frames = th.InferInput("frames", list(x.shape), "UINT8")
    frames.set_shared_memory("wrapped", x.nbytes)
    result = client.infer("frames", [frames])
    np.testing.assert_allclose(result.as_numpy("brightness"), expected_brightness(x), rtol=1e-5)
    client.unregister_cuda_shared_memory("wrapped")


def test_bad_requests_naming_regions_are_400_and_the_daemon_keeps_serving(served):
    client = th.InferenceServerClient(served.http)
    x = frame(3)
    client.register_cuda_shared_memory("small", exported(served, x).b64, 0, x.nbytes)
    cases = {
        "no shared memory region 'ghost' is registered": ("ghost", x.nbytes, 0),
        "is beyond CUDA region 'small'": ("small", x.nbytes, 16),
        "does not match shape": ("small", x.nbytes - 3, 0),
    }
    for match, (name, size, offset) in cases.items():
        frames = th.InferInput("frames", list(x.shape), "UINT8")
        frames.set_shared_memory(name, size, offset=offset)
        with pytest.raises(InferenceServerException, match=match) as exc:
            client.infer("frames", [frames])
        assert exc.value.status() == "400"
    frames = th.InferInput("frames", list(x.shape), "UINT8")
    frames.set_shared_memory("small", x.nbytes)
    out = th.InferRequestedOutput("channel_mean")
    out.set_shared_memory("small", 12, offset=x.nbytes - 4)  # refused before the model runs
    with pytest.raises(InferenceServerException, match="beyond CUDA region 'small'"):
        client.infer("frames", [frames], outputs=[out])
    np.testing.assert_allclose(plain_brightness(client, x), expected_brightness(x), rtol=1e-4)


def test_grpc_errors_are_invalid_argument(served):
    client = tg.InferenceServerClient(served.grpc)
    with pytest.raises(InferenceServerException, match="device_id 3 is not a CUDA device") as exc:
        client.register_cuda_shared_memory("r", exported(served, nbytes=8).b64.encode(), 3, 8, headers=AUTH)
    assert exc.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match="no CUDA shared memory region 'ghost'") as exc:
        client.get_cuda_shared_memory_status("ghost", headers=AUTH)
    assert exc.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_a_region_unregistered_while_a_request_uses_it(served):
    client = th.InferenceServerClient(served.http)
    x = frame(5)
    client.register_cuda_shared_memory("busy", exported(served, x).b64, 0, x.nbytes)
    result: dict = {}

    def request() -> None:
        frames = th.InferInput("frames", list(x.shape), "UINT8")
        frames.set_shared_memory("busy", x.nbytes)
        result["out"] = th.InferenceServerClient(served.http).infer("frames_slow", [frames]).as_numpy("brightness")

    thread = threading.Thread(target=request)
    thread.start()
    time.sleep(0.5)  # the request waits 1.5 s in the queue for company, holding the region
    client.unregister_cuda_shared_memory("busy")  # answered at once
    assert client.get_cuda_shared_memory_status() == []
    assert served.gpu.open_ipc_mappings() == 1  # still open for the request
    thread.join(10)
    np.testing.assert_allclose(result["out"], expected_brightness(x), rtol=1e-4)
    deadline = time.monotonic() + 5
    while served.gpu.open_ipc_mappings() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.gpu.open_ipc_mappings() == 0  # closed once the request ended


def test_an_output_region_unregistered_while_its_request_waits_is_written_then_closed(served):
    """The engine's thread writes the output after the batch (lease.DeviceOutputs): a region
    unregistered meanwhile stays open for it, gets the answer, and closes once the request ends."""
    client = th.InferenceServerClient(served.http)
    x = frame(6)
    src, dst = exported(served, x), exported(served, nbytes=4)
    client.register_cuda_shared_memory("in", src.b64, 0, x.nbytes)
    client.register_cuda_shared_memory("out-busy", dst.b64, 0, 4)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (brightness_via_regions(
        th, th.InferenceServerClient(served.http), "frames_slow", x, "in", "out-busy"), done.set()))
    thread.start()
    time.sleep(0.5)  # the request waits 1.5 s in the queue for company
    client.unregister_cuda_shared_memory("out-busy")  # answered at once
    assert [r["name"] for r in client.get_cuda_shared_memory_status()] == ["in"]
    assert served.gpu.open_ipc_mappings() == 2  # the output's still open for the request
    thread.join(10)
    assert done.is_set()
    np.testing.assert_allclose(dst.get(np.float32, (1,)), expected_brightness(x), rtol=1e-4)
    client.unregister_cuda_shared_memory("in")
    deadline = time.monotonic() + 5
    while served.gpu.open_ipc_mappings() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.gpu.open_ipc_mappings() == 0


def test_one_namespace_with_system_shared_memory(served):
    client = th.InferenceServerClient(served.http)
    client.register_cuda_shared_memory("shared-name", exported(served, nbytes=8).b64, 0, 8)
    with pytest.raises(InferenceServerException, match="'shared-name' is already registered"):
        client.register_system_shared_memory("shared-name", "/eb-never-created", 8)
