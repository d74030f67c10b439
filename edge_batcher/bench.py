"""`edge-batcher bench`: throughput and latency, measured side by side in one run.

For one model it measures, in this order and in the same process:

1. the raw engine ceiling: the engine's infer() called directly at the largest preferred size,
   and a minimal asyncio batcher on the same engine (a reference for what the interpreter
   allows, see _minimal_batcher);
2. in-process load through the full runtime (queue, policy, worker thread, futures), closed
   loop (N concurrent callers) and open loop (Poisson arrivals at a fixed rate);
3. the same closed-loop load with batching off (preferred sizes [1]); and, when the event loop
   and engine threads share one CPU ([server] loop_cpu), the closed loop without that;
4. optionally (--unix) the same closed-loop load through a daemon subprocess on a Unix socket,
   with the binary tensor extension.

Per-request overhead outside the engine = CPU time of the event-loop thread per request
(queueing, policy, futures, the load generator's own call) + the worker thread's batch
assembly/splitting time per request. It is CPU time, so the other core's work does not count.

While it runs, each step is announced on stderr (a bar on a terminal, plain lines in logs);
the results are two tables (throughput and latency; batching and overhead), and with --plot
FILE.png a picture of the same (matplotlib, the `plot` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .config import load_config
from .cpu_affinity import choose as choose_cpu, pin_this_thread
from .errors import ConfigError, EdgeBatcherError
from .metrics import Metrics
from .runtime import discover_models, load_runner
from .types import DATATYPE_TO_NUMPY, InferRequest


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="daemon config (default: built-in defaults)")
    p.add_argument("--models", help="model repository (default: the config's)")
    p.add_argument("--model", default="vibration", help="model to load (default: vibration)")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per phase (default 3)")
    p.add_argument("--concurrency", type=int, default=64, help="closed-loop callers (default 64)")
    p.add_argument("--rate", type=float, default=0.0, help="open-loop arrivals per second (default: 50%% of measured closed-loop throughput)")
    p.add_argument("--unix", action="store_true", help="also load a daemon subprocess over its Unix socket")
    p.add_argument("--mqtt", metavar="HOST:PORT", help="also load a daemon subprocess through this MQTT broker")
    p.add_argument("--repeat", type=int, default=3, help="repeat each phase, report medians (default 3)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", type=Path,
                   help="also draw throughput, p50/p99 latency and the batch-size mix per phase "
                        "(needs matplotlib: pip install 'edge-batcher[plot]')")


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if args.models:
        config.models.repository = str(Path(args.models).resolve())
    if args.plot is not None:
        _pyplot()  # fail now, not after minutes of measuring
    results = asyncio.run(_bench(config, args))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(format_report(results))
    if args.plot is not None:
        plot_report(results, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


class Progress:
    """The step the benchmark is at, on stderr: a bar redrawn in place on a terminal, one plain
    line per step where the output is a log or CI (a redrawn line would pile up there)."""

    def __init__(self, total: int, stream=None):
        self.stream = stream or sys.stderr
        self.total = total
        self.done = 0
        self.tty = self.stream.isatty()
        self.started = time.monotonic()

    def step(self, label: str) -> None:
        elapsed = time.monotonic() - self.started
        left = f", ~{elapsed / self.done * (self.total - self.done):.0f} s left" if self.done else ""
        self.done += 1
        if self.tty:
            width = 20
            filled = width * (self.done - 1) // self.total
            print(f"\r\033[K[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label} "
                  f"({elapsed:.0f} s{left})", end="", file=self.stream, flush=True)
        else:
            print(f"bench {self.done}/{self.total}: {label} ({elapsed:.0f} s{left})", file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty:
            print("\r\033[K", end="", file=self.stream, flush=True)


async def _bench(config, args) -> dict:
    (mc,) = discover_models(Path(config.models.repository), [args.model])
    loop = asyncio.get_running_loop()
    # The thread placement the daemon uses ([server] loop_cpu): this thread is the event loop.
    cpu = choose_cpu(config.server.loop_cpu)
    pin_this_thread(cpu)
    runner = await loop.run_in_executor(None, load_runner, mc, Metrics(), True)
    if not runner.runs_locally:
        await runner.close()
        raise ConfigError(f"model {mc.name!r} runs on offload peers only (backend {mc.backend!r}): "
                          f"nothing of it runs on this device to benchmark")
    engine = runner.engines[0]
    sample = _sample_inputs(runner)
    largest = mc.batching.preferred_batch_sizes[-1]
    out: dict = {"model": mc.name, "preferred_batch_sizes": mc.batching.preferred_batch_sizes,
                 "concurrency": args.concurrency, "duration_s": args.duration, "repeat": args.repeat,
                 "loop_cpu": cpu}

    n = args.repeat
    progress = Progress(n * (5 + (cpu is not None)) + bool(args.unix) + bool(args.mqtt))

    def runs(label: str):
        for i in range(n):
            progress.step(f"{label}, run {i + 1}/{n}")
            yield i

    ceilings = [_raw_ceiling(engine, sample, largest, args.duration) for _ in runs("raw engine ceiling")]
    out["raw_ceiling_rps"] = statistics.median(ceilings)
    floors = [await _minimal_batcher(engine, sample, largest, args) for _ in runs("minimal asyncio batcher")]
    out["minimal_batcher_rps"] = statistics.median(floors)
    await runner.close()

    batched = [await _in_process(mc, sample, args, closed=True) for _ in runs("in-process, closed loop")]
    out["in_process_closed"] = _median_run(batched)
    # Half the closed-loop throughput: latency under a moderate load, below saturation.
    rate = args.rate or 0.5 * out["in_process_closed"]["throughput_rps"]
    out["in_process_open"] = _median_run(
        [await _in_process(mc, sample, args, closed=False, rate=rate) for _ in runs("in-process, open loop")]
    )

    unbatched_config = copy.deepcopy(mc)
    unbatched_config.batching.preferred_batch_sizes = [1]
    unbatched_config.batching.max_batch_size = 1
    out["in_process_no_batching"] = _median_run(
        [await _in_process(unbatched_config, sample, args, closed=True) for _ in runs("in-process, batching off")]
    )
    # From here on this thread runs on every CPU: first the same closed loop with the loop
    # and engine threads free (loop_cpu = "off"), to show what sharing one CPU buys; then
    # only as the load generator of a daemon subprocess, which pins its own threads and
    # must not have to compete for its CPU.
    pin_this_thread(None)
    if cpu is not None:
        out["in_process_closed_any_cpu"] = _median_run(
            [await _in_process(mc, sample, args, closed=True) for _ in runs("in-process, threads on any CPU")]
        )
    out["ratio_to_ceiling"] = out["in_process_closed"]["throughput_rps"] / out["raw_ceiling_rps"]
    out["speedup_over_no_batching"] = (
        out["in_process_closed"]["throughput_rps"] / out["in_process_no_batching"]["throughput_rps"]
    )
    if args.unix:
        progress.step(f"Unix socket, a daemon subprocess, {n} run(s)")
        out["unix_socket_closed"] = await _over_unix_socket(config, mc.name, sample, args)
    if args.mqtt:
        progress.step(f"MQTT through {args.mqtt}, a daemon subprocess, {n} run(s)")
        out["mqtt"] = await _through_mqtt(config, mc.name, sample, args)
    progress.close()
    return out


def _sample_inputs(runner) -> dict[str, np.ndarray]:
    """One request's inputs: random data of the model's input shapes (rows = 1)."""
    rng = np.random.default_rng(0)
    inputs = {}
    seq = runner.config.sequence
    for spec in runner.inputs:
        # Sequence inputs at the smallest bucket's length, so the raw ceiling does the same
        # work as the batches the runner pads to that bucket.
        shape = [1] + [seq.buckets[0] if seq and spec.name in seq.inputs and axis == seq.axis else (d if d > 0 else 16)
                       for axis, d in enumerate(spec.shape) if axis > 0]
        dtype = DATATYPE_TO_NUMPY[spec.datatype]
        if dtype.kind == "f":
            inputs[spec.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind in "iub":
            inputs[spec.name] = rng.integers(0, 2, shape).astype(dtype)
        else:
            inputs[spec.name] = np.full(shape, b"edge-batcher", dtype=object)
    return inputs


def _raw_ceiling(engine, sample: dict[str, np.ndarray], size: int, duration: float) -> float:
    batch = {k: np.repeat(v, size, axis=0) for k, v in sample.items()}
    engine.infer(batch)
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < duration:
        engine.infer(batch)
        n += 1
    return n * size / (time.perf_counter() - t0)


async def _minimal_batcher(engine, sample: dict[str, np.ndarray], size: int, args) -> float:
    """Req/s of the least an asyncio batcher can do with the same callers and engine: a list
    of futures, full batches only, one engine thread fed by a queue, one call_soon_threadsafe
    per batch; no validation, policy, deadlines, stats or metrics. Not a usable runtime: a
    reference that shows how much of the gap to the raw ceiling is the interpreter's."""
    import queue
    import threading

    loop = asyncio.get_running_loop()
    waiting: list[tuple[asyncio.Future, dict]] = []
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    in_flight = 0

    def complete(batch, outputs) -> None:
        nonlocal in_flight
        in_flight -= 1
        for i, (future, _) in enumerate(batch):
            future.set_result({name: value[i:i + 1] for name, value in outputs.items()})
        dispatch()

    def work() -> None:
        while (batch := jobs.get()) is not None:
            inputs = {name: np.concatenate([x[name] for _, x in batch]) for name in sample}
            loop.call_soon_threadsafe(complete, batch, engine.infer(inputs))

    def dispatch() -> None:
        nonlocal in_flight
        while len(waiting) >= size and in_flight < 2:
            batch = waiting[:size]
            del waiting[:size]
            in_flight += 1
            jobs.put(batch)

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    done = 0
    stop_at = loop.time() + args.duration

    async def caller() -> None:
        nonlocal done
        while loop.time() < stop_at:
            future = loop.create_future()
            waiting.append((future, sample))
            dispatch()
            await future
            done += 1

    t0 = loop.time()
    callers = [asyncio.ensure_future(caller()) for _ in range(args.concurrency)]
    while loop.time() < stop_at:
        await asyncio.sleep(0.05)
    wall = loop.time() - t0
    finished = done
    while not all(c.done() for c in callers):  # the last callers wait short of a full batch: pad it
        if 0 < len(waiting) < size and in_flight == 0:
            waiting.extend((loop.create_future(), sample) for _ in range(size - len(waiting)))
            dispatch()
        await asyncio.sleep(0.01)
    jobs.put(None)
    worker.join()
    return finished / wall


async def _in_process(model_config, sample, args, *, closed: bool, rate: float = 0.0) -> dict:
    loop = asyncio.get_running_loop()
    metrics = Metrics()
    runner = await loop.run_in_executor(None, load_runner, model_config, metrics, True)
    await runner.start()

    latencies: list[float] = []
    errors: dict[str, int] = {}
    stop_at = loop.time() + args.duration

    async def one() -> None:
        t0 = loop.time()
        try:
            await runner.infer(InferRequest(model_config.name, sample))
        except EdgeBatcherError as exc:  # open loop past capacity: count it, as a client would see it
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            return
        latencies.append(loop.time() - t0)

    async def caller() -> None:
        while loop.time() < stop_at:
            await one()

    cpu0 = time.thread_time()
    t0 = loop.time()
    if closed:
        await asyncio.gather(*(caller() for _ in range(args.concurrency)))
    else:
        await _poisson_arrivals(runner, model_config.name, sample, rate, stop_at, latencies, errors)
    wall = loop.time() - t0
    loop_cpu = time.thread_time() - cpu0
    stats = runner.statistics()
    await runner.close()
    n = len(latencies)
    worker_io_s = stats["inference_stats"]["compute_input_output"]["ns"] / 1e9
    return {
        "requests": n,
        "throughput_rps": n / wall,
        "offered_rps": rate if not closed else None,
        "errors": errors,
        **_percentiles(latencies),
        "batch_sizes": {str(b["batch_size"]): b["compute_infer"]["count"] for b in stats["batch_stats"]},
        "dispatch_reasons": stats["dispatch_reasons"],
        "padding_ratio": round(stats["padding_ratio"], 4),
        "overhead_us_per_request": (loop_cpu + worker_io_s) / n * 1e6 if n else None,
        "runtime_overhead_us_per_request": ((loop_cpu + worker_io_s) / n * 1e6 - _generator_cost_us(model_config.name, sample))
        if n and closed else None,
        "loop_cpu_us_per_request": loop_cpu / n * 1e6 if n else None,
        "engine_us_per_request": stats["inference_stats"]["compute_infer"]["ns"] / 1e3 / n if n else None,
    }


async def _poisson_arrivals(runner, model: str, sample, rate: float, stop_at: float,
                            latencies: list[float], errors: dict[str, int]) -> None:
    """Open-loop load: requests arrive at Poisson times whatever the answers do, until stop_at;
    returns when every one is answered. Arrivals are timer callbacks and answers done
    callbacks, not a task per arrival: that cost the loop more than the runtime's own work
    and made the phase measure its generator. A timer that fires late submits every arrival
    already due, and latency counts from the scheduled arrival time, so falling behind (the
    generator's or the runtime's) shows in the latencies instead of lowering the load."""
    loop = asyncio.get_running_loop()
    rng = random.Random(1)
    all_answered = loop.create_future()
    outstanding = 0
    next_at = loop.time()

    def finish_if_done() -> None:
        if outstanding == 0 and next_at >= stop_at and not all_answered.done():
            all_answered.set_result(None)

    def count_error(exc: BaseException) -> None:
        if not isinstance(exc, EdgeBatcherError):  # a bug, not load: stop the phase with it
            if not all_answered.done():
                all_answered.set_exception(exc)
            return
        errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1

    def answered(future: asyncio.Future, arrived_at: float) -> None:
        nonlocal outstanding
        outstanding -= 1
        if future.exception() is None:
            latencies.append(loop.time() - arrived_at)
        else:
            count_error(future.exception())
        finish_if_done()

    def arrive() -> None:
        nonlocal next_at, outstanding
        now = loop.time()
        while next_at <= now and next_at < stop_at:
            try:
                future = runner.infer(InferRequest(model, sample))
            except EdgeBatcherError as exc:
                count_error(exc)
            else:
                outstanding += 1
                future.add_done_callback(functools.partial(answered, arrived_at=next_at))
            next_at += rng.expovariate(rate)
        if next_at < stop_at:
            loop.call_at(next_at, arrive)
        finish_if_done()

    arrive()
    await all_answered


def _generator_cost_us(model: str, sample) -> float:
    """Event-loop CPU per request of the closed-loop load generator itself: the same caller
    coroutine (building the InferRequest, awaiting, timing, recording) around a future that is
    already resolved. Subtracted to report the runtime's own overhead."""
    async def measure() -> float:
        loop = asyncio.get_running_loop()
        latencies: list[float] = []

        async def one() -> None:
            t0 = loop.time()
            InferRequest(model, sample)
            future = loop.create_future()
            future.set_result(None)
            await future
            latencies.append(loop.time() - t0)

        n = 20000
        cpu0 = time.thread_time()
        for _ in range(n):
            await one()
        return (time.thread_time() - cpu0) / n * 1e6

    # A fresh loop on a thread: this runs inside the benchmark's own event loop.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, measure()).result()


def _percentiles(latencies: list[float]) -> dict:
    if not latencies:
        return {"p50_ms": None, "p95_ms": None, "p99_ms": None}
    a = np.array(latencies) * 1e3
    return {f"p{q}_ms": float(np.percentile(a, q)) for q in (50, 95, 99)}


def _median_run(runs: list[dict]) -> dict:
    """The run with the median throughput (its other figures belong to the same run)."""
    ordered = sorted(runs, key=lambda r: r["throughput_rps"])
    best = dict(ordered[len(ordered) // 2])
    best["throughput_rps_all"] = [round(r["throughput_rps"], 1) for r in runs]
    return best


class _DaemonSubprocess:
    """`edge-batcher serve` for one model on a private socket, for the transport phases."""

    def __init__(self, config, model: str, extra_env: dict | None = None):
        self.socket = Path(tempfile.mkdtemp(prefix="edge-batcher-bench-")) / "bench.sock"
        cmd = [sys.executable, "-m", "edge_batcher.cli", "serve", "--unix-socket", str(self.socket),
               "--models", config.models.repository, "--log-level", "WARNING"]
        if config.source != "<defaults>":
            cmd[4:4] = ["--config", config.source]
        env = dict(os.environ, EDGE_BATCHER_MODELS_LOAD=model, **(extra_env or {}))
        self.proc = subprocess.Popen(cmd, env=env)

    async def __aenter__(self) -> "_DaemonSubprocess":
        from .client import AsyncClient

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


async def _over_unix_socket(config, model: str, sample, args) -> dict:
    from .client import AsyncClient

    async with _DaemonSubprocess(config, model) as daemon, AsyncClient(f"unix://{daemon.socket}") as client:
        loop = asyncio.get_running_loop()
        runs = []
        for _ in range(args.repeat):
            latencies: list[float] = []
            stop_at = loop.time() + args.duration

            async def caller() -> None:
                while loop.time() < stop_at:
                    t0 = loop.time()
                    await client.infer(model, sample)
                    latencies.append(loop.time() - t0)

            t0 = loop.time()
            await asyncio.gather(*(caller() for _ in range(args.concurrency)))
            wall = loop.time() - t0
            runs.append({"requests": len(latencies), "throughput_rps": len(latencies) / wall, **_percentiles(latencies)})
        result = _median_run(runs)
        stats = await client.stats(model)
        ms = stats["model_stats"][0]
        result["batch_sizes"] = {str(b["batch_size"]): b["compute_infer"]["count"] for b in ms["batch_stats"]}
        result["dispatch_reasons"] = ms["dispatch_reasons"]
        return result


async def _through_mqtt(config, model: str, sample, args) -> dict:
    """A daemon subprocess subscribed on the broker, loaded with MQTT 5 request/response."""
    from .bench_mqtt import bench_mqtt
    from .config import parse_host_port

    host, port = parse_host_port(args.mqtt, "--mqtt")
    prefix = f"edge-batcher/bench-{os.getpid()}"
    env = {"EDGE_BATCHER_MQTT_ENABLED": "true", "EDGE_BATCHER_MQTT_HOST": host,
           "EDGE_BATCHER_MQTT_PORT": str(port), "EDGE_BATCHER_MQTT_TOPIC_PREFIX": prefix,
           "EDGE_BATCHER_MQTT_CLIENT_ID": f"edge-batcher-bench-{os.getpid()}"}
    async with _DaemonSubprocess(config, model, env):
        loop = asyncio.get_running_loop()
        runs = []
        for _ in range(args.repeat):
            # paho's client is blocking: run the load generator off the event loop.
            r = await loop.run_in_executor(None, lambda: bench_mqtt(
                args.mqtt, model=model, topic_prefix=prefix, inputs=sample, duration_s=args.duration,
                concurrency=min(args.concurrency, 32)))
            runs.append(r)
        return _median_run(runs)


def _phases(r: dict) -> list[tuple[str, dict]]:
    """The load phases in the order they ran, each as one row: label and figures."""
    rows = [("in-process, closed loop", r["in_process_closed"]),
            (f"in-process, open loop ({r['in_process_open']['offered_rps']:.0f}/s)", r["in_process_open"]),
            ("in-process, batching off", r["in_process_no_batching"])]
    if "in_process_closed_any_cpu" in r:
        rows.append(("in-process, threads on any CPU", r["in_process_closed_any_cpu"]))
    if "unix_socket_closed" in r:
        rows.append(("Unix socket (binary), closed loop", r["unix_socket_closed"]))
    if "mqtt" in r:
        m = r["mqtt"]
        lat = m["latency_ms"]
        rows.append(("MQTT 5 request/response", {**m, "p50_ms": lat["p50"], "p95_ms": lat["p95"], "p99_ms": lat["p99"]}))
    return rows


def _table(rows: list[list[str]]) -> list[str]:
    """Columns padded to their widest cell; the first left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
            for row in rows]


def _counts(counts: dict | None, order=None) -> str:
    if not counts:
        return "-"
    keys = sorted(counts, key=order) if order else sorted(counts, key=lambda k: -counts[k])
    return " ".join(f"{k}:{counts[k]}" for k in keys if counts[k])


def format_report(r: dict) -> str:
    placement = (f"event loop and engine threads on CPU {r['loop_cpu']}" if r.get("loop_cpu") is not None
                 else "threads on any CPU")
    largest = r["preferred_batch_sizes"][-1]
    lines = [f"model {r['model']}, preferred sizes {r['preferred_batch_sizes']}, {r['concurrency']} closed-loop "
             f"callers, {r['duration_s']} s x {r['repeat']} run(s) per phase (the median run), {placement}", ""]

    speed = [["phase", "req/s", "runs", "p50 ms", "p95 ms", "p99 ms", "errors"],
             [f"raw engine ceiling (size {largest})", f"{r['raw_ceiling_rps']:.0f}", "", "", "", "", ""],
             ["minimal asyncio batcher (reference)", f"{r['minimal_batcher_rps']:.0f}", "", "", "", "", ""]]
    batching = [["phase", "batches by size", "why batches left", "padding", "overhead us/req (runtime's own)",
                 "engine us/req"]]
    for label, p in _phases(r):
        runs = p.get("throughput_rps_all") or []
        speed.append([label, f"{p['throughput_rps']:.0f}",
                      f"{min(runs):.0f}-{max(runs):.0f}" if len(runs) > 1 else "",
                      f"{p['p50_ms']:.2f}", f"{p['p95_ms']:.2f}", f"{p['p99_ms']:.2f}",
                      _counts(p.get("errors")) if p.get("errors") else ""])
        overhead = p.get("overhead_us_per_request")
        own = p.get("runtime_overhead_us_per_request")
        engine = p.get("engine_us_per_request")
        batching.append([label, _counts(p.get("batch_sizes"), order=lambda k: -int(k)),
                         _counts(p.get("dispatch_reasons")),
                         "-" if p.get("padding_ratio") is None else f"{p['padding_ratio']:.2f}",
                         "-" if overhead is None else f"{overhead:.1f}" + ("" if own is None else f" ({own:.1f})"),
                         "-" if engine is None else f"{engine:.1f}"])
    lines += _table(speed) + [""] + _table(batching) + [""]
    lines.append(f"speedup over no batching: {r['speedup_over_no_batching']:.2f}x")
    lines.append(f"throughput / raw ceiling: {r['ratio_to_ceiling']:.2f} "
                 f"(the minimal batcher: {r['minimal_batcher_rps'] / r['raw_ceiling_rps']:.2f}; "
                 f"the runtime / the minimal batcher: {r['in_process_closed']['throughput_rps'] / r['minimal_batcher_rps']:.2f})")
    if "in_process_closed_any_cpu" in r:
        gain = r["in_process_closed"]["throughput_rps"] / r["in_process_closed_any_cpu"]["throughput_rps"]
        lines.append(f"one shared CPU vs threads on any CPU: {gain:.2f}x")
    if "mqtt" in r:
        from .bench_mqtt import format_mqtt_report

        lines += ["", format_mqtt_report(r["mqtt"])]
    return "\n".join(lines)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'edge-batcher[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only: no display on a device or in CI
    import matplotlib.pyplot as plt

    return plt


def plot_report(r: dict, path: Path) -> None:
    """Throughput, p50/p99 latency and the batch-size mix per phase, in one PNG."""
    plt = _pyplot()
    phases = _phases(r)
    labels = [label for label, _ in phases]
    y = np.arange(len(phases))
    legend = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.16), "ncol": 2, "fontsize": 8, "frameon": False}
    fig, (ax_rps, ax_lat, ax_mix) = plt.subplots(1, 3, figsize=(15, 0.55 * len(phases) + 2.8), sharey=True)
    ax_rps.barh(y, [p["throughput_rps"] for _, p in phases], color="tab:blue")
    for value, name, style in ((r["raw_ceiling_rps"], f"raw engine ceiling (size {r['preferred_batch_sizes'][-1]})", "--"),
                               (r["minimal_batcher_rps"], "minimal asyncio batcher", ":")):
        ax_rps.axvline(value, color="black", linestyle=style, linewidth=1, label=name)
    ax_rps.set_xlabel("requests/s (median run)")
    ax_rps.legend(**legend)
    ax_rps.set_yticks(y, labels)
    ax_rps.invert_yaxis()

    height = 0.38
    ax_lat.barh(y - height / 2, [p["p50_ms"] for _, p in phases], height, label="p50", color="tab:green")
    ax_lat.barh(y + height / 2, [p["p99_ms"] for _, p in phases], height, label="p99", color="tab:red")
    ax_lat.set_xscale("log")
    ax_lat.set_xlabel("latency, ms (log scale)")
    ax_lat.legend(**legend)

    sizes = sorted({int(s) for _, p in phases for s in (p.get("batch_sizes") or {})})
    left = np.zeros(len(phases))
    colors = plt.get_cmap("viridis")
    for i, size in enumerate(sizes):
        shares = []
        for _, p in phases:
            counts = p.get("batch_sizes") or {}
            total = sum(counts.values())
            shares.append(counts.get(str(size), 0) / total if total else 0.0)
        ax_mix.barh(y, shares, left=left, label=f"size {size}", color=colors(i / max(1, len(sizes) - 1)))
        left += shares
    ax_mix.set_xlim(0, 1)
    ax_mix.set_xlabel("share of batches by size (where measured)")
    ax_mix.legend(**legend)

    placement = f"loop_cpu {r['loop_cpu']}" if r.get("loop_cpu") is not None else "threads on any CPU"
    fig.suptitle(f"edge-batcher bench: {r['model']}, {r['concurrency']} callers, {r['duration_s']} s x {r['repeat']} "
                 f"runs per phase, {placement}; {r['speedup_over_no_batching']:.2f}x over no batching")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
