"""The TensorRT backend inside a real daemon (batching, padding, warm-up, admission), over the fakes.

The model.toml names tests.fakes.fake_tensorrt:FakeTensorRTEngine, the real backend class with a
FakeTensorRT/FakeCuda passed in; everything else is the production daemon.
"""

from __future__ import annotations

import asyncio

import numpy as np
import onnxruntime as ort
import pytest

from edge_batcher.client import AsyncClient
from tests.trt.conftest import TRT10


@pytest.mark.parametrize("trt", [TRT10], indirect=True)  # FakeTensorRTEngine is a 10.3.0 fake
def test_daemon_serves_a_tensorrt_plan_in_preferred_sizes(start_daemon, repo, build):
    model_dir = build()
    toml = model_dir / "model.toml"
    toml.write_text(toml.read_text().replace('backend = "tensorrt"',
                                             'backend = "tests.fakes.fake_tensorrt:FakeTensorRTEngine"'))
    d = start_daemon('[models]\nload = ["vibration-trt"]\n', repo=repo)

    x = np.random.default_rng(5).normal(0.0, 0.7, size=(13, 256)).astype(np.float32)

    async def burst():
        async with AsyncClient(d.url) as client:
            return await asyncio.gather(*(client.infer("vibration-trt", {"signal": x[i:i + 1]}) for i in range(13)))

    results = asyncio.run(burst())
    session = ort.InferenceSession(str(repo / "vibration" / "model.onnx"), providers=["CPUExecutionProvider"])
    probs = session.run(["class_probs"], {"signal": x})[0]
    for i, outputs in enumerate(results):
        np.testing.assert_allclose(outputs["class_probs"], probs[i:i + 1], atol=1e-5)
    with d.client() as client:
        stats = client.stats("vibration-trt")["model_stats"][0]
    assert stats["inference_count"] == 13
    assert {b["batch_size"] for b in stats["batch_stats"]} <= {2, 4, 8}  # only sizes the plan has profiles for
    assert "TensorRT 10.3.0 plan model.plan, 3 profile(s)" in d.log_text()
