"""A real MLServer (Seldon) as an offload peer, for the interop tests.

MLServer and its ~400 MB of dependencies (FastAPI, gRPC, pandas, ...) live in their own
virtual environment, `.venv-mlserver`, which `make test` creates from the `mlserver-peer`
extra in pyproject.toml; outside it the tests that need it skip. The peer serves the demo
vibration model through tests/support/mlserver/runtime.py on free loopback ports.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

from tests.support.models import ROOT
from tests.support.ports import free_port
from tests.support.processes import terminate

MLSERVER = ROOT / ".venv-mlserver" / "bin" / "mlserver"


class MLServerPeer:
    def __init__(self, home: Path, model_repo: Path, model: str = "vibration", *,
                 model_settings: dict | None = None, parallel_workers: int = 0):
        """`model_settings`: more keys for the model's model-settings.json (e.g. adaptive
        batching's max_batch_size and max_batch_time); `parallel_workers`: MLServer's inference
        processes (0: in its own process; 1 is MLServer's default)."""
        self.home = home
        folder = home / model
        folder.mkdir(parents=True)
        shutil.copy(model_repo / model / "model.onnx", folder / "model.onnx")
        shutil.copy(Path(__file__).parent / "mlserver" / "runtime.py", home / "runtime.py")
        (folder / "model-settings.json").write_text(json.dumps(
            {"name": model, "implementation": "runtime.OnnxModel", "parameters": {"uri": str(folder / "model.onnx")},
             **(model_settings or {})}
        ))
        self.port = free_port()
        (home / "settings.json").write_text(json.dumps({
            "host": "127.0.0.1", "http_port": self.port, "grpc_port": free_port(),
            "metrics_port": free_port(), "parallel_workers": parallel_workers,
        }))
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = home / "mlserver.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120.0) -> MLServerPeer:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([str(MLSERVER), "start", str(self.home)], cwd=self.home,
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlserver exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/v2/models/vibration/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"mlserver not ready in {timeout_s} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        terminate(self.proc, 20)
