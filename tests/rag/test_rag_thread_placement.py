"""Native thread pools started while loading the embedding model keep every CPU, even when
the daemon's event-loop thread is pinned to one ([server] loop_cpu): the tokenizers library
starts its pool on its first batch, so the engine does that during load (rag/embed.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from edge_batcher.cpu_affinity import PROCESS_CPUS

CHILD = r"""
import json, os, sys, threading
from pathlib import Path
from edge_batcher.cpu_affinity import PROCESS_CPUS, choose, pin_this_thread
from edge_batcher.metrics import Metrics
from edge_batcher.runtime import discover_models, load_runner

def masks():
    out = {}
    for task in Path("/proc/self/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(task.name)] = line.split()[1]
    return out

pin_this_thread(choose("auto"))  # as the daemon does before loading anything
before = set(masks())
(mc,) = discover_models(Path(sys.argv[1]), ["minilm"])
runner = load_runner(mc, Metrics(), False)
runner.engines[0].prepare({"text": __import__("numpy").array([b"a question", b"another"], dtype=object)})
python_threads = {t.native_id for t in threading.enumerate()}
started = {tid: m for tid, m in masks().items() if tid not in before and tid not in python_threads}
print(json.dumps({"pinned": sorted(os.sched_getaffinity(0)), "native": started}))
"""


@pytest.mark.skipif(PROCESS_CPUS is None or len(PROCESS_CPUS) < 2, reason="needs Linux thread affinity and two CPUs")
def test_the_tokenizer_pool_started_at_load_is_not_confined_to_the_loop_cpu(minilm_dir):
    proc = subprocess.run([sys.executable, "-c", CHILD, str(minilm_dir.parent)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(seen["pinned"]) == 1  # the calling thread stayed pinned
    assert seen["native"], "expected the native threads of ONNX Runtime or tokenizers to have started"
    assert all(mask != str(seen["pinned"][0]) for mask in seen["native"].values()), seen
