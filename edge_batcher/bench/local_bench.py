"""The bench of one model, measured side by side in one run, in this order:

1. the raw engine ceiling: the engine's infer() called directly at the largest preferred size,
   and a minimal asyncio batcher on the same engine (a reference for what the interpreter
   allows, engine_phases.py);
2. in-process load through the full runtime (queue, policy, worker thread, futures), closed
   loop (N concurrent callers) and open loop (Poisson arrivals at each --rate): in_process.py;
3. the same closed-loop load with batching off (preferred sizes [1]); and, when the event loop
   and engine threads share one CPU ([server] loop_cpu), the closed loop without that;
4. optionally (--unix) the same closed-loop load through a daemon subprocess on a Unix socket,
   with the binary tensor extension, and (--mqtt) through an MQTT broker: daemon_phases.py.
"""

from __future__ import annotations

import asyncio
import copy
import statistics
import time
from pathlib import Path

from .. import placement
from ..cpu_affinity import choose as choose_cpu
from ..cpu_affinity import pin_this_thread
from ..metrics import Metrics
from ..progress import Progress
from ..runtime import discover_models, load_runner
from .daemon_phases import DAEMON_STARTUP_S, over_unix_socket, through_mqtt
from .engine_phases import minimal_batcher, raw_ceiling
from .figures import median_run
from .in_process import in_process
from .open_loop import GENERATOR_ALONE_S
from .transport_phases import MQTT_WARMUP_S


async def bench_local(config, args) -> dict:
    (mc,) = discover_models(Path(config.models.repository), [args.model])
    loop = asyncio.get_running_loop()
    # The thread placement the daemon uses ([server] loop_cpu): this thread is the event loop.
    cpu = choose_cpu(config.server.loop_cpu)
    pin_this_thread(cpu)
    started = time.monotonic()
    runner = await loop.run_in_executor(None, load_runner, mc, Metrics(), True)
    load_s = time.monotonic() - started  # each in-process run loads a fresh runner: the plan counts it
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
    graphs = runner.cuda_graphs
    plan = _plan(args, load_s, pinned=cpu is not None, auto=auto, graphs=graphs)
    progress = Progress("bench", len(plan), weights=plan)

    def runs(label: str):
        for i in range(n):
            progress.step(f"{label}, run {i + 1}/{n}")
            yield i

    ceilings = [raw_ceiling(engine, engine_sample, largest, args.duration) for _ in runs("raw engine ceiling")]
    out["raw_ceiling_rps"] = statistics.median(ceilings)
    plain_infer = getattr(engine, "infer_without_graphs", None) if graphs else None
    if plain_infer is not None:  # the same engine without its graphs: what they gain
        plain = [raw_ceiling(engine, engine_sample, largest, args.duration, plain_infer)
                 for _ in runs("raw engine ceiling without CUDA graphs")]
        out["raw_ceiling_plain_rps"] = statistics.median(plain)
    floors = [await minimal_batcher(engine, engine_sample, largest, args) for _ in runs("minimal asyncio batcher")]
    out["minimal_batcher_rps"] = statistics.median(floors)
    await runner.close()

    def fresh_phase(*a, **kw):  # with the collector as the daemon would have it
        return in_process(*a, gc_freeze=config.server.gc_freeze, **kw)

    batched = [await fresh_phase(mc, sample, args, closed=True) for _ in runs("in-process, closed loop")]
    out["in_process_closed"] = median_run(batched)
    # Open loop at several loads: the closed loop's throughput is no capacity for Poisson
    # arrivals (docs/benchmarks.md), so one rate cannot say where the runtime stops keeping up.
    closed_rps = out["in_process_closed"]["throughput_rps"]
    out["in_process_open"] = []
    for rate in args.rate:
        per_s = rate.per_second(closed_rps)
        phase = median_run([await fresh_phase(mc, sample, args, closed=False, rate=per_s)
                            for _ in runs(f"in-process, open loop at {rate}")])
        out["in_process_open"].append({"load": str(rate), **phase})

    unbatched_config = copy.deepcopy(mc)
    unbatched_config.batching.preferred_batch_sizes = [1]
    unbatched_config.batching.max_batch_size = 1
    out["in_process_no_batching"] = median_run(
        [await fresh_phase(unbatched_config, sample, args, closed=True) for _ in runs("in-process, batching off")]
    )
    # From here on this thread runs on every CPU: first the same closed loop with the loop
    # and engine threads free (loop_cpu = "off"), to show what sharing one CPU buys; then
    # only as the load generator of a daemon subprocess, which pins its own threads and
    # must not have to compete for its CPU.
    pin_this_thread(None)
    if cpu is not None:
        out["in_process_closed_any_cpu"] = median_run(
            [await fresh_phase(mc, sample, args, closed=True) for _ in runs("in-process, threads on any CPU")]
        )
    if auto:  # the placement the daemon would choose, measured as it measures, then loaded the same way
        out["in_process_closed_auto"] = median_run(
            [await fresh_phase(mc, sample, args, closed=True, auto_cpu=cpu) for _ in runs("in-process, loop_cpu auto")]
        )
        pin_this_thread(None)
    out["ratio_to_ceiling"] = out["in_process_closed"]["throughput_rps"] / out["raw_ceiling_rps"]
    out["speedup_over_no_batching"] = (
        out["in_process_closed"]["throughput_rps"] / out["in_process_no_batching"]["throughput_rps"]
    )
    if args.unix:
        progress.step(f"Unix socket, a daemon subprocess, {n} run(s)")
        out["unix_socket_closed"] = await over_unix_socket(config, mc.name, sample, args)
    if args.mqtt:
        progress.step(f"MQTT through {args.mqtt}, a daemon subprocess, {n} run(s)")
        out["mqtt"] = await through_mqtt(config, mc.name, sample, args)
    progress.close()
    return out


def _plan(args, load_s: float, *, pinned: bool, auto: bool, graphs: bool = False) -> list[float]:
    """Each step's expected seconds, in the order bench_local announces them: the progress
    estimate weighs the steps left by these (a daemon subprocess's step runs every repeat and
    first starts the daemon: ~4x the others at the defaults)."""
    d, n = args.duration, args.repeat
    run = d + load_s
    calibration = placement.ROUNDS * 2 * placement.SECONDS_PER_RUN
    steps = [d] * ((2 + graphs) * n) + [run] * n  # raw ceiling(s), minimal batcher; closed loop
    steps += [run + GENERATOR_ALONE_S] * (n * len(args.rate))  # open loop, then its generator alone
    steps += [run] * (n * (1 + pinned))  # batching off; threads on any CPU
    steps += [run + calibration] * (n * auto)
    daemon = DAEMON_STARTUP_S + load_s + calibration
    steps += [n * d + daemon] * bool(args.unix)
    steps += [n * (d + MQTT_WARMUP_S) + daemon] * bool(args.mqtt)
    return steps
