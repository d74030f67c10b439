"""`bench --url`: the transport phases against a daemon already running (the installed service,
a peer), on the models it serves (or --model). Per model: closed-loop callers over the URL, and
with --mqtt the same through the broker it is subscribed on. The engine and in-process phases
load the model in this process, which a running daemon's models are not: they are skipped, and
the results say so. Inputs are random data of the shapes the daemon's metadata gives."""

from __future__ import annotations

import sys

import numpy as np

from ..client import AsyncClient
from ..errors import ConfigError
from ..progress import Progress
from ..types import DATATYPE_TO_NUMPY
from .transport_phases import MQTT_WARMUP_S, closed_loop_over, through_broker

SKIPPED = ("raw engine ceiling, minimal asyncio batcher and in-process phases: they load the model "
           "in this process; run `edge-batcher bench` without --url for them")
FREE_DIM = 16  # a dimension the metadata leaves free (-1) and no sequence bucket sizes


async def bench_url(args) -> dict:
    async with AsyncClient(args.url, token=args.token) as client:
        served = [m["name"] for m in await client.models()]
        if args.model is not None and args.model not in served:
            raise ConfigError(f"--model {args.model}: the daemon at {args.url} serves {', '.join(served) or 'none'}")
        names = [args.model] if args.model is not None else served
        metadata = {name: await client.model_metadata(name) for name in names}
    print(f"bench: skipped: {SKIPPED}", file=sys.stderr)
    d, n = args.duration, args.repeat
    plan = [n * d, n * (d + MQTT_WARMUP_S)] if args.mqtt else [n * d]
    progress = Progress("bench", len(plan) * len(names), weights=plan * len(names))
    models = []
    for name in names:
        meta = metadata[name]
        params = meta.get("parameters", {})
        sample = sample_inputs(meta)
        r = {"model": name, "preferred_batch_sizes": params.get("preferred_batch_sizes"),
             "concurrency": args.concurrency, "duration_s": d, "repeat": n}
        progress.step(f"{name}: closed loop over {args.url}, {n} run(s)")
        r["url_closed"] = await closed_loop_over(args.url, args.token, name, sample, args)
        if args.mqtt:
            progress.step(f"{name}: MQTT through {args.mqtt}, {n} run(s)")
            r["mqtt"] = await through_broker(args.mqtt, args.mqtt_prefix, name, sample, args)
        models.append(r)
    progress.close()
    return {"url": args.url, "skipped": SKIPPED, "models": models}


def sample_inputs(metadata: dict) -> dict[str, np.ndarray]:
    """One request's inputs (one row) for a model as its v2 metadata describes it: random
    numbers, zeros and ones for integers and booleans, a short text for BYTES; a free dimension
    gets the smallest sequence bucket, as the in-process phases send."""
    rng = np.random.default_rng(0)
    buckets = metadata.get("parameters", {}).get("sequence_buckets") or []
    free = min(buckets) if buckets else FREE_DIM
    inputs = {}
    for spec in metadata["inputs"]:
        shape = [1] + [d if d > 0 else free for d in spec["shape"][1:]]
        if spec["datatype"] == "BYTES":
            inputs[spec["name"]] = np.full(shape, b"edge-batcher", dtype=object)
            continue
        dtype = DATATYPE_TO_NUMPY[spec["datatype"]]
        if dtype.kind == "f":
            inputs[spec["name"]] = rng.standard_normal(shape).astype(dtype)
        else:
            inputs[spec["name"]] = rng.integers(0, 2, shape).astype(dtype)
    return inputs
