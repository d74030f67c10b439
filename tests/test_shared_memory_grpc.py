"""Triton's system shared memory over gRPC against a real daemon, with tritonclient.grpc and
tritonclient's shared memory utilities unchanged: register, status, inputs and outputs in
regions beside raw contents, unregister; CUDA shared memory without a usable GPU refused with
its reason; bad requests answered INVALID_ARGUMENT."""

from __future__ import annotations

import base64
import socket
import uuid

import numpy as np
import pytest

from tests.support.daemon import DaemonProcess
from tests.support.frames import expected_brightness, expected_channel_mean
from tests.support.models import _tool

pytest.importorskip("edge_batcher.transports.grpc_v2.server", reason="the grpc extra is not installed")
tg = pytest.importorskip("tritonclient.grpc")
tshm = pytest.importorskip("tritonclient.utils.shared_memory")
from tritonclient.utils import InferenceServerException  # noqa: E402

TOKEN = "shm-grpc-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def grpc_target(tmp_path_factory) -> str:
    repo = tmp_path_factory.mktemp("frames_engines")
    _tool("build_frames_model").build(repo, "frames")
    home = tmp_path_factory.mktemp("shm_grpc")
    token = home / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = DaemonProcess(home, f'[server]\ntoken_file = "{token}"\ngrpc = ["127.0.0.1:{port}"]\n', repo=repo)
    d.start().wait_ready()
    yield f"127.0.0.1:{port}"
    assert d.stop() == 0


def _key() -> str:
    return f"/eb-test-{uuid.uuid4().hex[:12]}"


def test_tritonclient_grpc_with_its_shared_memory_utilities(grpc_target):
    client = tg.InferenceServerClient(grpc_target)
    rng = np.random.default_rng(7)
    x = rng.integers(0, 256, (3, 480, 640, 3), dtype=np.uint8)
    k_in, k_out = _key(), _key()
    h_in = tshm.create_shared_memory_region("in", k_in, x.nbytes)
    h_out = tshm.create_shared_memory_region("out", k_out, 64)
    try:
        tshm.set_shared_memory_region(h_in, [x])
        client.register_system_shared_memory("in", k_in, x.nbytes, headers=AUTH)
        client.register_system_shared_memory("out", k_out, 64, headers=AUTH)
        status = client.get_system_shared_memory_status(headers=AUTH, as_json=True)
        assert status["regions"]["in"] == {"name": "in", "key": k_in, "byte_size": str(x.nbytes)}
        assert set(status["regions"]) == {"in", "out"}

        frames = tg.InferInput("frames", list(x.shape), "UINT8")
        frames.set_shared_memory("in", x.nbytes)
        brightness = tg.InferRequestedOutput("brightness")
        brightness.set_shared_memory("out", 12)
        result = client.infer("frames", [frames], outputs=[brightness, tg.InferRequestedOutput("channel_mean")],
                              headers=AUTH)
        np.testing.assert_allclose(result.as_numpy("channel_mean"), expected_channel_mean(x), rtol=1e-4)
        assert list(result.get_output("brightness").shape) == [3]
        np.testing.assert_allclose(tshm.get_contents_as_numpy(h_out, np.float32, [3]),
                                   expected_brightness(x), rtol=1e-4)

        client.unregister_system_shared_memory("in", headers=AUTH)
        assert set(client.get_system_shared_memory_status(headers=AUTH, as_json=True)["regions"]) == {"out"}
        with pytest.raises(InferenceServerException, match="no shared memory region 'in'") as exc:
            client.infer("frames", [frames], headers=AUTH)
        assert exc.value.status() == "StatusCode.INVALID_ARGUMENT"
        client.unregister_system_shared_memory(headers=AUTH)
        assert client.get_system_shared_memory_status(headers=AUTH, as_json=True) == {}
    finally:
        tshm.destroy_shared_memory_region(h_in)
        tshm.destroy_shared_memory_region(h_out)


def test_cuda_shared_memory_without_a_usable_gpu_is_refused_over_grpc(grpc_target):
    """As over HTTP (test_shared_memory.py): refused naming why, here or on a GPU machine."""
    client = tg.InferenceServerClient(grpc_target)
    assert client.get_cuda_shared_memory_status(headers=AUTH, as_json=True) == {}
    zero_handle = base64.b64encode(bytes(64))  # tritonclient sends it decoded: the 64 bytes themselves
    with pytest.raises(InferenceServerException) as exc:
        client.register_cuda_shared_memory("gpu", zero_handle, 0, 16, headers=AUTH)
    assert exc.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert ("needs a discrete CUDA GPU" in exc.value.message()
            or "cannot open the CUDA IPC handle" in exc.value.message()), exc.value.message()
    assert client.get_cuda_shared_memory_status(headers=AUTH, as_json=True) == {}


@pytest.mark.parametrize("key, match", [("/../etc/passwd", "not a POSIX shm name"),
                                        ("/eb-test-never-created", "no shm object")])
def test_bad_registrations_are_invalid_argument(grpc_target, key, match):
    client = tg.InferenceServerClient(grpc_target)
    with pytest.raises(InferenceServerException, match=match) as exc:
        client.register_system_shared_memory("bad", key, 16, headers=AUTH)
    assert exc.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert client.is_server_live(headers=AUTH)
