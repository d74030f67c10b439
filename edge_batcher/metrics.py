"""Prometheus metrics in text exposition format, without a client library.

Metric names are a public contract (docs/observability.md; deploy/ has a Grafana dashboard and
alert rules built on them): every name gets the prefix `edge_batcher_`, except the standard
`process_*` metrics every Prometheus client library exports (ProcessMetrics), which dashboards
and alerts written for any exporter expect under exactly those names. Updates happen on the
event loop thread only, so no locks.
"""

from __future__ import annotations

import bisect
import gc
import math
import os
import resource
from abc import ABC, abstractmethod
from typing import Any

PREFIX = "edge_batcher_"

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    if not names:
        return ""
    inner = ",".join(f'{n}="{_escape(str(v))}"' for n, v in zip(names, values))
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Metric(ABC):
    kind = ""

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()):
        self.name = PREFIX + name
        self.help = help
        self.label_names = labels

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {tuple(labels)}")
        return tuple(str(labels[n]) for n in self.label_names)

    def labels(self, **labels: str):
        """A child bound to fixed label values: the hot path updates it without building keys."""
        return _Child(self, self._key(labels))

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    @abstractmethod
    def render(self) -> list[str]:
        """The metric's exposition lines: its header and one line per labelled child."""


class _Child:
    __slots__ = ("metric", "key")

    def __init__(self, metric: _Metric, key: tuple[str, ...]):
        # Any: a child serves counters, gauges and histograms alike, and each caller uses only its
        # own metric's method; a cast per update would cost a call on the hot path.
        self.metric: Any = metric
        self.key = key

    def inc(self, amount: float = 1.0) -> None:
        values = self.metric.values
        values[self.key] = values.get(self.key, 0.0) + amount

    def set(self, value: float) -> None:
        self.metric.values[self.key] = float(value)

    def observe(self, value: float) -> None:
        self.metric.observe_key(self.key, value)

    def observe_all(self, values: list[float]) -> None:
        self.metric.observe_all_key(self.key, values)


class Counter(_Metric):
    kind = "counter"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(self._key(labels), 0.0)

    def set_total(self, value: float, **labels: str) -> None:
        """A total counted elsewhere (and only ever growing there), copied in at scrape time."""
        self.values[self._key(labels)] = float(value)

    def render(self) -> list[str]:
        return self.header() + [
            f"{self.name}{_labels(self.label_names, k)} {_number(v)}" for k, v in sorted(self.values.items())
        ]


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        self.values[self._key(labels)] = float(value)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = (), buckets=LATENCY_BUCKETS):
        super().__init__(name, help, labels)
        self.bounds = tuple(buckets)
        self.series: dict[tuple[str, ...], list] = {}  # key -> [bucket counts..., sum, count]

    def observe(self, value: float, **labels: str) -> None:
        self.observe_key(self._key(labels), value)

    def observe_key(self, key: tuple[str, ...], value: float) -> None:
        self.observe_all_key(key, (value,))

    def observe_all_key(self, key: tuple[str, ...], values) -> None:
        """Several observations at once: a batch's requests cost one call, not one each."""
        s = self.series.get(key)
        if s is None:
            s = self.series[key] = [0] * len(self.bounds) + [0.0, 0]
        bounds = self.bounds
        n_bounds = len(bounds)
        for value in values:
            i = bisect.bisect_left(bounds, value)
            if i < n_bounds:
                s[i] += 1
            s[-2] += value
            s[-1] += 1

    def count(self, **labels: str) -> int:
        s = self.series.get(self._key(labels))
        return s[-1] if s else 0

    def render(self) -> list[str]:
        lines = self.header()
        for key, s in sorted(self.series.items()):
            cumulative = 0
            for bound, n in zip(self.bounds, s):
                cumulative += n
                le = _labels(self.label_names + ("le",), key + (_number(bound),))
                lines.append(f"{self.name}_bucket{le} {cumulative}")
            lines.append(f"{self.name}_bucket{_labels(self.label_names + ('le',), key + ('+Inf',))} {s[-1]}")
            lines.append(f"{self.name}_sum{_labels(self.label_names, key)} {_number(s[-2])}")
            lines.append(f"{self.name}_count{_labels(self.label_names, key)} {s[-1]}")
        return lines


class ProcessMetrics:
    """The standard process metrics (names as the Prometheus client libraries export them):
    CPU seconds, resident and virtual memory, open and maximum file descriptors, start time.
    Read from the kernel (through psutil) at each scrape: a few small /proc reads."""

    def __init__(self) -> None:
        import psutil

        self._process = psutil.Process(os.getpid())
        self._start_time = self._process.create_time()

    def render(self) -> list[str]:
        p = self._process
        with p.oneshot():
            cpu = p.cpu_times()
            memory = p.memory_info()
            fds = p.num_fds()
        max_fds = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        rows = [
            ("process_cpu_seconds_total", "counter", "Total user and system CPU time spent in seconds.",
             cpu.user + cpu.system),
            ("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", memory.rss),
            ("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", memory.vms),
            ("process_open_fds", "gauge", "Number of open file descriptors.", fds),
            ("process_max_fds", "gauge", "Maximum number of open file descriptors.",
             float("inf") if max_fds == resource.RLIM_INFINITY else max_fds),
            ("process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.",
             self._start_time),
        ]
        lines = []
        for name, kind, help, value in rows:
            lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name} {_number(value)}"]
        return lines


class GcMetrics:
    """The cyclic garbage collector's counters under the names the Prometheus Python client
    exports (`python_gc_*`, per generation), and how many objects gc_freeze.py keeps out of its
    walks. Read from `gc` at each scrape."""

    def render(self) -> list[str]:
        stats = gc.get_stats()
        lines = []
        for name, help, field in (
            ("python_gc_objects_collected_total", "Objects collected during gc", "collected"),
            ("python_gc_objects_uncollectable_total", "Uncollectable objects found during GC", "uncollectable"),
            ("python_gc_collections_total", "Number of times this generation was collected", "collections"),
        ):
            lines += [f"# HELP {name} {help}", f"# TYPE {name} counter"]
            lines += [f'{name}{{generation="{generation}"}} {s[field]}' for generation, s in enumerate(stats)]
        name = PREFIX + "gc_frozen_objects"
        lines += [f"# HELP {name} Objects moved out of the collector's walks once the daemon was ready ([server] "
                  "gc_freeze), counted again after each unload.",
                  f"# TYPE {name} gauge", f"{name} {gc.get_freeze_count()}"]
        return lines


class Metrics:
    """The daemon's metrics; one instance per runtime (no globals, so tests stay independent)."""

    def __init__(self) -> None:
        self.requests_total = Counter("requests_total", "Requests answered, by model and status.", ("model", "status"))
        self.batches_total = Counter(
            "batches_total", "Batches dispatched, by size, dispatch reason and target.",
            ("model", "size", "reason", "target"),
        )
        self.batch_size = Histogram("batch_size", "Engine batch size (with padding).", ("model",), SIZE_BUCKETS)
        self.queue_seconds = Histogram("queue_seconds", "Time from arrival to dispatch.", ("model",))
        self.request_seconds = Histogram("request_seconds", "Time from arrival to answer.", ("model",))
        self.padding_ratio = Gauge("padding_ratio", "Padding rows / batch rows over all batches so far.", ("model",))
        self.queue_depth = Gauge("queue_depth", "Requests waiting.", ("model",))
        self.memory_budget_bytes = Gauge("memory_budget_bytes", "Bytes the scheduler may plan batches with.")
        self.memory_estimate_bytes = Gauge(
            "memory_estimate_bytes", "Estimated footprint per model, batch size and part.", ("model", "batch", "part")
        )
        self.offloaded_requests_total = Counter(
            "offloaded_requests_total", "Requests sent to a peer, by reason and outcome.",
            ("model", "reason", "outcome")
        )
        self.oom_retries_total = Counter(
            "oom_retries_total", "Batches split and retried after the engine ran out of memory.", ("model",)
        )
        self.memory_resident_bytes = Gauge(
            "memory_resident_bytes", "Memory the plan counts for each loaded model (measured at load, or its "
            "weights where nothing measures it).", ("model",))
        self.memory_planned_bytes = Gauge(
            "memory_planned_bytes", "What the plan says the memory in use is now: its use when the daemon "
            "started, plus the resident memory of the models measured in it, plus batches in flight; by meter "
            "(the device probe's name, or \"process\": this process's resident memory).", ("meter",))
        self.process_resident_bytes = Gauge("process_resident_bytes", "Resident memory of the daemon process.")
        self.memory_waiting = Gauge(
            "memory_waiting", "1 while the model waits in the memory budget's line for memory other models "
            "hold, else 0.", ("model",))
        self.memory_waits_total = Counter(
            "memory_waits_total", "Times the model began waiting for memory other models hold.", ("model",))
        self.memory_wait_seconds_total = Counter(
            "memory_wait_seconds_total", "Seconds the model waited for memory other models hold.", ("model",))
        self.device_memory_bytes = Gauge(
            "device_memory_bytes", "Device memory as the memory probe last read it.", ("kind",)
        )
        # Set by watch_transports() when the daemon has an MQTT transport / offload peers.
        self.mqtt_connected = Gauge("mqtt_connected", "1 while connected and subscribed to the MQTT broker, else 0.")
        self.mqtt_undeliverable_total = Counter(
            "mqtt_undeliverable_total",
            "MQTT messages acknowledged and dropped because their reply cannot be delivered, by reason.", ("reason",),
        )
        self.offload_breaker_open = Gauge(
            "offload_breaker_open", "1 while a peer's circuit breaker is open (no requests sent to it), else 0.",
            ("peer",),
        )
        self.process = ProcessMetrics()
        self.gc = GcMetrics()
        # Called before each render: gauges read from elsewhere (the memory budget) update here.
        self.collectors: list = []

    def all(self) -> list[_Metric]:
        return [m for m in vars(self).values() if isinstance(m, _Metric)]

    def watch_transports(self, mqtt=None, offload=None) -> None:
        """Report the MQTT connection (a transport with .state) and the offload peers' breakers
        (a PeerPool with .status()) at every scrape."""

        def collect() -> None:
            if mqtt is not None:
                self.mqtt_connected.set(1 if mqtt.state == "connected" else 0)
            if offload is not None:
                for peer in offload.status():
                    self.offload_breaker_open.set(1 if peer["state"] == "open" else 0, peer=peer["name"])

        self.collectors.append(collect)

    def render(self) -> str:
        for collect in self.collectors:
            collect()
        lines: list[str] = []
        for metric in self.all():
            lines.extend(metric.render())
        lines.extend(self.process.render())
        lines.extend(self.gc.render())
        return "\n".join(lines) + "\n"
