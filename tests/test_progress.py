"""The shared progress helper: plain lines where the output is a log or a pipe, a bar on a terminal."""

from __future__ import annotations

import io
import re

from edge_batcher.progress import Progress, is_terminal


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_number_every_step_and_estimate_the_time_left():
    log = io.StringIO()
    with Progress("build", 3, log) as progress:
        for label in ("data", "train", "verify"):
            progress.step(label)
    lines = log.getvalue().splitlines()
    assert lines[0] == "build 1/3: data (0 s)"  # nothing measured yet: no estimate
    assert re.fullmatch(r"build 2/3: train \(\d+ s, ~\d+ s left\)", lines[1])
    assert re.fullmatch(r"build 3/3: verify \(\d+ s, ~\d+ s left\)", lines[2])
    assert len(lines) == 3  # closing writes nothing to a log


def test_a_step_more_than_planned_raises_the_total_instead_of_passing_it():
    log = io.StringIO()
    progress = Progress("x", 1, log)
    progress.step("a")
    progress.step("b")
    assert log.getvalue().splitlines()[1].startswith("x 2/2: b (")


def test_on_a_terminal_the_bar_is_redrawn_in_place_and_cleared():
    tty = Terminal()
    with Progress("build", 4, tty) as progress:
        progress.step("a")
        progress.step("b")
        progress.step("c")
    drawn = tty.getvalue()
    assert "\n" not in drawn
    assert "[##########..........] 3/4 c (" in drawn  # two of four steps done when the third starts
    assert drawn.endswith("\r\033[K")


def test_streams_without_isatty_count_as_logs():
    class Sink:
        def write(self, text: str) -> int:
            return len(text)

    assert not is_terminal(Sink()) and is_terminal(Terminal()) and not is_terminal(io.StringIO())
