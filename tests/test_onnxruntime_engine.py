"""The ONNX Runtime backend's execution-provider chain: a provider the installed build lacks is
skipped with a warning, and a CPU build shadowing an installed GPU build (the Jetson pip trap)
is named in that warning. The missing provider is one that no onnxruntime build has, so the
tests hold on a GPU machine with onnxruntime-gpu too."""

from __future__ import annotations

import logging
import shutil
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from edge_batcher.config import load_model_config
from edge_batcher.engines import onnxruntime as ort_backend
from edge_batcher.engines.onnxruntime import OnnxRuntimeEngine, shadowed_build
from edge_batcher.errors import ConfigError

# No onnxruntime build registers this provider (the real ones: onnxruntime.get_all_providers()).
MISSING_PROVIDER = "NoSuchTestExecutionProvider"


def model_asking_for_missing_provider(model_repo: Path, tmp_path: Path) -> Path:
    model = tmp_path / "vibration"
    shutil.copytree(model_repo / "vibration", model)
    toml = (model / "model.toml").read_text()
    toml = toml.replace('execution_providers = ["CPUExecutionProvider"]',
                        f'execution_providers = ["{MISSING_PROVIDER}", "CPUExecutionProvider"]')
    assert MISSING_PROVIDER in toml
    (model / "model.toml").write_text(toml)
    return model


class FakeDistribution:
    def __init__(self, where: Path):
        self.where = where

    def locate_file(self, path):
        return self.where / path


def pretend_installed(monkeypatch, names: dict[str, Path]) -> None:
    real = metadata.distribution

    def distribution(name):
        if name in names:
            return FakeDistribution(names[name])
        if name.startswith("onnxruntime"):
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "distribution", distribution)


def test_the_missing_provider_is_in_no_build():
    import onnxruntime

    assert MISSING_PROVIDER not in onnxruntime.get_all_providers()


def test_only_one_build_here_shadows_nothing():
    if shadowed_build() is not None:
        pytest.skip(f"{shadowed_build()[0]} is installed beside the CPU build on this machine: the case under test")
    assert shadowed_build() is None


def test_a_gpu_build_beside_the_cpu_build_is_found(monkeypatch, tmp_path):
    pretend_installed(monkeypatch, {"onnxruntime": tmp_path / "venv", "onnxruntime-gpu": tmp_path / "system"})
    assert shadowed_build() == ("onnxruntime-gpu", tmp_path / "system")
    pretend_installed(monkeypatch, {"onnxruntime-gpu": tmp_path / "system"})  # the GPU build alone is fine
    assert shadowed_build() is None


def test_a_missing_provider_is_skipped_and_the_model_runs_on_cpu(model_repo, tmp_path, caplog):
    engine = OnnxRuntimeEngine(load_model_config(model_asking_for_missing_provider(model_repo, tmp_path)))
    with caplog.at_level(logging.WARNING, logger=ort_backend.__name__):
        engine.load()
    assert engine.providers == ["CPUExecutionProvider"]
    assert f"execution provider {MISSING_PROVIDER} is not in this onnxruntime build" in caplog.text
    if shadowed_build() is None:
        assert "pip uninstall onnxruntime" not in caplog.text  # nothing is shadowed here
    out = engine.infer({engine.inputs[0].name: np.zeros((2, 256), np.float32)})
    assert all(v.shape[0] == 2 for v in out.values())


def test_the_warning_names_a_shadowed_gpu_build_and_the_fix(model_repo, tmp_path, monkeypatch, caplog):
    pretend_installed(monkeypatch, {"onnxruntime": tmp_path / "venv",
                                    "onnxruntime-gpu": Path("/usr/lib/python3/dist-packages")})
    engine = OnnxRuntimeEngine(load_model_config(model_asking_for_missing_provider(model_repo, tmp_path)))
    with caplog.at_level(logging.WARNING, logger=ort_backend.__name__):
        engine.load()
    assert "onnxruntime-gpu is installed too (in /usr/lib/python3/dist-packages)" in caplog.text
    assert "pip uninstall onnxruntime" in caplog.text


def test_a_model_file_cut_short_is_named_in_the_load_error(model_repo, tmp_path):
    """ONNX Runtime says only "Protobuf parsing failed"; the error adds what is wrong with the file."""
    model = tmp_path / "vibration"
    shutil.copytree(model_repo / "vibration", model)
    data = (model / "model.onnx").read_bytes()
    (model / "model.onnx").write_bytes(data[:len(data) // 2])
    engine = OnnxRuntimeEngine(load_model_config(model))
    with pytest.raises(ConfigError) as raised:
        engine.load()
    assert "onnxruntime cannot load" in str(raised.value)
    assert "(the file is not a whole ONNX model: the graph at byte " in str(raised.value)
    assert "a copy cut short?" in str(raised.value)


@pytest.mark.parametrize("setting, expected", [("", "1"), ("allow_spinning = false\n", "0"),
                                               ("allow_spinning = true\n", "1")])
def test_allow_spinning_reaches_both_thread_pools(model_repo, tmp_path, setting, expected):
    model = tmp_path / "vibration"
    shutil.copytree(model_repo / "vibration", model)
    toml = (model / "model.toml").read_text()
    (model / "model.toml").write_text(toml.replace("[onnxruntime]\n", "[onnxruntime]\n" + setting, 1))
    engine = OnnxRuntimeEngine(load_model_config(model))
    engine.load()
    try:
        options = engine.session.get_session_options()
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == expected
        assert options.get_session_config_entry("session.inter_op.allow_spinning") == expected
        out = engine.infer({"signal": np.zeros((2, 256), np.float32)})
        assert next(iter(out.values())).shape[0] == 2
    finally:
        engine.close()


def test_the_first_model_s_measured_memory_leaves_out_onnxruntime_s_own_setup(model_repo):
    """In a fresh process (ONNX Runtime's one-time setup happens once per process): the first
    model loaded under the cpu probe measures what it holds, not ONNX Runtime's environment
    (its first session's +10.5 MiB, set up before the load: set_up_runtime). The vibration model
    loaded first measured 11.5 MiB before, ~2 MiB now (1.4 MiB after another model)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from edge_batcher.config import MemorySettings, load_model_config\n"
        "from edge_batcher.memory.wiring import build_budget\n"
        "from edge_batcher.metrics import Metrics\n"
        "from edge_batcher.runtime import load_runner\n"
        "budget = build_budget(MemorySettings(probe='cpu'))\n"
        "runner = load_runner(load_model_config(Path(sys.argv[1])), Metrics(), warmup=False, budget=budget)\n"
        "print(runner.resident_bytes)\n"
    )
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", script, str(model_repo / "vibration")], capture_output=True,
                          text=True, timeout=120, cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert 0 < int(proc.stdout.split()[-1]) < 6 * (1 << 20), proc.stdout
