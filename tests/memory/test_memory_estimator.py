"""OnnxFootprintEstimator on hand-built graphs whose peak is known by construction.

The liveness rules the expected numbers follow (see edge_batcher/memory/estimator.py):
graph inputs stay live for the whole run (the caller owns them), a node's outputs are live
while it runs together with everything still live, an intermediate dies after its last reader,
graph outputs stay live to the end, initializers/Constants are weights, not activations.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge_batcher.errors import ConfigError
from edge_batcher.memory.estimator import Footprint, OnnxFootprintEstimator

F = TensorProto.FLOAT
I64 = TensorProto.INT64


def save(
    tmp_path: Path,
    name: str,
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: list[onnx.TensorProto] = (),  # type: ignore[assignment]
    *,
    check: bool = True,
    extra_opsets: tuple[tuple[str, int], ...] = (),
) -> Path:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=list(initializers))
    opsets = [helper.make_opsetid("", 17)] + [helper.make_opsetid(d, v) for d, v in extra_opsets]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    if check:
        onnx.checker.check_model(model)
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    return path


def out(name: str, elem: int = F, rank: int = 2) -> onnx.ValueInfoProto:
    """A graph output with symbolic dims, as exporters write them; the estimator infers them."""
    return helper.make_tensor_value_info(name, elem, [f"{name}_d{i}" for i in range(rank)])


def const_i64(name: str, values: list[int] | int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, dtype=np.int64), name)


# ---------------------------------------------------------------------------------------------


def chain_model(tmp_path: Path, *, shuffled: bool = False) -> Path:
    # x -> Relu -> a -> Sigmoid -> b -> Tanh -> c -> Neg -> y, every tensor [batch, 1024] f32
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Sigmoid", ["a"], ["b"]),
        helper.make_node("Tanh", ["b"], ["c"]),
        helper.make_node("Neg", ["c"], ["y"]),
    ]
    if shuffled:
        nodes = nodes[::-1]
    x = helper.make_tensor_value_info("x", F, ["batch", 1024])
    return save(tmp_path, "chain", nodes, [x], [out("y")], check=not shuffled)


def test_chain_peak_is_two_adjacent_tensors_plus_the_input(tmp_path: Path) -> None:
    est = OnnxFootprintEstimator(chain_model(tmp_path))
    s = 1 * 1024 * 4  # one tensor at batch 1
    # Relu: x + a = 2s; Sigmoid: x + a + b = 3s (a dies); Tanh: x + b + c = 3s (b dies);
    # Neg: x + c + y = 3s. The naive sum of all five tensors would be 5s.
    assert est.activation_peak(1) == 3 * s == 12288
    assert est.activation_peak(2) == 3 * 2 * s
    assert est.unknown_shapes == 0
    assert est.weights_bytes() == 0


def test_unsorted_graph_is_sorted_before_the_walk(tmp_path: Path) -> None:
    est = OnnxFootprintEstimator(chain_model(tmp_path, shuffled=True))
    assert est.activation_peak(1) == 12288


def test_diamond_keeps_both_branches_live(tmp_path: Path) -> None:
    # x -> Relu -> a;  a -> Sigmoid -> b1;  a -> Tanh -> b2;  Add(b1, b2) -> y
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Sigmoid", ["a"], ["b1"]),
        helper.make_node("Tanh", ["a"], ["b2"]),
        helper.make_node("Add", ["b1", "b2"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", F, ["batch", 1024])
    est = OnnxFootprintEstimator(save(tmp_path, "diamond", nodes, [x], [out("y")]))
    s = 4096
    # Relu: x + a = 2s; Sigmoid: x + a + b1 = 3s; Tanh: x + a + b1 + b2 = 4s, then a dies;
    # Add: x + b1 + b2 + y = 4s. Both branches are live at once: 4s, one more than a chain.
    assert est.activation_peak(1) == 4 * s == 16384


def test_naive_sum_far_exceeds_the_liveness_peak(tmp_path: Path) -> None:
    # 40 Relus in a row over [batch, 4096] f32: 41 activation tensors of s bytes each.
    names = ["x"] + [f"t{i}" for i in range(1, 40)] + ["y"]
    nodes = [helper.make_node("Relu", [names[i]], [names[i + 1]]) for i in range(40)]
    x = helper.make_tensor_value_info("x", F, ["batch", 4096])
    est = OnnxFootprintEstimator(save(tmp_path, "long", nodes, [x], [out("y")]))
    s = 4096 * 4
    naive = 41 * s
    peak = est.activation_peak(1)
    assert peak == 3 * s == 49152  # input + the two tensors of the running node
    assert naive / peak > 13


def reshape_matmul_model(tmp_path: Path) -> tuple[Path, onnx.ModelProto]:
    # x [batch, 16, 32] f32 -> Reshape to [batch, 512] with the target shape computed from
    # Shape(x) (needs data propagation) -> MatMul W [512, 256] -> Relu -> y [batch, 256]
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),  # int64[3]   24 bytes
        helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),  # int64 scalar 8 bytes
        helper.make_node("Unsqueeze", ["b", "axes0"], ["bu"]),  # int64[1]   8 bytes
        helper.make_node("Concat", ["bu", "c512"], ["shape"], axis=0),  # int64[2]   16 bytes
        helper.make_node("Reshape", ["x", "shape"], ["r"]),  # [batch, 512] f32
        helper.make_node("MatMul", ["r", "w"], ["h"]),  # [batch, 256] f32
        helper.make_node("Relu", ["h"], ["y"]),  # [batch, 256] f32
    ]
    w = numpy_helper.from_array(np.ones((512, 256), dtype=np.float32), "w")
    inits = [const_i64("zero", 0), const_i64("axes0", [0]), const_i64("c512", [512]), w]
    x = helper.make_tensor_value_info("x", F, ["batch", 16, 32])
    path = save(tmp_path, "reshape_matmul", nodes, [x], [out("y")], inits)
    return path, onnx.load(str(path))


@pytest.mark.parametrize("batch", [1, 2, 4, 8])
def test_reshape_matmul_peak_scales_linearly_with_batch(tmp_path: Path, batch: int) -> None:
    path, _ = reshape_matmul_model(tmp_path)
    est = OnnxFootprintEstimator(path)
    b = batch
    # x = r = 2048b, h = y = 1024b; x stays live (input).
    # Shape: 2048b + 24; Gather: 2048b + 24 + 8; Unsqueeze: 2048b + 8 + 8;
    # Concat: 2048b + 8 + 16; Reshape: 2048b + 16 + 2048b; MatMul: x + r + h = 5120b (r dies);
    # Relu: x + h + y = 4096b.
    assert est.activation_peak(batch) == 5120 * b
    assert est.unknown_shapes == 0  # Reshape's output shape came from data propagation
    # w 512*256*4 + zero 8 + axes0 8 + c512 8
    assert est.weights_bytes() == 524288 + 24


def test_external_data_is_counted_from_the_file(tmp_path: Path) -> None:
    _, model = reshape_matmul_model(tmp_path)
    ext_dir = tmp_path / "ext"
    ext_dir.mkdir()
    onnx.save_model(
        model, str(ext_dir / "m.onnx"), save_as_external_data=True,
        all_tensors_to_one_file=True, location="weights.bin", size_threshold=0,
    )
    est = OnnxFootprintEstimator(ext_dir / "m.onnx")
    file_size = os.path.getsize(ext_dir / "weights.bin")
    assert file_size >= 524288 + 24
    assert est.weights_bytes() == file_size
    assert est.activation_peak(4) == 5120 * 4


def test_constants_are_weights_not_activations(tmp_path: Path) -> None:
    # x [batch, 100] + c (initializer [100]) -> a; a @ W (Constant node [100, 100]) -> y
    w = numpy_helper.from_array(np.ones((100, 100), dtype=np.float32), "wv")
    nodes = [
        helper.make_node("Constant", [], ["w"], value=w),
        helper.make_node("Add", ["x", "c"], ["a"]),
        helper.make_node("MatMul", ["a", "w"], ["y"]),
    ]
    c = numpy_helper.from_array(np.ones(100, dtype=np.float32), "c")
    x = helper.make_tensor_value_info("x", F, ["batch", 100])
    est = OnnxFootprintEstimator(save(tmp_path, "consts", nodes, [x], [out("y")], [c]))
    assert est.weights_bytes() == 100 * 100 * 4 + 100 * 4  # 40400
    # x = a = y = 400 bytes at batch 1. Add: x + a = 800; MatMul: x + a + y = 1200.
    assert est.activation_peak(1) == 1200
    assert est.unknown_shapes == 0


def sequence_model(tmp_path: Path) -> Path:
    # input_ids int64 [batch, seq] -> Gather(emb [1000, 64]) -> e [batch, seq, 64] f32
    # attention_mask f32 [batch, seq] -> Unsqueeze(axis 2) -> m [batch, seq, 1]
    # e * m -> p -> Relu -> y [batch, seq, 64]
    nodes = [
        helper.make_node("Unsqueeze", ["attention_mask", "axes2"], ["m"]),
        helper.make_node("Gather", ["emb", "input_ids"], ["e"], axis=0),
        helper.make_node("Mul", ["e", "m"], ["p"]),
        helper.make_node("Relu", ["p"], ["y"]),
    ]
    emb = numpy_helper.from_array(np.zeros((1000, 64), dtype=np.float32), "emb")
    inputs = [
        helper.make_tensor_value_info("input_ids", I64, ["batch", "seq"]),
        helper.make_tensor_value_info("attention_mask", F, ["batch", "seq"]),
    ]
    return save(tmp_path, "seq", nodes, inputs, [out("y", rank=3)], [emb, const_i64("axes2", [2])])


@pytest.mark.parametrize(("batch", "seq_len"), [(2, 10), (2, 20), (4, 20)])
def test_sequence_axis_is_bound(tmp_path: Path, batch: int, seq_len: int) -> None:
    # Only input_ids is named; attention_mask shares its dim_param "seq" and is bound too.
    est = OnnxFootprintEstimator(sequence_model(tmp_path), sequence_axes={"input_ids": 1})
    bs = batch * seq_len
    # ids 8bs + mask 4bs stay live (inputs). m = 4bs, e = p = y = 256bs.
    # Unsqueeze: 12bs + 4bs; Gather: 12bs + 4bs + 256bs; Mul: 12bs + 4bs + 256bs + 256bs = 528bs
    # (e and m die); Relu: 12bs + 256bs + 256bs = 524bs.
    assert est.activation_peak(batch, seq_len) == 528 * bs
    assert est.unknown_shapes == 0


def test_sequence_axes_are_validated(tmp_path: Path) -> None:
    path = sequence_model(tmp_path)
    with pytest.raises(ConfigError, match="no input 'ids'"):
        OnnxFootprintEstimator(path, sequence_axes={"ids": 1})
    with pytest.raises(ConfigError, match="batch"):
        OnnxFootprintEstimator(path, sequence_axes={"input_ids": 0})
    with pytest.raises(ConfigError, match="axis"):
        OnnxFootprintEstimator(path, sequence_axes={"input_ids": 2})
    est = OnnxFootprintEstimator(path, sequence_axes={"input_ids": -1})
    with pytest.raises(ValueError, match="seq_len"):
        est.activation_peak(2)
    assert est.activation_peak(1, 1) == 528


def kv_model(tmp_path: Path) -> Path:
    # Two layers of fp16 KV cache, 4 kv heads, head_dim 16. The graph only passes them on:
    # logits = Cast(input_ids) [batch, seq] f32; present.N.* = Identity(past_key_values.N.*)
    inputs = [helper.make_tensor_value_info("input_ids", I64, ["batch", "seq"])]
    outputs = [out("logits")]
    nodes = [helper.make_node("Cast", ["input_ids"], ["logits"], to=F)]
    for layer in range(2):
        for kind in ("key", "value"):
            past = f"past_key_values.{layer}.{kind}"
            present = f"present.{layer}.{kind}"
            inputs.append(
                helper.make_tensor_value_info(past, TensorProto.FLOAT16, ["batch", 4, "past", 16])
            )
            nodes.append(helper.make_node("Identity", [past], [present]))
            outputs.append(out(present, TensorProto.FLOAT16, rank=4))
    return save(tmp_path, "kv", nodes, inputs, outputs)


def test_kv_cache_formula(tmp_path: Path) -> None:
    est = OnnxFootprintEstimator(
        kv_model(tmp_path), sequence_axes={"input_ids": 1}, max_new_tokens=28
    )
    # bytes per token = 2 (K and V) x 2 layers x 4 kv_heads x 16 head_dim x 2 bytes (fp16) = 512
    assert est.kv_layers == 2
    assert est.kv_bytes_per_token == 512
    # batch 3, 100 prompt tokens + 28 new tokens
    assert est.kv_bytes(3, 100) == 512 * 3 * 128 == 196608

    # Activations: past inputs are the KV cache, not activations; their past axis is bound to
    # seq_len, so each present.* is [3, 4, 100, 16] fp16 = 38400 bytes.
    # ids 2400 (live) ; Cast: + logits 1200 ; 4 Identities add 38400 each, all graph outputs.
    assert est.activation_peak(3, 100) == 2400 + 1200 + 4 * 38400 == 157200
    assert est.unknown_shapes == 0

    est.calibration = 1.5
    fp = est.estimate(3, 100)
    assert fp == Footprint(weights=0, activations=235800, kv_cache=196608)
    assert fp.total == 235800 + 196608


def test_models_without_past_inputs_have_no_kv_cache(tmp_path: Path) -> None:
    est = OnnxFootprintEstimator(chain_model(tmp_path), max_new_tokens=64)
    assert est.kv_bytes(8, 512) == 0
    fp = est.estimate(2)
    assert fp == Footprint(weights=0, activations=3 * 2 * 4096, kv_cache=0)


def test_unknown_shapes_fall_back_to_the_largest_input_and_are_counted(tmp_path: Path) -> None:
    # A custom op nothing can infer: x -> Mystery -> u -> Relu -> y
    nodes = [
        helper.make_node("Mystery", ["x"], ["u"], domain="com.example"),
        helper.make_node("Relu", ["u"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", F, ["batch", 1024])
    path = save(
        tmp_path, "custom", nodes, [x], [out("y")], check=False,
        extra_opsets=(("com.example", 1),),
    )
    est = OnnxFootprintEstimator(path)
    s = 4096
    # u is assumed as large as x (s); y as large as u (s). Relu: x + u + y = 3s.
    assert est.activation_peak(1) == 3 * s
    assert est.unknown_shapes == 2
    assert est.unknown_tensors == ("u", "y")
    assert est.estimate(1).unknown_shapes == 2


def test_if_subgraphs_are_charged_conservatively(tmp_path: Path) -> None:
    then_branch = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["t"])], "then", [], [out("t")]
    )
    else_branch = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["e"])], "else", [], [out("e")]
    )
    nodes = [
        helper.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch)
    ]
    inputs = [
        helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        helper.make_tensor_value_info("x", F, ["batch", 1024]),
    ]
    est = OnnxFootprintEstimator(save(tmp_path, "if", nodes, inputs, [out("y")]))
    s = 4096
    # cond 1 byte + x s live; If: + y s + both branches' own peaks (s each) = 4s + 1.
    assert est.activation_peak(1) == 4 * s + 1
    assert est.unknown_shapes == 0


def test_estimate_is_cached_and_calibration_applies_after_the_cache(tmp_path: Path) -> None:
    est = OnnxFootprintEstimator(chain_model(tmp_path), calibration=2.0)
    first = est.estimate(4)
    assert first.activations == 2 * 3 * 4 * 4096
    est.calibration = 3.0
    assert est.estimate(4).activations == 3 * 3 * 4 * 4096
    assert est.activation_peak(4) == 3 * 4 * 4096  # raw, no calibration


def test_a_length_bucket_may_have_its_own_calibration(tmp_path: Path) -> None:
    est = OnnxFootprintEstimator(sequence_model(tmp_path), sequence_axes={"input_ids": 1}, calibration=2.0)
    est.set_calibration(1.5, seq_len=10)
    assert est.estimate(2, 10).activations == math.ceil(1.5 * 528 * 20)  # its own factor
    assert est.estimate(2, 20).activations == 2 * 528 * 40  # the default
    assert (est.calibration, est.calibration_for(10), est.calibration_for(20)) == (2.0, 1.5, 2.0)
    est.scale_calibration(2.0)  # after an out-of-memory error: every factor rises
    assert (est.calibration, est.calibration_for(10)) == (4.0, 3.0)
    with pytest.raises(ConfigError, match="calibration"):
        est.set_calibration(-1.0, seq_len=10)
    with pytest.raises(ValueError, match="seq_len"):
        est.set_calibration(1.0, seq_len=0)


def test_bad_arguments(tmp_path: Path) -> None:
    path = chain_model(tmp_path)
    with pytest.raises(ConfigError, match="calibration"):
        OnnxFootprintEstimator(path, calibration=0)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        OnnxFootprintEstimator(path, max_new_tokens=-1)
    with pytest.raises(ConfigError, match="model_path"):
        OnnxFootprintEstimator(tmp_path / "missing.onnx")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\xff\x00not onnx at all")
    with pytest.raises(ConfigError, match="model_path"):
        OnnxFootprintEstimator(garbage)
    est = OnnxFootprintEstimator(path)
    with pytest.raises(ConfigError, match="calibration"):
        est.calibration = float("nan")
    with pytest.raises(ValueError, match="batch"):
        est.activation_peak(0)
    with pytest.raises(ValueError, match="seq_len"):
        est.kv_bytes(1, 0)


# ---------------------------------------------------------------------------------------------
# Measured check against a real onnxruntime session.

# The peak is VmHWM, this address space's own high-water mark: ru_maxrss would carry over the
# parent's resident set from the fork before exec (a pytest process of 700 MB read as the peak).
_MEASURE = """
import sys
import numpy as np, onnxruntime as ort, psutil
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
proc = psutil.Process()
x = np.ones((BATCH, 128, 512), np.float32)
rss0 = proc.memory_info().rss
options = ort.SessionOptions()
options.intra_op_num_threads = 1
session = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
y = session.run(None, {"x": x})[0]
peak = max(hwm(), proc.memory_info().rss)
print(peak - rss0)
"""


@pytest.mark.slow
def test_estimate_is_within_a_sane_factor_of_onnxruntime_rss(tmp_path: Path) -> None:
    """x [64, 128, 512] @ W1 [512, 2048] -> Relu -> @ W2 [2048, 512]: about 150 MB.

    Runs in a fresh interpreter so the RSS increase is this session's alone. ORT reuses the
    MatMul output buffer for Relu and keeps prepacked weight copies, so the measurement is
    typically ~0.8x the estimate; 0.5x-2x is what "sane" means here. Input x is allocated
    before the baseline, so it is taken out of the estimate.
    """
    pytest.importorskip("onnxruntime")
    import subprocess
    import sys

    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array((rng.random((512, 2048)) * 0.01).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.random((2048, 512)) * 0.01).astype(np.float32), "w2")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", F, ["batch", 128, 512])
    path = save(tmp_path, "measured", nodes, [x], [out("y", rank=3)], [w1, w2])

    batch = 64
    fp = OnnxFootprintEstimator(path).estimate(batch)
    input_bytes = batch * 128 * 512 * 4
    # x 16 MiB + h 64 MiB + r 64 MiB during Relu; weights 8 MiB
    assert fp.activations == 144 * 2**20 and fp.weights == 8 * 2**20
    expected = fp.total - input_bytes

    script = _MEASURE.replace("BATCH", str(batch))
    result = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    measured = int(result.stdout.strip())
    assert 0.5 * expected <= measured <= 2.0 * expected, (measured, expected)


def test_the_estimator_does_not_keep_a_copy_of_the_weights(tmp_path):
    """On unified memory (a Jetson, a cgroup) every byte the estimator keeps is taken from the
    batches: it once held the whole loaded model (86 MiB for MiniLM) next to the engine's copy."""
    import subprocess
    import sys

    weights = numpy_helper.from_array(np.ones((4096, 4096), np.float32), "w")  # 64 MiB
    path = save(tmp_path, "big", [helper.make_node("MatMul", ["x", "w"], ["y"])],
                [helper.make_tensor_value_info("x", F, ["batch", 4096])],
                [helper.make_tensor_value_info("y", F, ["batch", 4096])], [weights])
    script = (
        "import gc, sys, psutil\n"
        "from edge_batcher.memory.estimator import OnnxFootprintEstimator\n"
        "rss = lambda: psutil.Process().memory_info().rss\n"
        "before = rss()\n"
        "estimator = OnnxFootprintEstimator(sys.argv[1])\n"
        "estimator.estimate(8, None)\n"
        "gc.collect()\n"
        "print((rss() - before) / 2**20)\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    kept_mib = float(out.stdout.strip())
    assert kept_mib < 16, f"the estimator keeps {kept_mib:.1f} MiB after reading a model with 64 MiB of weights"
