#!/usr/bin/env python3
"""Where each thread's samples go in a `py-spy record --threads --format raw` file: per thread,
its share of all samples, then the functions with the most samples of their own and the most
samples under them (inclusive). Used by tools/gpu_checks.sh's `profile` step, so that a lent GPU
machine's profile comes back as a few dozen lines; the raw file comes back too.

Usage: python tools/profile_threads.py RECORD.txt [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

# "thread (123): engine-vision-0" -> "engine-vision-0"; worker pools are one line per pool
THREAD = re.compile(r"thread \(\w+\): (?P<name>.*)")
POOL_INDEX = re.compile(r"_\d+$")
SOURCE_PREFIX = re.compile(r"\(/\S*?/(site-packages|lib/python3\.\d+)/")


def thread_name(frame: str) -> str:
    match = THREAD.match(frame)
    return POOL_INDEX.sub("_*", match["name"]) if match else frame


def read(path: Path) -> dict[str, list[tuple[list[str], int]]]:
    """The record's stacks grouped by thread: (frames outermost first, samples)."""
    threads: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        first, *frames = stack.split(";")
        threads[thread_name(first)].append(([SOURCE_PREFIX.sub("(", f) for f in frames], int(count)))
    return threads


def report(threads: dict[str, list[tuple[list[str], int]]], top: int) -> str:
    total = sum(n for stacks in threads.values() for _, n in stacks) or 1
    lines = [f"{total} samples"]
    for name, stacks in sorted(threads.items(), key=lambda item: -sum(n for _, n in item[1])):
        samples = sum(n for _, n in stacks)
        own: collections.Counter[str] = collections.Counter()
        under: collections.Counter[str] = collections.Counter()
        for frames, n in stacks:
            if frames:
                own[frames[-1]] += n
            for frame in set(frames):
                under[frame] += n
        lines.append(f"\n## {name}: {samples} samples ({100 * samples / total:.0f}%)")
        lines.append("own:       " + "; ".join(f"{100 * n / samples:.0f}% {f}" for f, n in own.most_common(top)))
        # the frames every stack shares (the thread's entry point) say nothing: left out
        shared = [f for f, n in under.items() if n == samples]
        rest = [(f, n) for f, n in under.most_common(top + len(shared)) if f not in shared][:top]
        lines.append("inclusive: " + "; ".join(f"{100 * n / samples:.0f}% {f}" for f, n in rest))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("record", type=Path)
    ap.add_argument("--top", type=int, default=12, help="functions listed per thread and kind (default 12)")
    args = ap.parse_args()
    print(report(read(args.record), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
