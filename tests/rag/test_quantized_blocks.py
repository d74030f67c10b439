"""tools/build_smollm2.py --q4 on GGUF blocks made here (no GGUF file, no gguf package, so this
runs in CI): Q4_1 and Q8_0 rows encoded by hand, turned into MatMulNBits operands by q4_blocks /
q8_blocks, and multiplied by ONNX Runtime's own kernel as the builder wires it. It holds the two
facts the builder relies on: MatMulNBits without zero points computes (q - 8) x d for 4 bits and
(b - 128) x d for 8 bits, and a Q4_1 block's minimum comes back as its offset times the input's
block sum."""

from __future__ import annotations

import numpy as np
import pytest

from tests.rag.conftest import _tool

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

K, N, ROWS = 64, 24, 3  # two blocks of 32 per weight row


def q4_1_rows(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """N rows of K weights as GGUF Q4_1 bytes (per block: f16 d, f16 m, 16 bytes, element j in
    the low nibble of byte j and j + 16 in the high one), and the weights they decode to."""
    d = rng.uniform(0.01, 0.1, (N, K // 32)).astype(np.float16)
    m = rng.uniform(-0.5, 0.1, (N, K // 32)).astype(np.float16)
    q = rng.integers(0, 16, (N, K // 32, 32)).astype(np.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    raw = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8), nibbles], axis=-1)
    weights = d.astype(np.float32)[..., None] * q + m.astype(np.float32)[..., None]
    return raw.reshape(N, -1), weights.reshape(N, K)


def q8_0_rows(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """N rows as GGUF Q8_0 bytes (per block: f16 d, 32 int8) and their weights."""
    d = rng.uniform(0.001, 0.01, (N, K // 32)).astype(np.float16)
    q = rng.integers(-128, 128, (N, K // 32, 32)).astype(np.int8)
    raw = np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], axis=-1)
    return raw.reshape(N, -1), (d.astype(np.float32)[..., None] * q).reshape(N, K)


def run(nodes, inits, x: np.ndarray) -> np.ndarray:
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        nodes, "blocks", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, N])],
        initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)], ir_version=8)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def matmul_nbits(bits: int, b: np.ndarray, scales: np.ndarray, out: str, accuracy_level: int = 0):
    from onnx import helper

    return helper.make_node("MatMulNBits", ["x", "b", "s"], [out], domain="com.microsoft", K=K, N=N, bits=bits,
                            block_size=32, accuracy_level=accuracy_level), {"b": b, "s": scales.reshape(-1)}


@pytest.mark.parametrize("accuracy_level", [0, 4])
def test_q4_1_blocks_multiply_as_their_weights(accuracy_level):
    from onnx import helper

    rng = np.random.default_rng(0)
    raw, weights = q4_1_rows(rng)
    packed, scales, offsets = _tool("build_smollm2").q4_blocks(raw)
    assert packed.shape == (N, K // 32, 16) and packed.dtype == np.uint8
    product, inits = matmul_nbits(4, packed, scales, "product", accuracy_level)
    nodes = [product,
             helper.make_node("Reshape", ["x", "blocks32"], ["blocks"]),
             helper.make_node("ReduceSum", ["blocks", "axm1"], ["block_sums"], keepdims=0),
             helper.make_node("MatMul", ["block_sums", "m"], ["shift"]),
             helper.make_node("Add", ["product", "shift"], ["y"])]
    inits.update(blocks32=np.array([0, -1, 32], np.int64), axm1=np.array([-1], np.int64),
                 m=np.ascontiguousarray(offsets.reshape(N, -1).T))
    x = rng.standard_normal((ROWS, K)).astype(np.float32)
    expected = x @ weights.T
    # Float activations: the same weights, so float rounding only. int8 activations (llama.cpp's
    # way): within a few percent of the largest output.
    tolerance = 1e-4 if accuracy_level == 0 else 0.05 * np.abs(expected).max()
    np.testing.assert_allclose(run(nodes, inits, x), expected, atol=tolerance)


def test_q8_0_blocks_multiply_as_their_weights():
    rng = np.random.default_rng(1)
    raw, weights = q8_0_rows(rng)
    b, scales = _tool("build_smollm2").q8_blocks(raw)
    assert b.shape == (N, K // 32, 32) and b.dtype == np.uint8
    node, inits = matmul_nbits(8, b, scales, "y")
    x = rng.standard_normal((ROWS, K)).astype(np.float32)
    np.testing.assert_allclose(run([node], inits, x), x @ weights.T, atol=1e-4)
    # The embedding rows the graph gathers from the same operands: (b - 128) x d, block by block.
    rows = (b.astype(np.float32) - 128) * scales[..., None]
    np.testing.assert_allclose(rows.reshape(N, K), weights, atol=1e-7)
