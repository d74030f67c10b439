"""What tools/build_frames_model.py's `frames` model answers, computed in numpy, for the shared
memory tests over HTTP and gRPC, and the request those tests send most: a frame in one region,
its brightness written into another."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.support.models import _tool

STRIDE = _tool("build_frames_model").STRIDE


def _grid(x: np.ndarray) -> np.ndarray:
    """The pixels the frames model reads (every STRIDE-th)."""
    return x[:, ::STRIDE, ::STRIDE, :].astype(np.float64)


def expected_brightness(x: np.ndarray) -> np.ndarray:
    return _grid(x).mean(axis=(1, 2, 3))


def expected_channel_mean(x: np.ndarray) -> np.ndarray:
    return _grid(x).mean(axis=(1, 2))


def brightness_via_regions(tritonclient: Any, client: Any, model: str, x: np.ndarray, region_in: str,
                           region_out: str, headers: dict[str, str] | None = None) -> Any:
    """`client` (of `tritonclient`'s http or grpc module) infers `model` on the frames `x` that
    region_in holds, with the brightness written into region_out (4 bytes a frame)."""
    frames = tritonclient.InferInput("frames", list(x.shape), "UINT8")
    frames.set_shared_memory(region_in, x.nbytes)
    out = tritonclient.InferRequestedOutput("brightness")
    out.set_shared_memory(region_out, 4 * x.shape[0])
    # a copy: tritonclient.http's infer writes Inference-Header-Content-Length into the dict it is
    # given, and a stale one would cut the next request's JSON short
    return client.infer(model, [frames], outputs=[out], headers=dict(headers) if headers else None)
