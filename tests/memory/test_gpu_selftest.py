"""tools/gpu_selftest.py here, without a GPU: its degraded mode says so and exits 0 (2 when a GPU
is required); its parsers read real nvidia-smi and tegrastats lines; a failed check exits 1."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gpu_selftest.py"

spec = importlib.util.spec_from_file_location("gpu_selftest", TOOL)
selftest = importlib.util.module_from_spec(spec)
sys.modules["gpu_selftest"] = selftest  # its dataclasses look their module up there
spec.loader.exec_module(selftest)
MiB = 1 << 20

no_gpu = pytest.mark.skipif(selftest.gpu_present()[0], reason="a GPU is here: run the self-test itself on it")


@no_gpu
def test_without_a_gpu_it_says_so_and_runs_the_cpu_probe(model_repo):
    proc = subprocess.run([sys.executable, str(TOOL), "--models", str(model_repo)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "NO GPU: CUDAExecutionProvider is not in this onnxruntime build" in proc.stdout
    assert "skipped: no GPU" in proc.stdout
    assert "probes   cpu" in proc.stdout and "MiB free of" in proc.stdout
    required = subprocess.run([sys.executable, str(TOOL), "--models", str(model_repo), "--require-gpu"],
                              capture_output=True, text=True, timeout=120)
    assert required.returncode == 2


def test_a_failed_check_exits_non_zero(model_repo, monkeypatch, capsys):
    monkeypatch.setattr(selftest, "gpu_present", lambda: (False, "test"))
    monkeypatch.setattr(selftest, "check_probes",
                        lambda on_gpu: [selftest.Check("probes", "cuda vs nvidia-smi", False, "free 10 vs 500 MiB")])
    assert selftest.main(["--models", str(model_repo)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "1 check(s) failed" in out


def test_nvidia_smi_and_tegrastats_lines_are_read():
    assert selftest.parse_nvidia_smi("81559, 887, 80672\n") == [
        {"total": 81559 * MiB, "used": 887 * MiB, "free": 80672 * MiB}]
    assert selftest.parse_nvidia_smi("[N/A], [N/A], [N/A]\n") == []  # NVML memory not supported
    line = ("11-26-2026 07:00:00 RAM 2391/7620MB (lfb 2x4MB) SWAP 0/3810MB (cached 0MB) "
            "CPU [3%@729,1%@729] GR3D_FREQ 0%")
    assert selftest.parse_tegrastats(line) == {"used": 2391 * MiB, "total": 7620 * MiB}
    assert selftest.parse_tegrastats("no memory here") is None
