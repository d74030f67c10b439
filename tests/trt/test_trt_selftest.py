"""tools/jetson_selftest.py: its pure parts, and a whole run against the fakes (plumbing only)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.fakes.fake_cuda_bindings import fake_cuda_module
from tests.fakes.fake_tensorrt import FakeCuda, FakeTensorRT, tensorrt_installed
from tests.trt.conftest import TRT10, TRT11

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "jetson_selftest.py"


@pytest.fixture(scope="module")
def st():
    spec = importlib.util.spec_from_file_location("jetson_selftest", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


ORIN_MEMINFO = """\
MemTotal:        7451728 kB
MemFree:         3202220 kB
MemAvailable:    5384092 kB
SwapFree:        3725852 kB
HugePages_Total:       0
NvMapMemFree:     102400 kB
NvMapMemUsed:     524288 kB
"""


def test_parse_meminfo_converts_kb_and_keeps_counts(st):
    m = st.parse_meminfo(ORIN_MEMINFO + "garbage line\nEmpty:\n")
    assert m["MemTotal"] == 7451728 * 1024
    assert m["HugePages_Total"] == 0
    assert st.nvmap_used(m) == 524288 * 1024
    assert st.nvmap_used(st.parse_meminfo("MemTotal: 1 kB\n")) is None
    assert "Empty" not in m


@pytest.mark.parametrize(
    "text, expected",
    [
        ("# R36 (release), REVISION: 4.0, GCID: 37537400, BOARD: generic, EABI: aarch64, DATE: Fri Sep 13\n",
         "L4T R36.4.0 (JetPack 6.1/6.2)"),
        ("# R35 (release), REVISION: 5.0, GCID: 35550185, BOARD: t186ref\n", "L4T R35.5.0 (JetPack 5.1)"),
        ("# R38 (release), REVISION: 2.0, GCID: 41844464, BOARD: generic, EABI: aarch64\n",
         "L4T R38.2.0 (JetPack 7.0/7.1)"),
        ("# R39 (release), REVISION: 0.0, GCID: 1, BOARD: generic, EABI: aarch64\n", "L4T R39.0.0 (JetPack 7.2)"),
        ("# R99 (release), REVISION: 1.0\n", "L4T R99.1.0"),
        ("", ""),
        ("not a release file", ""),
    ],
)
def test_parse_l4t_release(st, text, expected):
    assert st.parse_l4t_release(text) == expected


def test_tolerances_widen_with_reduced_precision(st):
    fp32, fp16, int8 = (st.tolerance(p) for p in ("fp32", "fp16", "int8"))
    assert fp32[0] < fp16[0] < int8[0] and fp32[2] == 0.0 < fp16[2]


def test_compare_outputs(st):
    ref = {"p": np.array([[0.5, 0.5], [0.9, 0.1]], np.float32), "id": np.array([0, 0], np.int64)}
    same = st.compare_outputs(ref, {k: v.copy() for k, v in ref.items()}, "fp32")
    assert all(c.ok for c in same) and same[0].max_abs == 0.0
    near = {"p": ref["p"] + np.float32(5e-3), "id": ref["id"]}
    assert not st.compare_outputs(ref, near, "fp32")[0].ok
    assert st.compare_outputs(ref, near, "fp16")[0].ok
    flipped = {"p": ref["p"], "id": np.array([0, 1], np.int64)}
    (_, ids) = st.compare_outputs(ref, flipped, "fp16")
    assert not ids.ok and ids.mismatched == 1  # 1 of 2 is more than the 2% fp16 allows
    (shape, missing) = st.compare_outputs(ref, {"p": ref["p"][:1]}, "fp32")
    assert not shape.ok and "shape" in shape.note and not missing.ok and missing.note == "missing"
    nan = {"p": np.full((2, 2), np.nan, np.float32), "id": ref["id"]}
    assert not st.compare_outputs(ref, nan, "fp16")[0].ok


def test_format_report_is_markdown_with_every_section(st):
    c = st.Comparison("class_probs", 1e-5, 2e-5, 0, 32, True, "atol 0.0001, rtol 0.001")
    report = st.Report(
        versions={"TensorRT": "10.3.0", "jetson": "L4T R36.4.0 (JetPack 6)"},
        build={"precision": "fp16"},
        sizes=[st.SizeResult(8, [c], ms_per_batch=0.5, ort_ms_per_batch=2.0)],
        memory={"source": "NvMapMemUsed (/proc/meminfo)", "weights": 300 << 10, "reserved": 100 << 10,
                "estimate_total": 400 << 10, "measured": 800 << 10},
    )
    text = st.format_report(report)
    assert text.startswith("## edge-batcher TensorRT self-test")
    assert "**Result: PASS**" in text and "FAKE" not in text
    assert "| TensorRT | 10.3.0 |" in text
    assert "| 8 | class_probs | 1e-05 | 2e-05 | 0/32 |" in text
    assert "| 8 | 0.500 | 16000 | 2.000 | 4.0x |" in text
    assert "| measured / estimate | 2.00 | |" in text
    failed = st.Report(versions={}, build={}, error="RuntimeError: boom", fake=True)
    text = st.format_report(failed)
    assert "**Result: FAIL**: RuntimeError: boom" in text and "FAKE TensorRT" in text


@pytest.mark.parametrize("binding", ["pycuda", "cuda-python"])
@pytest.mark.parametrize("version, precision_from", [(TRT10, "builder flags"), (TRT11, "FP16 conversion")])
def test_a_whole_run_against_the_fakes(st, model_repo, tmp_path, capsys, version, precision_from, binding):
    cuda = FakeCuda()
    out = tmp_path / "report.md"
    rc = st.main(["--onnx", str(model_repo / "vibration" / "model.onnx"), "--fp16", "--iterations", "3",
                  "--workdir", str(tmp_path / "work"), "--out", str(out), "--root", str(tmp_path / "no-jetson")],
                 FakeTensorRT(cuda, version=version), fake_cuda_module(binding, cuda))
    assert rc == 0
    text = out.read_text()
    assert text in capsys.readouterr().out  # printed too, for pasting
    assert "**Result: PASS**" in text and "FAKE TensorRT" in text
    assert f"| TensorRT | TensorRT {version}: " in text and f"| CUDA binding | {binding} (fake) |" in text
    assert f"| precision from | {precision_from} |" in text
    for size in (1, 2, 4, 8):
        assert f"| {size} | class_probs |" in text
    assert "measured (cuMemGetInfo (total - free))" in text
    assert (tmp_path / "work" / "selftest" / "model.plan").is_file()


def thor_root(tmp_path: Path) -> Path:
    root = tmp_path / "thor"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "nv_tegra_release").write_text("# R38 (release), REVISION: 2.0, GCID: 1, BOARD: generic\n")
    (root / "proc" / "device-tree").mkdir(parents=True)
    (root / "proc" / "device-tree" / "model").write_bytes(b"NVIDIA Jetson AGX Thor Developer Kit\x00")
    return root


def test_dla_on_jetson_thor_is_refused_up_front(st, model_repo, tmp_path, capsys):
    cuda = FakeCuda()
    rc = st.main(["--onnx", str(model_repo / "vibration" / "model.onnx"), "--fp16", "--dla-core", "0",
                  "--root", str(thor_root(tmp_path))], FakeTensorRT(cuda), cuda)
    assert rc == 2
    assert "Jetson AGX Thor (T5000) has no DLA" in capsys.readouterr().err


def test_versions_name_jetpack_7_on_thor(st, tmp_path):
    from edge_batcher.engines.cuda_api import cuda_api_from

    cuda = FakeCuda()
    api = cuda_api_from(cuda)
    api.init()
    versions = st.read_versions(FakeTensorRT(cuda), api, thor_root(tmp_path))
    assert versions["jetson"] == ("L4T R38.2.0, JetPack 7.0/7.1 (CUDA 13, TensorRT 10.13-10.16, Python 3.12), "
                                  "Jetson AGX Thor (T5000)")
    assert versions["CUDA driver"] == "12.6" and versions["GPU"].startswith("FakeCuda device")


def test_a_failing_run_reports_instead_of_crashing(st, model_repo, tmp_path, capsys):
    cuda = FakeCuda(total_memory=1000)  # not even the weights fit
    rc = st.main(["--onnx", str(model_repo / "vibration" / "model.onnx"), "--iterations", "1"],
                 FakeTensorRT(cuda), cuda)
    assert rc == 1
    assert "**Result: FAIL**" in capsys.readouterr().out


def test_without_tensorrt_it_exits_2(st, capsys):
    if tensorrt_installed():
        pytest.skip("tensorrt is installed here")
    assert st.main([]) == 2
    assert "TensorRT and a CUDA binding (cuda-python or pycuda) are needed" in capsys.readouterr().err


def test_missing_demo_model_and_dla_without_fp16_exit_2(st, tmp_path, capsys):
    cuda = FakeCuda()
    assert st.main(["--onnx", str(tmp_path / "none.onnx")], FakeTensorRT(cuda), cuda) == 2
    assert "build_demo_models.py" in capsys.readouterr().err
    assert st.main(["--onnx", str(SCRIPT), "--dla-core", "0"], FakeTensorRT(cuda), cuda) == 2
    assert "--dla-core needs --fp16" in capsys.readouterr().err


def test_soak_adds_the_memory_under_traffic_section(st, model_repo, tmp_path, capsys):
    """--soak: a real daemon on the repository after the TensorRT checks (here the fakes), its
    figures in the report, read by the process meter (on a machine with a GPU "auto" would read the
    whole GPU, which the suite's other workers share)."""
    import shutil

    repo = tmp_path / "engines"
    shutil.copytree(model_repo / "vibration", repo / "vibration")
    cuda = FakeCuda()
    out = tmp_path / "report.md"
    rc = st.main(["--onnx", str(model_repo / "vibration" / "model.onnx"), "--iterations", "2",
                  "--root", str(tmp_path / "no-jetson"), "--out", str(out),
                  "--soak", "2", "--soak-clients", "4", "--soak-meter", "process", "--models", str(repo)],
                 FakeTensorRT(cuda), fake_cuda_module("cuda-python", cuda))
    text = out.read_text()
    assert rc == 0, text
    assert "## Memory under traffic (tools/memory_soak.py)" in text
    assert "meter process" in text and "result: ok" in text and "answers by status         200:" in text
