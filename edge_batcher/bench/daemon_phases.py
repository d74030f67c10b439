"""Phases through a daemon subprocess: `edge-batcher serve` for one model on a private Unix
socket, loaded over that socket (the async client, binary tensor extension) or through an MQTT
broker (mqtt_load.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .figures import median_run, percentiles

# A subprocess's interpreter and imports before `serve` loads its model (~1 s on the 2-core VM,
# where the whole start took 2.1 s with the model's load and the loop_cpu = "auto" calibration).
DAEMON_STARTUP_S = 1.0
MQTT_WARMUP_S = 0.5  # the MQTT phase's unmeasured start of each run


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
        from ..client import AsyncClient

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
        self.proc.wait(timeout=30)


async def over_unix_socket(config, model: str, sample, args) -> dict:
    from ..client import AsyncClient

    async with DaemonSubprocess(config, model) as daemon, AsyncClient(f"unix://{daemon.socket}") as client:
        loop = asyncio.get_running_loop()
        runs = []
        for _ in range(args.repeat):
            latencies: list[float] = []
            stop_at = loop.time() + args.duration

            async def caller(stop_at: float = stop_at, latencies: list[float] = latencies) -> None:
                while loop.time() < stop_at:
                    t0 = loop.time()
                    await client.infer(model, sample)
                    latencies.append(loop.time() - t0)

            t0 = loop.time()
            await asyncio.gather(*(caller() for _ in range(args.concurrency)))
            wall = loop.time() - t0
            runs.append({"requests": len(latencies), "throughput_rps": len(latencies) / wall,
                         **percentiles(latencies)})
        result = median_run(runs)
        stats = await client.stats(model)
        ms = stats["model_stats"][0]
        result["batch_sizes"] = {str(b["batch_size"]): b["compute_infer"]["count"] for b in ms["batch_stats"]}
        result["dispatch_reasons"] = ms["dispatch_reasons"]
        return result


async def through_mqtt(config, model: str, sample, args) -> dict:
    """A daemon subprocess subscribed on the broker, loaded with MQTT 5 request/response."""
    from ..config import parse_host_port
    from .mqtt_load import bench_mqtt

    host, port = parse_host_port(args.mqtt, "--mqtt")
    prefix = f"edge-batcher/bench-{os.getpid()}"
    env = {"EDGE_BATCHER_MQTT_ENABLED": "true", "EDGE_BATCHER_MQTT_HOST": host,
           "EDGE_BATCHER_MQTT_PORT": str(port), "EDGE_BATCHER_MQTT_TOPIC_PREFIX": prefix,
           "EDGE_BATCHER_MQTT_CLIENT_ID": f"edge-batcher-bench-{os.getpid()}"}
    async with DaemonSubprocess(config, model, env):
        loop = asyncio.get_running_loop()
        runs = []
        for _ in range(args.repeat):
            # paho's client is blocking: run the load generator off the event loop.
            r = await loop.run_in_executor(None, lambda: bench_mqtt(
                args.mqtt, model=model, topic_prefix=prefix, inputs=sample, duration_s=args.duration,
                warmup_s=MQTT_WARMUP_S, concurrency=min(args.concurrency, 32)))
            runs.append(r)
        return median_run(runs)
