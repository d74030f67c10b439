"""Phases through a daemon's transports, whoever started it: a closed loop over its HTTP API
(a Unix socket or TCP, the async client with binary tensors) and MQTT 5 request/response through
a broker (mqtt_load.py). Answers are counted by status, as a client sees them; the batch sizes
and dispatch reasons are the daemon's statistics over the phase (after minus before), so a
daemon that served traffic before is measured on the bench's requests alone."""

from __future__ import annotations

import asyncio

from ..client import AsyncClient, ClientError, DaemonUnreachable
from .closed_loop import closed_loop
from .figures import by_status, median_run, percentiles

MQTT_WARMUP_S = 0.5  # the MQTT phase's unmeasured start of each run


async def closed_loop_over(url: str, token: str | None, model: str, sample, args) -> dict:
    """`args.concurrency` callers over `url`, `args.repeat` runs of `args.duration` seconds."""
    async with AsyncClient(url, token=token) as client:
        before = await _batch_counts(client, model)
        runs = [await _closed_loop_run(client, model, sample, args) for _ in range(args.repeat)]
        after = await _batch_counts(client, model)
    result = {"url": url, **median_run(runs)}
    if before is not None and after is not None:
        result["batch_sizes"] = _grown(before[0], after[0])
        result["dispatch_reasons"] = _grown(before[1], after[1])
    return result


async def _closed_loop_run(client: AsyncClient, model: str, sample, args) -> dict:
    async def send() -> tuple[int, str | None]:
        try:
            await client.infer(model, sample)
        except DaemonUnreachable:
            raise  # no daemon is no answer to count
        except ClientError as exc:
            return exc.status, None
        return 200, None

    run = await closed_loop(send, args.concurrency, args.duration)
    return {"requests": len(run.latencies), "throughput_rps": run.throughput_rps,
            "statuses": by_status(run.statuses), **percentiles(run.latencies)}


async def _batch_counts(client: AsyncClient, model: str) -> tuple[dict, dict] | None:
    """(executions by batch size, batches by dispatch reason) from the daemon's statistics;
    None for a model without them (a service, a remote model)."""
    try:
        stats = (await client.stats(model))["model_stats"][0]
    except (ClientError, KeyError, IndexError):
        return None
    sizes = {str(b["batch_size"]): b["compute_infer"]["count"] for b in stats.get("batch_stats", [])}
    return sizes, dict(stats.get("dispatch_reasons", {}))


def _grown(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}


async def through_broker(address: str, topic_prefix: str | None, model: str, sample, args) -> dict:
    """MQTT 5 request/response to a daemon subscribed on the broker at `address` (HOST:PORT)
    under `topic_prefix` (None: mqtt_load's default, this host's), `args.repeat` runs."""
    from .mqtt_load import bench_mqtt

    loop = asyncio.get_running_loop()
    runs = []
    for _ in range(args.repeat):
        # paho's client is blocking: run the load generator off the event loop.
        runs.append(await loop.run_in_executor(None, lambda: bench_mqtt(
            address, model=model, topic_prefix=topic_prefix, inputs=sample, duration_s=args.duration,
            warmup_s=MQTT_WARMUP_S, concurrency=min(args.concurrency, 32))))
    return median_run(runs)
