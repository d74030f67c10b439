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

While it runs, each step is announced on stderr (progress.py: a bar on a terminal, plain lines
in logs); the results are two tables (throughput and latency; batching and overhead), and with
--plot FILE.png a picture of the same (report.py; matplotlib, the `plot` extra).
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

from .. import placement
from ..config import load_config
from ..cpu_affinity import choose as choose_cpu
from ..cpu_affinity import pin_this_thread
from ..errors import EdgeBatcherError
from ..metrics import Metrics
from ..progress import Progress
from ..runtime import discover_models, load_runner
from ..types import InferRequest
from .report import format_report, plot_report, pyplot


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="daemon config (default: built-in defaults)")
    p.add_argument("--models", help="model repository (default: the config's)")
    p.add_argument("--model", default="vibration", help="model to load (default: vibration)")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per phase (default 3)")
    p.add_argument("--concurrency", type=int, default=64, help="closed-loop callers (default 64)")
    p.add_argument("--rate", type=float, default=0.0,
                   help="open-loop arrivals per second (default: 50%% of measured closed-loop throughput)")
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
        pyplot()  # fail now, not after minutes of measuring
    results = asyncio.run(_bench(config, args))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(format_report(results))
    if args.plot is not None:
        plot_report(results, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


async def _bench(config, args) -> dict:
    (mc,) = discover_models(Path(config.models.repository), [args.model])
    loop = asyncio.get_running_loop()
    # The thread placement the daemon uses ([server] loop_cpu): this thread is the event loop.
    cpu = choose_cpu(config.server.loop_cpu)
    pin_this_thread(cpu)
    runner = await loop.run_in_executor(None, load_runner, mc, Metrics(), True)
    engine = runner.engines[0]
    sample = placement.sample_inputs(runner)
    # What the engine itself takes: a model that prepares its inputs (text -> token ids) gets
    # them prepared, as the runner would, for the two phases that bypass the runner.
    prepare = getattr(engine, "prepare", None)
    engine_sample = prepare(sample)[0] if callable(prepare) else sample
    largest = mc.batching.preferred_batch_sizes[-1]
    out: dict = {"model": mc.name, "preferred_batch_sizes": mc.batching.preferred_batch_sizes,
                 "concurrency": args.concurrency, "duration_s": args.duration, "repeat": args.repeat,
                 "loop_cpu": cpu}

    n = args.repeat
    auto = cpu is not None and config.server.loop_cpu == "auto"
    progress = Progress("bench", n * (5 + (cpu is not None) + auto) + bool(args.unix) + bool(args.mqtt))

    def runs(label: str):
        for i in range(n):
            progress.step(f"{label}, run {i + 1}/{n}")
            yield i

    ceilings = [_raw_ceiling(engine, engine_sample, largest, args.duration) for _ in runs("raw engine ceiling")]
    out["raw_ceiling_rps"] = statistics.median(ceilings)
    floors = [await _minimal_batcher(engine, engine_sample, largest, args) for _ in runs("minimal asyncio batcher")]
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
    if auto:  # the placement the daemon would choose, measured as it measures, then loaded the same way
        out["in_process_closed_auto"] = _median_run(
            [await _in_process(mc, sample, args, closed=True, auto_cpu=cpu) for _ in runs("in-process, loop_cpu auto")]
        )
        pin_this_thread(None)
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


async def _in_process(model_config, sample, args, *, closed: bool, rate: float = 0.0,
                      auto_cpu: int | None = None) -> dict:
    """One load phase on a fresh runner; `auto_cpu`: first let placement.choose decide
    between that CPU and any CPU, as the daemon does with loop_cpu = "auto"."""
    loop = asyncio.get_running_loop()
    metrics = Metrics()
    runner = await loop.run_in_executor(None, load_runner, model_config, metrics, True)
    await runner.start()
    choice = await placement.choose(auto_cpu, [runner]) if auto_cpu is not None else None

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
    worker_io_s = stats["execution_ns"]["assemble_and_split"] / 1e9
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
        "runtime_overhead_us_per_request": (
            (loop_cpu + worker_io_s) / n * 1e6 - _generator_cost_us(model_config.name, sample)
        ) if n and closed else None,
        "loop_cpu_us_per_request": loop_cpu / n * 1e6 if n else None,
        "engine_us_per_request": stats["execution_ns"]["engine"] / 1e3 / n if n else None,
        **({"placement_cpu": choice.cpu, "placement": choice.why} if choice else {}),
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
        exc = future.exception()
        if exc is None:
            latencies.append(loop.time() - arrived_at)
        else:
            count_error(exc)
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

    async def __aenter__(self) -> _DaemonSubprocess:
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


async def _over_unix_socket(config, model: str, sample, args) -> dict:
    from ..client import AsyncClient

    async with _DaemonSubprocess(config, model) as daemon, AsyncClient(f"unix://{daemon.socket}") as client:
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
                         **_percentiles(latencies)})
        result = _median_run(runs)
        stats = await client.stats(model)
        ms = stats["model_stats"][0]
        result["batch_sizes"] = {str(b["batch_size"]): b["compute_infer"]["count"] for b in ms["batch_stats"]}
        result["dispatch_reasons"] = ms["dispatch_reasons"]
        return result


async def _through_mqtt(config, model: str, sample, args) -> dict:
    """A daemon subprocess subscribed on the broker, loaded with MQTT 5 request/response."""
    from ..config import parse_host_port
    from .mqtt_load import bench_mqtt

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
