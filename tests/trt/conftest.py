"""Fixtures for the TensorRT tests: the fakes, a scratch repository with the demo model, a builder.

`trt` is parametrized over the two TensorRT API generations (a 10.x fake with the weak-typing
builder flags and the INT8 calibrator, an 11.x fake without them), and `cuda_module` over the two
CUDA bindings (pycuda's FakeCuda, cuda-python's FakeCudaDriver, both over the same fake GPU
`cuda`), so a call that one generation or binding lacks fails here. Tests that only make sense
for one generation take `trt10` / `trt11` instead.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from edge_batcher.config import ModelConfig, load_model_config
from edge_batcher.engines import trt_build
from edge_batcher.engines.tensorrt import TensorRTEngine
from tests.fakes.fake_cuda_bindings import fake_cuda_module
from tests.fakes.fake_tensorrt import FakeCuda, FakeTensorRT

TRT10, TRT11 = "10.3.0", "11.4.0"  # JetPack 6.2's TensorRT; pip's newest (CUDA 13) at the time of writing


@pytest.fixture
def cuda() -> FakeCuda:
    return FakeCuda()


@pytest.fixture(params=[TRT10, TRT11], ids=["trt10", "trt11"])
def trt(request, cuda) -> FakeTensorRT:
    return FakeTensorRT(cuda, version=request.param)


@pytest.fixture
def trt10(cuda) -> FakeTensorRT:
    return FakeTensorRT(cuda, version=TRT10)


@pytest.fixture
def trt11(cuda) -> FakeTensorRT:
    return FakeTensorRT(cuda, version=TRT11)


@pytest.fixture(params=["pycuda", "cuda-python"])
def binding(request) -> str:
    return request.param


@pytest.fixture
def cuda_module(cuda, binding):
    """The fake GPU `cuda` through the binding under test: FakeCuda itself, or FakeCudaDriver."""
    return fake_cuda_module(binding, cuda)


@pytest.fixture
def repo(tmp_path, model_repo) -> Path:
    """A scratch model repository holding copies of the demo vibration model and seqsum."""
    out = tmp_path / "engines"
    out.mkdir()
    for name in ("vibration", "seqsum"):
        shutil.copytree(model_repo / name, out / name)
    return out


def build_args(*argv: str) -> argparse.Namespace:
    return trt_build.make_parser().parse_args(list(argv))


@pytest.fixture
def build(repo, trt, cuda):
    """build(*extra_args, source="vibration", trt=..., cuda=...) -> the built model's directory."""

    def run(*extra: str, source: str = "vibration", model: str | None = None,
            trt_module=None, cuda_module=None) -> Path:
        args = build_args(str(repo / source / "model.onnx"), *(["--model", model] if model else []), "--quiet", *extra)
        request = trt_build.request_from_args(args)
        trt_build.build_engine(request, trt_module or trt, cuda_module or cuda, write=lambda line: None,
                               progress=False)
        return request.model_dir

    return run


@pytest.fixture
def engine_for(trt, cuda_module):
    """engine_for(model_dir) -> a loaded TensorRTEngine over the fakes (closed after the test)."""
    engines: list[TensorRTEngine] = []
    default_cuda = cuda_module

    def make(model_dir: Path | ModelConfig, trt_module=None, cuda_module=None, load: bool = True) -> TensorRTEngine:
        config = model_dir if isinstance(model_dir, ModelConfig) else load_model_config(model_dir)
        engine = TensorRTEngine(config, trt_module=trt_module or trt, cuda_module=cuda_module or default_cuda)
        engines.append(engine)
        if load:
            engine.load()
        return engine

    yield make
    for engine in engines:
        engine.close()
