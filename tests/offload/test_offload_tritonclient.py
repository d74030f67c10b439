"""Interop: tritonclient.http, the reference KServe v2 client, against our HTTP app over TCP
(with the bearer token), in JSON and with the binary tensor extension.

tritonclient is synchronous (geventhttpclient), so it runs on a worker thread while the
server runs on the test's event loop.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.offload.conftest import TOKEN, assert_matches_local
from tests.support.signals import windows

httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is not installed")
from tritonclient.utils import InferenceServerException  # noqa: E402

AUTH = {"Authorization": f"Bearer {TOKEN}"}
OUTPUTS = ("class_probs", "class_id", "anomaly_score")


def triton_session(port: int, x: np.ndarray) -> dict:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", connection_timeout=10, network_timeout=10)
    try:
        result: dict = {
            "live": client.is_server_live(),  # no token needed for liveness
            "ready": client.is_server_ready(headers=AUTH),
            "model_ready": client.is_model_ready("vibration", headers=AUTH),
            "server": client.get_server_metadata(headers=AUTH),
            "metadata": client.get_model_metadata("vibration", headers=AUTH),
        }
        try:
            client.get_model_metadata("vibration")
        except InferenceServerException as exc:
            result["no_token"] = str(exc)
        for binary in (False, True):
            inp = httpclient.InferInput("signal", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=binary)
            outs = [httpclient.InferRequestedOutput(name, binary_data=binary) for name in OUTPUTS]
            response = client.infer("vibration", [inp], outputs=outs, headers=AUTH, request_id=f"r-{binary}")
            result["binary" if binary else "json"] = {name: response.as_numpy(name) for name in OUTPUTS}
            result[f"id-{binary}"] = response.get_response()["id"]
        return result
    finally:
        client.close()


async def test_tritonclient_http_talks_to_edge_batcher(serve_peer, model_repo):
    server = await serve_peer()
    x = windows(5, seed=20)
    result = await asyncio.to_thread(triton_session, server.port, x)
    assert result["live"] and result["ready"] and result["model_ready"]
    assert "binary_tensor_data" in result["server"]["extensions"]
    meta = result["metadata"]
    assert meta["name"] == "vibration"
    assert meta["inputs"] == [{"name": "signal", "datatype": "FP32", "shape": [-1, 256]}]
    assert {o["name"] for o in meta["outputs"]} == set(OUTPUTS)
    assert "missing or invalid bearer token" in result["no_token"]
    for mode in ("json", "binary"):
        assert_matches_local(model_repo, x, result[mode])
    for name in OUTPUTS:
        np.testing.assert_array_equal(result["json"][name], result["binary"][name])
    assert result["id-False"] == "r-False" and result["id-True"] == "r-True"
    # The wire really was JSON, then binary (Inference-Header-Content-Length present).
    assert [hl for _, path, _, hl in server.seen if path.endswith("/infer")] == [False, True]
