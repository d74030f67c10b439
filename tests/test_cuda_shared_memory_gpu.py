"""CUDA shared memory on a real discrete GPU: tritonclient.utils.cuda_shared_memory in this process
exports device buffers, a daemon subprocess opens them by IPC handle (a real cudaIpcOpenMemHandle
across processes, which no fake can show), over HTTP and gRPC. Two copies of the frames model:
one on ONNX Runtime's CUDA EP (the batch assembled on the device, bound with IOBinding) and one on
its CPU EP (one device-to-host copy per request). Every answer must equal the plain path's.

Skipped, saying why, without cuda-python (tritonclient's CUDA utilities need it), without a CUDA
device, or without onnxruntime-gpu's CUDA EP. Not run on the machine this was written on (no GPU):
docs/api.md ("CUDA shared memory") says what was verified where.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from tests.support.daemon import DaemonProcess
from tests.support.frames import brightness_via_regions
from tests.support.models import _tool
from tests.support.ports import free_port

th = pytest.importorskip("tritonclient.http")
tg = pytest.importorskip("tritonclient.grpc")
pytest.importorskip("edge_batcher.transports.grpc_v2.server", reason="the grpc extra is not installed")
try:
    import tritonclient.utils.cuda_shared_memory as cudashm
except (ImportError, RuntimeError) as exc:  # tritonclient raises RuntimeError without cuda-python
    pytest.skip(f"tritonclient's CUDA shared memory utilities are unavailable: {exc}", allow_module_level=True)
ort = pytest.importorskip("onnxruntime")
if "CUDAExecutionProvider" not in ort.get_available_providers():
    pytest.skip("onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)", allow_module_level=True)
try:
    from cuda.bindings import runtime as cudart

    _err, _count = cudart.cudaGetDeviceCount()
    if int(_err) != 0 or _count == 0:
        pytest.skip(f"no CUDA device ({_err})", allow_module_level=True)
except ImportError as exc:
    pytest.skip(f"cuda-python is not installed: {exc}", allow_module_level=True)

TOKEN = "cuda-shm-gpu-token"
HTTP_AUTH = {"Authorization": f"Bearer {TOKEN}"}
GRPC_AUTH = {"authorization": f"Bearer {TOKEN}"}
FRAME = (64, 96, 3)


@pytest.fixture(scope="module")
def gpu_daemon(tmp_path_factory):
    repo = tmp_path_factory.mktemp("frames_gpu")
    build = _tool("build_frames_model").build
    build(repo, "frames_cpu", height=FRAME[0], width=FRAME[1], delay_ms=300.0, dispatch_when_idle=False)
    gpu_model = build(repo, "frames_cuda", height=FRAME[0], width=FRAME[1], delay_ms=300.0, dispatch_when_idle=False)
    toml = gpu_model / "model.toml"
    text = toml.read_text().replace('execution_providers = ["CPUExecutionProvider"]',
                                    'execution_providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]')
    assert "CUDAExecutionProvider" in text
    toml.write_text(text)
    home = tmp_path_factory.mktemp("cuda_shm_daemon")
    token = home / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    http_port, grpc_port = free_port(), free_port()
    d = DaemonProcess(home, f'[server]\nhttp = "127.0.0.1:{http_port}"\ngrpc = ["127.0.0.1:{grpc_port}"]\n'
                            f'token_file = "{token}"\n', repo=repo)
    d.start().wait_ready()
    d.tcp, d.grpc = f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
    yield d
    assert d.stop() == 0


def frame(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (1, *FRAME), dtype=np.uint8)


def _raw_handle_str(handle) -> str:
    raw = cudashm.get_raw_handle(handle)
    return raw.decode() if isinstance(raw, bytes) else raw


def plain(daemon, model: str, x: np.ndarray) -> np.ndarray:
    """The plain path's answer (data in the body), to compare the region path with."""
    client = th.InferenceServerClient(daemon.tcp)
    frames = th.InferInput("frames", list(x.shape), "UINT8")
    frames.set_data_from_numpy(x, binary_data=True)
    return client.infer(model, [frames], headers=dict(HTTP_AUTH)).as_numpy("brightness")


@dataclass(frozen=True)
class Protocol:
    """How a tritonclient protocol registers CUDA regions and lists them: the rest is the same."""

    module: Any  # tritonclient.http or tritonclient.grpc
    address: Callable[[Any], str]  # of the daemon
    raw_handle: Callable[[Any], Any]  # as its register_cuda_shared_memory takes it
    headers: dict[str, str]
    region_names: Callable[[Any], set[str]]  # from get_cuda_shared_memory_status


PROTOCOLS = {
    "http": Protocol(th, lambda d: d.tcp, _raw_handle_str, HTTP_AUTH,
                     lambda c: {r["name"] for r in c.get_cuda_shared_memory_status(headers=HTTP_AUTH)}),
    "grpc": Protocol(tg, lambda d: d.grpc, cudashm.get_raw_handle, GRPC_AUTH,
                     lambda c: set(c.get_cuda_shared_memory_status(headers=GRPC_AUTH, as_json=True)["regions"])),
}


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("model", ["frames_cuda", "frames_cpu"])
def test_input_and_output_in_cuda_regions_equal_the_plain_path(gpu_daemon, model, protocol):
    p = PROTOCOLS[protocol]
    client = p.module.InferenceServerClient(p.address(gpu_daemon))
    x = frame(1)
    names = (f"{protocol}-in", f"{protocol}-out")
    h_in = cudashm.create_shared_memory_region(names[0], x.nbytes, 0)
    h_out = cudashm.create_shared_memory_region(names[1], 4, 0)
    try:
        cudashm.set_shared_memory_region(h_in, [x])
        client.register_cuda_shared_memory(names[0], p.raw_handle(h_in), 0, x.nbytes, headers=p.headers)
        client.register_cuda_shared_memory(names[1], p.raw_handle(h_out), 0, 4, headers=p.headers)
        assert p.region_names(client) == set(names)
        brightness_via_regions(p.module, client, model, x, *names, p.headers)
        got = cudashm.get_contents_as_numpy(h_out, np.float32, [1])
        np.testing.assert_array_equal(got, plain(gpu_daemon, model, x))
    finally:
        client.unregister_cuda_shared_memory(headers=p.headers)
        cudashm.destroy_shared_memory_region(h_in)
        cudashm.destroy_shared_memory_region(h_out)


@pytest.mark.parametrize("model", ["frames_cuda", "frames_cpu"])
def test_eight_clients_in_regions_batch_together_and_each_gets_its_rows(gpu_daemon, model):
    xs = [frame(10 + i) for i in range(8)]
    expected = [plain(gpu_daemon, model, x) for x in xs]
    handles = []
    client = th.InferenceServerClient(gpu_daemon.tcp)
    try:
        for i, x in enumerate(xs):
            h_in = cudashm.create_shared_memory_region(f"b{i}", x.nbytes, 0)
            h_out = cudashm.create_shared_memory_region(f"o{i}", 4, 0)
            cudashm.set_shared_memory_region(h_in, [x])
            client.register_cuda_shared_memory(f"b{i}", _raw_handle_str(h_in), 0, x.nbytes, headers=HTTP_AUTH)
            client.register_cuda_shared_memory(f"o{i}", _raw_handle_str(h_out), 0, 4, headers=HTTP_AUTH)
            handles.append((h_in, h_out))
        start = threading.Barrier(8)

        def one(i: int) -> np.ndarray:
            c = th.InferenceServerClient(gpu_daemon.tcp)
            start.wait()
            brightness_via_regions(th, c, model, xs[i], f"b{i}", f"o{i}", HTTP_AUTH)
            return cudashm.get_contents_as_numpy(handles[i][1], np.float32, [1])

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(one, range(8)))
        for i in range(8):
            np.testing.assert_array_equal(got[i], expected[i])
        stats = client.get_inference_statistics(model, headers=HTTP_AUTH)["model_stats"][0]
        assert any(b["batch_size"] > 1 for b in stats["batch_stats"]), stats["batch_stats"]
    finally:
        client.unregister_cuda_shared_memory(headers=HTTP_AUTH)
        for h_in, h_out in handles:
            cudashm.destroy_shared_memory_region(h_in)
            cudashm.destroy_shared_memory_region(h_out)
