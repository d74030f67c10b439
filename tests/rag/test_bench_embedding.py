"""`edge-batcher bench` on a model that prepares its inputs (text -> token ids): the phases
that drive the engine directly get prepared inputs, as the runner gives it."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_runs_every_phase_on_the_embedding_model(minilm_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "edge_batcher.cli", "bench", "--models", str(minilm_dir.parent), "--model",
         minilm_dir.name, "--duration", "0.3", "--repeat", "1", "--concurrency", "8", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["raw_ceiling_rps"] > 0 and r["minimal_batcher_rps"] > 0  # KeyError 'attention_mask' before
    assert r["in_process_closed"]["requests"] > 0
