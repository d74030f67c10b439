"""Fixtures for the TensorRT tests: the fakes, a scratch repository with the demo model, a builder."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from edge_batcher.config import ModelConfig, load_model_config
from edge_batcher.engines import trt_build
from edge_batcher.engines.tensorrt import TensorRTEngine
from tests.fakes.fake_tensorrt import FakeCuda, FakeTensorRT


@pytest.fixture
def cuda() -> FakeCuda:
    return FakeCuda()


@pytest.fixture
def trt(cuda) -> FakeTensorRT:
    return FakeTensorRT(cuda)


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

    def run(*extra: str, source: str = "vibration", model: str | None = None, trt_module=None, cuda_module=None) -> Path:
        args = build_args(str(repo / source / "model.onnx"), *(["--model", model] if model else []), "--quiet", *extra)
        request = trt_build.request_from_args(args)
        trt_build.build_engine(request, trt_module or trt, cuda_module or cuda, write=lambda line: None,
                               progress=False)
        return request.model_dir

    return run


@pytest.fixture
def engine_for(trt, cuda):
    """engine_for(model_dir) -> a loaded TensorRTEngine over the fakes (closed after the test)."""
    engines: list[TensorRTEngine] = []

    def make(model_dir: Path | ModelConfig, trt_module=None, cuda_module=None, load: bool = True) -> TensorRTEngine:
        config = model_dir if isinstance(model_dir, ModelConfig) else load_model_config(model_dir)
        engine = TensorRTEngine(config, trt_module=trt_module or trt, cuda_module=cuda_module or cuda)
        engines.append(engine)
        if load:
            engine.load()
        return engine

    yield make
    for engine in engines:
        engine.close()
