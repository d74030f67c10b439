"""build-engine: argument handling (pure), and builds through FakeTensorRT."""

from __future__ import annotations

import io
import json
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 on JetPack 6
    import tomli as tomllib

from edge_batcher.config import load_model_config
from edge_batcher.engines import trt_build, trt_builder
from edge_batcher.engines.trt_settings import TensorRTSettings, tensorrt_settings
from edge_batcher.errors import ConfigError
from tests.fakes.fake_tensorrt import FakeTensorRT, tensorrt_installed


def build_args(*argv: str):
    return trt_build.make_parser().parse_args(list(argv))


def request(repo, *argv, source="vibration"):
    return trt_build.request_from_args(build_args(str(repo / source / "model.onnx"), *argv))


# ------------------------------------------------------------------ arguments -> BuildRequest


def test_defaults_come_from_the_source_model(repo):
    r = request(repo)
    assert r.model == "vibration-trt"
    assert r.repository == repo and r.model_dir == repo / "vibration-trt"
    assert r.plan_path == repo / "vibration-trt" / "model.plan"
    assert r.sizes == [2, 4, 8]
    assert (r.precision, r.profile_mode, r.dla_core, r.gpu_fallback) == ("fp32", "per_size", -1, True)
    assert [p.inputs["signal"].opt for p in r.profiles] == [(2, 256), (4, 256), (8, 256)]
    assert r.source is not None and r.source.name == "vibration"


def test_explicit_options(repo, tmp_path):
    r = request(repo, "--model", "vib16", "--repository", str(tmp_path / "other"), "--sizes", "1, 2,4",
                "--fp16", "--range", "--workspace-mb", "256", "--timing-cache", str(tmp_path / "t.cache"))
    assert (r.model, r.repository, r.sizes, r.precision, r.profile_mode, r.workspace_mb) == (
        "vib16", tmp_path / "other", [1, 2, 4], "fp16", "range", 256)
    (p,) = r.profiles
    assert (p.inputs["signal"].min, p.inputs["signal"].max) == ((1, 256), (4, 256))
    s = r.settings()
    assert (s.precision, s.profiles, s.workspace_mb, s.timing_cache) == (
        "fp16", "range", 256, str(tmp_path / "t.cache"))
    assert s.onnx == "../../engines/vibration/model.onnx"


def test_a_bare_onnx_file_gets_default_sizes_and_a_name_from_the_file(tmp_path, repo):
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "detector.onnx").write_bytes((repo / "vibration" / "model.onnx").read_bytes())
    r = trt_build.request_from_args(build_args(str(lone / "detector.onnx"), "--repository", str(tmp_path / "e")))
    assert (r.model, r.sizes, r.source) == ("detector-trt", [2, 4, 8], None)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sizes", "4,2"], "ascending distinct positive"),
        (["--sizes", "2,2"], "ascending distinct positive"),
        (["--sizes", "0,2"], "ascending distinct positive"),
        (["--sizes", "two"], "comma-separated integers"),
        (["--dla-core", "0"], "--dla-core needs --fp16 or --int8"),
        (["--dla-core", "0", "--fp16", "--range"], "cannot use --range"),
        (["--dla-core", "-2", "--fp16"], "DLA core number >= 0"),
        (["--no-gpu-fallback"], "only applies with --dla-core"),
        (["--int8"], "--int8 needs INT8 scales"),
        (["--calibration-cache", "x.cache"], "only applies with --int8"),
        (["--int8", "--calibration-cache", "/nonexistent/calib.cache"], "not found"),
        (["--workspace-mb", "-1"], ">= 0"),
        (["--timing-cache", "/nonexistent/dir/t.cache"], "does not exist"),
        (["--model", "bad name"], "letters, digits"),
    ],
)
def test_invalid_arguments_are_config_errors(repo, argv, message):
    with pytest.raises(ConfigError, match=message):
        request(repo, *argv)


def test_int8_needs_the_users_calibration_cache_and_says_so(repo):
    with pytest.raises(ConfigError) as info:
        request(repo, "--int8")
    assert "your own representative data" in str(info.value) and "Q/DQ" in str(info.value)


def test_int8_with_a_calibration_cache(repo, tmp_path):
    cache = tmp_path / "calib.cache"
    cache.write_bytes(b"TRT-100300-EntropyCalibration2\n")
    r = request(repo, "--int8", "--calibration-cache", str(cache))
    assert r.precision == "int8" and r.calibration_cache == cache


def test_missing_onnx_and_existing_outputs(repo, build):
    with pytest.raises(ConfigError, match="ONNX model not found"):
        trt_build.request_from_args(build_args(str(repo / "nope.onnx")))
    build()
    with pytest.raises(ConfigError, match="model.plan exists; pass --force"):
        request(repo)
    assert request(repo, "--force").force


def test_an_unplannable_input_is_refused_before_tensorrt(repo):
    # seqsum's x is [batch, seq]; without its [sequence] table the seq axis has no sizes to plan
    (repo / "seqsum" / "model.toml").write_text('backend = "onnxruntime"\n')
    with pytest.raises(ConfigError, match="'x' dimension 1 is dynamic"):
        request(repo, source="seqsum")


# ------------------------------------------------------------------ builds with the fake


def test_build_writes_plan_record_and_a_loadable_model_toml(repo, build, trt):
    model_dir = build("--fp16")
    assert (model_dir / "model.plan").is_file()
    info = json.loads((model_dir / "model.plan.json").read_text())
    assert info["tensorrt"] == trt.__version__ and info["precision"] == "fp16" and info["fake"] is True
    assert info["profiles"][1] == {"signal": {"min": [4, 256], "opt": [4, 256], "max": [4, 256]}}
    assert len(info["onnx_sha256"]) == 64
    raw = tomllib.loads((model_dir / "model.toml").read_text())
    assert raw["backend"] == "tensorrt" and raw["model_file"] == "model.plan"
    assert raw["batching"]["preferred_batch_sizes"] == [2, 4, 8]
    assert raw["batching"]["queue_capacity"] == 1024  # inherited from the source model.toml
    assert raw["labels"] == ["normal", "imbalance", "misalignment", "bearing_fault"]
    assert raw["tensorrt"]["precision"] == "fp16" and raw["tensorrt"]["onnx"] == "../vibration/model.onnx"
    config = load_model_config(model_dir)
    assert config.backend == "tensorrt"
    s = tensorrt_settings(config)
    assert isinstance(s, TensorRTSettings) and s.precision == "fp16" and s.profiles == "per_size"
    assert (model_dir / s.onnx).resolve() == (repo / "vibration" / "model.onnx").resolve()


def test_sequence_settings_are_carried_over(repo, build):
    config = load_model_config(build(source="seqsum"))
    assert config.sequence is not None and config.sequence.buckets == [8, 16, 32]
    assert config.model_file == "model.plan"


def test_timing_cache_is_loaded_and_saved(repo, build, tmp_path):
    cache = tmp_path / "timing.cache"
    build("--timing-cache", str(cache), model="a")
    first = json.loads(cache.read_bytes())
    assert len(first) == 3  # one entry per profile
    build("--timing-cache", str(cache), "--sizes", "2,4,8,16", model="b")
    second = json.loads(cache.read_bytes())
    assert set(first) < set(second) and len(second) == 4  # reused the three, added one


def test_progress_is_printed_by_phase(repo, trt, cuda, capsys):
    rc = trt_build.build_engine_main([str(repo / "vibration" / "model.onnx")], trt, cuda)
    assert rc == 0
    out = capsys.readouterr().out
    assert "building vibration-trt: 3 profile(s) (profile 0: signal 2x256; profile 1: signal 4x256; " in out
    assert "Building engine (3 steps)" in out and "  Building optimization profiles (3 steps)" in out
    assert "Building engine: done in" in out
    assert f"wrote {repo / 'vibration-trt' / 'model.plan'}" in out


def test_on_a_terminal_the_build_phases_are_one_redrawn_bar(repo, trt, cuda):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal, lines = Terminal(), []
    trt_build.build_engine(request(repo), trt, cuda, write=lines.append, bar=terminal)
    drawn = terminal.getvalue()
    assert "\n" not in drawn  # redrawn in place, never a new line
    for n, phase in enumerate(["Parsing network", "Building optimization profiles", "Serializing engine"], 1):
        assert f"] {n}/3 Building engine: {phase} (" in drawn
    assert drawn.endswith("\r\033[K")  # the bar is cleared when the build is done
    assert not any("Parsing network" in line for line in lines)  # no phase lines beside the bar
    assert any(line.startswith("Building engine: done in") for line in lines)


def test_quiet_build_prints_no_phases(repo, trt, cuda, capsys):
    assert trt_build.build_engine_main([str(repo / "vibration" / "model.onnx"), "--quiet"], trt, cuda) == 0
    assert "Building engine" not in capsys.readouterr().out


def test_dla_build_sets_the_builder_up_for_dla(repo, build, cuda, trt):
    agx = FakeTensorRT(cuda, version=trt.__version__, num_dla_cores=2)
    model_dir = build("--fp16", "--dla-core", "1", trt_module=agx)
    plan = json.loads((model_dir / "model.plan").read_text())
    assert plan["dla_core"] == 1 and plan["precision"] == "fp16"
    assert tomllib.loads((model_dir / "model.toml").read_text())["tensorrt"]["dla_core"] == 1


def test_a_tensorrt_build_failure_exits_1_with_tensorrts_reason(repo, trt, cuda, capsys):
    # An Orin Nano has no DLA; without GPU fallback TensorRT refuses.
    rc = trt_build.build_engine_main(
        [str(repo / "vibration" / "model.onnx"), "--fp16", "--dla-core", "0", "--no-gpu-fallback", "--quiet"],
        trt, cuda)
    assert rc == 1
    err = capsys.readouterr().err
    assert "could not build vibration-trt" in err and "GPU fallback is off" in err
    assert not (repo / "vibration-trt").exists()


def test_bad_arguments_exit_2(repo, trt, cuda, capsys):
    assert trt_build.build_engine_main([str(repo / "vibration" / "model.onnx"), "--dla-core", "0"], trt, cuda) == 2
    assert "--dla-core needs --fp16" in capsys.readouterr().err


def test_without_tensorrt_the_cli_says_it_is_needed_and_exits_2(repo, capsys):
    if tensorrt_installed():
        pytest.skip("tensorrt is installed here")
    assert trt_build.build_engine_main([str(repo / "vibration" / "model.onnx")]) == 2
    err = capsys.readouterr().err
    assert "TensorRT is needed" in err and "JetPack" in err and "pip install 'edge-batcher[tensorrt]'" in err


def test_tools_build_engine_script_runs(repo):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "tools" / "build_engine.py"
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--dla-core" in proc.stdout and "--timing-cache" in proc.stdout
    if not tensorrt_installed():
        proc = subprocess.run([sys.executable, str(script), str(repo / "vibration" / "model.onnx")],
                              capture_output=True, text=True)
        assert proc.returncode == 2 and "TensorRT is needed" in proc.stderr


def test_model_toml_values_are_valid_toml():
    assert trt_builder._toml_value('say "hi"\\') == '"say \\"hi\\"\\\\"'
    assert tomllib.loads(f"x = {trt_builder._toml_value(['a', 1, 2.5, True])}")["x"] == ["a", 1, 2.5, True]


# ------------------------------------------------------------------ TensorRT 10.x and 11.x


def qdq_model(directory):
    """A small explicitly quantized model (Q/DQ on the input, then a MatMul), dynamic batch."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32), "w")
    scale = numpy_helper.from_array(np.array(0.05, np.float32), "scale")
    zero = numpy_helper.from_array(np.array(0, np.int8), "zero")
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["signal", "scale", "zero"], ["q"]),
         helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["dq"]),
         helper.make_node("MatMul", ["dq", "w"], ["logits"])],
        "qdq",
        [helper.make_tensor_value_info("signal", TensorProto.FLOAT, ["N", 256])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 4])],
        [w, scale, zero],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    directory.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(directory / "model.onnx"))
    return directory / "model.onnx"


def plan_json(model_dir):
    return json.loads((model_dir / "model.plan").read_bytes())


def test_fp16_on_tensorrt_10_sets_the_builder_flag(build, trt10):
    model_dir = build("--fp16", trt_module=trt10)
    plan, record = plan_json(model_dir), json.loads((model_dir / "model.plan.json").read_text())
    assert (plan["precision"], plan["typing"]) == ("fp16", "weak")
    assert record["precision_from"] == "builder flags" and record["onnx_built"].endswith("vibration/model.onnx")
    assert not (model_dir / trt_build.FP16_ONNX_FILE).exists()


def test_fp16_on_tensorrt_11_converts_the_model_and_builds_it_strongly_typed(repo, build, trt11, capsys):
    model_dir = build("--fp16", trt_module=trt11)
    plan, record = plan_json(model_dir), json.loads((model_dir / "model.plan.json").read_text())
    assert (plan["precision"], plan["typing"]) == ("fp16", "strong")
    assert record["precision_from"] == "FP16 conversion"
    assert record["onnx_built"] == str((model_dir / trt_build.FP16_ONNX_FILE).resolve())
    assert "strongly typed networks only" in record["tensorrt_capabilities"]
    # The plan's I/O stays FP32 (the conversion casts at the edges), so clients see no change.
    assert {t["name"]: t["dtype"] for t in plan["io"]}["signal"] == "FLOAT"
    # model.toml still says fp16 and names the original model: a rebuild converts again.
    s = tensorrt_settings(load_model_config(model_dir))
    assert (s.precision, s.onnx) == ("fp16", "../vibration/model.onnx")


def test_calibration_cache_on_tensorrt_11_exits_2_and_names_the_way_forward(repo, trt11, cuda, tmp_path, capsys):
    cache = tmp_path / "calib.cache"
    cache.write_bytes(b"TRT-100300-EntropyCalibration2\n")
    rc = trt_build.build_engine_main([str(repo / "vibration" / "model.onnx"), "--int8", "--calibration-cache",
                                      str(cache), "--quiet"], trt11, cuda)
    assert rc == 2
    err = capsys.readouterr().err
    assert "TensorRT 11.4.0 has no INT8 calibration" in err and "modelopt.onnx.quantization" in err
    assert "build that model with --int8" in err
    assert not (repo / "vibration-trt").exists()


def test_int8_without_qdq_on_tensorrt_11_is_refused_even_past_the_argument_check(repo, trt11, cuda):
    request = trt_build.request_from_args(build_args(str(repo / "vibration" / "model.onnx"), "--fp16"))
    request.precision = "int8"  # as a caller that skipped request_from_args' own check would
    with pytest.raises(ConfigError, match="strongly typed networks only.*no(ne| Q/DQ).*modelopt"):
        trt_build.build_engine(request, trt11, cuda, write=lambda line: None, progress=False)


@pytest.mark.parametrize("version, typing", [("10.3.0", "weak"), ("11.4.0", "strong")])
def test_a_qdq_model_builds_int8_on_both_generations(tmp_path, cuda, version, typing):
    onnx_path = qdq_model(tmp_path / "src" / "qdq")
    trt = FakeTensorRT(cuda, version=version)
    request = trt_build.request_from_args(build_args(str(onnx_path), "--int8", "--repository", str(tmp_path / "out")))
    assert request.has_qdq and request.calibration_cache is None
    trt_build.build_engine(request, trt, cuda, write=lambda line: None, progress=False)
    plan = plan_json(request.model_dir)
    assert (plan["precision"], plan["typing"]) == ("int8", typing)
    record = json.loads(request.plan_path.with_name("model.plan.json").read_text())
    assert record["precision_from"] == ("builder flags" if typing == "weak" else "Q/DQ nodes")


def test_an_fp16_build_that_cannot_be_converted_says_how_to_convert_it(tmp_path, trt11, cuda, capsys):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="nearest")], "resize",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor("scales", TensorProto.FLOAT, [4], [1, 1, 2, 2])],
    )
    (tmp_path / "up").mkdir()
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
              str(tmp_path / "up" / "model.onnx"))
    rc = trt_build.build_engine_main([str(tmp_path / "up" / "model.onnx"), "--fp16", "--repository",
                                      str(tmp_path / "out"), "--quiet"], trt11, cuda)
    assert rc == 2
    err = capsys.readouterr().err
    assert "cannot convert" in err and "Resize" in err and "modelopt.onnx.autocast" in err
    assert not (tmp_path / "out").exists()


def test_a_plan_that_does_not_fit_on_the_disk_leaves_the_old_one_and_no_scrap(small_disk):
    """A build writing its plan on a full device: the write fails with the file system's error,
    the plan there before stays whole, and the part written is removed."""
    from edge_batcher.engines.trt_builder import _write_atomic
    from edge_batcher.errors import StorageFull

    plan = small_disk / "model.plan"
    plan.write_bytes(b"old plan")
    with pytest.raises(StorageFull) as failed:
        _write_atomic(plan, b"\0" * (2 << 20))
    assert failed.value.status == 507
    assert f"could not write {plan}: No space left on device" in failed.value.message
    assert plan.read_bytes() == b"old plan" and [p.name for p in small_disk.iterdir()] == ["model.plan"]


def test_build_engine_on_a_full_disk_exits_1_saying_so(repo, trt10, cuda, small_disk, capsys):
    """The repository to write the engine into is full: one line naming the file and the error,
    exit 1, nothing of the build left there (before: a traceback, and the partial plan)."""
    import os

    free = os.statvfs(small_disk)
    (small_disk / "filler").write_bytes(b"\0" * (free.f_bavail * free.f_frsize - 16 * 1024))  # a few KiB left
    rc = trt_build.build_engine_main([str(repo / "vibration" / "model.onnx"), "--repository", str(small_disk),
                                      "--quiet"], trt10, cuda)
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "could not write" in err and "No space left on device" in err and "Traceback" not in err
    assert [p.name for p in small_disk.iterdir()] == ["filler"]  # no partial plan, no empty model directory
