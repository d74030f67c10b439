#!/usr/bin/env python3
"""Build the ``vision`` demo model: a camera frame (uint8 640x480 RGB) -> the state of an indicator lamp.

Everything is generated here, nothing is downloaded: synthetic frames of a control panel with one
indicator lamp that is off, green, amber or red, under clutter (panel texture, stickers and screws,
lighting level, colour cast and gradient, exposure, sensor noise, lamp position and size); a small
CNN whose preprocessing (uint8 -> float, 8x8 area downsampling, normalisation) runs inside the ONNX
graph, whose convolutions are designed (colour-opponent 1x1 filters, then blur and centre-surround
blob filters) and whose classifier head is trained with numpy Adam on their pooled responses. The
numpy forward pass is the reference the ONNX graph is verified against on held-out frames.
``python tools/build_vision_model.py [--out engines] [--seed 0] [--force]``; tools/build_demo_models.py
(``make models``) calls it. See docs/vision-model.md for the task, the network and the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # edge_batcher from a checkout, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))  # vision_frames, beside this script

from vision_frames import HEIGHT, LABELS, N_CLASSES, WIDTH, generate, noise_field  # noqa: E402

from edge_batcher.progress import Progress  # noqa: E402

MODEL_NAME = "vision"
SOURCES = (Path(__file__), Path(__file__).with_name("vision_frames.py"))  # a newer one: rebuild
POOL = 8  # area downsampling inside the graph: 480x640 -> 60x80
CHANNEL_MEAN = np.float32(0.5)  # normalisation of x/255 inside the graph
CHANNEL_INV_STD = np.float32(4.0)
HIDDEN = 32

OPSET = 17
IR_VERSION = 8

N_TRAIN = 1600
N_HELDOUT = 400
CHUNK = 32  # frames generated and featurised at a time (a frame is 0.9 MB as uint8)
CHECK_BATCH = 8  # frames per onnxruntime run in the held-out check (the largest preferred size)
EPOCHS = 200
BATCH_SIZE = 128
MIN_ACCURACY = 0.93  # measured 0.95-0.97 on 400-frame held-out sets; red stickers are the usual miss
MAX_ABS_DIFF = 1e-4

MODEL_TOML = """\
# Demo camera model built by tools/build_vision_model.py: camera frame -> indicator lamp state.
backend = "onnxruntime"
model_file = "model.onnx"
instances = 1
description = "Indicator lamp classifier: 640x480 RGB camera frame (uint8, HWC) -> lamp state \
(off, green, amber, red)"
labels = ["off", "green", "amber", "red"]

[onnxruntime]
execution_providers = ["CPUExecutionProvider"]
intra_op_threads = 1

[batching]
preferred_batch_sizes = [2, 4, 8]
max_queue_delay_ms = 2.0
default_timeout_ms = 5000
queue_capacity = 64
"""

# --------------------------------------------------------------------------------------
# The network (numpy reference; the ONNX graph mirrors it op for op)
# --------------------------------------------------------------------------------------

# conv1, 1x1, on RGB in 0-1 (folded onto the normalised input in conv_weights): brightness and
# colour-opponent channels, and thresholded ones that fire only on bright saturated colour, as a
# lit lamp is and a sticker under the same light rarely is. Rows: (w_r, w_g, w_b, bias).
COLOUR_FILTERS = np.array([
    (1 / 3, 1 / 3, 1 / 3, 0.0),  # brightness
    (1.0, -1.0, 0.0, 0.0),  # red - green
    (-1.0, 1.0, 0.0, 0.0),  # green - red
    (0.5, 0.5, -1.0, 0.0),  # yellow - blue
    (0.0, 1.0, -1.0, 0.0),  # green - blue
    (-0.5, -0.5, 1.0, 0.0),  # blue - yellow
    (1 / 3, 1 / 3, 1 / 3, -0.7),  # bright
    (1.0, -0.5, -0.5, -0.25),  # saturated red
    (-0.5, 1.0, -0.5, -0.2),  # saturated green
    (1.0, 1.0, -2.0, -0.7),  # bright amber / yellow
    (1.0, 0.0, 0.0, -0.8),  # very bright red
    (0.0, 1.0, 0.0, -0.7),  # very bright green
    (1.0, -1.0, -1.0, -0.4),  # lit red: high red, low green
    (1.0, 1.0, -1.0, -1.2),  # lit amber: high red and green, low blue
    (-1.0, 1.0, 0.0, -0.3),  # lit green: green well above red
], dtype=np.float64)
N_COLOUR = len(COLOUR_FILTERS)
KERNEL = 5


def _gaussian(sigma: float) -> np.ndarray:
    k = np.arange(KERNEL) - KERNEL // 2
    g = np.exp(-(k[:, None] ** 2 + k[None, :] ** 2) / (2 * sigma**2))
    return g / g.sum()


def conv_weights() -> dict[str, np.ndarray]:
    """The designed convolutions (float32): ``w1 [15, 3, 1, 1]``, ``b1 [15]`` acting on the
    normalised input, and ``w2 [30, 1, 5, 5]``, depthwise (group = 15): a blur and a
    centre-surround (difference of Gaussians, zero sum: a blob the size of a lens) per channel."""
    a, c = COLOUR_FILTERS[:, :3], COLOUR_FILTERS[:, 3]
    # x01 = z / (255 * CHANNEL_INV_STD / 255) + mean, i.e. z / 4 + 0.5: fold that into the 1x1 filter.
    w1 = a / float(CHANNEL_INV_STD)
    b1 = c + a.sum(axis=1) * float(CHANNEL_MEAN)
    blur, dog = _gaussian(1.0), _gaussian(0.8) - _gaussian(2.0)
    w2 = np.stack([blur, dog] * N_COLOUR)[:, None]
    return {
        "w1": w1.reshape(N_COLOUR, 3, 1, 1).astype(np.float32),
        "b1": b1.astype(np.float32),
        "w2": w2.astype(np.float32),
    }


def preprocess(frames: np.ndarray, channels_first: bool = False) -> np.ndarray:
    """uint8 [n, 480, 640, 3] (or [n, 3, 480, 640]) -> normalised float32 [n, 3, 60, 80]: 8x8
    area mean, then (x/255 - 0.5) * 4. Sums of 64 uint8 values are exact in float32, so summing
    rows first, then columns, gives the graph's block means bit for bit, at a fraction of the cost."""
    n = len(frames)
    if channels_first:
        rows = frames.reshape(n * 3 * HEIGHT // POOL, POOL, WIDTH).sum(axis=1, dtype=np.float32)
        x = rows.reshape(n, 3, HEIGHT // POOL, WIDTH // POOL, POOL).sum(axis=4)
    else:
        rows = frames.reshape(n * HEIGHT // POOL, POOL, WIDTH * 3).sum(axis=1, dtype=np.float32)
        x = rows.reshape(n, HEIGHT // POOL, WIDTH // POOL, POOL, 3).sum(axis=3).transpose(0, 3, 1, 2)
    x = x * np.float32(1 / POOL**2)
    return (x * np.float32(1 / 255) - CHANNEL_MEAN) * CHANNEL_INV_STD


def pooled_features(frames: np.ndarray, w: dict[str, np.ndarray], channels_first: bool = False) -> np.ndarray:
    """The convolutional part: frames -> [n, 60] (global max and global mean of the 30 maps)."""
    x = preprocess(frames, channels_first)
    n, h, wd = len(x), x.shape[2], x.shape[3]
    c1 = np.einsum("kc,nchw->nkhw", w["w1"][:, :, 0, 0], x) + w["b1"][:, None, None]
    c1 = np.maximum(c1, np.float32(0))
    pad = KERNEL // 2
    xp = np.pad(c1, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    c2 = np.zeros((n, N_COLOUR, 2, h, wd), np.float32)
    for dy in range(KERNEL):
        for dx in range(KERNEL):
            window = xp[:, :, dy : dy + h, dx : dx + wd]
            c2[:, :, 0] += w["w2"][0, 0, dy, dx] * window
            c2[:, :, 1] += w["w2"][1, 0, dy, dx] * window
    c2 = np.maximum(c2.reshape(n, 2 * N_COLOUR, h, wd), np.float32(0))
    c2 = c2.reshape(n, 2 * N_COLOUR, h // 2, 2, wd // 2, 2).max(axis=(3, 5))  # MaxPool 2x2
    return np.concatenate([c2.max(axis=(2, 3)), c2.mean(axis=(2, 3), dtype=np.float32)], axis=1)


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def head(f: np.ndarray, p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Standardise the pooled features, 60 -> 32 ReLU -> 4 softmax: the two graph outputs."""
    z = (f - p["feat_mean"]) * p["feat_inv_std"]
    h = np.maximum(z @ p["w3"] + p["b3"], np.float32(0))
    probs = softmax(h @ p["w4"] + p["b4"]).astype(np.float32)
    return {"probabilities": probs, "label": probs.argmax(axis=1).astype(np.int64)}


def forward(frames: np.ndarray, p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return head(pooled_features(frames, p), p)


def train_head(z: np.ndarray, y: np.ndarray, rng: np.random.Generator, epochs: int = EPOCHS,
               lr: float = 3e-3, weight_decay: float = 1e-3) -> dict[str, np.ndarray]:
    """Softmax cross-entropy, Adam with a cosine-decayed rate and a little L2, on standardised
    features ``z``; returns float32 ``w3, b3, w4, b4``."""
    n, d = z.shape
    p = {"w3": rng.normal(0, np.sqrt(2 / d), (d, HIDDEN)), "b3": np.zeros(HIDDEN),
         "w4": rng.normal(0, np.sqrt(1 / HIDDEN), (HIDDEN, N_CLASSES)), "b4": np.zeros(N_CLASSES)}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(v) for k, v in p.items()}
    onehot = np.eye(N_CLASSES)[y]
    steps = int(np.ceil(n / BATCH_SIZE))
    total, t = epochs * steps, 0
    for _ in range(epochs):
        order = rng.permutation(n)
        for s in range(steps):
            idx = order[s * BATCH_SIZE : (s + 1) * BATCH_SIZE]
            a1 = z[idx] @ p["w3"] + p["b3"]
            h = np.maximum(a1, 0)
            d2 = (softmax(h @ p["w4"] + p["b4"]) - onehot[idx]) / len(idx)
            d1 = (d2 @ p["w4"].T) * (a1 > 0)
            grads = {"w4": h.T @ d2 + weight_decay * p["w4"], "b4": d2.sum(0),
                     "w3": z[idx].T @ d1 + weight_decay * p["w3"], "b3": d1.sum(0)}
            t += 1
            rate = lr * 0.5 * (1 + np.cos(np.pi * t / total))
            for k, g in grads.items():
                m[k] = 0.9 * m[k] + 0.1 * g
                v[k] = 0.999 * v[k] + 0.001 * g * g
                p[k] -= rate * (m[k] / (1 - 0.9**t)) / (np.sqrt(v[k] / (1 - 0.999**t)) + 1e-8)
    return {k: val.astype(np.float32) for k, val in p.items()}


def featurise(n: int, rng: np.random.Generator, noise: np.ndarray,
              w: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Generate ``n`` frames chunk by chunk (they are 0.9 MB each); their pooled features and labels."""
    feats, labels = [], []
    for start in range(0, n, CHUNK):
        frames, y = generate(min(CHUNK, n - start), rng, noise, channels_first=True)
        feats.append(pooled_features(frames, w, channels_first=True))
        labels.append(y)
    return np.concatenate(feats), np.concatenate(labels)


# --------------------------------------------------------------------------------------
# ONNX graph
# --------------------------------------------------------------------------------------


def build_onnx(p: dict[str, np.ndarray]):
    """The ONNX model (``onnx.ModelProto``) mirroring :func:`forward`: input ``frames`` UINT8
    ``[batch, 480, 640, 3]``, outputs ``probabilities`` FP32 ``[batch, 4]`` and ``label`` INT64
    ``[batch]``. Every op works frame by frame, so a frame's outputs do not depend on its batch."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def const(name: str, value) -> onnx.TensorProto:
        return numpy_helper.from_array(np.array(value, dtype=np.float32, order="C"), name=name)

    def shape(name: str, *dims: int) -> onnx.TensorProto:
        return numpy_helper.from_array(np.array(dims, np.int64), name)

    # Sums over each block's 8 rows (a [1, 8] row of ones times the strip), then over its 8
    # columns per channel (a [24, 3] 0/1 matrix): two GEMMs where a ReduceMean over two
    # non-adjacent axes was 2.3x slower (docs/benchmarks.md); sums of uint8 are exact in float32.
    column_sum = np.zeros((POOL * 3, 3), np.float32)
    column_sum[np.arange(POOL * 3), np.arange(POOL * 3) % 3] = 1
    initializers = [
        shape("strips", -1, HEIGHT // POOL, POOL, WIDTH * 3),
        const("row_ones", np.ones((1, POOL))),
        shape("block_rows", -1, HEIGHT // POOL, WIDTH // POOL, POOL * 3),
        const("column_sum", column_sum),
        const("inv_area", 1 / POOL**2),
        const("inv_255", 1 / 255), const("channel_mean", CHANNEL_MEAN), const("channel_inv_std", CHANNEL_INV_STD),
        const("w1", p["w1"]), const("b1", p["b1"]), const("w2", p["w2"]),
        const("feat_mean", p["feat_mean"]), const("feat_inv_std", p["feat_inv_std"]),
        const("w3", p["w3"]), const("b3", p["b3"]), const("w4", p["w4"]), const("b4", p["b4"]),
    ]
    N = helper.make_node
    nodes = [
        # preprocessing: uint8 -> float, 8x8 area downsampling as the mean of each 8x8 block (on
        # the HWC frame), then the small result to CHW, normalised
        N("Cast", ["frames"], ["frames_f"], to=TensorProto.FLOAT, name="preprocess/to_float"),
        N("Reshape", ["frames_f", "strips"], ["strips_f"], name="preprocess/strips"),
        N("MatMul", ["row_ones", "strips_f"], ["row_sums"], name="preprocess/sum_rows"),
        N("Reshape", ["row_sums", "block_rows"], ["block_rows_f"], name="preprocess/block_rows"),
        N("MatMul", ["block_rows_f", "column_sum"], ["block_sums"], name="preprocess/sum_columns"),
        N("Mul", ["block_sums", "inv_area"], ["small_hwc"], name="preprocess/downsample"),
        N("Transpose", ["small_hwc"], ["small"], perm=[0, 3, 1, 2], name="preprocess/to_chw"),
        N("Mul", ["small", "inv_255"], ["unit"], name="preprocess/to_unit"),
        N("Sub", ["unit", "channel_mean"], ["centred"], name="preprocess/centre"),
        N("Mul", ["centred", "channel_inv_std"], ["x"], name="preprocess/scale"),
        # designed convolutions
        N("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[1, 1], name="conv1/colour"),
        N("Relu", ["c1"], ["r1"], name="conv1/relu"),
        N("Conv", ["r1", "w2"], ["c2"], kernel_shape=[KERNEL, KERNEL], group=N_COLOUR,
          pads=[KERNEL // 2] * 4, name="conv2/blob"),
        N("Relu", ["c2"], ["r2"], name="conv2/relu"),
        N("MaxPool", ["r2"], ["m2"], kernel_shape=[2, 2], strides=[2, 2], name="conv2/maxpool"),
        N("GlobalMaxPool", ["m2"], ["gmax"], name="pool/max"),
        N("GlobalAveragePool", ["m2"], ["gmean"], name="pool/mean"),
        N("Concat", ["gmax", "gmean"], ["pooled"], axis=1, name="pool/concat"),
        N("Flatten", ["pooled"], ["feat_raw"], axis=1, name="pool/flatten"),
        # trained head
        N("Sub", ["feat_raw", "feat_mean"], ["feat_c"], name="standardise/sub"),
        N("Mul", ["feat_c", "feat_inv_std"], ["feat"], name="standardise/mul"),
        N("MatMul", ["feat", "w3"], ["z3_mm"], name="fc1/matmul"),
        N("Add", ["z3_mm", "b3"], ["z3"], name="fc1/bias"),
        N("Relu", ["z3"], ["h3"], name="fc1/relu"),
        N("MatMul", ["h3", "w4"], ["logits_mm"], name="fc2/matmul"),
        N("Add", ["logits_mm", "b4"], ["logits"], name="fc2/bias"),
        N("Softmax", ["logits"], ["probabilities"], axis=1, name="softmax"),
        N("ArgMax", ["probabilities"], ["label"], axis=1, keepdims=0, name="argmax"),
    ]
    graph = helper.make_graph(
        nodes,
        "indicator_lamp_classifier",
        inputs=[helper.make_tensor_value_info("frames", TensorProto.UINT8, ["batch", HEIGHT, WIDTH, 3])],
        outputs=[
            helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", N_CLASSES]),
            helper.make_tensor_value_info("label", TensorProto.INT64, ["batch"]),
        ],
        initializer=initializers,
        doc_string="Indicator lamp classifier: 640x480 RGB frame -> (off, green, amber, red).",
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                              producer_name="edge-batcher/tools/build_vision_model.py", producer_version="1",
                              doc_string="Demo camera model trained on synthetic frames.")
    helper.set_model_props(model, {"labels": json.dumps(list(LABELS)), "layout": "NHWC RGB uint8"})
    onnx.checker.check_model(model, full_check=True)
    return model


def open_session(model_path: Path):
    """An onnxruntime session on the saved model as model.toml configures it (CPU EP, one thread)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])


def run_onnxruntime(session, frames: np.ndarray) -> dict[str, np.ndarray]:
    """Score ``frames`` (uint8 [n, 480, 640, 3]) with ``session``; the outputs by name."""
    probs, label = session.run(["probabilities", "label"], {"frames": np.ascontiguousarray(frames, dtype=np.uint8)})
    return {"probabilities": probs, "label": label}


# --------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------

BUILD_STEPS = 5  # the step() calls of build_vision
SAMPLE_CLASSES = ("red", "off")  # the frames of sample_frames.npy


def build_vision(out_dir: Path, seed: int = 0, step: Callable[[str], None] = lambda label: None) -> dict:
    """Build ``<out_dir>/vision/`` (model.onnx, model.toml, sample_frames.npy): train the head on
    N_TRAIN frames (seed ``[seed, 0]``), write and check the graph, then score N_HELDOUT held-out
    frames (seed ``[seed, 1]``) with onnxruntime and compare them with the numpy forward pass.
    Returns the figures main() prints (``accuracy``, ``max_abs_diff``, ...)."""
    import onnx

    started, cpu_started = time.perf_counter(), time.process_time()
    model_dir = Path(out_dir) / MODEL_NAME
    model_dir.mkdir(parents=True, exist_ok=True)
    model_path = model_dir / "model.onnx"
    noise = noise_field(seed)
    params = conv_weights()

    step(f"generating {N_TRAIN} training frames and their conv features")
    f_train, y_train = featurise(N_TRAIN, np.random.default_rng([seed, 0]), noise, params)
    params["feat_mean"] = f_train.mean(axis=0).astype(np.float32)
    params["feat_inv_std"] = (1.0 / (f_train.std(axis=0) + 1e-6)).astype(np.float32)

    step("training the classifier head (numpy, Adam)")
    z = ((f_train - params["feat_mean"]) * params["feat_inv_std"]).astype(np.float64)
    params.update(train_head(z, y_train, np.random.default_rng([seed, 2])))
    train_acc = float((head(f_train, params)["label"] == y_train).mean())

    step("writing the ONNX graph")
    tmp = model_path.with_suffix(".onnx.tmp")
    onnx.save_model(build_onnx(params), str(tmp))
    tmp.replace(model_path)

    step(f"checking {N_HELDOUT} held-out frames with onnxruntime against numpy")
    session = open_session(model_path)  # one: each session keeps its own memory arena
    rng, labels, preds, max_abs_diff, samples = np.random.default_rng([seed, 1]), [], [], 0.0, {}
    for start in range(0, N_HELDOUT, CHECK_BATCH):
        frames, y = generate(min(CHECK_BATCH, N_HELDOUT - start), rng, noise)
        got, ref = run_onnxruntime(session, frames), forward(frames, params)
        max_abs_diff = max(max_abs_diff, float(np.abs(got["probabilities"] - ref["probabilities"]).max()))
        labels.append(y)
        preds.append(got["label"])
        for name in SAMPLE_CLASSES:  # the sample: the frame of that class the model is surest of
            c = LABELS.index(name)
            for i in np.flatnonzero(y == c):
                if got["probabilities"][i, c] > samples.get(name, (0.0, None))[0]:
                    samples[name] = (float(got["probabilities"][i, c]), frames[i])
    y_test, pred = np.concatenate(labels), np.concatenate(preds)

    step("writing model.toml and sample_frames.npy")
    (model_dir / "model.toml").write_text(MODEL_TOML)
    np.save(model_dir / "sample_frames.npy", np.stack([samples[name][1] for name in SAMPLE_CLASSES]))
    return {
        "model_path": model_path,
        "accuracy": float((pred == y_test).mean()),
        "per_class_accuracy": {LABELS[c]: float((pred[y_test == c] == c).mean()) for c in range(N_CLASSES)},
        "train_accuracy": train_acc,
        "max_abs_diff": max_abs_diff,
        "n_heldout": N_HELDOUT,
        "params": params,
        "build_seconds": time.perf_counter() - started,
        "cpu_seconds": time.process_time() - cpu_started,
    }


def is_up_to_date(out_dir: Path) -> bool:
    """True when ``<out_dir>/vision/`` holds all its files and the model is newer than the scripts."""
    model_dir = Path(out_dir) / MODEL_NAME
    files = [model_dir / name for name in ("model.onnx", "model.toml", "sample_frames.npy")]
    newest_source = max(p.stat().st_mtime for p in SOURCES)
    return all(f.exists() for f in files) and files[0].stat().st_mtime > newest_source


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    default_out = Path(__file__).resolve().parent.parent / "engines"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=default_out, help=f"model repository (default {default_out})")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--force", action="store_true", help="rebuild even if the model is up to date")
    args = ap.parse_args(argv)

    model_path = args.out / MODEL_NAME / "model.onnx"
    if not args.force and is_up_to_date(args.out):
        print(f"{MODEL_NAME}: skipped, {model_path} is newer than {', '.join(p.name for p in SOURCES)} "
              "(use --force to rebuild)")
        return 0
    print(f"{MODEL_NAME}: building into {args.out / MODEL_NAME} (seed {args.seed})")
    with Progress(MODEL_NAME, BUILD_STEPS) as progress:
        m = build_vision(args.out, seed=args.seed, step=progress.step)
    print(f"wrote {m['model_path']}")
    print(f"train accuracy: {m['train_accuracy']:.3f} ({N_TRAIN} frames)")
    print("per-class held-out accuracy: " + ", ".join(f"{k} {v:.3f}" for k, v in m["per_class_accuracy"].items()))
    print(f"onnxruntime vs numpy max abs diff: {m['max_abs_diff']:.2e}")
    print(f"built in {m['build_seconds']:.1f} s ({m['cpu_seconds']:.1f} s of CPU)")
    print(f"held-out accuracy: {m['accuracy']:.3f} ({m['n_heldout']} frames)")
    ok = True
    if m["max_abs_diff"] >= MAX_ABS_DIFF:
        print(f"error: onnxruntime and numpy differ by {m['max_abs_diff']:.2e} >= {MAX_ABS_DIFF}", file=sys.stderr)
        ok = False
    if m["accuracy"] < MIN_ACCURACY:
        print(f"error: held-out accuracy {m['accuracy']:.3f} < {MIN_ACCURACY}", file=sys.stderr)
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
