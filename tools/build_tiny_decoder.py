#!/usr/bin/env python3
"""Build ``tinylm``: a TINY decoder LLM with RANDOM weights, for correctness tests only.

It generates gibberish. It exists so the generation code (KV cache, continuous batching, KV
admission, streaming) can be tested in CI without downloading a real model: it has exactly
the input/output signature of a Hugging Face Optimum ``text-generation-with-past`` ONNX export
(Qwen2, Llama, ... exported with ``optimum-cli export onnx``):

* inputs ``input_ids`` INT64 ``[batch, seq]``, ``attention_mask`` INT64 ``[batch, past + seq]``,
  ``position_ids`` INT64 ``[batch, seq]``, ``past_key_values.N.key`` / ``.value`` FP32
  ``[batch, kv_heads, past, head_dim]``;
* outputs ``logits`` FP32 ``[batch, seq, vocab]``, ``present.N.key`` / ``.value``
  ``[batch, kv_heads, past + seq, head_dim]``.

Architecture (opset 17, built with ``onnx.helper``): token + learned position embeddings,
``--layers`` pre-LayerNorm blocks with grouped-query attention (``--heads`` query heads sharing
``--kv-heads`` KV heads, like Qwen2) under a causal + padding mask computed from
attention_mask, and a GELU MLP; final LayerNorm and an untied LM head. Weights are drawn with a
fixed seed and scaled so the logits are far apart (greedy decoding has no near-ties that
rounding could flip).

The tokenizer is a byte-level BPE (vocabulary ``--vocab`` 512, special token
``<|endoftext|>``) trained here with the ``tokenizers`` library on the shipped corpus
(docs/corpus/*.md), so prompts tokenize to ordinary-looking ids and decoding streams bytes.

``--kv-layout shared`` builds the same weights in tools/build_smollm2.py's default layout instead
(GroupQueryAttention, the cache written in place; positions from ``seqlens_k``): the tests
compare the two.

The build checks the graph against a numpy forward pass, and that logits computed step by
step with the KV cache equal a full recompute. Writes ``<out>/tinylm/{model.onnx,
tokenizer.json, model.toml}`` (the model served with ``backend = "generator"``).

Usage::

    python tools/build_tiny_decoder.py [--out engines] [--name tinylm] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # edge_batcher from a checkout, installed or not

from edge_batcher.progress import Progress  # noqa: E402
from edge_batcher.rag.decoder import bind_in_place, in_place_refused, signature  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "docs" / "corpus"
OPSET = 17
IR_VERSION = 8
EOS = "<|endoftext|>"
MASK_NEG = -1e9

MODEL_TOML = """\
# Built by tools/build_tiny_decoder.py. RANDOM WEIGHTS: a tiny decoder with the Optimum ONNX
# signature for correctness tests of generation (KV cache, continuous batching, KV admission).
# It produces gibberish; see docs/rag.md for exporting a real model (Qwen2.5-0.5B-Instruct).
backend = "generator"
model_file = "model.onnx"
description = "TEST ONLY: tiny random-weight decoder ({layers} layers, {heads} heads / {kv_heads} KV heads \
x {head_dim}, vocab {vocab})"

[onnxruntime]
execution_providers = ["CPUExecutionProvider"]
intra_op_threads = 1

[batching]
queue_capacity = 64
default_timeout_ms = 30000

[tokenizer]
file = "tokenizer.json"
add_special_tokens = false

[generator]
max_context = {max_positions}
max_new_tokens = 32
max_new_tokens_limit = 256
max_running = 8
stop_tokens = ["<|endoftext|>"]
"""


def train_tokenizer(vocab_size: int, files: list[Path]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in files], trainer)
    return tok


def make_weights(seed: int, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                 ffn: int, max_positions: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def n(shape, std):
        return rng.normal(0.0, std, size=shape).astype(np.float32)

    w = {"tok": n((vocab, hidden), 1.0), "pos": n((max_positions, hidden), 0.5),
         "lnf.w": (1.0 + n((hidden,), 0.1)), "lnf.b": n((hidden,), 0.1),
         "lm_head": n((hidden, vocab), 0.4)}
    for i in range(layers):
        p = f"l{i}."
        w.update({
            p + "ln1.w": 1.0 + n((hidden,), 0.1), p + "ln1.b": n((hidden,), 0.1),
            p + "q.w": n((hidden, heads * head_dim), 0.15), p + "q.b": n((heads * head_dim,), 0.1),
            p + "k.w": n((hidden, kv_heads * head_dim), 0.15), p + "k.b": n((kv_heads * head_dim,), 0.1),
            p + "v.w": n((hidden, kv_heads * head_dim), 0.15), p + "v.b": n((kv_heads * head_dim,), 0.1),
            p + "o.w": n((heads * head_dim, hidden), 0.1), p + "o.b": n((hidden,), 0.05),
            p + "ln2.w": 1.0 + n((hidden,), 0.1), p + "ln2.b": n((hidden,), 0.1),
            p + "fc1.w": n((hidden, ffn), 0.1), p + "fc1.b": n((ffn,), 0.05),
            p + "fc2.w": n((ffn, hidden), 0.1), p + "fc2.b": n((hidden,), 0.05),
        })
    return w


# --------------------------------------------------------------------------- numpy reference

_erf = np.frompyfunc(math.erf, 1, 1)


def _ln(x, w, b, eps=1e-5):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + eps) * w + b


def numpy_forward(w: dict, dims: dict, ids: np.ndarray) -> np.ndarray:
    """Logits [batch, seq, vocab] of a full (uncached, unpadded) forward pass."""
    b, t = ids.shape
    heads, kv, d = dims["heads"], dims["kv_heads"], dims["head_dim"]
    g = heads // kv
    x = (w["tok"][ids] + w["pos"][:t][None]).astype(np.float64)
    causal = np.tril(np.ones((t, t), dtype=bool))
    for i in range(dims["layers"]):
        p = f"l{i}."
        h = _ln(x, w[p + "ln1.w"], w[p + "ln1.b"])
        q = (h @ w[p + "q.w"] + w[p + "q.b"]).reshape(b, t, kv, g, d).transpose(0, 2, 3, 1, 4)
        k = (h @ w[p + "k.w"] + w[p + "k.b"]).reshape(b, t, kv, d).transpose(0, 2, 1, 3)
        v = (h @ w[p + "v.w"] + w[p + "v.b"]).reshape(b, t, kv, d).transpose(0, 2, 1, 3)
        s = q @ k[:, :, None].transpose(0, 1, 2, 4, 3) / math.sqrt(d)
        s = np.where(causal, s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        ctx = (s @ v[:, :, None]).transpose(0, 3, 1, 2, 4).reshape(b, t, heads * d)
        x = x + ctx @ w[p + "o.w"] + w[p + "o.b"]
        h = _ln(x, w[p + "ln2.w"], w[p + "ln2.b"])
        a = h @ w[p + "fc1.w"] + w[p + "fc1.b"]
        a = 0.5 * a * (1.0 + _erf(a / math.sqrt(2.0)).astype(np.float64))
        x = x + a @ w[p + "fc2.w"] + w[p + "fc2.b"]
    return (_ln(x, w["lnf.w"], w["lnf.b"]) @ w["lm_head"]).astype(np.float32)


# --------------------------------------------------------------------------- ONNX graph


def build_onnx(w: dict, dims: dict, shared_kv: bool = False):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    heads, kv, d, layers = dims["heads"], dims["kv_heads"], dims["head_dim"], dims["layers"]
    g = heads // kv
    nodes, inits = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(op, inputs, output, **attrs):
        nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    def linear(x, p, out):
        return node("Add", [node("MatMul", [x, const(p + ".w", w[p + ".w"])], out + "/mm"),
                            const(p + ".b", w[p + ".b"])], out)

    def ln(x, p, out):
        return node("LayerNormalization", [x, const(p + ".w.ln", w[p + ".w"]), const(p + ".b.ln", w[p + ".b"])], out,
                    axis=-1, epsilon=1e-5)

    const("tok", w["tok"])
    const("pos", w["pos"])
    const("i0", np.array(0, dtype=np.int64))
    const("i1", np.array(1, dtype=np.int64))
    const("ax0", np.array([0], dtype=np.int64))
    const("ax1", np.array([1], dtype=np.int64))
    node("Gather", [node("Shape", ["input_ids"], "ids_shape"), "i1"], "seq", axis=0)
    if shared_kv:  # each row's positions end at seqlens_k (its length after this run, less one)
        ends = node("Add", [node("Cast", ["seqlens_k"], "seqlens64", to=TensorProto.INT64), "i1"], "ends")
        starts = node("Unsqueeze", [node("Sub", [ends, "seq"], "starts1"), "ax1"], "starts")
        steps = node("Unsqueeze", [node("Range", ["i0", "seq", "i1"], "steps1"), "ax0"], "steps")
        node("Add", [starts, steps], "position_ids")
    x = node("Add", [node("Gather", ["tok", "input_ids"], "tok_emb", axis=0),
                     node("Gather", ["pos", "position_ids"], "pos_emb", axis=0)], "emb")

    if not shared_kv:
        # Causal + padding mask [batch, 1, 1, seq, total]: query i (absolute position past + i) sees
        # key j when j <= past + i and attention_mask[j] == 1.
        node("Gather", [node("Shape", ["attention_mask"], "mask_shape"), "i1"], "total", axis=0)
        node("Sub", ["total", "seq"], "past_len")
        node("Range", ["past_len", "total", "i1"], "q_pos")
        node("Range", ["i0", "total", "i1"], "k_pos")
        node("LessOrEqual", [node("Unsqueeze", ["k_pos", "ax0"], "k_row"),
                             node("Unsqueeze", ["q_pos", "ax1"], "q_col")], "causal")
        const("ax123", np.array([1, 2, 3], dtype=np.int64))
        node("Unsqueeze", [node("Cast", ["attention_mask"], "mask_b", to=TensorProto.BOOL), "ax123"], "pad_ok")
        node("And", ["causal", "pad_ok"], "allowed")
        const("zero_f", np.array(0.0, dtype=np.float32))
        const("neg_f", np.array(MASK_NEG, dtype=np.float32))
        node("Where", ["allowed", "zero_f", "neg_f"], "mask_bias")
        const("q_shape", np.array([0, 0, kv, g, d], dtype=np.int64))
        const("kv_shape", np.array([0, 0, kv, d], dtype=np.int64))
        const("out_shape", np.array([0, 0, heads * d], dtype=np.int64))
        const("scale", np.array(1.0 / math.sqrt(d), dtype=np.float32))
        const("ax2", np.array([2], dtype=np.int64))

    def optimum_attention(h, i, p):  # past and present apart, the padding masked
        q = node("Transpose", [node("Reshape", [linear(h, p + "q", p + "q"), "q_shape"], p + "q5")], p + "qh",
                 perm=[0, 2, 3, 1, 4])
        k = node("Transpose", [node("Reshape", [linear(h, p + "k", p + "k"), "kv_shape"], p + "k4")], p + "kh",
                 perm=[0, 2, 1, 3])
        v = node("Transpose", [node("Reshape", [linear(h, p + "v", p + "v"), "kv_shape"], p + "v4")], p + "vh",
                 perm=[0, 2, 1, 3])
        pk = node("Concat", [f"past_key_values.{i}.key", k], f"present.{i}.key", axis=2)
        pv = node("Concat", [f"past_key_values.{i}.value", v], f"present.{i}.value", axis=2)
        # Transposed right before the MatMul, so that ONNX Runtime fuses the two (FusedMatMul, transB)
        # instead of copying the whole key cache transposed at every step.
        kt = node("Transpose", [node("Unsqueeze", [pk, "ax2"], p + "k5")], p + "kt5", perm=[0, 1, 2, 4, 3])
        s = node("Add", [node("Mul", [node("MatMul", [q, kt], p + "qk"), "scale"], p + "qk_s"), "mask_bias"],
                 p + "scores")
        a = node("Softmax", [s], p + "probs", axis=-1)
        ctx = node("MatMul", [a, node("Unsqueeze", [pv, "ax2"], p + "v5")], p + "ctx5")
        return node("Reshape", [node("Transpose", [ctx], p + "ctx_t", perm=[0, 3, 1, 2, 4]), "out_shape"], p + "ctx")

    const("sqrt2", np.array(math.sqrt(2.0), dtype=np.float32))
    const("half", np.array(0.5, dtype=np.float32))
    const("one", np.array(1.0, dtype=np.float32))
    for i in range(layers):
        p = f"l{i}."
        h = ln(x, p + "ln1", p + "h1")
        if shared_kv:  # one operator, the cache written in place (build_smollm2.py's layout)
            ctx = p + "ctx"
            nodes.append(helper.make_node(
                "GroupQueryAttention",
                [linear(h, p + "q", p + "q"), linear(h, p + "k", p + "k"), linear(h, p + "v", p + "v"),
                 f"past_key_values.{i}.key", f"past_key_values.{i}.value", "seqlens_k", "total_sequence_length"],
                [ctx, f"present.{i}.key", f"present.{i}.value"], name=p + "gqa", domain="com.microsoft",
                num_heads=heads, kv_num_heads=kv))
        else:
            ctx = optimum_attention(h, i, p)
        x = node("Add", [x, linear(ctx, p + "o", p + "attn")], p + "res1")
        h = ln(x, p + "ln2", p + "h2")
        f = linear(h, p + "fc1", p + "fc1")
        gelu = node("Mul", [node("Mul", [f, "half"], p + "fh"),
                            node("Add", [node("Erf", [node("Div", [f, "sqrt2"], p + "fd")], p + "erf"), "one"],
                                 p + "erf1")], p + "gelu")
        x = node("Add", [x, linear(gelu, p + "fc2", p + "mlp")], p + "res2")
    # Logits only from position logits_from on (0: every position): the decoder asks for a
    # prompt's last one, which skips the LM head for the others.
    x = node("Slice", [x, node("Unsqueeze", ["logits_from", const("ax0_lf", np.array([0]))], "logits_from1"),
                      const("end_lf", np.array([1 << 62])), const("ax1_lf", np.array([1]))], "x_logits")
    h = ln(x, "lnf", "hf")
    node("MatMul", [h, const("lm_head", w["lm_head"])], "logits")

    def declared(specs):
        return [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), dims)
                for name, dtype, dims in specs]

    inputs, outputs = (declared(specs) for specs in signature(layers, kv, d, w["lm_head"].shape[1], shared_kv))
    graph = helper.make_graph(nodes, "tinylm", inputs, outputs, initializer=inits)
    opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid("com.microsoft", 1)] if shared_kv else [])
    model = helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION,
                              producer_name="edge-batcher tools/build_tiny_decoder.py (random weights, tests only)")
    onnx.checker.check_model(model)
    return model


def verify(path: Path, w: dict, dims: dict, vocab: int) -> dict:
    """ONNX == numpy on a full pass; cached step-by-step logits == full recompute."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    ids = rng.integers(0, vocab, size=(2, 12)).astype(np.int64)
    kv, d = dims["kv_heads"], dims["head_dim"]

    shared = "seqlens_k" in {i.name for i in sess.get_inputs()}
    buffers = [np.zeros((2, kv, 12, d), np.float32) for _ in range(2 * dims["layers"])]

    def run(step_ids, mask, positions, past):
        if shared:  # as the daemon runs it: one buffer per layer and kind, past and present at once
            bound = bind_in_place(sess, step_ids, positions[:, 0], buffers, vocab)
            sess.run_with_iobinding(bound.binding)
            return bound.logits, past
        feed = {"input_ids": step_ids, "attention_mask": mask, "position_ids": positions,
                "logits_from": np.array(0, np.int64)}  # every position's logits
        for i in range(dims["layers"]):
            feed[f"past_key_values.{i}.key"], feed[f"past_key_values.{i}.value"] = past[2 * i], past[2 * i + 1]
        out = sess.run(None, feed)
        return out[0], out[1:]

    empty = [np.zeros((2, kv, 0, d), np.float32)] * (2 * dims["layers"])
    full, _ = run(ids, np.ones_like(ids), np.tile(np.arange(12), (2, 1)), empty)
    ref_diff = float(np.abs(full - numpy_forward(w, dims, ids)).max())
    logits, past = run(ids[:, :5], np.ones((2, 5), np.int64), np.tile(np.arange(5), (2, 1)), empty)
    steps = [logits]
    for t in range(5, 12):
        logits, past = run(ids[:, t:t + 1], np.ones((2, t + 1), np.int64), np.full((2, 1), t), past)
        steps.append(logits)
    cache_diff = float(np.abs(np.concatenate(steps, axis=1) - full).max())
    spread = float(np.std(full))
    if ref_diff > 1e-3 or cache_diff > 1e-4:
        raise SystemExit(f"tiny decoder check failed: |onnx - numpy| {ref_diff:.2e}, |cached - full| {cache_diff:.2e}")
    return {"numpy_diff": ref_diff, "cache_diff": cache_diff, "logit_std": spread}


BUILD_STEPS = 3  # the step() calls of build


def build(out: Path, name: str = "tinylm", seed: int = 0, *, vocab: int = 512, hidden: int = 64, layers: int = 2,
          heads: int = 4, kv_heads: int = 2, ffn: int = 256, max_positions: int = 1024, quiet: bool = False,
          step: Callable[[str], None] = lambda label: None, kv_layout: str = "optimum") -> Path:
    import onnx

    if kv_layout == "shared":
        import onnxruntime

        why = in_place_refused(onnxruntime.__version__)
        if why:
            raise SystemExit(f"--kv-layout shared: {why}; upgrade onnxruntime or use --kv-layout optimum")
    target = out / name
    target.mkdir(parents=True, exist_ok=True)
    files = sorted(CORPUS.glob("*.md"))
    if not files:
        raise SystemExit(f"no corpus to train the tokenizer on in {CORPUS}")
    step(f"training a {vocab}-token byte-level BPE tokenizer on {len(files)} corpus file(s)")
    tok = train_tokenizer(vocab, files)
    tok.save(str(target / "tokenizer.json"))
    vocab_size = tok.get_vocab_size()
    dims = {"layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": hidden // heads}
    step(f"building the ONNX graph ({layers} layers, random weights)")
    w = make_weights(seed, vocab_size, hidden, layers, heads, kv_heads, hidden // heads, ffn, max_positions)
    model = build_onnx(w, dims, shared_kv=kv_layout == "shared")
    onnx.save(model, target / "model.onnx")
    step("checking it against numpy and its KV cache against full recomputation")
    report = verify(target / "model.onnx", w, dims, vocab_size)
    (target / "model.toml").write_text(MODEL_TOML.format(layers=layers, heads=heads, kv_heads=kv_heads,
                                                         head_dim=hidden // heads, vocab=vocab_size,
                                                         max_positions=max_positions))
    if not quiet:
        print(f"built {target / 'model.onnx'} (RANDOM weights, tests only): vocab {vocab_size}, {layers} layers, "
              f"|onnx - numpy| {report['numpy_diff']:.1e}, |cached - full| {report['cache_diff']:.1e}, "
              f"logit std {report['logit_std']:.2f}")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("engines"))
    parser.add_argument("--name", default="tinylm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-positions", type=int, default=1024)
    parser.add_argument("--kv-layout", choices=("optimum", "shared"), default="optimum",
                        help="optimum: Optimum's signature (the default here: what user exports have); shared: "
                             "the cache written in place (tools/build_smollm2.py's default)")
    args = parser.parse_args(argv)
    with Progress(args.name, BUILD_STEPS) as progress:
        build(args.out, args.name, args.seed, layers=args.layers, max_positions=args.max_positions,
              step=progress.step, kv_layout=args.kv_layout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
