#!/usr/bin/env python3
"""Build the demo models of the model repository from synthetic data.

Two models: ``vision`` (a camera frame -> indicator lamp state, built by
tools/build_vision_model.py, which this script runs after its own) and ``vibration``, a fault
classifier for 256-sample accelerometer windows (2560 Hz).  Everything is generated here,
nothing is downloaded:

1. synthetic vibration windows for four classes with physically-motivated signatures
   (:func:`generate`);
2. a feature extractor written once in numpy (:func:`features`): remove the mean,
   Hann window, DFT power spectrum through constant cos/sin matrices, band pooling,
   ``log(1 + band power)`` and standardisation; the ONNX graph mirrors it op for op,
   so the model takes raw windows;
3. a small MLP (32 -> 32 ReLU -> 4 softmax) trained with numpy only (Adam);
4. the ONNX graph (opset 17, IR version 8) built with ``onnx.helper`` and checked,
   then verified with onnxruntime against the numpy forward pass on held-out data.

Usage::

    python tools/build_demo_models.py [--out engines] [--seed 0] [--force] [--model vibration|vision]

Each model's build is skipped when its model.onnx is newer than the script that builds it
(``--force`` rebuilds both).  The output is deterministic for a given seed.
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

from edge_batcher.progress import Progress  # noqa: E402

# --------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------

MODEL_NAME = "vibration"
SAMPLE_RATE_HZ = 2560.0
WINDOW = 256
N_BINS = WINDOW // 2 + 1  # 129 one-sided DFT bins, 10 Hz apart
N_BANDS = 32
HIDDEN = 32
LABELS = ("normal", "imbalance", "misalignment", "bearing_fault")
N_CLASSES = len(LABELS)

OPSET = 17
IR_VERSION = 8  # the IR version that goes with opset 17; loadable by onnxruntime >= 1.14

N_TRAIN = 8000
N_HELDOUT = 2000
EPOCHS = 300
BATCH_SIZE = 128
MIN_ACCURACY = 0.95
MAX_ABS_DIFF = 1e-4

MODEL_TOML = """\
# Demo sensor model built by tools/build_demo_models.py: vibration window -> fault class.
backend = "onnxruntime"
model_file = "model.onnx"
instances = 1
description = "Vibration fault classifier: 256-sample accelerometer window at 2560 Hz -> \
class (normal, imbalance, misalignment, bearing_fault) and anomaly score"
labels = ["normal", "imbalance", "misalignment", "bearing_fault"]

[onnxruntime]
execution_providers = ["CPUExecutionProvider"]
intra_op_threads = 1

[batching]
preferred_batch_sizes = [2, 4, 8]
max_queue_delay_ms = 2.0
default_timeout_ms = 5000
queue_capacity = 1024
"""


# --------------------------------------------------------------------------------------
# Synthetic data
# --------------------------------------------------------------------------------------


def generate(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Generate ``n`` synthetic accelerometer windows and their fault classes.

    Each window is 256 samples at 2560 Hz (0.1 s) of a machine whose shaft turns at a
    random 20-40 Hz.  Classes (balanced, shuffled):

    * 0 ``normal``: moderate 1x shaft harmonic, a trace of 2x, small noise;
    * 1 ``imbalance``: strong 1x harmonic;
    * 2 ``misalignment``: strong 2x and 3x harmonics on top of a normal 1x;
    * 3 ``bearing_fault``: normal 1x plus periodic impulses (3-5.5 per revolution,
      like an outer-race defect frequency) that each ring an 800-1000 Hz structural
      resonance, amplitude-modulated by the shaft rotation.

    Amplitudes, phases, noise levels, a sensor DC offset and an overall gain are
    randomised so the classes overlap a little.

    Returns ``(X, y)``: X float32 ``[n, 256]`` (in g), y int64 ``[n]``.
    """
    t = np.arange(WINDOW) / SAMPLE_RATE_HZ  # [256]
    y = rng.permutation(np.arange(n) % N_CLASSES).astype(np.int64)

    def u(lo: float, hi: float) -> np.ndarray:
        return rng.uniform(lo, hi, size=(n, 1))

    shaft = u(20.0, 40.0)
    phase = rng.uniform(0.0, 2 * np.pi, size=(n, 4))
    gain = u(0.75, 1.33)
    noise = u(0.02, 0.25)
    offset = u(-0.5, 0.5)

    def harmonic(order: int, amp: np.ndarray) -> np.ndarray:
        return amp * np.sin(2 * np.pi * order * shaft * t + phase[:, order - 1 : order])

    is_ = [(y == c)[:, None] for c in range(N_CLASSES)]

    # 1x: imbalance makes it strong, everything else has the ordinary residual 1x.
    a1 = np.where(is_[1], u(1.3, 3.0), u(0.3, 0.9))
    # 2x / 3x: strong for misalignment, a trace otherwise.
    a2 = np.where(is_[2], a1 * u(0.6, 1.5), a1 * u(0.0, 0.15))
    a3 = np.where(is_[2], a1 * u(0.3, 0.9), a1 * u(0.0, 0.08))
    x = harmonic(1, a1) + harmonic(2, a2) + harmonic(3, a3)

    # Bearing fault: impulse train ringing a high-frequency resonance.
    impulse_rate = shaft * u(3.0, 5.5)  # impulses per second
    f_res = u(800.0, 1000.0)
    tau = u(0.0015, 0.004)  # resonance decay time constant, s
    a_imp = u(0.4, 1.6)
    mod_depth = u(0.2, 0.8)
    mod_phase = u(0.0, 2 * np.pi)
    period = 1.0 / impulse_rate
    t0 = -u(0.0, 1.0) * period  # first impulse before the window so ringing carries in
    jitter = rng.normal(0.0, 0.02, size=(n, 40)) * period
    burst = np.zeros((n, WINDOW))
    k_max = int(np.ceil(WINDOW / SAMPLE_RATE_HZ * 40.0 * 5.5)) + 2
    for k in range(k_max):
        tk = t0 + k * period + jitter[:, k : k + 1]  # [n, 1]
        dt = t - tk  # [n, 256]
        env = 1.0 + mod_depth * np.cos(2 * np.pi * shaft * tk + mod_phase)
        ring = env * np.exp(-np.maximum(dt, 0.0) / tau) * np.sin(2 * np.pi * f_res * dt)
        burst += np.where(dt >= 0.0, ring, 0.0)
    x = x + np.where(is_[3], a_imp * burst, 0.0)

    x = gain * (x + offset + noise * rng.standard_normal((n, WINDOW)))
    return x.astype(np.float32), y


# --------------------------------------------------------------------------------------
# Feature extraction (numpy reference; the ONNX graph mirrors it)
# --------------------------------------------------------------------------------------


def band_edges() -> np.ndarray:
    """Bin edges of the 32 pooling bands: fine (one 10 Hz bin) below 160 Hz, where
    the shaft harmonics live, then 17 equal bands of ~6.6 bins up to Nyquist."""
    fine = np.array([0, 2] + list(range(3, 17)))  # band 0 = bins 0-1 (DC is ~0), then 2..15
    coarse = np.round(np.linspace(16, N_BINS, N_BANDS - (len(fine) - 1) + 1)).astype(int)[1:]
    edges = np.concatenate([fine, coarse])
    assert len(edges) == N_BANDS + 1 and edges[-1] == N_BINS and np.all(np.diff(edges) > 0)
    return edges


def feature_constants() -> dict[str, np.ndarray]:
    """Constant tensors of the feature extractor (float32): Hann window ``[256]``, DFT
    cos/sin matrices ``[256, 129]`` and the band-pooling matrix ``[129, 32]`` (mean
    power per band)."""
    n = np.arange(WINDOW)
    k = np.arange(N_BINS)
    angle = 2 * np.pi * np.outer(n, k) / WINDOW
    hann = 0.5 - 0.5 * np.cos(2 * np.pi * n / WINDOW)  # periodic Hann
    edges = band_edges()
    pool = np.zeros((N_BINS, N_BANDS))
    for b in range(N_BANDS):
        pool[edges[b] : edges[b + 1], b] = 1.0 / (edges[b + 1] - edges[b])
    return {
        "hann": hann.astype(np.float32),
        "dft_cos": np.cos(angle).astype(np.float32),
        "dft_sin": (-np.sin(angle)).astype(np.float32),
        "band_pool": pool.astype(np.float32),
    }


def log_band_energies(x: np.ndarray, c: dict[str, np.ndarray]) -> np.ndarray:
    """Unstandardised features ``[n, 32]``: log(1 + mean band power of the Hann-windowed,
    mean-removed window).  Same op sequence as the ONNX graph."""
    x = x.astype(np.float32)
    centred = x - x.mean(axis=1, keepdims=True)  # ReduceMean + Sub
    windowed = centred * c["hann"]  # Mul
    re = windowed @ c["dft_cos"]  # MatMul
    im = windowed @ c["dft_sin"]  # MatMul
    power = re * re + im * im  # Mul, Mul, Add
    bands = power @ c["band_pool"]  # MatMul
    return np.log(bands + np.float32(1.0))  # Add, Log


def features(x: np.ndarray, params: dict[str, np.ndarray]) -> np.ndarray:
    """Standardised features ``[n, 32]`` (``params`` holds the constants plus
    ``feat_mean`` and ``feat_inv_std``)."""
    return (log_band_energies(x, params) - params["feat_mean"]) * params["feat_inv_std"]


def softmax(z: np.ndarray) -> np.ndarray:
    """Row-wise softmax."""
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def forward(x: np.ndarray, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The numpy reference of the whole model (float32): the three graph outputs."""
    f = features(x, params)
    h = np.maximum(f @ params["w1"] + params["b1"], np.float32(0.0))
    probs = softmax(h @ params["w2"] + params["b2"]).astype(np.float32)
    return {
        "class_probs": probs,
        "class_id": probs.argmax(axis=1).astype(np.int64),
        "anomaly_score": (np.float32(1.0) - probs[:, 0]).astype(np.float32),
    }


# --------------------------------------------------------------------------------------
# Training (numpy only)
# --------------------------------------------------------------------------------------


def train_mlp(
    f: np.ndarray,
    y: np.ndarray,
    rng: np.random.Generator,
    epochs: int = EPOCHS,
    batch_size: int = BATCH_SIZE,
    lr: float = 3e-3,
    weight_decay: float = 1e-3,
) -> dict[str, np.ndarray]:
    """Train a 32 -> HIDDEN ReLU -> 4 MLP on standardised features with softmax
    cross-entropy and Adam (cosine-decayed learning rate, small L2).  Returns float32
    weights ``w1, b1, w2, b2``."""
    n, d = f.shape
    f = f.astype(np.float64)
    p = {
        "w1": rng.normal(0.0, np.sqrt(2.0 / d), size=(d, HIDDEN)),
        "b1": np.zeros(HIDDEN),
        "w2": rng.normal(0.0, np.sqrt(1.0 / HIDDEN), size=(HIDDEN, N_CLASSES)),
        "b2": np.zeros(N_CLASSES),
    }
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(v) for k, v in p.items()}
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    onehot = np.eye(N_CLASSES)[y]
    steps_per_epoch = int(np.ceil(n / batch_size))
    total = epochs * steps_per_epoch
    step = 0
    for _ in range(epochs):
        order = rng.permutation(n)
        for s in range(steps_per_epoch):
            idx = order[s * batch_size : (s + 1) * batch_size]
            xb, tb = f[idx], onehot[idx]
            z1 = xb @ p["w1"] + p["b1"]
            h = np.maximum(z1, 0.0)
            probs = softmax(h @ p["w2"] + p["b2"])
            dz2 = (probs - tb) / len(idx)
            dh = dz2 @ p["w2"].T
            dz1 = dh * (z1 > 0)
            grads = {
                "w2": h.T @ dz2 + weight_decay * p["w2"],
                "b2": dz2.sum(axis=0),
                "w1": xb.T @ dz1 + weight_decay * p["w1"],
                "b1": dz1.sum(axis=0),
            }
            step += 1
            lr_t = lr * 0.5 * (1.0 + np.cos(np.pi * step / total))
            for k, g in grads.items():
                m[k] = beta1 * m[k] + (1 - beta1) * g
                v[k] = beta2 * v[k] + (1 - beta2) * g * g
                m_hat = m[k] / (1 - beta1**step)
                v_hat = v[k] / (1 - beta2**step)
                p[k] -= lr_t * m_hat / (np.sqrt(v_hat) + eps)
    return {k: val.astype(np.float32) for k, val in p.items()}


# --------------------------------------------------------------------------------------
# ONNX graph
# --------------------------------------------------------------------------------------


def build_onnx(params: dict[str, np.ndarray]):
    """Build the ONNX model (``onnx.ModelProto``) mirroring :func:`forward`.

    Input ``signal`` FP32 ``[batch, 256]``; outputs ``class_probs`` FP32 ``[batch, 4]``,
    ``class_id`` INT64 ``[batch]`` and ``anomaly_score`` FP32 ``[batch]``.  Every op
    works row by row, so a row's outputs do not depend on the other rows of a batch.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def const(name: str, value: np.ndarray):
        return numpy_helper.from_array(np.array(value, order="C"), name=name)  # keeps 0-d scalars 0-d

    initializers = [
        const("hann", params["hann"]),
        const("dft_cos", params["dft_cos"]),
        const("dft_sin", params["dft_sin"]),
        const("band_pool", params["band_pool"]),
        const("one", np.array(1.0, dtype=np.float32)),
        const("feat_mean", params["feat_mean"]),
        const("feat_inv_std", params["feat_inv_std"]),
        const("w1", params["w1"]),
        const("b1", params["b1"]),
        const("w2", params["w2"]),
        const("b2", params["b2"]),
        const("normal_index", np.array(0, dtype=np.int64)),
    ]
    N = helper.make_node
    nodes = [
        # features
        N("ReduceMean", ["signal"], ["mean"], axes=[1], keepdims=1, name="remove_mean/mean"),
        N("Sub", ["signal", "mean"], ["centred"], name="remove_mean/sub"),
        N("Mul", ["centred", "hann"], ["windowed"], name="hann_window"),
        N("MatMul", ["windowed", "dft_cos"], ["dft_re"], name="dft/re"),
        N("MatMul", ["windowed", "dft_sin"], ["dft_im"], name="dft/im"),
        N("Mul", ["dft_re", "dft_re"], ["re2"], name="power/re2"),
        N("Mul", ["dft_im", "dft_im"], ["im2"], name="power/im2"),
        N("Add", ["re2", "im2"], ["power"], name="power/sum"),
        N("MatMul", ["power", "band_pool"], ["bands"], name="band_pool"),
        N("Add", ["bands", "one"], ["bands_p1"], name="log1p/add"),
        N("Log", ["bands_p1"], ["log_bands"], name="log1p/log"),
        N("Sub", ["log_bands", "feat_mean"], ["feat_c"], name="standardise/sub"),
        N("Mul", ["feat_c", "feat_inv_std"], ["feat"], name="standardise/mul"),
        # MLP
        N("MatMul", ["feat", "w1"], ["z1_mm"], name="fc1/matmul"),
        N("Add", ["z1_mm", "b1"], ["z1"], name="fc1/bias"),
        N("Relu", ["z1"], ["h1"], name="fc1/relu"),
        N("MatMul", ["h1", "w2"], ["logits_mm"], name="fc2/matmul"),
        N("Add", ["logits_mm", "b2"], ["logits"], name="fc2/bias"),
        # heads
        N("Softmax", ["logits"], ["class_probs"], axis=1, name="softmax"),
        N("ArgMax", ["class_probs"], ["class_id"], axis=1, keepdims=0, name="argmax"),
        N("Gather", ["class_probs", "normal_index"], ["p_normal"], axis=1, name="p_normal"),
        N("Sub", ["one", "p_normal"], ["anomaly_score"], name="anomaly_score"),
    ]
    graph = helper.make_graph(
        nodes,
        "vibration_fault_classifier",
        inputs=[helper.make_tensor_value_info("signal", TensorProto.FLOAT, ["batch", WINDOW])],
        outputs=[
            helper.make_tensor_value_info("class_probs", TensorProto.FLOAT, ["batch", N_CLASSES]),
            helper.make_tensor_value_info("class_id", TensorProto.INT64, ["batch"]),
            helper.make_tensor_value_info("anomaly_score", TensorProto.FLOAT, ["batch"]),
        ],
        initializer=initializers,
        doc_string=(
            "Vibration fault classifier: 256-sample accelerometer window at 2560 Hz -> "
            "log band energies -> MLP -> (normal, imbalance, misalignment, bearing_fault)."
        ),
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="edge-batcher/tools/build_demo_models.py",
        producer_version="1",
        ir_version=IR_VERSION,
        doc_string="Demo sensor model trained on synthetic data.",
    )
    helper.set_model_props(
        model,
        {
            "labels": json.dumps(list(LABELS)),
            "sample_rate_hz": str(SAMPLE_RATE_HZ),
            "window": str(WINDOW),
        },
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def run_onnxruntime(model_path: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    """Score ``x`` with onnxruntime (CPUExecutionProvider, one thread) on the saved
    model file; returns the outputs by name."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    out = sess.run(names, {"signal": np.ascontiguousarray(x, dtype=np.float32)})
    return dict(zip(names, out))


# --------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------


def _sample_request(x: np.ndarray, y: np.ndarray, pred: np.ndarray) -> tuple[dict, list[int]]:
    """The demo KServe v2 request: the first correctly classified ``bearing_fault``
    window and the first correctly classified ``normal`` window of ``x``."""
    rows = []
    for cls in (LABELS.index("bearing_fault"), LABELS.index("normal")):
        ok = np.flatnonzero((y == cls) & (pred == cls))
        rows.append(int(ok[0]) if len(ok) else int(np.flatnonzero(y == cls)[0]))
    data = [round(float(v), 5) for v in x[rows].reshape(-1)]
    request = {
        "id": "demo-1",
        "inputs": [{"name": "signal", "shape": [len(rows), WINDOW], "datatype": "FP32", "data": data}],
    }
    return request, rows


BUILD_STEPS = 5  # the step() calls of build_vibration


def build_vibration(out_dir: Path, seed: int = 0, step: Callable[[str], None] = lambda label: None) -> dict:
    """Build ``<out_dir>/vibration/`` (model.onnx, model.toml, sample_request.json).

    Generates 8000 training windows (seed ``[seed, 0]``), trains the MLP, writes and
    checks the ONNX graph, then scores 2000 held-out windows (seed ``[seed, 1]``) with
    onnxruntime and compares them with the numpy forward pass.

    Returns a dict with ``accuracy``, ``max_abs_diff``, ``model_path``,
    ``per_class_accuracy``, ``train_accuracy``, ``n_heldout``, ``build_seconds``,
    ``sample_classes`` (true labels of the sample request rows) and
    ``sample_predictions`` (the model's labels for the rounded sample rows).
    """
    started = time.perf_counter()
    model_dir = Path(out_dir) / MODEL_NAME
    model_dir.mkdir(parents=True, exist_ok=True)
    model_path = model_dir / "model.onnx"

    step(f"generating {N_TRAIN} training windows and their features")
    x_train, y_train = generate(N_TRAIN, np.random.default_rng([seed, 0]))
    params: dict[str, np.ndarray] = feature_constants()
    raw = log_band_energies(x_train, params)
    params["feat_mean"] = raw.mean(axis=0).astype(np.float32)
    params["feat_inv_std"] = (1.0 / (raw.std(axis=0) + 1e-6)).astype(np.float32)
    f_train = features(x_train, params)

    step("training the MLP (numpy, Adam)")
    params.update(train_mlp(f_train, y_train, np.random.default_rng([seed, 2])))
    train_acc = float((forward(x_train, params)["class_id"] == y_train).mean())

    step("writing the ONNX graph")
    import onnx

    model = build_onnx(params)
    tmp = model_path.with_suffix(".onnx.tmp")
    onnx.save_model(model, str(tmp))
    tmp.replace(model_path)

    step(f"checking {N_HELDOUT} held-out windows with onnxruntime against numpy")
    x_test, y_test = generate(N_HELDOUT, np.random.default_rng([seed, 1]))
    got = run_onnxruntime(model_path, x_test)
    ref = forward(x_test, params)
    max_abs_diff = float(
        max(
            np.abs(got["class_probs"] - ref["class_probs"]).max(),
            np.abs(got["anomaly_score"] - ref["anomaly_score"]).max(),
        )
    )
    pred = got["class_id"]
    accuracy = float((pred == y_test).mean())
    per_class = {LABELS[c]: float((pred[y_test == c] == c).mean()) for c in range(N_CLASSES)}

    step("writing model.toml and sample_request.json")
    (model_dir / "model.toml").write_text(MODEL_TOML)
    request, rows = _sample_request(x_test, y_test, pred)
    (model_dir / "sample_request.json").write_text(json.dumps(request) + "\n")
    sample_x = np.asarray(request["inputs"][0]["data"], dtype=np.float32).reshape(len(rows), WINDOW)
    sample_pred = run_onnxruntime(model_path, sample_x)["class_id"]

    return {
        "model_path": model_path,
        "accuracy": accuracy,
        "max_abs_diff": max_abs_diff,
        "argmax_agreement": float((got["class_id"] == ref["class_id"]).mean()),
        "per_class_accuracy": per_class,
        "train_accuracy": train_acc,
        "n_heldout": N_HELDOUT,
        "sample_classes": [LABELS[int(y_test[r])] for r in rows],
        "sample_predictions": [LABELS[int(c)] for c in sample_pred],
        "build_seconds": time.perf_counter() - started,
    }


def is_up_to_date(out_dir: Path) -> bool:
    """True when ``<out_dir>/vibration/model.onnx`` (and its companion files) exist and
    the model is newer than this script."""
    model_dir = Path(out_dir) / MODEL_NAME
    model_path = model_dir / "model.onnx"
    if not all(p.exists() for p in (model_path, model_dir / "model.toml", model_dir / "sample_request.json")):
        return False
    return model_path.stat().st_mtime > Path(__file__).stat().st_mtime


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    default_out = Path(__file__).resolve().parent.parent / "engines"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=default_out, help=f"model repository (default {default_out})")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--force", action="store_true", help="rebuild even if the model is up to date")
    ap.add_argument("--model", action="append", choices=("vibration", "vision"),
                    help="build only this model (repeatable; default: both)")
    args = ap.parse_args(argv)
    models = args.model or ["vibration", "vision"]
    status = _build_vibration_and_report(args) if "vibration" in models else 0
    if "vision" in models:
        vision = _load_sibling("build_vision_model")
        status = vision.main(["--out", str(args.out), "--seed", str(args.seed)] + ["--force"] * args.force) or status
    return status


def _load_sibling(name: str):
    """Another builder of tools/ (not a package), by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_vibration_and_report(args: argparse.Namespace) -> int:
    model_path = args.out / MODEL_NAME / "model.onnx"
    if not args.force and is_up_to_date(args.out):
        print(f"{MODEL_NAME}: skipped, {model_path} is newer than {Path(__file__).name} (use --force to rebuild)")
        return 0

    print(f"{MODEL_NAME}: building into {args.out / MODEL_NAME} (seed {args.seed})")
    with Progress(MODEL_NAME, BUILD_STEPS) as progress:
        m = build_vibration(args.out, seed=args.seed, step=progress.step)
    print(f"wrote {m['model_path']}")
    print(f"train accuracy: {m['train_accuracy']:.3f} ({N_TRAIN} windows)")
    print("per-class held-out accuracy: " + ", ".join(f"{k} {v:.3f}" for k, v in m["per_class_accuracy"].items()))
    print(f"onnxruntime vs numpy max abs diff: {m['max_abs_diff']:.2e} (argmax agreement {m['argmax_agreement']:.4f})")
    print(
        "sample_request.json rows: "
        + ", ".join(
            f"row {i} = {c} (model says {p})"
            for i, (c, p) in enumerate(zip(m["sample_classes"], m["sample_predictions"]))
        )
    )
    print(f"built in {m['build_seconds']:.1f} s")
    print(f"held-out accuracy: {m['accuracy']:.3f} ({m['n_heldout']} windows)")

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
