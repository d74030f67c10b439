"""Typed settings: the daemon's TOML config (model.toml's settings are in model_config.py).

Everything is validated on load. An unknown key, a wrong type or an impossible value raises
ConfigError with a message naming the file, the key and what was expected, so start-up stops
with a sentence a user can act on. Relative paths in a config file are resolved against the
directory of that file.

Environment overrides: EDGE_BATCHER_<SECTION>_<KEY>, e.g. EDGE_BATCHER_SERVER_UNIX_SOCKET or
EDGE_BATCHER_MODELS_REPOSITORY. CLI flags (applied by the CLI) override both.

The model settings and the shared builder are re-exported here: `from edge_batcher.config import
ModelConfig, load_model_config, build_dataclass` keeps working.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_origin, get_type_hints

from .errors import ConfigError
from .model_config import (
    MODEL_KEYS,
    BatchingSettings,
    ExecutionProvider,
    ModelConfig,
    OnnxRuntimeSettings,
    SequenceSettings,
    TensorOverride,
    backend_settings,
    discover_models,
    load_model_config,
)
from .toml_settings import build_dataclass, check_positive, read_toml

__all__ = [
    "ENV_PREFIX", "LOG_LEVELS", "DAEMON_SECTIONS", "ServerSettings", "ModelsSettings", "MemorySettings",
    "StreamMapping", "MqttSettings", "PeerSettings", "OffloadSettings", "DaemonConfig", "resolve_socket_path",
    "load_config", "read_secret", "parse_host_port", "every_setting",
    # re-exported from model_config.py and toml_settings.py
    "MODEL_KEYS", "ExecutionProvider", "OnnxRuntimeSettings", "SequenceSettings", "BatchingSettings",
    "TensorOverride", "ModelConfig", "backend_settings", "load_model_config", "discover_models",
    "build_dataclass",
]  # fmt: skip

ENV_PREFIX = "EDGE_BATCHER_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


# --------------------------------------------------------------------------- daemon config


@dataclass
class ServerSettings:
    # "auto": $RUNTIME_DIRECTORY (systemd), else $XDG_RUNTIME_DIR/edge-batcher, else
    # /tmp/edge-batcher-<uid>: a path a normal user can create when not under systemd.
    unix_socket: str = "auto"
    socket_mode: str = "0660"
    http: str = ""  # "HOST:PORT" also serves the API on TCP; empty: Unix socket only
    # The KServe v2 gRPC API (the `grpc` extra) on each of these addresses: "HOST:PORT" (TCP: the
    # token and TLS settings below apply) or "unix:PATH" (mode socket_mode). Empty: no gRPC.
    grpc: list[str] = field(default_factory=list)
    # TCP only (the Unix socket is protected by its file mode): a bearer token is required
    # whenever http is set; from token or, better, token_file. TLS when cert and key are set.
    token: str = ""
    token_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    max_body_bytes: int = 16 * 1024 * 1024
    # Limits every listener shares, HTTP and gRPC (transports/edge.py, docs/http.md): bytes all
    # request bodies and messages in progress may hold at once (503 beyond; 0: 4 x
    # max_body_bytes), open connections on every listener together (within the descriptor
    # limit; also gRPC's calls in progress), time allowed to an idle connection or one still
    # sending its header, and to send a whole body (408 beyond).
    max_inflight_body_bytes: int = 0
    max_connections: int = 512
    idle_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    drain_timeout_s: float = 30.0
    log_level: str = "INFO"
    log_format: str = "auto"  # auto | plain | journald | json
    # Whether the event loop and the engine worker threads share one CPU (cpu_affinity.py):
    # "auto" (measured after warm-up, placement.py), "off", or a CPU number as a string ("3").
    loop_cpu: str = "auto"
    # Once ready, move the objects alive then out of the cyclic GC's full collections, which
    # otherwise stop the event loop for tens of ms (gc_freeze.py); again after every unload.
    gc_freeze: bool = True
    # Triton's system shared memory (shared_memory/regions.py, docs/api.md): regions registered at
    # once (each holds 2 descriptors), their byte_size together, and the uids besides the daemon's
    # own whose /dev/shm objects may be registered.
    shm_max_regions: int = 32
    shm_max_bytes: int = 1 << 30
    shm_allowed_uids: list[int] = field(default_factory=list)


@dataclass
class ModelsSettings:
    repository: str = "engines"
    # Empty: every model found in the repository; else only these names.
    load: list[str] = field(default_factory=list)
    warmup: bool = True


@dataclass
class MemorySettings:
    probe: str = "auto"  # auto | jetson | cuda | nvml | cpu | fixed
    budget_mb: float = 0.0  # > 0: a fixed budget instead of the probe's free memory
    reserve_fraction: float = 0.1
    headroom_mb: float = 64.0
    refresh_interval_s: float = 1.0
    check_interval_s: float = 5.0  # how often, while serving, the memory in use is compared with the plan
    # At load, measure one batch per ONNX model in a subprocess and scale the activation
    # estimate to what ONNX Runtime really allocated (docs/memory.md). Costs a second or two
    # and a second copy of the weights briefly: off by default on small devices.
    calibrate_at_warmup: bool = False


@dataclass
class StreamMapping:
    """Plain sensor topics routed to a model (no v2 envelope on the wire)."""

    topic: str  # MQTT topic filter, e.g. "sensors/+/vibration"
    model: str
    input: str = ""  # the model input the payload fills; empty: the model's only input
    encoding: str = "json"  # json: a JSON number array | raw: little-endian bytes of the input's datatype
    output_topic: str = ""  # template; {1}, {2}... are the filter's wildcard segments, e.g. "results/{1}/vibration"


@dataclass
class MqttSettings:
    enabled: bool = False
    host: str = "localhost"
    port: int = 1883
    client_id: str = ""  # empty: edge-batcher-<device id>-<hash of the Unix socket path>
    device_id: str = ""  # empty: the host name
    topic_prefix: str = ""  # empty: edge-batcher/<device id>
    shared_group: str = ""  # non-empty: subscribe as $share/<group>/... to split requests across daemons
    qos: int = 1
    keepalive_s: int = 30
    session_expiry_s: int = 3600  # persistent session: requests published while we restart are kept
    username: str = ""
    password: str = ""
    password_file: str = ""  # read at start; never logged
    tls: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    tls_insecure: bool = False  # skip hostname verification (testing only)
    max_inflight: int = 20  # QoS 1/2 messages in flight towards the broker
    max_queued: int = 1000  # outgoing messages buffered while disconnected
    max_pending: int = 256  # messages answered at once (and the MQTT 5 Receive Maximum)
    max_held_bytes: int = 32 * 1024 * 1024  # received, unanswered messages held in memory, payload + ~2 KiB each
    reconnect_min_s: float = 1.0
    reconnect_max_s: float = 30.0
    streams: list[StreamMapping] = field(default_factory=list)


@dataclass
class PeerSettings:
    """A nearby server speaking KServe v2: another edge-batcher, Triton, MLServer, OVMS."""

    url: str  # http://host:port or https://host:port
    name: str = ""  # for logs and metrics; default: the URL
    token: str = ""
    token_file: str = ""
    ca_file: str = ""  # verify the peer's TLS certificate against this CA (default: system CAs)
    tls_insecure: bool = False  # testing only
    binary: bool = True  # use the binary tensor extension when the peer advertises it
    model_map: dict[str, str] = field(default_factory=dict)  # local model name -> peer model name


@dataclass
class OffloadSettings:
    enabled: bool = False
    peers: list[PeerSettings] = field(default_factory=list)  # tried in order
    remote_only: list[str] = field(default_factory=list)  # models that always run on a peer
    # Send a backlog to the peer when the local queue would miss deadlines and the peer's
    # measured latency would meet them.
    offload_on_backlog: bool = True
    health_interval_s: float = 5.0
    request_timeout_s: float = 30.0  # upper bound; each request's own deadline is tighter
    breaker_failures: int = 3  # consecutive failures/timeouts that open a peer's breaker
    breaker_reset_s: float = 10.0  # open -> half-open after this long
    max_rows: int = 64  # largest batch sent to a peer in one request


@dataclass
class DaemonConfig:
    server: ServerSettings = field(default_factory=ServerSettings)
    models: ModelsSettings = field(default_factory=ModelsSettings)
    memory: MemorySettings = field(default_factory=MemorySettings)
    mqtt: MqttSettings = field(default_factory=MqttSettings)
    offload: OffloadSettings = field(default_factory=OffloadSettings)
    source: str = "<defaults>"  # the file it was loaded from
    # "section.key" -> where its value came from: "config file", "environment VAR" or a CLI
    # flag (set by the CLI); absent: the default. `edge-batcher config` prints them.
    origins: dict[str, str] = field(default_factory=dict)

    def socket_path(self) -> Path:
        return resolve_socket_path(self.server.unix_socket)

    def repository_path(self) -> Path:
        return Path(self.models.repository)


DAEMON_SECTIONS = {
    "server": ServerSettings, "models": ModelsSettings, "memory": MemorySettings, "mqtt": MqttSettings,
    "offload": OffloadSettings,
}  # fmt: skip
SECRET_KEYS = ("token", "password")  # printed as set or not, never as their value


def every_setting(config: DaemonConfig) -> dict[str, tuple[object, str]]:
    """"section.key" -> (effective value, where it came from) for every daemon setting
    (`edge-batcher config`)."""
    out: dict[str, tuple[object, str]] = {}
    for section in DAEMON_SECTIONS:
        table = getattr(config, section)
        for f in dataclasses.fields(table):
            key = f"{section}.{f.name}"
            value = getattr(table, f.name)
            shown = ("(set)" if value else "") if f.name in SECRET_KEYS else _plain(value)
            out[key] = (shown, config.origins.get(key, "default"))
    return out


def _plain(value: object) -> object:
    """Settings tables ([[mqtt.streams]], [[offload.peers]]) as dicts, for printing."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def resolve_socket_path(value: str, environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if value and value != "auto":
        return Path(value)
    if env.get("RUNTIME_DIRECTORY"):
        return Path(env["RUNTIME_DIRECTORY"].split(":")[0]) / "edge-batcher.sock"
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "edge-batcher" / "edge-batcher.sock"
    return Path(f"/tmp/edge-batcher-{os.getuid()}") / "edge-batcher.sock"


def load_config(path: str | Path | None, environ: dict[str, str] | None = None) -> DaemonConfig:
    """Load and validate the daemon config; None gives the built-in defaults (+ env overrides)."""
    env = os.environ if environ is None else environ
    raw: dict[str, Any] = {}
    source = "<defaults>"
    base = Path.cwd()
    if path is not None:
        path = Path(path)
        raw = read_toml(path)
        source = str(path)
        base = path.resolve().parent
    config = DaemonConfig(source=source)
    _check_env_names(env)
    for key in raw:
        if key not in DAEMON_SECTIONS:
            raise ConfigError(
                f"{source}: unknown section [{key}]; expected one of "
                + ", ".join(f"[{s}]" for s in DAEMON_SECTIONS)
            )
    for section, cls in DAEMON_SECTIONS.items():
        table = raw.get(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: [{section}] must be a table")
        table = dict(table)
        overrides = _env_overrides(section, cls, env)
        config.origins.update({f"{section}.{key}": "config file" for key in table})
        config.origins.update({f"{section}.{key}": f"environment {env_name(section, key)}" for key in overrides})
        table.update(overrides)
        setattr(config, section, build_dataclass(cls, table, f"{source}: [{section}]"))
    _validate_daemon(config, source)
    repo = Path(config.models.repository)
    if not repo.is_absolute():
        config.models.repository = str((base / repo).resolve())
    return config


def _validate_daemon(config: DaemonConfig, source: str) -> None:
    s = config.server
    if s.log_level.upper() not in LOG_LEVELS:
        raise ConfigError(
            f"{source}: [server] log_level: expected one of {', '.join(LOG_LEVELS)}, got {s.log_level!r}"
        )
    s.log_level = s.log_level.upper()
    if s.log_format not in ("auto", "plain", "journald", "json"):
        raise ConfigError(
            f"{source}: [server] log_format: expected auto, plain, journald or json, got {s.log_format!r}"
        )
    if s.loop_cpu not in ("auto", "off") and not s.loop_cpu.isdigit():
        raise ConfigError(
            f"{source}: [server] loop_cpu: expected \"auto\", \"off\" or a CPU number like \"3\", got {s.loop_cpu!r}"
        )
    try:
        mode = int(s.socket_mode, 8)
    except ValueError:
        raise ConfigError(
            f"{source}: [server] socket_mode: expected an octal string like \"0660\", got {s.socket_mode!r}"
        ) from None
    if not 0 <= mode <= 0o777:
        raise ConfigError(f"{source}: [server] socket_mode: {s.socket_mode!r} is not a file mode")
    if s.http:
        parse_host_port(s.http, f"{source}: [server] http")
    for address in s.grpc:
        if not address.startswith("unix:"):
            parse_host_port(address, f"{source}: [server] grpc")
        elif len(address) == len("unix:"):
            raise ConfigError(f"{source}: [server] grpc: expected unix:PATH, got {address!r}")
    check_positive(s.max_body_bytes, f"{source}: [server] max_body_bytes")
    check_positive(s.max_inflight_body_bytes, f"{source}: [server] max_inflight_body_bytes", allow_zero=True)
    if s.max_inflight_body_bytes == 0:
        s.max_inflight_body_bytes = 4 * s.max_body_bytes
    elif s.max_inflight_body_bytes < s.max_body_bytes:
        raise ConfigError(f"{source}: [server] max_inflight_body_bytes ({s.max_inflight_body_bytes}) must be at "
                          f"least max_body_bytes ({s.max_body_bytes}), or no body of the largest size is ever accepted")
    check_positive(s.max_connections, f"{source}: [server] max_connections")
    check_positive(s.idle_timeout_s, f"{source}: [server] idle_timeout_s")
    check_positive(s.body_timeout_s, f"{source}: [server] body_timeout_s")
    check_positive(s.shm_max_regions, f"{source}: [server] shm_max_regions", allow_zero=True)
    check_positive(s.shm_max_bytes, f"{source}: [server] shm_max_bytes", allow_zero=True)
    if any(isinstance(uid, bool) or not isinstance(uid, int) or uid < 0 for uid in s.shm_allowed_uids):
        raise ConfigError(f"{source}: [server] shm_allowed_uids: expected user ids (integers >= 0), "
                          f"got {s.shm_allowed_uids!r}")
    if bool(s.tls_cert) != bool(s.tls_key):
        raise ConfigError(f"{source}: [server] tls_cert and tls_key go together: set both or neither")
    o = config.offload
    if o.enabled and not o.peers:
        raise ConfigError(f"{source}: [offload] enabled = true needs at least one [[offload.peers]] entry")
    for i, peer in enumerate(o.peers):
        if not peer.url.startswith(("http://", "https://")):
            raise ConfigError(
                f"{source}: [[offload.peers]] #{i + 1} url: expected http://HOST:PORT or https://..., got {peer.url!r}"
            )
    check_positive(o.health_interval_s, f"{source}: [offload] health_interval_s")
    check_positive(o.request_timeout_s, f"{source}: [offload] request_timeout_s")
    check_positive(o.breaker_failures, f"{source}: [offload] breaker_failures")
    check_positive(o.breaker_reset_s, f"{source}: [offload] breaker_reset_s")
    check_positive(o.max_rows, f"{source}: [offload] max_rows")
    check_positive(s.drain_timeout_s, f"{source}: [server] drain_timeout_s", allow_zero=True)
    m = config.memory
    if not 0.0 <= m.reserve_fraction < 1.0:
        raise ConfigError(
            f"{source}: [memory] reserve_fraction: expected 0 <= value < 1, got {m.reserve_fraction}"
        )
    check_positive(m.budget_mb, f"{source}: [memory] budget_mb", allow_zero=True)
    check_positive(m.headroom_mb, f"{source}: [memory] headroom_mb", allow_zero=True)
    check_positive(m.refresh_interval_s, f"{source}: [memory] refresh_interval_s")
    check_positive(m.check_interval_s, f"{source}: [memory] check_interval_s")


def read_secret(value: str, file: str, where: str) -> str:
    """A secret from config or, preferably, from a file (first line, stripped). Never logged."""
    if file:
        try:
            return Path(file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"{where}_file: cannot read {file}: {exc.strerror}") from None
        except UnicodeDecodeError:  # the secret itself is never quoted
            raise ConfigError(f"{where}_file: {file} is not UTF-8 text") from None
    return value


def parse_host_port(value: str, where: str = "address") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{where}: expected HOST:PORT (e.g. 127.0.0.1:8000), got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def env_name(section: str, key: str) -> str:
    return f"{ENV_PREFIX}{section.upper()}_{key.upper()}"


# EDGE_BATCHER_ variables that are not settings, read where they apply.
OTHER_ENV = ("EDGE_BATCHER_CUDA_BINDING",)  # engines/cuda_api.py


def _check_env_names(env: Mapping[str, str]) -> None:
    """An EDGE_BATCHER_ variable that names no setting is an error, like an unknown TOML key: a
    misspelled override (EDGE_BATCHER_SERVER_DRAIN_TIMOUT_S) would otherwise do nothing, silently."""
    known = {env_name(section, f.name) for section, cls in DAEMON_SECTIONS.items() for f in dataclasses.fields(cls)}
    for var in sorted(env):
        if var.startswith(ENV_PREFIX) and var not in known and var not in OTHER_ENV:
            near = difflib.get_close_matches(var, sorted(known) + list(OTHER_ENV), n=1)
            raise ConfigError(f"environment {var}: no such setting" + (f"; did you mean {near[0]}?" if near else
                              f" (settings are {ENV_PREFIX}<SECTION>_<KEY>, e.g. {env_name('server', 'log_level')})"))


def _env_overrides(section: str, cls: type, env: Mapping[str, str]) -> dict[str, Any]:
    hints = get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        var = env_name(section, f.name)
        if var not in env:
            continue
        text, hint = env[var], hints[f.name]
        try:
            if hint is bool:
                lowered = text.strip().lower()
                if lowered not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(text)
                out[f.name] = lowered in ("1", "true", "yes")
            elif hint is int:
                out[f.name] = int(text)
            elif hint is float:
                out[f.name] = float(text)
            elif get_origin(hint) is list:
                out[f.name] = json.loads(text) if text.strip().startswith("[") else [
                    t.strip() for t in text.split(",") if t.strip()
                ]
            else:
                out[f.name] = text
        except ValueError:
            raise ConfigError(f"environment {var}: expected {getattr(hint, '__name__', hint)}, got {text!r}") from None
    return out
