"""The model builders in tools/ announce their steps: plain numbered lines on stderr in a log or CI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"


@pytest.mark.parametrize(("script", "name", "argv"), [
    ("build_encoder_model.py", "encoder", ["--layers", "1"]),
    ("build_tiny_decoder.py", "tinylm", ["--layers", "1", "--max-positions", "64"]),
])
def test_a_builder_run_in_a_log_prints_every_step_as_one_numbered_line(tmp_path, script, name, argv):
    proc = subprocess.run([sys.executable, str(TOOLS / script), "--out", str(tmp_path), *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    steps = re.findall(rf"^{name} (\d+)/(\d+): (.+) \(\d+ s(?:, ~\d+ s left)?\)$", proc.stderr, re.M)
    total = int(steps[0][1])
    assert total >= 3 and [int(n) for n, _, _ in steps] == list(range(1, total + 1))
    assert "\r" not in proc.stderr and "\033[" not in proc.stderr  # no bar drawn into a log
    assert (tmp_path / name / "model.onnx").is_file()
