#!/usr/bin/env python3
"""Mixed traffic over every model of a repository through a real daemon, and its memory against the plan.

Starts `edge-batcher serve` (optionally inside a memory cgroup: `--cgroup-limit-mb`, the way a
Jetson's unified memory bounds the process), waits until it is ready, then has `--clients`
connections send requests for `--seconds`: each picks a model at random and sends it a random
request of 1 to max_batch_size rows (random text of 5-100 words, token sequences of random
length up to the longest bucket, sensor windows); a generator gets a prompt of 20 to 400 words
(a quarter of its context at most) through the generate extension with 8-64 new tokens. Memory
is sampled every 50 ms on one meter:

  device   the GPU's memory in use (NVML; nvidia-smi when pynvml is missing), the daemon's GPU plan;
  jetson   a Jetson's shared memory in use, as the daemon's jetson probe reads it (NVML has none);
  process  the daemon's resident memory (psutil), the plan of CPU engines under the cpu probe.

It prints memory before the daemon, after warm-up (ready and idle), the peak under load, the
plan (the daemon's `edge_batcher_memory_planned_bytes` for that meter: what was in use at its
start + every measured model's resident memory + what else it held at ready + batches in
flight: what it held at ready, in full), the answers by status, and inside a cgroup its peak
usage and OOM kills. It fails (exit 1) when a request is answered with an error other than
overload (429) or a passed deadline (504), nothing is answered, the daemon dies or is
OOM-killed, or the peak exceeds what the daemon held at ready (its plan), read by the same meter,
by more than its margin: on the GPU `--tolerance` (5%) of the models' resident memory, for the
daemon's resident memory the budget's headroom (`[memory] headroom_mb`, what it keeps for
request bodies and Python objects). A generator's KV cache is reserved per running batch, not
held at ready: with generators the peak may exceed ready by the most their reservations reached
(their statistics' `kv.reserved_bytes`, read every 100 ms) plus the margin. It also fails when the
daemon's own memory watch logged growth beyond its plan, or a generator's decode loop a KV cache
beyond what it had reserved. docs/memory.md has the runs recorded.

    python tools/memory_soak.py [--config FILE] [--models DIR] [--seconds 30] [--clients 48]
                                [--meter auto|device|process] [--cgroup-limit-mb N] [--json FILE]

tools/gpu_selftest.py runs it with `--soak SECONDS`; tests/memory/test_memory_soak.py runs it
under a cgroup limit on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from edge_batcher.config import ModelConfig, discover_models, load_config  # noqa: E402
from edge_batcher.protocol import v2  # noqa: E402

MiB = 1 << 20
SAMPLE_S = 0.05
OVERLOAD = ("429", "504")  # the load was beyond what the models serve in time: reported, not a failure
WORDS = ("bearing vibration sensor pump motor fault imbalance misalignment battery gateway firmware "
         "temperature alarm threshold mounting magnet calibration spectrum envelope velocity amplitude "
         "frequency axial radial shaft coupling lubrication grease noise reading interval report").split()


# --------------------------------------------------------------------------- meters


class ProcessMeter:
    """The daemon's resident memory."""

    name = "process"

    def __init__(self, pid: int):
        import psutil

        self._process = psutil.Process(pid)

    def used(self) -> int:
        return int(self._process.memory_info().rss)


class DeviceMeter:
    """GPU 0's memory in use, by everyone: NVML, or nvidia-smi without pynvml."""

    name = "device"

    def __init__(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._nvml = pynvml
        except Exception:  # no pynvml or no driver: nvidia-smi, or nothing
            self._nvml = None
            if shutil.which("nvidia-smi") is None:
                raise RuntimeError("no GPU meter: neither pynvml nor nvidia-smi works here") from None

    def used(self) -> int:
        if self._nvml is not None:
            return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
        return int(out.split()[0]) * MiB


class JetsonMeter:
    """A Jetson's shared memory in use (the daemon's own jetson probe: MemTotal - what is free)."""

    name = "jetson"

    def __init__(self) -> None:
        from edge_batcher.memory.jetson import JetsonProbe

        self._probe = JetsonProbe()

    def used(self) -> int:
        snapshot = self._probe.read()
        return snapshot.total_bytes - snapshot.free_bytes


def auto_meter() -> str:
    """The meter for this machine: jetson on a Jetson, device with a discrete GPU, else process."""
    from edge_batcher.memory.jetson import is_jetson

    if is_jetson():
        return "jetson"
    return "device" if gpu_here() else "process"


def gpu_here() -> bool:
    try:
        DeviceMeter()
        return True
    except RuntimeError:
        return False


class Sampler:
    """A meter read every SAMPLE_S on its own thread; the peak since the last reset."""

    def __init__(self, meter: Any):
        self.meter = meter
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> Sampler:
        self.peak = self.meter.used()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            try:
                self.peak = max(self.peak, self.meter.used())
            except Exception:  # the daemon died: the soak reports it
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


# --------------------------------------------------------------------------- cgroup


class MemoryCgroup:
    """A memory cgroup of its own (v1 or v2; root only) with a limit, for the daemon."""

    def __init__(self, limit_bytes: int):
        name = f"edge-batcher-soak-{os.getpid()}"
        v1 = Path("/sys/fs/cgroup/memory")
        v2 = Path("/sys/fs/cgroup")
        if (v1 / "memory.limit_in_bytes").exists():
            self.path, self.v1 = v1 / name, True
        elif (v2 / "cgroup.controllers").exists() and "memory" in (v2 / "cgroup.controllers").read_text():
            self.path, self.v1 = v2 / name, False
        else:
            raise RuntimeError("no writable memory cgroup controller here")
        try:
            self.path.mkdir()
            if self.v1:
                (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                try:  # swap would hide the limit: memory+swap capped at the same figure
                    (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
                except OSError:
                    pass
            else:
                (self.path / "memory.max").write_text(str(limit_bytes))
                (self.path / "memory.swap.max").write_text("0")
        except OSError as exc:
            raise RuntimeError(f"cannot create a memory cgroup at {self.path}: {exc}") from exc
        self.limit = limit_bytes

    def join(self) -> None:
        """Called in the child before exec (preexec_fn): the daemon runs in the cgroup."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def usage(self) -> int:
        return int((self.path / ("memory.usage_in_bytes" if self.v1 else "memory.current")).read_text())

    def peak(self) -> int | None:
        f = self.path / ("memory.max_usage_in_bytes" if self.v1 else "memory.peak")
        return int(f.read_text()) if f.exists() else None

    def oom_kills(self) -> int:
        f = self.path / ("memory.oom_control" if self.v1 else "memory.events")
        for line in f.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


# --------------------------------------------------------------------------- requests


@dataclasses.dataclass
class ModelTraffic:
    """Random requests for one model: built from its metadata and model.toml."""

    name: str
    inputs: list[dict]  # v2 metadata: name, datatype, shape
    max_rows: int
    max_length: int  # the longest sequence bucket, or 0
    max_words: int  # of a text (the rag service refuses questions longer than its embedding model reads)
    generator: bool = False  # a prompt through the generate extension instead of v2 infer

    @property
    def large(self) -> bool:
        """Rows of more than LARGE_ROW values (a camera frame: 921,600): sent as binary tensors, as
        real clients send them (as JSON a frame is ~3 MB of text, and 8 of them pass max_body_bytes),
        and fewer of them pooled per client."""
        return any(int(np.prod([max(d, 1) for d in spec["shape"][1:]])) > LARGE_ROW for spec in self.inputs)

    @property
    def path(self) -> str:
        return f"/v2/models/{self.name}/" + ("generate" if self.generator else "infer")

    def request(self, rng: random.Random) -> tuple[bytes, dict[str, str]]:
        if self.generator:
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, self.max_words)))
            body = {"text_input": prompt, "parameters": {"max_new_tokens": rng.randint(8, 64), "ignore_stop": True}}
            return json.dumps(body).encode(), {"Content-Type": "application/json"}
        rows = rng.randint(1, self.max_rows)
        length = rng.randint(min(8, self.max_length), self.max_length) if self.max_length else 0
        arrays = {}
        for spec in self.inputs:
            shape = [rows] + [d if d > 0 else (length or 1) for d in spec["shape"][1:]]
            arrays[spec["name"]] = _random_tensor(spec, shape, rng, self.max_words)
        body, header_length = v2.encode_request(arrays, binary_inputs=self.large, binary_outputs=False)
        if header_length is None:
            return body, {"Content-Type": "application/json"}
        return body, {"Content-Type": v2.BINARY_CONTENT_TYPE, v2.HEADER_LENGTH: str(header_length)}


LARGE_ROW = 65536


def _random_tensor(spec: dict, shape: list[int], rng: random.Random, max_words: int) -> np.ndarray:
    datatype, name = spec["datatype"], spec["name"]
    if datatype == "BYTES":
        count = int(np.prod(shape))
        return np.array([" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, max_words))).encode()
                         for _ in range(count)], dtype=object).reshape(shape)
    if datatype.startswith("FP"):
        return np.random.default_rng(rng.randrange(1 << 30)).standard_normal(shape).astype(
            {"FP16": np.float16, "FP32": np.float32, "FP64": np.float64}[datatype])
    dtype = {"INT64": np.int64, "INT32": np.int32, "INT8": np.int8, "UINT8": np.uint8, "BOOL": np.bool_}[datatype]
    if "mask" in name:
        return np.ones(shape, dtype)
    if "type" in name or datatype == "BOOL":
        return np.zeros(shape, dtype)
    return np.random.default_rng(rng.randrange(1 << 30)).integers(1, 1000, shape).astype(dtype)  # any vocabulary


def traffic_for(metadata: dict, config: ModelConfig | None) -> ModelTraffic:
    if config is not None and config.backend == "generator":
        from edge_batcher.config import backend_settings
        from edge_batcher.rag.generate import GeneratorSettings

        # Prompts well within the context: a word is 1-3 tokens, and 64 new ones follow.
        words = min(400, backend_settings(config, "generator", GeneratorSettings).max_context // 4)
        return ModelTraffic(metadata["name"], metadata["inputs"], 1, 0, words, generator=True)
    service = config is None or config.backend == "rag"
    max_rows = 1 if service else min(8, config.batching.max_batch_size)
    max_length = max(config.sequence.buckets) if config is not None and config.sequence else 0
    return ModelTraffic(metadata["name"], metadata["inputs"], max_rows, max_length, 30 if service else 100)


# --------------------------------------------------------------------------- the daemon


@dataclasses.dataclass
class SoakResult:
    meter: str
    before: int
    ready: int
    peak: int
    planned: int  # the daemon's plan at ready, for this meter
    resident: dict[str, int]  # per model, from the daemon
    statuses: dict[str, int]
    errors: list[str]
    seconds: float
    clients: int
    alive: bool
    cgroup: dict[str, int] | None
    margin: int  # bytes the peak may exceed the plan by
    kv_reserved_peak: int = 0  # the most the generators' KV reservations reached together
    log_tail: str = ""
    memory_log: str = ""  # the daemon's log lines about memory

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    @property
    def resident_total(self) -> int:
        return sum(self.resident.values())

    @property
    def over_plan(self) -> int:
        """Growth under traffic beyond what the daemon held at ready and its generators reserved,
        which its plan counts in full (memory/plan.py), read by one meter: NVML's figures are not
        the daemon's cuMemGetInfo."""
        return self.peak - self.ready - self.kv_reserved_peak

    def failures(self) -> list[str]:
        out = []
        if not self.alive:
            out.append("the daemon died during the soak")
        if self.cgroup is not None and self.cgroup["oom_kills"]:
            out.append(f"{self.cgroup['oom_kills']} OOM kill(s) in the cgroup")
        bad = {k: v for k, v in self.statuses.items() if k not in ("200", *OVERLOAD)}
        if bad:
            out.append(f"errors answered: {bad}; first: {[e for e in self.errors if e[:3] not in OVERLOAD][:3]}")
        if not self.statuses.get("200"):
            out.append("nothing was answered")
        if self.over_plan > self.margin:
            reserved = (f" and its generators reserved ({self.kv_reserved_peak / MiB:.1f} MiB)"
                        if self.kv_reserved_peak else "")
            out.append(f"peak {self.peak / MiB:.1f} MiB is {self.over_plan / MiB:.1f} MiB above what the daemon held "
                       f"at ready (its plan){reserved}, more than the margin of {self.margin / MiB:.1f} MiB")
        watch = [line for line in self.memory_log.splitlines() if "above the plan" in line]
        if watch:
            out.append(f"the daemon's memory watch saw growth beyond its plan: {watch[0][-200:]}")
        kv = [line for line in self.memory_log.splitlines() if "reserved for it" in line]
        if kv:
            out.append(f"{len(kv)} round(s) of a generator found its KV cache beyond its reservation: {kv[0][-160:]}")
        return out

    def report(self) -> str:
        lines = [
            f"soak: {self.clients} clients, {self.seconds:.0f} s, {self.requests} requests, meter {self.meter}",
            f"  memory before the daemon  {self.before / MiB:10.1f} MiB",
            f"  after warm-up (ready)     {self.ready / MiB:10.1f} MiB",
            f"  peak under load           {self.peak / MiB:10.1f} MiB  "
            f"({(self.peak - self.ready) / MiB:+.1f} MiB beyond ready, margin {self.margin / MiB:.1f} MiB)",
            f"  the daemon's plan         {self.planned / MiB:10.1f} MiB  (its own meter at ready; "
            f"models resident {self.resident_total / MiB:.1f} MiB: "
            + ", ".join(f"{m} {b / MiB:.1f}" for m, b in sorted(self.resident.items())) + ")",
            *([f"  generators' KV reserved    {self.kv_reserved_peak / MiB:10.1f} MiB at most"]
              if self.kv_reserved_peak else []),
            "  answers by status         " + ", ".join(f"{k}: {v}" for k, v in sorted(self.statuses.items())),
        ]
        if self.cgroup is not None:
            lines.append(f"  cgroup limit {self.cgroup['limit'] / MiB:.0f} MiB: peak usage "
                         f"{self.cgroup['peak'] / MiB:.1f} MiB, OOM kills {self.cgroup['oom_kills']}")
        failures = self.failures()
        lines.append("  result: " + ("ok" if not failures else "FAIL: " + "; ".join(failures)))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("log_tail", "memory_log")} | {
            "failures": self.failures()}


def kv_reserved(sock: str, generators: list[str]) -> int:
    """What the generators have reserved for their KV caches now (their statistics): memory in
    the plan while their sequences run, not growth. A generator that does not answer counts 0."""
    total = 0
    for name in generators:
        try:
            status, body = _http(sock, "GET", f"/v2/models/{name}/stats")
        except OSError:
            continue
        if status == 200:
            total += json.loads(body)["model_stats"][0]["kv"]["reserved_bytes"]
    return total


class KvReservations:
    """The generators' KV reservations together, read from their statistics every 100 ms on a
    thread; stop() gives the most they reached."""

    def __init__(self, sock: str, generators: list[str]):
        self.sock, self.generators = sock, generators
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> KvReservations:
        if self.generators:
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, kv_reserved(self.sock, self.generators))

    def stop(self) -> int:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.peak


def _http(sock: str, method: str, path: str, body: bytes | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    import http.client
    import socket

    class UnixConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(sock)

    conn = UnixConnection("localhost", timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _metric_values(text: str, name: str) -> dict[str, float]:
    """{label value or "": value} of one metric in Prometheus text (one label at most)."""
    values = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, _, value = line.rpartition(" ")
            label = head.partition('"')[2].rpartition('"')[0]
            values[label] = float(value)
    return values


async def _drive(sock: str, traffic: list[ModelTraffic], clients: int, seconds: float, seed: int,
                 statuses: Counter, errors: list[str]) -> None:
    import aiohttp

    connector = aiohttp.UnixConnector(path=sock, limit=clients)
    paths = {t.name: t.path for t in traffic}
    stop_at = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def client(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            pools = {t.name: [t.request(rng) for _ in range(2 if t.large else 16)] for t in traffic}
            while time.monotonic() < stop_at:
                model = rng.choice(traffic).name
                body, headers = rng.choice(pools[model])
                try:
                    async with session.post(f"http://localhost{paths[model]}", data=body,
                                            headers=headers) as response:
                        text = await response.read()
                        statuses[str(response.status)] += 1
                        if response.status != 200 and len(errors) < 20:
                            errors.append(f"{response.status} {model}: {text[:200]!r}")
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    statuses["connection error"] += 1
                    if len(errors) < 20:
                        errors.append(f"connection: {model}: {exc!r}")
                    await asyncio.sleep(0.1)

        await asyncio.gather(*(client(i) for i in range(clients)))


def run_soak(*, config: str | None = None, models: str | None = None, seconds: float = 30.0, clients: int = 48,
             meter: str = "auto", cgroup_limit_mb: float | None = None, tolerance: float = 0.05,
             seed: int = 0, ready_timeout: float = 300.0, env: dict[str, str] | None = None) -> SoakResult:
    """Run one soak (see the module docstring) and return its figures; raises RuntimeError when
    the daemon does not become ready."""
    daemon_config = load_config(config)
    repository = Path(models) if models else Path(daemon_config.models.repository)
    configs = {mc.name: mc for mc in discover_models(repository, daemon_config.models.load)}
    if meter == "auto":
        meter = auto_meter()
    cgroup = MemoryCgroup(int(cgroup_limit_mb * MiB)) if cgroup_limit_mb else None
    workdir = Path(tempfile.mkdtemp(prefix="eb-soak-"))
    sock = str(workdir / "eb.sock")
    log_path = workdir / "daemon.log"
    cmd = [sys.executable, "-m", "edge_batcher.cli", "serve", "--unix-socket", sock, "--models", str(repository)]
    if config:
        cmd += ["--config", config]
    device = DeviceMeter() if meter == "device" else JetsonMeter() if meter == "jetson" else None
    before = device.used() if device is not None else 0
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})),
                                preexec_fn=cgroup.join if cgroup is not None else None)
    try:
        _wait_ready(proc, sock, ready_timeout, log_path)
        sampler = Sampler(device if device is not None else ProcessMeter(proc.pid))
        time.sleep(1.0)  # idle after ready: what warm-up left
        ready = sampler.meter.used()
        metrics = _http(sock, "GET", "/metrics")[1].decode()
        planned = _metric_values(metrics, "edge_batcher_memory_planned_bytes")
        resident = {k: int(v) for k, v in _metric_values(metrics, "edge_batcher_memory_resident_bytes").items()}
        plan_key = next((k for k in planned if k == meter or (meter == "device" and k in ("cuda", "nvml"))), None)
        if plan_key is None:
            raise RuntimeError(f"the daemon has no memory plan for the {meter} meter: {planned or 'none'} "
                               "(are its models on the CPU while a GPU is measured, or the other way round?)")
        traffic = []
        for name in sorted(configs):
            status, body = _http(sock, "GET", f"/v2/models/{name}")
            if status == 200:
                traffic.append(traffic_for(json.loads(body), configs[name]))
        statuses: Counter = Counter()
        errors: list[str] = []
        reservations = KvReservations(sock, [t.name for t in traffic if t.generator]).start()
        sampler.start()
        t0 = time.monotonic()
        asyncio.run(_drive(sock, traffic, clients, seconds, seed, statuses, errors))
        elapsed = time.monotonic() - t0
        peak = sampler.stop()
        kv_reserved_peak = reservations.stop()
        alive = proc.poll() is None
        cg = None
        if cgroup is not None:
            cg = {"limit": cgroup.limit, "peak": cgroup.peak() or 0, "oom_kills": cgroup.oom_kills()}
        margin = (int(daemon_config.memory.headroom_mb * MiB) if meter == "process"
                  else int(tolerance * sum(resident.values())))
        return SoakResult(meter, before, ready, peak, int(planned[plan_key]), resident, dict(statuses), errors,
                          elapsed, clients, alive, cg, margin, kv_reserved_peak, _tail(log_path),
                          _memory_lines(log_path))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if cgroup is not None:
            cgroup.remove()
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_ready(proc: subprocess.Popen, sock: str, timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with status {proc.returncode} before it was ready:\n"
                               f"{_tail(log_path)}")
        try:
            status, _ = _http(sock, "GET", "/v2/health/ready", timeout=2.0)
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the daemon was not ready after {timeout:.0f} s:\n{_tail(log_path)}")


def _memory_lines(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(line for line in text.splitlines()
                     if "memory" in line and "grew" not in line or "WARNING" in line or "ERROR" in line)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="daemon config (default: the embedded default)")
    ap.add_argument("--models", help="model repository (default: the config's)")
    ap.add_argument("--seconds", type=float, default=30.0, help="seconds of traffic (default 30)")
    ap.add_argument("--clients", type=int, default=48, help="concurrent connections (default 48)")
    ap.add_argument("--meter", choices=("auto", "device", "jetson", "process"), default="auto",
                    help="what to measure: the GPU, a Jetson's shared memory, or the daemon's resident memory "
                         "(auto: the Jetson's, else the GPU's if there is one, else the daemon's)")
    ap.add_argument("--cgroup-limit-mb", type=float, help="run the daemon in a memory cgroup with this limit (root)")
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="on the GPU, peak above the plan allowed as a fraction of the models' resident memory "
                         "(default 0.05); the daemon's resident memory may exceed it by the budget's headroom")
    ap.add_argument("--json", help="also write the result as JSON to this file")
    args = ap.parse_args(argv)
    try:
        result = run_soak(config=args.config, models=args.models, seconds=args.seconds, clients=args.clients,
                          meter=args.meter, cgroup_limit_mb=args.cgroup_limit_mb, tolerance=args.tolerance)
    except RuntimeError as exc:
        print(f"memory soak: {exc}", file=sys.stderr)
        return 1
    print(result.report())
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=2))
    if result.failures():
        print(result.log_tail, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
