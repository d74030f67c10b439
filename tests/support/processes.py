"""Stopping the helper processes tests start (brokers, peer servers)."""

from __future__ import annotations

import subprocess


def terminate(proc: subprocess.Popen | None, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`; no-op when it is gone."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
