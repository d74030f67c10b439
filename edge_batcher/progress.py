"""Progress of a long command on a stream: a bar redrawn in place on a terminal, plain lines elsewhere.

A redrawn line is what a person at a terminal wants, and what piles up into noise in a log,
a CI job or a pipe, so :class:`Progress` asks the stream (``isatty``) and writes one of the
two. Used by ``edge-batcher bench``, ``build-engine`` (engines/trt_builder.py) and the model
builders in tools/; it writes to stderr unless told otherwise, so stdout keeps only results.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TextIO

BAR_WIDTH = 20
CLEAR_LINE = "\r\033[K"


def is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """The step a command of ``total`` steps is at, with the time spent and an estimate of the
    time left. ``step(label)`` announces the next step; ``close()`` (or leaving the ``with``
    block) clears the bar. In plain mode each step is one line: ``<name> 2/5: <label> (3 s, ~4 s left)``.

    The estimate scales the time spent by the work left: by the count of steps, or, given
    ``weights`` (each step's expected cost, e.g. its planned seconds), by their weight, so that
    a long last step is not announced at the length of the short ones before it.
    """

    def __init__(self, name: str, total: int, stream: TextIO | None = None, *,
                 weights: Sequence[float] | None = None):
        if weights is not None and len(weights) != total:
            raise ValueError(f"{len(weights)} step weights for {total} steps")
        self.name = name
        self.stream = stream if stream is not None else sys.stderr
        self.total = total
        self.weights = list(weights) if weights is not None else [1.0] * total
        self.done = 0
        self.tty = is_terminal(self.stream)
        self.started = time.monotonic()

    def time_left(self, elapsed: float) -> float:
        """Seconds left after `elapsed` for the steps done so far, at the pace they went."""
        done = sum(self.weights[:self.done])
        return elapsed / done * sum(self.weights[self.done:]) if done > 0 else 0.0

    def step(self, label: str) -> None:
        elapsed = time.monotonic() - self.started
        left = f", ~{self.time_left(elapsed):.0f} s left" if self.done else ""
        self.done += 1
        self.total = max(self.total, self.done)  # a step more than planned: never past 100%
        if self.tty:
            filled = BAR_WIDTH * (self.done - 1) // self.total
            self._write(f"{CLEAR_LINE}[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {self.done}/{self.total} "
                        f"{label} ({elapsed:.0f} s{left})", end="")
        else:
            self._write(f"{self.name} {self.done}/{self.total}: {label} ({elapsed:.0f} s{left})")

    def close(self) -> None:
        if self.tty:
            self._write(CLEAR_LINE, end="")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, text: str, end: str = "\n") -> None:
        print(text, end=end, file=self.stream, flush=True)
