#!/usr/bin/env python3
"""Malformed and hostile requests at every HTTP door of a running daemon, over its Unix socket:
v2 infer (JSON and binary tensors), the generate extension (plain and streamed), system shared
memory, the document index and the repository extension, with junk values in every field, truncated bodies and clients
that leave mid-request; with --grpc-socket, the gRPC RPCs too (junk in every field of their
requests, and bytes that are no message). It fails on a 5xx other than 503/504 (gRPC: INTERNAL
or UNKNOWN), on a request that hangs, on a
daemon no longer ready at the end, and (with --pid) on the daemon's memory growing more than
--max-growth-mb over the run (less what generators have reserved for their KV caches at the
time: memory in the plan while their sequences run). Found the speller's quadratic work on one
long "word" (64-135 MiB a question) and the stream whose client left before its headers (an
ERROR with a traceback).

    python tools/fuzz_daemon.py --socket /run/edge-batcher/edge-batcher.sock --seconds 60 --pid "$(pidof ...)"
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))  # memory_soak, beside this script

from memory_soak import kv_reserved  # noqa: E402

from tests.support.rawhttp import request as http_request  # noqa: E402

PARAMETERS = ["max_new_tokens", "temperature", "top_p", "top_k", "seed", "ignore_stop", "timeout_ms", "timeout",
              "priority", "binary_data_output", "shared_memory_region", "shared_memory_byte_size",
              "shared_memory_offset", "binary_data_size", "stream", "id", ""]
FIELDS = ["inputs", "outputs", "name", "datatype", "shape", "data", "parameters", "id", "text_input", "documents",
          "text", "key", "offset", "byte_size", "raw_handle"]


class Junk:
    """Values a client should never send, and some it may: every field gets one now and then."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def value(self, depth: int = 0):
        r = self.rng
        kind = r.randrange(11)
        if kind == 0:
            return r.choice([None, True, False])
        if kind == 1:
            return r.choice([-1, 0, 1, 2, 8, 256, 2**31, 2**63, -(2**70), 10**30])
        if kind == 2:
            return r.choice([0.0, -0.0, 1e-310, 1e308, 0.5, 100.0001, -1.5])
        if kind == 3:
            return r.choice(["", "x", "nan", "\x00", "é" * 40, "FP32", "BYTES", "../etc/passwd"])
        if kind == 4:  # long text, and one long "word" (the speller's worst case)
            return r.choice(["how do I grease the bearing? " * r.randint(1, 60), "x" * r.randint(100, 2000)])
        if kind == 5 and depth < 3:
            return [self.value(depth + 1) for _ in range(r.randint(0, 4))]
        if kind == 6 and depth < 3:
            return {r.choice(FIELDS + PARAMETERS): self.value(depth + 1) for _ in range(r.randint(0, 4))}
        return r.choice(["How do I replace the battery?", 1, 64, [1, 256], "vibration"])

    def parameters(self) -> dict:
        return {self.rng.choice(PARAMETERS): self.value() for _ in range(self.rng.randint(0, 4))}


def requests_for(models: list[str], junk: Junk) -> tuple[str, str, bytes, dict]:
    """One request (method, path, body, headers) at a random door."""
    r = junk.rng
    model = r.choice(models + ["nosuch"])
    door = r.randrange(8)
    if door == 0:  # v2 infer, JSON
        tensor = {"name": r.choice(["text", "text_input", "question", "signal", "input_ids"]),
                  "datatype": r.choice(["BYTES", "FP32", "INT64", "UINT8"]),
                  "shape": r.choice([[1], [2], [1, 256], [-1], [0], [1, 8]]), "data": junk.value(),
                  "parameters": junk.parameters()}
        body = {"inputs": [tensor] if r.random() < 0.9 else junk.value(), "parameters": junk.parameters()}
        if r.random() < 0.3:
            body["outputs"] = [{"name": junk.value(), "parameters": junk.parameters()}]
        return "POST", f"/v2/models/{model}/infer", _json(body), {}
    if door == 1:  # v2 infer, binary tensors
        header = _json({"inputs": [{"name": r.choice(["text", "signal"]), "datatype": r.choice(["BYTES", "FP32"]),
                                    "shape": r.choice([[1], [1, 256]]),
                                    "parameters": {"binary_data_size": junk.value()}}]})
        length = r.choice([len(header), len(header) + 3, 0, -1, 10**12, "x"])
        return ("POST", f"/v2/models/{model}/infer", header + os.urandom(r.choice([0, 4, 1024])),
                {"Inference-Header-Content-Length": str(length)})
    if door in (2, 3):  # the generate extension
        body = {"text_input": junk.value(), "parameters": junk.parameters()}
        for _ in range(r.randint(0, 2)):
            body[r.choice(PARAMETERS)] = junk.value()
        return "POST", f"/v2/models/{model}/{'generate' if door == 2 else 'generate_stream'}", _json(body), {}
    if door == 4:  # system shared memory
        name = r.choice(["r1", "", "a" * 300, "../x"])
        path = r.choice([f"/v2/systemsharedmemory/region/{name}/register",
                         f"/v2/systemsharedmemory/region/{name}/unregister",
                         "/v2/systemsharedmemory/unregister", "/v2/cudasharedmemory/region/r1/register"])
        body = {"key": r.choice(["/nosuch", "", "/../x", junk.value()]), "offset": junk.value(),
                "byte_size": junk.value(), "raw_handle": {"b64": junk.value()}}
        return "POST", path, _json(body), {}
    if door == 5:  # the document index
        body = {"documents": [{"id": junk.value(), "text": junk.value(), "title": junk.value()}
                              for _ in range(r.randint(0, 2))], "ids": junk.value()}
        return "POST", r.choice([f"/v2/models/{model}/index", f"/v2/models/{model}/index/remove"]), _json(body), {}
    if door == 6:  # the repository extension, on names the repository lacks (unloading a real
        # model would leave the rest of the run without it)
        name = r.choice(["nosuch", "", "../x", "a" * 300, "%2e%2e", "vibration/../x"])
        body = r.choice([b"", b"{}", _json({"parameters": junk.parameters()}), _json(junk.value())])
        return "POST", f"/v2/repository/models/{name}/{r.choice(['load', 'unload'])}", body, {}
    path = r.choice(["/v2/systemsharedmemory/status", f"/v2/models/{model}/index", f"/v2/models/{model}/config",
                     "/v2/repository/index"])
    method = r.choice(["GET", "GET", "POST"]) if path == "/v2/repository/index" else "GET"
    return method, path, _json(junk.parameters()) if method == "POST" else b"", {}


def grpc_call_for(models: list[str], junk: Junk) -> tuple[str, bytes]:
    """One gRPC call (method, serialized request) at a random RPC of the KServe v2 service: junk in
    every field protobuf lets through, now and then a message that is not one at all. Model
    loading and unloading only name models the repository lacks (an unload of a real one would
    empty the daemon the run fuzzes)."""
    from edge_batcher.transports.grpc_v2 import grpc_service_pb2 as pb

    r = junk.rng
    model = r.choice(models + ["nosuch", "", "../x", "é" * 40])
    version = r.choice(["", "1", "2", "x"])
    method = r.choice(["ModelInfer"] * 6 + ["ModelMetadata", "ModelConfig", "ModelReady", "ModelStatistics",
                                            "SystemSharedMemoryRegister", "SystemSharedMemoryStatus",
                                            "SystemSharedMemoryUnregister", "CudaSharedMemoryRegister",
                                            "CudaSharedMemoryStatus", "CudaSharedMemoryUnregister",
                                            "ServerMetadata", "RepositoryIndex", "RepositoryModelLoad",
                                            "RepositoryModelUnload"])
    if method == "ModelInfer":
        message = pb.ModelInferRequest(model_name=model, model_version=version, id=_text(junk))
        _grpc_parameters(message.parameters, junk)
        for _ in range(r.choice([0, 1, 1, 1, 2, 3])):
            tensor = message.inputs.add(name=r.choice(["text", "text_input", "question", "signal", "input_ids", ""]),
                                        datatype=r.choice(["BYTES", "FP32", "INT64", "UINT8", "FP16", "BOOL", "X"]))
            tensor.shape.extend(r.choice([[1], [2], [1, 256], [-1], [0], [1, 8], [2**62, 2**62], [1, 1, 1, 1, 1]]))
            _grpc_parameters(tensor.parameters, junk)
            if r.random() < 0.3:
                contents = tensor.contents
                kind = r.randrange(4)
                if kind == 0:
                    value = r.choice([0.5, float("nan"), float("inf"), -1e38])
                    contents.fp32_contents.extend([value] * r.choice([1, 256, 300]))
                elif kind == 1:
                    contents.int64_contents.extend([r.choice([0, -1, 2**62])] * r.choice([1, 8, 256]))
                elif kind == 2:
                    contents.bytes_contents.extend([r.choice([b"", b"How do I replace the battery?", b"\xff\xfe",
                                                              b"x" * 5000])] * r.choice([1, 2]))
                else:
                    contents.uint_contents.extend([r.randrange(2**32)] * r.choice([1, 3]))
        for _ in range(r.choice([0, 0, 1, 2])):
            output = message.outputs.add(name=r.choice(["class_probs", "embedding", "text_output", "", "nosuch"]))
            _grpc_parameters(output.parameters, junk)
        for _ in range(r.choice([0, 1, 1, 2])):
            message.raw_input_contents.append(os.urandom(r.choice([0, 3, 4, 8, 1024, 1028])))
    elif method in ("ModelMetadata", "ModelConfig", "ModelReady", "ModelStatistics"):
        message = getattr(pb, f"{method}Request")(name=model, version=version)
    elif method == "SystemSharedMemoryRegister":
        message = pb.SystemSharedMemoryRegisterRequest(
            name=r.choice(["r1", "", "a" * 300, "../x"]),
            key=r.choice(["/nosuch", "", "/../x", "/dev/shm/x", _text(junk)]),
            offset=r.choice([0, 1, 2**63 - 1, 4096]), byte_size=r.choice([0, 1, 2**63 - 1, 4096]))
    elif method == "CudaSharedMemoryRegister":
        message = pb.CudaSharedMemoryRegisterRequest(
            name=r.choice(["r1", "", "a" * 300]), raw_handle=os.urandom(r.choice([0, 64, 65])),
            device_id=r.choice([0, 1, -1, 2**62]), byte_size=r.choice([0, 1, 2**63 - 1]))
    elif method in ("RepositoryModelLoad", "RepositoryModelUnload"):  # names the repository lacks
        message = getattr(pb, f"{method}Request")(model_name=r.choice(["nosuch", "", "../x", "a" * 300]))
        for _ in range(r.randint(0, 2)):
            message.parameters[r.choice(PARAMETERS + ["unload_dependents", "config"])].bool_param = r.random() < 0.5
    elif method.startswith(("SystemSharedMemory", "CudaSharedMemory")):
        message = getattr(pb, f"{method}Request")(name=r.choice(["r1", "", "nosuch"]))
    else:
        message = getattr(pb, f"{method}Request")()
    raw = message.SerializeToString()
    if r.random() < 0.1:  # not a message of its type at all: cut, flipped or random bytes
        raw = r.choice([raw[:r.randint(0, len(raw))], bytes(b ^ 0xFF for b in raw[:64]) + raw[64:],
                        os.urandom(r.randint(1, 64))])
    return method, raw


def _text(junk: Junk) -> str:
    value = junk.value()
    return value if isinstance(value, str) else json.dumps(value)[:200]


def _grpc_parameters(parameters, junk: Junk) -> None:
    """Junk InferParameters under the names the daemon reads (and others)."""
    r = junk.rng
    for _ in range(r.randint(0, 3)):
        p = parameters[r.choice(PARAMETERS)]
        kind = r.randrange(5)
        if kind == 0:
            p.bool_param = r.random() < 0.5
        elif kind == 1:
            p.int64_param = r.choice([-1, 0, 1, 64, 2**62, -(2**63)])
        elif kind == 2:
            p.string_param = _text(junk)
        elif kind == 3:
            p.double_param = r.choice([0.0, -1.0, 0.5, float("nan"), float("inf"), 1e308])
        else:
            p.uint64_param = r.choice([0, 1, 2**64 - 1])


def _json(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


# gRPC's answers for a client's mistake or a busy daemon; INTERNAL and UNKNOWN are the 500 of gRPC
GRPC_FINE = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED",
             "UNIMPLEMENTED", "FAILED_PRECONDITION", "ALREADY_EXISTS", "OUT_OF_RANGE", "PERMISSION_DENIED",
             "UNAUTHENTICATED", "CANCELLED"}


class Fuzzer:
    def __init__(self, sock: str, models: list[str], seconds: float, seed: int, grpc_socket: str | None = None):
        self.sock, self.models, self.seconds, self.seed = sock, models, seconds, seed
        self.grpc_socket = grpc_socket
        self.statuses: dict[str, int] = {}
        self.failures: list[str] = []
        self.lock = threading.Lock()

    def count(self, key: str) -> None:
        with self.lock:
            self.statuses[key] = self.statuses.get(key, 0) + 1

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what[:600])

    def client(self, n: int) -> None:
        junk = Junk(random.Random(self.seed * 1000 + n))
        end = time.monotonic() + self.seconds
        while time.monotonic() < end:
            method, path, body, headers = requests_for(self.models, junk)
            if junk.rng.random() < 0.15:
                self.leave_early(method, path, body, junk.rng)
                continue
            try:
                status, answer = http_request(self.sock, method, path, body or None,
                                              {"Content-Type": "application/json", **headers}, timeout=60)
            except TimeoutError:
                self.fail(f"no answer in 60 s: {method} {path} {body[:200]!r}")
                continue
            except OSError as exc:  # the daemon closed the connection: counted, not a failure
                self.count(type(exc).__name__)
                continue
            self.count(str(status))
            if status >= 500 and status not in (503, 504):
                self.fail(f"{status} on {method} {path} {body[:200]!r}: {str(answer)[:300]}")

    def grpc_client(self, n: int) -> None:
        """gRPC calls with junk requests on one channel (grpcio), answered or refused by status."""
        import grpc

        junk = Junk(random.Random(self.seed * 1000 + 500 + n))
        end = time.monotonic() + self.seconds
        with grpc.insecure_channel(f"unix:{self.grpc_socket}") as channel:
            while time.monotonic() < end:
                method, raw = grpc_call_for(self.models, junk)
                call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
                try:
                    call(raw, timeout=60)
                    code = "OK"
                except grpc.RpcError as exc:
                    code, details = exc.code().name, exc.details()
                    if code == "DEADLINE_EXCEEDED" and "Deadline Exceeded" == details:  # ours, not the daemon's
                        self.fail(f"gRPC {method}: no answer in 60 s: {raw[:200]!r}")
                        continue
                    if code not in GRPC_FINE:
                        self.fail(f"gRPC {code} on {method} {raw[:200]!r}: {details[:300]}")
                self.count(f"grpc {code}")

    def leave_early(self, method: str, path: str, body: bytes, rng: random.Random) -> None:
        """Send all or part of a request, then close without reading (a client gone)."""
        head = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        whole = head + body
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(10)
                s.connect(self.sock)
                s.sendall(whole[:rng.choice([len(whole), len(head), rng.randint(0, len(whole))])])
        except OSError:
            pass
        self.count("left")


def rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run(sock: str, seconds: float, clients: int, seed: int, pid: int | None, max_growth_mb: float,
        grpc_socket: str | None = None) -> dict:
    status, stats = http_request(sock, "GET", "/v2/models/stats")
    models = [m["name"] for m in stats["model_stats"]] if status == 200 else []
    generators = [m["name"] for m in stats["model_stats"] if "kv" in m] if status == 200 else []
    fuzzer = Fuzzer(sock, models, seconds, seed, grpc_socket)
    start = rss_of(pid) if pid else 0
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        kv, n = 0, 0
        while not done.wait(0.02):
            if generators and n % 5 == 0:
                kv = kv_reserved(sock, generators)
            n += 1
            peak[0] = max(peak[0], rss_of(pid) - kv)

    sampler = threading.Thread(target=sample, daemon=True)
    if pid:
        sampler.start()
    threads = [threading.Thread(target=fuzzer.client, args=(n,)) for n in range(clients)]
    if grpc_socket:
        threads += [threading.Thread(target=fuzzer.grpc_client, args=(n,)) for n in range(max(1, clients // 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    growth = (peak[0] - start) / (1 << 20) if pid else None
    if growth is not None and growth > max_growth_mb:
        fuzzer.fail(f"the daemon's memory grew {growth:.1f} MiB over the run (limit {max_growth_mb} MiB)")
    ready, _ = http_request(sock, "GET", "/v2/health/ready")
    if ready != 200:
        fuzzer.fail(f"the daemon is not ready after the run ({ready})")
    return {"models": models, "answers": fuzzer.statuses, "peak_growth_mib": growth, "failures": fuzzer.failures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", required=True, help="the daemon's Unix socket")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pid", type=int, default=None, help="the daemon's process, to watch its memory")
    parser.add_argument("--max-growth-mb", type=float, default=64.0)
    parser.add_argument("--grpc-socket", default=None,
                        help="the daemon's gRPC Unix socket ([server] grpc = [\"unix:PATH\"]): fuzz the gRPC RPCs too, "
                             "from half as many clients more")
    args = parser.parse_args(argv)
    result = run(args.socket, args.seconds, args.clients, args.seed, args.pid, args.max_growth_mb, args.grpc_socket)
    print(json.dumps(result, indent=1))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
