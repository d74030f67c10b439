"""Profile planning, selection, buffer sizing and ONNX Runtime TensorRT EP options (pure, no TensorRT)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_batcher.config import BatchingSettings, ModelConfig, SequenceSettings
from edge_batcher.engines import trt_profiles as tp
from edge_batcher.errors import ConfigError
from edge_batcher.types import TensorSpec

SIGNAL = [TensorSpec("signal", "FP32", (-1, 256))]
TOKENS = [TensorSpec("ids", "INT64", (-1, -1)), TensorSpec("mask", "INT64", (-1, -1)),
          TensorSpec("scale", "FP32", (-1, 1))]


def model(sizes=(2, 4, 8), sequence=None, name="m") -> ModelConfig:
    return ModelConfig(name=name, directory=Path("/tmp") / name,
                       batching=BatchingSettings(preferred_batch_sizes=list(sizes)), sequence=sequence)


# ------------------------------------------------------------------ planning


def test_one_static_profile_per_preferred_size():
    profiles = tp.plan_profiles(SIGNAL, [2, 4, 8])
    assert [p.index for p in profiles] == [0, 1, 2]
    for p, size in zip(profiles, (2, 4, 8)):
        r = p.inputs["signal"]
        assert r.min == r.opt == r.max == (size, 256)
        assert r.static
        assert p.batch_range() == (size, size)


def test_range_mode_is_one_profile_from_one_to_the_largest_size():
    (p,) = tp.plan_profiles(SIGNAL, [2, 4, 8], mode="range")
    r = p.inputs["signal"]
    assert (r.min, r.opt, r.max) == ((1, 256), (8, 256), (8, 256))
    assert p.batch_range() == (1, 8)


def test_sequence_buckets_give_a_profile_per_size_and_bucket():
    profiles = tp.plan_profiles(TOKENS, [2, 4], sequence_inputs=["ids", "mask"], sequence_axis=1, buckets=[16, 32, 64])
    assert len(profiles) == 6
    shapes = [(p.inputs["ids"].opt, p.inputs["mask"].opt, p.inputs["scale"].opt) for p in profiles]
    assert shapes[0] == ((2, 16), (2, 16), (2, 1))
    assert shapes[2] == ((2, 64), (2, 64), (2, 1))
    assert shapes[5] == ((4, 64), (4, 64), (4, 1))
    assert all(p.inputs["ids"].static for p in profiles)


def test_sequence_range_mode_spans_one_to_the_longest_bucket():
    (p,) = tp.plan_profiles(TOKENS, [2, 4], mode="range", sequence_inputs=["ids", "mask"], buckets=[16, 64])
    assert (p.inputs["ids"].min, p.inputs["ids"].opt, p.inputs["ids"].max) == ((1, 1), (4, 64), (4, 64))
    assert (p.inputs["scale"].min, p.inputs["scale"].max) == ((1, 1), (4, 1))


def test_profiles_for_model_reads_sizes_and_buckets_from_the_model_config():
    seq = SequenceSettings(inputs=["ids", "mask"], axis=1, buckets=[8, 16])
    profiles = tp.profiles_for_model(model((1, 2), seq), TOKENS)
    assert [p.inputs["ids"].opt for p in profiles] == [(1, 8), (1, 16), (2, 8), (2, 16)]


@pytest.mark.parametrize(
    "specs, kwargs, message",
    [
        ([TensorSpec("x", "FP32", (-1, -1))], {}, "dimension 1 is dynamic"),
        ([TensorSpec("x", "FP32", (1, 256))], {}, "fixed batch dimension 1"),
        ([TensorSpec("x", "FP32", ())], {}, "scalar"),
        (SIGNAL, {"mode": "dynamic"}, "profile mode 'dynamic'"),
        (SIGNAL, {"sequence_inputs": ["nope"], "buckets": [8]}, "names input 'nope'"),
        (TOKENS, {"sequence_inputs": ["ids"]}, "need buckets"),
        (TOKENS, {"sequence_inputs": ["ids", "mask"], "buckets": [16, 8]}, "ascending"),
        (TOKENS, {"sequence_inputs": ["ids", "mask"], "sequence_axis": 3, "buckets": [8]}, "outside input"),
        ([], {}, "no inputs"),
    ],
)
def test_unplannable_models_are_config_errors_that_say_why(specs, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        tp.plan_profiles(specs, [2, 4, 8], **kwargs)


@pytest.mark.parametrize("sizes", [[], [4, 2], [2, 2], [0, 2], [-1]])
def test_preferred_sizes_must_be_ascending_distinct_positive(sizes):
    with pytest.raises(ConfigError, match="ascending distinct positive"):
        tp.plan_profiles(SIGNAL, sizes)


def test_a_fixed_batch_dimension_is_fine_when_it_is_the_only_size():
    (p,) = tp.plan_profiles([TensorSpec("x", "FP32", (4, 3))], [4])
    assert p.inputs["x"].opt == (4, 3)


def test_shape_range_rejects_inconsistent_ranges():
    with pytest.raises(ValueError):
        tp.ShapeRange((4, 2), (2, 2), (8, 2))
    with pytest.raises(ValueError):
        tp.ShapeRange((1,), (2, 2), (3, 3))


# ------------------------------------------------------------------ selection


@pytest.mark.parametrize("size, index", [(2, 0), (4, 1), (8, 2)])
def test_each_preferred_size_selects_its_own_profile(size, index):
    profiles = tp.plan_profiles(SIGNAL, [2, 4, 8])
    assert tp.profile_for_batch(size, profiles) == index
    assert tp.select_profile({"signal": (size, 256)}, profiles) == index


@pytest.mark.parametrize("size", [1, 3, 5, 9, 16])
def test_sizes_between_static_profiles_are_not_served(size):
    profiles = tp.plan_profiles(SIGNAL, [2, 4, 8])
    with pytest.raises(ValueError, match=f"batch size {size}.*serves batch sizes 2, 4, 8"):
        tp.profile_for_batch(size, profiles)
    assert tp.select_profile({"signal": (size, 256)}, profiles) is None


def test_select_profile_checks_every_dimension_and_every_input():
    profiles = tp.plan_profiles(SIGNAL, [2, 4, 8])
    assert tp.select_profile({"signal": (4, 255)}, profiles) is None
    assert tp.select_profile({"signal": (4,)}, profiles) is None
    assert tp.select_profile({"other": (4, 256)}, profiles) is None


def test_the_exact_profile_wins_over_a_range_that_also_covers_the_batch():
    static = tp.plan_profiles(SIGNAL, [4])
    (wide,) = tp.plan_profiles(SIGNAL, [2, 8], mode="range")
    profiles = [tp.Profile(0, wide.inputs), tp.Profile(1, static[0].inputs)]
    assert tp.profile_for_batch(4, profiles) == 1
    assert tp.select_profile({"signal": (4, 256)}, profiles) == 1
    assert tp.profile_for_batch(3, profiles) == 0  # only the range serves 3
    assert tp.select_profile({"signal": (3, 256)}, profiles) == 0


def test_among_ranges_the_smallest_covering_one_wins():
    small = tp.Profile(0, {"signal": tp.ShapeRange((1, 256), (2, 256), (4, 256))})
    large = tp.Profile(1, {"signal": tp.ShapeRange((1, 256), (8, 256), (8, 256))})
    assert tp.select_profile({"signal": (3, 256)}, [large, small]) == 0
    assert tp.profile_for_batch(3, [large, small]) == 0
    assert tp.select_profile({"signal": (6, 256)}, [large, small]) == 1


def test_profile_for_batch_with_sequence_buckets():
    profiles = tp.plan_profiles(TOKENS, [2, 4], sequence_inputs=["ids", "mask"], buckets=[16, 32])
    seq = {"sequence_axis": 1, "sequence_inputs": ["ids", "mask"]}
    assert tp.profile_for_batch(2, profiles, 16, **seq) == 0
    assert tp.profile_for_batch(2, profiles, 32, **seq) == 1
    assert tp.profile_for_batch(4, profiles, 32, **seq) == 3
    with pytest.raises(ValueError, match="sequence length 24"):
        tp.profile_for_batch(4, profiles, 24, **seq)


def test_uncovered_lists_sizes_and_buckets_no_profile_serves():
    profiles = tp.plan_profiles(SIGNAL, [2, 4])
    assert tp.uncovered(profiles, [2, 4]) == []
    assert tp.uncovered(profiles, [2, 4, 8]) == ["8"]
    seq_profiles = tp.plan_profiles(TOKENS, [2], sequence_inputs=["ids", "mask"], buckets=[16])
    assert tp.uncovered(seq_profiles, [2], ["ids", "mask"], 1, [16, 32]) == ["2 (sequence 32)"]


def test_describe_reads_well():
    assert tp.plan_profiles(SIGNAL, [2])[0].describe() == "profile 0: signal 2x256"
    (p,) = tp.plan_profiles(SIGNAL, [2, 8], mode="range")
    assert p.describe() == "profile 0: signal 1x256..8x256 (opt 8x256)"


# ------------------------------------------------------------------ sizing


@pytest.mark.parametrize(
    "shape, datatype, nbytes",
    [((8, 256), "FP32", 8192), ((8, 256), "FP16", 4096), ((8,), "INT64", 64), ((2, 3), "BOOL", 6),
     ((4, 4), "INT8", 16), ((), "FP32", 4), ((0, 5), "FP32", 0)],
)
def test_tensor_bytes(shape, datatype, nbytes):
    assert tp.tensor_bytes(shape, datatype) == nbytes


def test_tensor_bytes_refuses_dynamic_shapes_and_bytes_tensors():
    with pytest.raises(ValueError, match="not concrete"):
        tp.tensor_bytes((-1, 4), "FP32")
    with pytest.raises(ValueError, match="BYTES"):
        tp.tensor_bytes((4,), "BYTES")


def test_buffers_are_sized_per_profile_and_shared_at_the_maximum():
    datatypes = {"signal": "FP32", "class_id": "INT64"}
    per_profile = [
        tp.profile_buffer_bytes({"signal": (size, 256), "class_id": (size,)}, datatypes) for size in (2, 4, 8)
    ]
    assert per_profile[0] == {"signal": 2048, "class_id": 16}
    assert per_profile[2] == {"signal": 8192, "class_id": 64}
    assert tp.shared_buffer_bytes(per_profile) == {"signal": 8192, "class_id": 64}
    assert tp.shared_buffer_bytes([]) == {}


def test_footprint_arithmetic():
    io = [{"x": 100, "y": 10}, {"x": 400, "y": 40}]
    f = tp.footprint(weights=1000, activations_per_profile=[300, 900], io_per_profile=io, profile=0)
    assert (f.weights, f.activations, f.io) == (1000, 300, 110)
    assert f.reserved == 900 + 400 + 40  # largest activations + shared buffers
    assert f.resident == 1000 + 1340
    d = f.as_dict()
    assert d["per_batch"] == 0 and d["kv_cache"] == 0 and d["resident"] == 2340
    assert tp.footprint(1000, [300, 900], io, 1).activations == 900
    with pytest.raises(ValueError):
        tp.footprint(1, [1], [], 0)


def test_trt_datatype_names_map_to_v2_datatypes():
    assert tp.TRT_DTYPE_TO_DATATYPE["FLOAT"] == "FP32"
    assert tp.TRT_DTYPE_TO_DATATYPE["HALF"] == "FP16"
    assert "BF16" not in tp.TRT_DTYPE_TO_DATATYPE and "FP8" not in tp.TRT_DTYPE_TO_DATATYPE


# ------------------------------------------------------------------ ONNX Runtime TensorRT EP


def test_profile_shape_strings_repeat_inputs_for_each_profile():
    strings = tp.profile_shape_strings(tp.plan_profiles(SIGNAL, [2, 4, 8]))
    assert strings["trt_profile_min_shapes"] == "signal:2x256,signal:4x256,signal:8x256"
    assert strings["trt_profile_opt_shapes"] == strings["trt_profile_min_shapes"]
    assert strings["trt_profile_max_shapes"] == strings["trt_profile_min_shapes"]


def test_profile_shape_strings_for_several_inputs_and_a_range():
    (p,) = tp.plan_profiles(TOKENS, [2, 4], mode="range", sequence_inputs=["ids", "mask"], buckets=[32])
    strings = tp.profile_shape_strings([p])
    assert strings["trt_profile_min_shapes"] == "ids:1x1,mask:1x1,scale:1x1"
    assert strings["trt_profile_opt_shapes"] == "ids:4x32,mask:4x32,scale:4x1"


def test_profile_shape_strings_refuse_names_the_format_cannot_carry():
    bad = [tp.Profile(0, {"a:b": tp.ShapeRange((1,), (1,), (1,)), "c": tp.ShapeRange((1,), (1,), (1,))})]
    with pytest.raises(ConfigError, match="':' or ','"):
        tp.profile_shape_strings(bad)


def test_ort_trt_provider_options(tmp_path):
    options = tp.ort_trt_provider_options(model(), SIGNAL, tmp_path / "trt-cache", fp16=True)
    assert options == {
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(tmp_path / "trt-cache"),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(tmp_path / "trt-cache"),
        "trt_fp16_enable": "True",
        "trt_profile_min_shapes": "signal:2x256,signal:4x256,signal:8x256",
        "trt_profile_opt_shapes": "signal:2x256,signal:4x256,signal:8x256",
        "trt_profile_max_shapes": "signal:2x256,signal:4x256,signal:8x256",
    }
    assert all(isinstance(v, str) for v in options.values())


def test_ort_trt_provider_options_range_and_dla(tmp_path):
    ranged = tp.ort_trt_provider_options(model(), SIGNAL, tmp_path, mode="range")
    assert ranged["trt_profile_min_shapes"] == "signal:1x256"
    assert ranged["trt_profile_max_shapes"] == "signal:8x256"
    assert ranged["trt_fp16_enable"] == "False"
    dla = tp.ort_trt_provider_options(model(), SIGNAL, tmp_path, fp16=True, dla_core=1)
    assert dla["trt_dla_enable"] == "True" and dla["trt_dla_core"] == "1"
    with pytest.raises(ConfigError, match="FP16 or INT8"):
        tp.ort_trt_provider_options(model(), SIGNAL, tmp_path, dla_core=0)
    with pytest.raises(ConfigError, match="no dynamic dimensions"):
        tp.ort_trt_provider_options(model(), SIGNAL, tmp_path, fp16=True, dla_core=0, mode="range")


def test_ort_trt_provider_options_are_accepted_by_an_onnxruntime_model_toml(tmp_path):
    """The options go into model.toml as written; the config loader keeps them as strings."""
    from edge_batcher.config import load_model_config

    options = tp.ort_trt_provider_options(model(), SIGNAL, tmp_path / "cache")
    d = tmp_path / "vib"
    d.mkdir()
    table = ", ".join(f'{k} = "{v}"' for k, v in options.items())
    (d / "model.toml").write_text(
        '[[onnxruntime.execution_providers]]\nname = "TensorrtExecutionProvider"\n'
        f"options = {{ {table} }}\n"
        '[[onnxruntime.execution_providers]]\nname = "CPUExecutionProvider"\n'
    )
    config = load_model_config(d)
    assert config.onnxruntime.execution_providers[0].options == options
