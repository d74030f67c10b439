"""Command line: `edge-batcher serve | infer | models | config | estimate | build-engine | index | bench`.

Errors the user can fix (bad config, unreachable daemon, bad input) print one line to stderr
and exit 2 (config/usage) or 1 (request failed), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import numpy as np

from .config import every_setting, load_config, parse_host_port, read_secret
from .errors import ConfigError, EdgeBatcherError, StorageError
from .model_config import repository_models

log = logging.getLogger("edge_batcher")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a bare `edge-batcher`: what it can do, not "required: command"
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except ConfigError as exc:
        print(f"edge-batcher: configuration error: {exc}", file=sys.stderr)
        return 2
    except StorageError as exc:  # a full or read-only disk: the device's state, said in one line
        print(f"edge-batcher: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (e.g. `edge-batcher infer ... | head`): stop quietly, and keep
        # Python from complaining again while it flushes stdout on exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def package_version() -> str:
    """The installed distribution's version (the source tree's when run uninstalled)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("edge-batcher")
    except PackageNotFoundError:
        from . import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edge-batcher", description="Memory-aware batching inference daemon for edge devices."
    )
    parser.add_argument("--version", action="version", version=f"edge-batcher {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add_settings(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help="TOML config file (default: built-in defaults)")
        p.add_argument("--unix-socket", help="path of the Unix socket to serve on")
        p.add_argument("--http", help="also serve the API on TCP HOST:PORT (needs a token: --token-file)")
        p.add_argument("--grpc", action="append", metavar="ADDRESS",
                       help="also serve the KServe v2 gRPC API (the grpc extra) on HOST:PORT (needs a token) "
                            "or unix:PATH; repeat for several")
        p.add_argument("--token-file", help="file holding the bearer token TCP clients must send")
        p.add_argument("--models", metavar="DIR", help="model repository directory: one subdirectory per model "
                                                       "(to serve only some models: [models] load)")
        p.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")

    p = sub.add_parser("serve", help="run the daemon in the foreground",
                       description="Run the daemon in the foreground: load, measure and warm up every model of the "
                                   "repository, then serve the KServe v2 API on the Unix socket (and TCP, gRPC, "
                                   "MQTT as configured) until SIGTERM, which drains what is queued. The config "
                                   "file, EDGE_BATCHER_<SECTION>_<KEY> variables and these flags set it; "
                                   "`edge-batcher config` prints what it would use.")
    add_settings(p)
    p.add_argument("--check", action="store_true",
                   help="check the configuration, every listener (bound and let go), each model's backend and "
                        "file, and the memory plan, without loading a model; print what was found and exit "
                        "(2 if something would stop the start)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("config", help="print the settings `serve` would use with the same flags: socket path, "
                                      "TCP address, model repository, MQTT, memory, offload")
    add_settings(p)
    p.add_argument("--json", action="store_true", help="print them as JSON (secrets left out)")
    p.add_argument("--socket", action="store_true",
                   help="print only the socket path local clients use: the systemd service's when it "
                        "exists, else the one above (e.g. curl --unix-socket \"$(edge-batcher config --socket)\")")
    p.set_defaults(func=cmd_config)

    def add_target(p: argparse.ArgumentParser) -> None:
        p.add_argument("--url", help="daemon address: unix:///path.sock or http://host:port (default: the systemd "
                                     "service's socket if it exists, else the socket `serve` uses by default)")
        p.add_argument("--token", help="bearer token for a TCP endpoint that requires one")

    p = sub.add_parser("infer", help="send one request and print the outputs")
    p.add_argument("model")
    p.add_argument("--input", "-i", action="append", default=[], metavar="NAME=FILE.npy|JSON",
                   help="an input tensor: a .npy file, or JSON data (nested lists); repeat for several inputs")
    p.add_argument("--request", metavar="FILE.json", help="a whole KServe v2 JSON request instead of --input")
    p.add_argument("--json", action="store_true", help="print outputs as JSON")
    p.add_argument("--timeout-ms", type=float, help="request deadline")
    p.add_argument("--priority", type=int,
                   help="Triton's scale: 1 is the highest; 0 or none: the model's default level")
    add_target(p)
    p.set_defaults(func=cmd_infer)

    p = sub.add_parser("models", help="list the daemon's models with their inputs and outputs")
    p.add_argument("--json", action="store_true")
    add_target(p)
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("ps", help="the daemon's models now: state, instances, batch sizes, memory, queue, "
                                  "batches and requests since start",
                       description="What runs in the daemon, a line per model (as `ollama ps`): its state (READY, or "
                                   "UNAVAILABLE with why), engine instances, the batch sizes it serves, the memory "
                                   "the plan counts for it and what measured it, requests waiting, batches run and "
                                   "requests answered since it loaded.")
    p.add_argument("--json", action="store_true")
    add_target(p)
    p.set_defaults(func=cmd_ps)

    p = sub.add_parser("estimate", help="memory footprint per model, batch size and bucket vs the device budget")
    from .memory.report import add_arguments as add_estimate_arguments

    add_estimate_arguments(p)
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("build-engine",
                       help="build a TensorRT engine with profiles for the preferred sizes (docs/tensorrt.md)")
    from .engines import trt_build

    trt_build.add_arguments(p)
    p.set_defaults(func=trt_build.run)

    p = sub.add_parser("index", help="build and inspect the RAG document index (docs/rag.md)")
    from .rag.index_cli import add_arguments as add_index_arguments

    add_index_arguments(p)
    p.set_defaults(func=cmd_index, parser=p)

    p = sub.add_parser("bench", help="measure throughput and latency (see docs/benchmarks.md)")
    from .bench.command import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_bench)
    return parser


def resolve_settings(args: argparse.Namespace):
    """The daemon configuration: the file (or defaults), env overrides, then the flags; checked
    here, before any model loads, as far as it can be without loading them."""
    config = load_config(args.config)
    flags = config.origins
    if args.unix_socket:
        config.server.unix_socket = args.unix_socket
        flags["server.unix_socket"] = "--unix-socket"
    if args.http is not None:
        if args.http:
            parse_host_port(args.http, "--http")
        config.server.http = args.http
        flags["server.http"] = "--http"
    if args.grpc:
        for address in args.grpc:
            if not address.startswith("unix:"):
                parse_host_port(address, "--grpc")
        config.server.grpc = args.grpc
        flags["server.grpc"] = "--grpc"
    if args.token_file:
        config.server.token_file = args.token_file
        flags["server.token_file"] = "--token-file"
    if args.models:
        config.models.repository = str(Path(args.models).resolve())
        flags["models.repository"] = "--models"
        _check_repository_flag(Path(args.models))
    if args.log_level:
        config.server.log_level = args.log_level.upper()
        flags["server.log_level"] = "--log-level"
    s = config.server
    tcp = [s.http] if s.http else []
    tcp += [a for a in s.grpc if not a.startswith("unix:")]
    if tcp and not read_secret(s.token, s.token_file, "[server] token"):
        # The daemon checks this too, but only after every model has loaded and warmed.
        raise ConfigError(
            f"TCP ({', '.join(tcp)}) needs a bearer token: pass --token-file FILE "
            f"(e.g. `openssl rand -hex 32 > token`) or set [server] token_file"
        )
    return config


def cmd_serve(args: argparse.Namespace) -> int:
    from .daemon import serve
    from .systemd import configure_logging

    config = resolve_settings(args)
    try:
        configure_logging(config.server.log_level, config.server.log_format)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if args.check:
        from .preflight import preflight, print_findings

        return print_findings(preflight(config))
    serve(config)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from .client import DEFAULT_URL, parse_url

    config = resolve_settings(args)
    # The systemd service's socket wins when it exists, as in client.default_url(), which
    # `edge-batcher models/infer` and Client() use without --url.
    service_socket = parse_url(DEFAULT_URL).socket_path or ""
    service_running = os.path.exists(service_socket)
    if args.socket:
        print(service_socket if service_running else config.socket_path())
        return 0
    s, m, mq, o = config.server, config.models, config.mqtt, config.offload
    repo = config.repository_path()
    found = list(repository_models(repo))
    settings = {
        "version": package_version(),
        "config": config.source,
        "unix_socket": str(config.socket_path()),
        "socket_mode": s.socket_mode,
        "http": s.http or None,
        "grpc": s.grpc or None,
        "token": ("from " + s.token_file) if s.token_file else ("set" if s.token else None),
        "tls": bool(s.tls_cert),
        "models_repository": str(repo),
        "models_found": found,
        "models_load": m.load or "all",
        "memory_probe": config.memory.probe,
        "memory_budget_mb": config.memory.budget_mb or None,
        "mqtt": {"broker": f"{mq.host}:{mq.port}", "client_id": mq.client_id or "auto",
                 "device_id": mq.device_id or "auto", "topic_prefix": mq.topic_prefix or "auto"}
                if mq.enabled else None,
        "offload_peers": [p.name or p.url for p in o.peers] if o.enabled else [],
        "service_socket": f"{service_socket} ({'exists' if service_running else 'absent'})",
    }
    every = every_setting(config)
    if args.json:
        print(json.dumps(settings | {"settings": {k: {"value": v, "from": f} for k, (v, f) in every.items()}},
                         indent=2, default=str))
        return 0
    width = max(len(k) for k in settings)
    for key, value in settings.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v}" for k, v in value.items())
        elif isinstance(value, list):
            value = ", ".join(value) or "-"
        print(f"{key:<{width}}  {'-' if value is None else value}")
    print("\nevery setting (value, and where it came from):")
    width = max(len(k) for k in every)
    for key, (value, origin) in every.items():
        print(f"  {key:<{width}}  {json.dumps(value, default=str)}  ({origin})")
    return 0


def _client(args: argparse.Namespace):
    from .client import Client

    return Client(args.url, token=args.token)  # no --url: the client's default_url()


def cmd_infer(args: argparse.Namespace) -> int:
    from .client import ClientError
    from .protocol import v2

    with _client(args) as client:
        try:
            if args.request:
                body = Path(args.request).read_bytes()
                decoded = v2.decode_request(body)
                inputs = decoded.inputs
            else:
                inputs = dict(_parse_input(spec) for spec in args.input)
                inputs = _cast_json_inputs(client.model_metadata(args.model), inputs, args.input)
            if not inputs:
                print("edge-batcher infer: give --input NAME=FILE.npy|JSON or --request FILE.json", file=sys.stderr)
                return 2
            outputs = client.infer(args.model, inputs, timeout_ms=args.timeout_ms, priority=args.priority)
            labels = client.model_metadata(args.model).get("parameters", {}).get("labels") or []
        except ClientError as exc:
            prefix = f"{exc.status}: " if exc.status else ""  # status 0: no HTTP answer at all
            print(f"edge-batcher infer: {prefix}{exc.message}", file=sys.stderr)
            return 1
        except (OSError, EdgeBatcherError) as exc:
            print(f"edge-batcher infer: {exc}", file=sys.stderr)
            return 1
    named = class_names(outputs, labels)
    if args.json:
        doc = {k: _jsonable(v) for k, v in outputs.items()}
        if named and "labels" not in doc:
            doc["labels"] = named
        print(json.dumps(doc))
    else:
        for name, value in outputs.items():
            print(f"{name} {value.dtype} {list(value.shape)}:")
            print(np.array2string(value, precision=4, threshold=64))
            if name in named:
                print(f"  labels: {', '.join(named[name])}")
    return 0


def cmd_ps(args: argparse.Namespace) -> int:
    from .client import ClientError

    with _client(args) as client:
        try:
            index = client.repository_index()
            stats = {m["name"]: m for m in client.all_stats()["model_stats"]}
        except ClientError as exc:
            prefix = f"{exc.status}: " if exc.status else ""
            print(f"edge-batcher ps: {prefix}{exc.message}", file=sys.stderr)
            return 1
    rows = []
    for entry in index:
        st = stats.get(entry["name"], {})
        memory = st.get("memory", {})
        rows.append({
            "model": entry["name"], "state": entry["state"], "reason": entry.get("reason", ""),
            "instances": st.get("instances"), "batch_sizes": st.get("batch_sizes"),
            "memory_bytes": memory.get("resident_bytes"), "measured_by": memory.get("measured_by"),
            "queue": st.get("queue_depth"), "batches": st.get("execution_count"),
            "requests": st.get("inference_stats", {}).get("success", {}).get("count"),
        })
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0

    def cell(value: object) -> str:
        return "-" if value is None else ",".join(map(str, value)) if isinstance(value, list) else str(value)

    table = [("MODEL", "STATE", "INSTANCES", "SIZES", "MEMORY", "QUEUE", "BATCHES", "REQUESTS")] + [
        (r["model"], r["state"], cell(r["instances"]), cell(r["batch_sizes"]),
         "-" if r["memory_bytes"] is None else f"{r['memory_bytes'] / (1 << 20):.1f} MiB"
         + (f" ({r['measured_by']})" if r["measured_by"] else ""),
         cell(r["queue"]), cell(r["batches"]), cell(r["requests"])) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(value.ljust(width) for value, width in zip(row, widths)).rstrip())
    for r in rows:
        if r["reason"]:
            print(f"{r['model']}: {r['reason']}")
    return 0


def class_names(outputs: dict[str, np.ndarray], labels: list[str]) -> dict[str, list[str]]:
    """The model's labels for integer outputs holding one class index per row (argmax-style
    class_id): the rule MQTT stream results use."""
    named = {}
    for name, out in outputs.items():
        if not labels or out.dtype.kind not in "iu" or out.ndim != 1 or out.size == 0:
            continue
        if out.min() >= 0 and out.max() < len(labels):
            named[name] = [labels[int(i)] for i in out]
    return named


def _check_repository_flag(path: Path) -> None:
    """--models names a repository (a directory of model directories), not a model."""
    if (path / "model.toml").is_file():
        raise ConfigError(f"--models {path}: that is one model's directory (it holds model.toml); pass the "
                          f"repository above it (--models {path.resolve().parent}) and, to serve only this model, "
                          f"EDGE_BATCHER_MODELS_LOAD={path.resolve().name}")
    if not path.is_dir():
        raise ConfigError(f"--models {path}: no such directory; --models takes the model repository (a directory "
                          f"with one subdirectory per model); to serve only some models set [models] load or "
                          f"EDGE_BATCHER_MODELS_LOAD={path.name}")


def _parse_input(spec: str) -> tuple[str, np.ndarray]:
    name, sep, value = spec.partition("=")
    if not sep or not name:
        raise ConfigError(f"--input {spec!r}: expected NAME=FILE.npy or NAME=JSON")
    if value.endswith(".npy"):
        try:
            array = np.load(value, allow_pickle=False)
        except FileNotFoundError:
            raise ConfigError(f"--input {name}={value}: no such file") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--input {name}={value}: not a readable .npy file ({exc})") from None
        return name, array
    path = Path(value)
    text = path.read_text() if path.suffix == ".json" and path.exists() else value
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--input {name}: not a .npy file or valid JSON: {exc}") from None
    array = np.asarray(data)
    if array.dtype == np.float64:
        array = array.astype(np.float32)  # JSON numbers: FP32 is what models almost always take
    elif array.dtype.kind in "US":
        array = np.array([s.encode() for s in array.ravel()], dtype=object).reshape(array.shape)
    return name, array


def _cast_json_inputs(metadata: dict, inputs: dict[str, np.ndarray], specs: list[str]) -> dict[str, np.ndarray]:
    """JSON numbers carry no datatype: give inputs typed on the command line the model's own. A
    .npy file keeps its own, except that float64 for an FP32 input is refused with the fix."""
    from .types import DATATYPE_TO_NUMPY

    from_json = {s.partition("=")[0] for s in specs if not s.partition("=")[2].endswith(".npy")}
    declared = {t["name"]: t["datatype"] for t in metadata.get("inputs", [])}
    out = {}
    for name, array in inputs.items():
        if name in from_json and name in declared and declared[name] != "BYTES":
            array = array.astype(DATATYPE_TO_NUMPY[declared[name]])
        elif array.dtype == np.float64 and declared.get(name) == "FP32":
            # numpy's default float in a .npy: the daemon's 400 would say FP64 is not FP32, not what to do.
            raise ConfigError(f"--input {name}: the .npy file holds float64 and the model takes FP32: save it as "
                              f"float32 (np.save(path, array.astype(np.float32)))")
        out[name] = array
    return out


def _jsonable(value: np.ndarray):
    if value.dtype == object:
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in value.ravel().tolist()]
    return value.tolist()


def cmd_models(args: argparse.Namespace) -> int:
    from .client import ClientError

    with _client(args) as client:
        try:
            index = client.models()
            models = [client.model_metadata(m["name"]) for m in index]
        except (ClientError, OSError) as exc:
            print(f"edge-batcher models: {exc}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    for m in models:
        params = m.get("parameters", {})
        print(f"{m['name']}  ({m.get('platform')}, batch sizes {params.get('preferred_batch_sizes')})")
        if params.get("description"):
            print(f"  {params['description']}")
        for kind in ("inputs", "outputs"):
            for t in m.get(kind, []):
                print(f"  {kind[:-1]:6} {t['name']}: {t['datatype']} {t['shape']}")
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from .memory.report import run

    return run(args)


def cmd_index(args: argparse.Namespace) -> int:
    from .rag.index_cli import run

    if args.index_command is None:  # `edge-batcher index`: its commands, not "required: index_command"
        args.parser.print_help()
        return 2
    return run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.command import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
