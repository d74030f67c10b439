#!/usr/bin/env python3
"""Build ``encoder``: a small BERT-like transformer encoder in ONNX, for memory measurement.

**The weights are random** (fixed seed, BERT-style N(0, 0.02) initialisation). The model
computes nothing useful; it exists so the footprint estimator can be checked against what
ONNX Runtime really allocates on a graph shaped like the embedding models edge-batcher serves
for RAG (see tools/bench_estimator.py and docs/memory.md). Do not use it for retrieval.

Graph (opset 17, IR version 8), built with ``onnx.helper``:

* inputs ``input_ids`` INT64 ``[batch, seq]`` and ``attention_mask`` INT64 ``[batch, seq]``
  (``seq`` is a symbolic dimension: any length up to ``--max-positions``);
* embeddings: word Gather + position Gather (position ids = CumSum of ones along the
  sequence minus 1, so the graph needs no Shape/Range data dependency) -> LayerNormalization;
* ``--layers`` (default 4) post-LN blocks of multi-head self-attention (``--heads`` 4 of
  ``--hidden``/heads = 64 dims; Q/K/V/O MatMul+Add, Reshape/Transpose into heads, scaled
  scores + additive mask, Softmax, context MatMul) and a GELU FFN (``--ffn`` 1024, GELU written
  with Erf as in BERT exports), each with a residual Add and LayerNormalization;
* masked mean pooling -> output ``embedding`` FP32 ``[batch, hidden]``.

It is written to ``<out>/encoder/model.onnx`` with a ``model.toml`` (backend onnxruntime, CPU
EP, preferred batch sizes [2, 4, 8], ``[sequence]`` on both inputs, axis 1, buckets
[32, 64, 128]) and then run once with onnxruntime to check it works.

Usage::

    python tools/build_encoder_model.py [--out engines] [--seed 0] [--layers 4]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # edge_batcher from a checkout, installed or not

from edge_batcher.progress import Progress  # noqa: E402

MODEL_NAME = "encoder"
OPSET = 17
IR_VERSION = 8

VOCAB = 1000
MAX_POSITIONS = 512
HIDDEN = 256
HEADS = 4
FFN = 1024
LAYERS = 4
LN_EPS = 1e-12
BUCKETS = (32, 64, 128)

MODEL_TOML = """\
# Built by tools/build_encoder_model.py. RANDOM WEIGHTS: a BERT-shaped encoder that exists only
# to measure memory (estimator accuracy, tools/bench_estimator.py); its embeddings mean nothing.
backend = "onnxruntime"
model_file = "model.onnx"
instances = 1
description = "Random-weight BERT-like encoder ({layers} layers, hidden {hidden}, {heads} heads, FFN {ffn}) \
for memory measurement only"

[onnxruntime]
execution_providers = ["CPUExecutionProvider"]
intra_op_threads = 1

[batching]
preferred_batch_sizes = [2, 4, 8]
max_queue_delay_ms = 5.0

[sequence]
inputs = ["input_ids", "attention_mask"]
axis = 1
buckets = [32, 64, 128]
pad_value = 0
"""


def build_onnx(
    *,
    seed: int = 0,
    layers: int = LAYERS,
    hidden: int = HIDDEN,
    heads: int = HEADS,
    ffn: int = FFN,
    vocab: int = VOCAB,
    max_positions: int = MAX_POSITIONS,
):
    """The encoder as an ``onnx.ModelProto`` (checked with ``onnx.checker``)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
    head_dim = hidden // heads
    rng = np.random.default_rng(seed)
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def weight(name: str, shape: tuple[int, ...], std: float = 0.02) -> str:
        inits.append(numpy_helper.from_array(rng.normal(0.0, std, shape).astype(np.float32), name))
        return name

    def const(name: str, value) -> str:
        inits.append(numpy_helper.from_array(np.array(value), name))
        return name

    def node(op: str, inputs: list[str], output: str, **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    def ones(name: str, shape: tuple[int, ...]) -> str:
        inits.append(numpy_helper.from_array(np.ones(shape, np.float32), name))
        return name

    def zeros(name: str, shape: tuple[int, ...]) -> str:
        inits.append(numpy_helper.from_array(np.zeros(shape, np.float32), name))
        return name

    def layer_norm(x: str, prefix: str) -> str:
        return node(
            "LayerNormalization",
            [x, ones(f"{prefix}.gamma", (hidden,)), zeros(f"{prefix}.beta", (hidden,))],
            f"{prefix}.out", axis=-1, epsilon=LN_EPS,
        )

    def linear(x: str, prefix: str, n_in: int, n_out: int) -> str:
        mm = node("MatMul", [x, weight(f"{prefix}.weight", (n_in, n_out))], f"{prefix}.matmul")
        return node("Add", [mm, zeros(f"{prefix}.bias", (n_out,))], f"{prefix}.out")

    # Shared constants.
    const("zero_i64", np.array(0, np.int64))
    const("one_i64", np.array(1, np.int64))
    const("one_f", np.array(1.0, np.float32))
    const("half_f", np.array(0.5, np.float32))
    const("inv_sqrt2", np.array(1.0 / np.sqrt(2.0), np.float32))
    const("mask_neg", np.array(-10000.0, np.float32))
    const("score_scale", np.array(1.0 / np.sqrt(head_dim), np.float32))
    const("split_heads_shape", np.array([0, 0, heads, head_dim], np.int64))
    const("merge_heads_shape", np.array([0, 0, hidden], np.int64))
    const("seq_axis", np.array(1, np.int64))
    const("mask_axes", np.array([1, 2], np.int64))
    const("pool_axes", np.array([1], np.int64))
    const("last_axis", np.array([-1], np.int64))

    # Embeddings.
    word = node("Gather", [weight("embeddings.word", (vocab, hidden)), "input_ids"], "embeddings.word_out")
    ones_i = node("Add", [node("Mul", ["input_ids", "zero_i64"], "pos.zeros"), "one_i64"], "pos.ones")
    pos_ids = node("Sub", [node("CumSum", [ones_i, "seq_axis"], "pos.cumsum"), "one_i64"], "position_ids")
    pos = node("Gather", [weight("embeddings.position", (max_positions, hidden)), pos_ids], "embeddings.position_out")
    x = layer_norm(node("Add", [word, pos], "embeddings.sum"), "embeddings.ln")

    # Additive attention mask [batch, 1, 1, seq]: 0 where attended, -10000 where padded.
    mask_f = node("Cast", ["attention_mask"], "mask.float", to=TensorProto.FLOAT)
    inverted = node("Sub", ["one_f", mask_f], "mask.inverted")
    additive = node("Mul", [inverted, "mask_neg"], "mask.additive")
    mask4 = node("Unsqueeze", [additive, "mask_axes"], "mask.4d")

    for i in range(layers):
        p = f"layer{i}"

        def heads_of(t: str, perm: list[int], name: str, p: str = p) -> str:
            split = node("Reshape", [t, "split_heads_shape"], f"{p}.{name}.split")
            return node("Transpose", [split], f"{p}.{name}.heads", perm=perm)

        q = heads_of(linear(x, f"{p}.attn.q", hidden, hidden), [0, 2, 1, 3], "q")  # [b,h,s,d]
        k = heads_of(linear(x, f"{p}.attn.k", hidden, hidden), [0, 2, 3, 1], "k")  # [b,h,d,s]
        v = heads_of(linear(x, f"{p}.attn.v", hidden, hidden), [0, 2, 1, 3], "v")  # [b,h,s,d]
        scores = node("MatMul", [q, k], f"{p}.attn.scores")  # [b,h,s,s]
        scaled = node("Mul", [scores, "score_scale"], f"{p}.attn.scaled")
        masked = node("Add", [scaled, mask4], f"{p}.attn.masked")
        probs = node("Softmax", [masked], f"{p}.attn.probs", axis=-1)
        ctx = node("MatMul", [probs, v], f"{p}.attn.context")  # [b,h,s,d]
        ctx = node("Transpose", [ctx], f"{p}.attn.context_t", perm=[0, 2, 1, 3])
        ctx = node("Reshape", [ctx, "merge_heads_shape"], f"{p}.attn.merged")
        attn = linear(ctx, f"{p}.attn.o", hidden, hidden)
        x = layer_norm(node("Add", [x, attn], f"{p}.attn.residual"), f"{p}.attn.ln")

        h = linear(x, f"{p}.ffn.in", hidden, ffn)
        # GELU(h) = 0.5 * h * (1 + erf(h / sqrt(2))), the form BERT exports use.
        erf = node("Erf", [node("Mul", [h, "inv_sqrt2"], f"{p}.ffn.gelu.scaled")], f"{p}.ffn.gelu.erf")
        gelu = node(
            "Mul",
            [node("Mul", [h, "half_f"], f"{p}.ffn.gelu.half"), node("Add", [erf, "one_f"], f"{p}.ffn.gelu.erf1")],
            f"{p}.ffn.gelu.out",
        )
        out = linear(gelu, f"{p}.ffn.out", ffn, hidden)
        x = layer_norm(node("Add", [x, out], f"{p}.ffn.residual"), f"{p}.ffn.ln")

    # Masked mean pooling: sum(x * mask) / max(sum(mask), 1).
    mask3 = node("Unsqueeze", [mask_f, "last_axis"], "pool.mask3")  # [b,s,1]
    summed = node("ReduceSum", [node("Mul", [x, mask3], "pool.masked"), "pool_axes"], "pool.sum", keepdims=0)
    count = node("ReduceSum", [mask3, "pool_axes"], "pool.count", keepdims=0)  # [b,1]
    count = node("Max", [count, "one_f"], "pool.count_clamped")
    node("Div", [summed, count], "embedding")

    graph = helper.make_graph(
        nodes,
        "random_bert_like_encoder",
        inputs=[
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]),
        ],
        outputs=[helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", hidden])],
        initializer=inits,
        doc_string="Random-weight BERT-like encoder for memory measurement only.",
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="edge-batcher/tools/build_encoder_model.py",
        producer_version="1",
        ir_version=IR_VERSION,
        doc_string="RANDOM WEIGHTS (fixed seed): for memory measurement only.",
    )
    helper.set_model_props(
        model,
        {"layers": str(layers), "hidden": str(hidden), "heads": str(heads), "ffn": str(ffn),
         "vocab": str(vocab), "max_positions": str(max_positions), "seed": str(seed),
         "random_weights": "true"},
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def sample_inputs(batch: int, seq: int, *, seed: int = 0, vocab: int = VOCAB) -> dict[str, np.ndarray]:
    """Random token ids and an attention mask whose last rows are partly padded."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), dtype=np.int64)
    for row in range(batch):
        pad = (row * seq) // (2 * max(batch, 1))  # row 0 unpadded, later rows up to half padded
        if pad:
            mask[row, seq - pad :] = 0
            ids[row, seq - pad :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def check_runs(model_path: Path, batch: int = 2, seq: int = 32) -> np.ndarray:
    """Run the saved model once with onnxruntime (CPU EP); returns the embeddings."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
    (emb,) = sess.run(["embedding"], sample_inputs(batch, seq))
    if emb.shape != (batch, HIDDEN):
        raise RuntimeError(f"embedding has shape {emb.shape}, expected ({batch}, {HIDDEN})")
    if not np.all(np.isfinite(emb)):
        raise RuntimeError("embedding has non-finite values")
    return emb


BUILD_STEPS = 3  # the step() calls of build_encoder


def build_encoder(out_dir: Path, *, seed: int = 0, layers: int = LAYERS,
                  step: Callable[[str], None] = lambda label: None) -> Path:
    """Write ``<out_dir>/encoder/model.onnx`` and ``model.toml``; run it once; return the
    model directory."""
    import onnx

    model_dir = Path(out_dir) / MODEL_NAME
    model_dir.mkdir(parents=True, exist_ok=True)
    step(f"building the ONNX graph ({layers} layers, random weights)")
    model = build_onnx(seed=seed, layers=layers)
    model_path = model_dir / "model.onnx"
    step("writing model.onnx and model.toml")
    tmp = model_path.with_suffix(".onnx.tmp")
    onnx.save_model(model, str(tmp))
    tmp.replace(model_path)
    (model_dir / "model.toml").write_text(
        MODEL_TOML.format(layers=layers, hidden=HIDDEN, heads=HEADS, ffn=FFN)
    )
    step("running it once with onnxruntime")
    check_runs(model_path)
    return model_dir


def main(argv: list[str] | None = None) -> int:
    default_out = Path(__file__).resolve().parent.parent / "engines"
    ap = argparse.ArgumentParser(description="Build the random-weight encoder used to measure memory.")
    ap.add_argument("--out", type=Path, default=default_out, help=f"model repository (default {default_out})")
    ap.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    ap.add_argument("--layers", type=int, default=LAYERS, help=f"number of encoder layers (default {LAYERS})")
    args = ap.parse_args(argv)
    if not 1 <= args.layers <= 12:
        ap.error("--layers must be between 1 and 12")
    with Progress(MODEL_NAME, BUILD_STEPS) as progress:
        model_dir = build_encoder(args.out, seed=args.seed, layers=args.layers, step=progress.step)
    size = (model_dir / "model.onnx").stat().st_size
    print(f"wrote {model_dir / 'model.onnx'} ({size / 2**20:.1f} MiB, {args.layers} layers, random weights)")
    print("onnxruntime check: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
