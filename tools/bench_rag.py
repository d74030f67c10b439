#!/usr/bin/env python3
"""RAG questions through a real daemon: latency, the daemon's CPU per question and where the time
goes, optionally beside another checkout's daemon in the same rounds (docs/rag.md).

Starts `edge-batcher serve` on a private Unix socket with the `rag` model of --model-repo (its
model.toml, the index in --index) and its embedding model, and asks it the questions of
--questions one after another, --rounds times; with --baseline DIR (another checkout, e.g. `git
worktree add /tmp/base HEAD~3`) that checkout's daemon is asked the same questions in the same
rounds, the order alternating, so the two are compared on one machine state. Prints per daemon
the p50, p90 and mean latency, the daemon's CPU time per question, the rag model's stages per
question (embed, search, extract, generate) and, with a baseline, how many answers are the same.

Usage: python tools/bench_rag.py [--model-repo engines] [--index state/index]
           [--questions docs/corpus/questions-technician.json] [--count 40] [--rounds 3]
           [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_compare import Server, start_daemon  # noqa: E402

from edge_batcher.client import Client  # noqa: E402


def rag_repository(home: Path, model_repo: Path, index: Path) -> Path:
    """A repository in `home` with model_repo's rag model (reading `index`) and its embedding model."""
    repo = home / "models"
    (repo / "rag").mkdir(parents=True)
    toml = (model_repo / "rag" / "model.toml").read_text()
    (repo / "rag" / "model.toml").write_text(toml.replace('index_dir = ""', f'index_dir = "{index}"', 1))
    (repo / "minilm").symlink_to(model_repo / "minilm")
    return repo


def ask(server: Server, questions: list[str]) -> tuple[list[float], float, dict, list[str]]:
    """(latencies, daemon CPU seconds, the rag stats' change, answers) for one pass."""
    with Client(server.address, timeout=120) as client:
        before = client.stats("rag")["model_stats"][0]
        cpu0 = server.cpu()[0]
        latencies, answers = [], []
        for question in questions:
            t0 = time.perf_counter()
            out = client.infer("rag", {"question": np.array([question.encode()], dtype=object)})
            latencies.append(time.perf_counter() - t0)
            answers.append(out["answer"][0].decode())
        cpu = server.cpu()[0] - cpu0
        after = client.stats("rag")["model_stats"][0]
    stages = {k: after["stage_ns"][k] - before["stage_ns"][k] for k in after["stage_ns"]}
    return latencies, cpu, stages, answers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-repo", type=Path, default=ROOT / "engines", help="holds minilm and rag (make models)")
    ap.add_argument("--index", type=Path, default=ROOT / "state" / "index")
    ap.add_argument("--questions", type=Path, default=ROOT / "docs" / "corpus" / "questions-technician.json")
    ap.add_argument("--count", type=int, default=40, help="the first N questions of the file")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="another checkout whose daemon is asked in the same rounds")
    args = ap.parse_args()
    questions = [q["question"] for q in json.loads(args.questions.read_text())["questions"]][:args.count]
    sources = {"this checkout": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    results: dict[str, dict] = {name: {"latencies": [], "cpu": 0.0, "stages": {}, "answers": None}
                                for name in sources}
    with tempfile.TemporaryDirectory(prefix="eb-bench-rag-") as tmp:
        repo = rag_repository(Path(tmp), args.model_repo.resolve(), args.index.resolve())
        daemons: dict[str, Server] = {}
        try:
            for i, (name, source) in enumerate(sources.items()):
                daemons[name] = start_daemon(Path(tmp) / f"d{i}", repo, None, {"models": {"load": ["minilm", "rag"]}},
                                             source)
            names = list(sources)
            for r in range(args.rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    latencies, cpu, stages, answers = ask(daemons[name], questions)
                    res = results[name]
                    res["latencies"] += latencies
                    res["cpu"] += cpu
                    for k, v in stages.items():
                        res["stages"][k] = res["stages"].get(k, 0) + v
                    res["answers"] = res["answers"] or answers
        finally:
            for server in daemons.values():
                server.stop()
    n = len(questions) * args.rounds
    print(f"{len(questions)} questions of {args.questions.name} x {args.rounds} rounds, one at a time over the "
          f"Unix socket, {os.cpu_count()} CPUs\n")
    print("| daemon | p50 ms | p90 ms | mean ms | daemon CPU ms/question | stages ms/question |\n"
          "|---|---|---|---|---|---|")
    for name, res in results.items():
        lat = sorted(res["latencies"])
        stages = ", ".join(f"{k} {v / n / 1e6:.1f}" for k, v in res["stages"].items())
        print(f"| {name} | {lat[len(lat) // 2] * 1e3:.1f} | {lat[int(len(lat) * 0.9)] * 1e3:.1f} | "
              f"{statistics.fmean(lat) * 1e3:.1f} | {res['cpu'] / n * 1e3:.1f} | {stages} |")
    if args.baseline:
        mine, base = results["this checkout"]["answers"], results["baseline"]["answers"]
        print(f"\nthe same answer from both: {sum(a == b for a, b in zip(mine, base))} of {len(questions)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
