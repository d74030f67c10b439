"""tools/build_smollm2.py --q4 on a tiny Llama made here (no GGUF file, no gguf package, so this
runs in CI): its weights encoded by hand as GGUF Q4_1 (linear layers) and Q8_0 (embeddings)
blocks, the graph written by the builder's own build_onnx, run by ONNX Runtime and compared with
the builder's numpy pass over the decoded weights. It holds what the builder relies on:
MatMulNBits without zero points computes (q - 8) x d for 4 bits and (b - 128) x d for 8 bits,
and a Q4_1 block's minimum comes back as its offset times the input's block sum."""

from __future__ import annotations

import numpy as np
import pytest

from tests.rag.conftest import _tool

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
BUILDER = _tool("build_smollm2")
if BUILDER.older_than(ort.__version__, BUILDER.Q4_SINCE):
    pytest.skip(f"onnxruntime {ort.__version__} has no 8-bit MatMulNBits (--q4 needs 1.22)", allow_module_level=True)

DIMS = {"layers": 2, "hidden": 64, "heads": 2, "kv_heads": 1, "head_dim": 32, "ffn": 96, "eps": 1e-5,
        "rope_base": 10000.0, "rope_dim": 32, "context": 64, "vocab": 50, "tied": True}
LINEAR_SHAPES = {"attn_q": (64, 64), "attn_k": (64, 32), "attn_v": (64, 32), "attn_output": (64, 64),
                 "ffn_gate": (64, 96), "ffn_up": (64, 96), "ffn_down": (96, 64)}  # [in, out]


def q4_1(rng: np.random.Generator, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """rows x cols weights as GGUF Q4_1 bytes (per block of 32: f16 d, f16 m, 16 bytes, element j
    in the low nibble of byte j and j + 16 in the high one), and the weights they decode to."""
    d = rng.uniform(0.01, 0.05, (rows, cols // 32)).astype(np.float16)
    m = rng.uniform(-0.3, 0.0, (rows, cols // 32)).astype(np.float16)
    q = rng.integers(0, 16, (rows, cols // 32, 32)).astype(np.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    raw = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8), nibbles], axis=-1)
    weights = d.astype(np.float32)[..., None] * q + m.astype(np.float32)[..., None]
    return raw.reshape(rows, -1), weights.reshape(rows, cols)


def q8_0(rng: np.random.Generator, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """rows x cols weights as GGUF Q8_0 bytes (per block of 32: f16 d, 32 int8) and their weights."""
    d = rng.uniform(0.005, 0.02, (rows, cols // 32)).astype(np.float16)
    q = rng.integers(-128, 128, (rows, cols // 32, 32)).astype(np.int8)
    raw = np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], axis=-1)
    return raw.reshape(rows, -1), (d.astype(np.float32)[..., None] * q).reshape(rows, cols)


def tiny_llama() -> dict[str, np.ndarray]:
    """Weights as read_gguf gives them: FP32 (linear ones as [in, out]) beside the raw blocks."""
    rng = np.random.default_rng(0)
    w: dict[str, np.ndarray] = {}
    w["token_embd.weight.q8"], w["token_embd.weight"] = q8_0(rng, DIMS["vocab"], DIMS["hidden"])
    w["output_norm.weight"] = rng.uniform(0.5, 1.5, DIMS["hidden"]).astype(np.float32)
    for i in range(DIMS["layers"]):
        p = f"blk.{i}."
        for norm in ("attn_norm", "ffn_norm"):
            w[p + norm + ".weight"] = rng.uniform(0.5, 1.5, DIMS["hidden"]).astype(np.float32)
        for name, (k, n) in LINEAR_SHAPES.items():
            raw, weights = q4_1(rng, n, k)  # GGUF rows are [out, in]
            w[p + name + ".weight.q4"], w[p + name + ".weight"] = raw, np.ascontiguousarray(weights.T)
    return w


def logits(model, ids: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    empty = np.zeros((1, DIMS["kv_heads"], 0, DIMS["head_dim"]), np.float32)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(ids.shape[1])[None],
            "logits_from": np.array(0, np.int64)}
    for i in range(DIMS["layers"]):
        feed[f"past_key_values.{i}.key"] = feed[f"past_key_values.{i}.value"] = empty
    return session.run(["logits"], feed)[0]


def test_4bit_and_8bit_blocks_compute_their_weights():
    tool = BUILDER
    w = tiny_llama()
    model = tool.build_onnx(w, DIMS, DIMS["context"], q4=True)
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == DIMS["layers"] * len(LINEAR_SHAPES) + 1  # the linear layers and the tied LM head
    assert all(len(n.input) == 3 for n in nbits)  # no zero points: ONNX Runtime's packed kernels
    assert "token_embd.weight" not in {t.name for t in model.graph.initializer}  # no FP32 copy of the embeddings
    ids = np.random.default_rng(1).integers(0, DIMS["vocab"], (1, 12))
    expected = tool.numpy_forward(w, DIMS, ids)
    # Float activations: the same weights, so float rounding only.
    np.testing.assert_allclose(logits(model, ids), expected, atol=1e-4 * np.abs(expected).max())
    # int8 activations (llama.cpp's way): within a few percent of the largest logit.
    tool.set_accuracy_level(model, 4)
    np.testing.assert_allclose(logits(model, ids), expected, atol=0.05 * np.abs(expected).max())
