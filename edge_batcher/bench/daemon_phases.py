"""Phases through a daemon subprocess: `edge-batcher serve` for one model on a private Unix
socket, loaded over that socket or through an MQTT broker (transport_phases.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..client import AsyncClient
from .transport_phases import closed_loop_over, through_broker

# A subprocess's interpreter and imports before `serve` loads its model (~1 s on the 2-core VM,
# where the whole start took 2.1 s with the model's load and the loop_cpu = "auto" calibration).
DAEMON_STARTUP_S = 1.0


class DaemonSubprocess:
    """`edge-batcher serve` for one model on a private socket, for the transport phases."""

    def __init__(self, config, model: str, extra_env: dict | None = None):
        self.socket = Path(tempfile.mkdtemp(prefix="edge-batcher-bench-")) / "bench.sock"
        cmd = [sys.executable, "-m", "edge_batcher.cli", "serve", "--unix-socket", str(self.socket),
               "--models", config.models.repository, "--log-level", "WARNING"]
        if config.source != "<defaults>":
            cmd[4:4] = ["--config", config.source]
        env = dict(os.environ, EDGE_BATCHER_MODELS_LOAD=model, **(extra_env or {}))
        self.proc = subprocess.Popen(cmd, env=env)

    async def __aenter__(self) -> DaemonSubprocess:
        async with AsyncClient(f"unix://{self.socket}") as client:
            for _ in range(600):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the daemon exited with {self.proc.returncode}")
                if await client.ready():
                    return self
                await asyncio.sleep(0.1)
        raise RuntimeError("daemon did not become ready in 60 s")

    async def __aexit__(self, *exc) -> None:
        self.proc.terminate()
        await asyncio.get_running_loop().run_in_executor(None, self.proc.wait, 30)


async def over_unix_socket(config, model: str, sample, args) -> dict:
    """A daemon subprocess for `model`, loaded by closed-loop callers over its Unix socket."""
    async with DaemonSubprocess(config, model) as daemon:
        return await closed_loop_over(f"unix://{daemon.socket}", None, model, sample, args)


async def through_mqtt(config, model: str, sample, args) -> dict:
    """A daemon subprocess subscribed on the broker, loaded with MQTT 5 request/response."""
    from ..config import parse_host_port

    host, port = parse_host_port(args.mqtt, "--mqtt")
    prefix = f"edge-batcher/bench-{os.getpid()}"
    env = {"EDGE_BATCHER_MQTT_ENABLED": "true", "EDGE_BATCHER_MQTT_HOST": host,
           "EDGE_BATCHER_MQTT_PORT": str(port), "EDGE_BATCHER_MQTT_TOPIC_PREFIX": prefix,
           "EDGE_BATCHER_MQTT_CLIENT_ID": f"edge-batcher-bench-{os.getpid()}"}
    async with DaemonSubprocess(config, model, env):
        return await through_broker(args.mqtt, prefix, model, sample, args)
