"""The gRPC server: KServe v2's `inference.GRPCInferenceService` on TCP and Unix sockets.

Serves ServerLive/Ready, ServerMetadata, ModelMetadata/Ready, ModelConfig, ModelStatistics,
RepositoryIndex, RepositoryModelLoad/Unload and ModelInfer on the event loop, over the daemon's
own HTTP/2 (http2.py: unary calls, no grpcio), through the same Runtime, model lookup, parameters
mapping and codec checks as HTTP, and Triton's shared memory RPCs (shared_memory.py, on the
daemon's one registry); the RPCs it does not serve (tracing, streaming) answer UNIMPLEMENTED.
Every call passes the gRPC edge (edge.py) with the limits every listener shares
(transports/edge.py): the call limit and, over TCP, the bearer token (`authorization: Bearer
...` metadata, every method but ServerLive) before its message is read, then the body budget and
the error tree's translation. Calls on a Unix socket are guarded by its file mode.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from ... import __version__
from ...config import parse_host_port
from ...errors import ConfigError, InvalidInput
from ...protocol.parameters import to_infer_request
from ...protocol.tensor_decode import RegionReader
from ...protocol.v2 import DecodedRequest
from ...runtime import Runtime
from ...servable import Servable
from ...shared_memory.cuda_regions import CudaRegionRegistry, link_namespaces
from ...shared_memory.lease import Lease
from ...shared_memory.regions import RegionRegistry
from ..descriptors import ACCEPT_BATCH, serve_with_small_accept_batches
from ..edge import EdgeLimits
from ..listeners import check_unix_socket_path, remove_stale_socket
from ..triton_config import MODEL_VERSION, PLATFORMS, model_config, servable_for
from ..v2_decode import DECODE_OFF_LOOP_BYTES
from . import grpc_service_pb2 as pb
from . import model_config_pb2
from .codec import decode_infer_request, encode_infer_response
from .edge import RAW_MESSAGE, UNIX_PREFIX, ConnectionCount, GrpcEdge, Method, parse_message
from .http2 import GrpcConnection
from .shared_memory import shared_memory_rpcs

log = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"
EXTENSIONS = ["binary_tensor_data", "statistics", "model_repository", "model_configuration", "system_shared_memory",
              "cuda_shared_memory"]


def unix_socket_path(address: str) -> Path | None:
    """The path of a `unix:PATH` (or `unix:///abs/path`) address; None for HOST:PORT."""
    if not address.startswith(UNIX_PREFIX):
        return None
    path = address[len(UNIX_PREFIX):]
    return Path(path[2:] if path.startswith("//") else path)


class GrpcServer:
    """The listening sockets of `[server] grpc`, each serving HTTP/2 connections to one GrpcEdge."""

    def __init__(self, runtime: Runtime, addresses: list[str], *, limits: EdgeLimits, tls: tuple[str, str] | None,
                 shared_memory: RegionRegistry | None = None, cuda_shared_memory: CudaRegionRegistry | None = None):
        self.runtime = runtime
        self.shared_memory = shared_memory or RegionRegistry()  # the daemon's, shared with HTTP
        if cuda_shared_memory is None:
            cuda_shared_memory = CudaRegionRegistry()
            link_namespaces(self.shared_memory, cuda_shared_memory)
        self.cuda_shared_memory = cuda_shared_memory
        self.addresses = addresses
        self.limits = limits
        self._tls = _tls_context(tls) if tls else None
        self._socket_files: list[Path] = []
        self._sockets: list[tuple[socket.socket, bool]] = []  # (listening socket, is Unix)
        self._servers: list[asyncio.Server] = []
        self._counts: list[ConnectionCount] = []
        self.bound: list[str] = []  # the addresses as bound (a TCP port 0 becomes the real one)
        self.edge = GrpcEdge(limits, SERVICE, self._handlers())

    def bind(self) -> None:
        """Bind every address now (before the models load: a port in use fails the start at once)."""
        for address in self.addresses:
            path = unix_socket_path(address)
            if path is not None:
                self._bind_unix(path)
            else:
                self._bind_tcp(address)

    async def start(self) -> None:
        """Serve on the addresses bound (bind() first)."""
        loop = asyncio.get_running_loop()
        for sock, unix in self._sockets:
            count = ConnectionCount(self.limits.grpc_connections)
            self._counts.append(count)

            def connection(unix: bool = unix, count: ConnectionCount = count) -> GrpcConnection:
                return GrpcConnection(self.edge.dispatch, idle_timeout_s=self.limits.idle_timeout_s, unix=unix,
                                      admit=count.admit, closed=count.closed)

            if unix:
                server = await loop.create_unix_server(connection, sock=sock, backlog=ACCEPT_BATCH)
            else:
                handshake_s = self.limits.idle_timeout_s if self._tls else None
                server = await loop.create_server(connection, sock=sock, backlog=ACCEPT_BATCH, ssl=self._tls,
                                                  ssl_handshake_timeout=handshake_s)
            serve_with_small_accept_batches(sock)
            self._servers.append(server)
        for path in self._socket_files:
            os.chmod(path, self.limits.socket_mode)
        for address in self.bound:
            log.info("serving the v2 gRPC API on %s%s", address,
                     "" if address.startswith(UNIX_PREFIX) else " (bearer token required)")

    async def stop(self, grace: float | None) -> None:
        """Take no new calls; let those in progress finish within `grace` seconds."""
        for server in self._servers:
            server.close()
        connections = [conn for count in self._counts for conn in count.open]
        for conn in connections:
            conn.go_away()
        if connections and grace:
            await asyncio.wait([conn.gone for conn in connections], timeout=grace)
        for conn in connections:
            conn.abort()
        self._servers.clear()
        for sock, _ in self._sockets:
            sock.close()
        for path in self._socket_files:
            path.unlink(missing_ok=True)
        self._socket_files.clear()

    def _bind_unix(self, path: Path) -> None:
        check_unix_socket_path(path, "[server] grpc")
        try:
            remove_stale_socket(path, "choose another [server] grpc address")
        except ConfigError as exc:
            raise ConfigError(f"[server] grpc: {exc}") from None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"[server] grpc: cannot listen on unix:{path}: {exc}") from None
        self._sockets.append((sock, True))
        self._socket_files.append(path)
        self.bound.append(f"{UNIX_PREFIX}{path}")

    def _bind_tcp(self, address: str) -> None:
        host, port = parse_host_port(address, "[server] grpc")
        try:
            family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                               flags=socket.AI_PASSIVE)[0]
            sock = socket.socket(family, kind, proto)
        except OSError as exc:
            raise ConfigError(f"[server] grpc: cannot listen on {address}: {exc}") from None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(where)
        except OSError as exc:
            sock.close()
            raise ConfigError(f"[server] grpc: cannot listen on {address}: {exc}") from None
        self._sockets.append((sock, False))
        self.bound.append(f"{host}:{sock.getsockname()[1]}")

    def _handlers(self) -> dict[str, tuple[Method, Any]]:
        return {
            "ServerLive": (self.server_live, pb.ServerLiveRequest),
            "ServerReady": (self.server_ready, pb.ServerReadyRequest),
            "ModelReady": (self.model_ready, pb.ModelReadyRequest),
            "ServerMetadata": (self.server_metadata, pb.ServerMetadataRequest),
            "ModelMetadata": (self.model_metadata, pb.ModelMetadataRequest),
            "ModelConfig": (self.model_config, pb.ModelConfigRequest),
            "ModelStatistics": (self.model_statistics, pb.ModelStatisticsRequest),
            "RepositoryIndex": (self.repository_index, pb.RepositoryIndexRequest),
            "RepositoryModelLoad": (self.repository_model_load, pb.RepositoryModelLoadRequest),
            "RepositoryModelUnload": (self.repository_model_unload, pb.RepositoryModelUnloadRequest),
            "ModelInfer": (self.model_infer, RAW_MESSAGE),
            **shared_memory_rpcs(self.shared_memory, self.cuda_shared_memory),
        }

    # ------------------------------------------------------------------ the RPCs

    async def server_live(self, request, context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request, context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.runtime.ready)

    async def model_ready(self, request, context) -> pb.ModelReadyResponse:
        servable = servable_for(self.runtime, request.name, request.version)  # NOT_FOUND for another model
        return pb.ModelReadyResponse(ready=self.runtime.ready and servable.not_ready() is None)

    async def server_metadata(self, request, context) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="edge-batcher", version=__version__, extensions=EXTENSIONS)

    async def model_metadata(self, request, context) -> pb.ModelMetadataResponse:
        servable = servable_for(self.runtime, request.name, request.version)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=servable.name, versions=[MODEL_VERSION],
            platform=PLATFORMS.get(servable.config.backend, servable.config.backend),
            inputs=[tensor(name=s.name, datatype=s.datatype, shape=s.shape) for s in servable.inputs],
            outputs=[tensor(name=s.name, datatype=s.datatype, shape=s.shape) for s in servable.outputs],
        )

    async def model_config(self, request, context) -> pb.ModelConfigResponse:
        config = model_config(servable_for(self.runtime, request.name, request.version))
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, model_config_pb2.ModelConfig()))

    async def model_statistics(self, request, context) -> pb.ModelStatisticsResponse:
        if request.name:
            servables = [servable_for(self.runtime, request.name, request.version)]
        else:
            servables = [s for _, s in sorted(self.runtime.runners.items())]
        return pb.ModelStatisticsResponse(model_stats=[
            # edge-batcher's own fields (dispatch reasons, padding...) have no place in the message
            json_format.ParseDict(s.statistics(), pb.ModelStatistics(), ignore_unknown_fields=True)
            for s in servables
        ])

    async def repository_index(self, request, context) -> pb.RepositoryIndexResponse:
        index = pb.RepositoryIndexResponse.ModelIndex
        not_ready = self.runtime.not_ready()
        return pb.RepositoryIndexResponse(models=[
            index(name=name, version=MODEL_VERSION, state="UNAVAILABLE" if name in not_ready else "READY",
                  reason=not_ready.get(name, "")) for name in sorted(self.runtime.runners)
        ])

    async def repository_model_load(self, request, context) -> pb.RepositoryModelLoadResponse:
        """As HTTP's POST /v2/repository/models/{m}/load (http_repository.py)."""
        if request.parameters:
            raise InvalidInput(f"load: parameters {', '.join(sorted(request.parameters))} are not supported: "
                               "edge-batcher loads a model as its directory's model.toml says (change it there)")
        try:
            await self.runtime.load_model(request.model_name)
        except ConfigError as exc:
            raise InvalidInput(f"failed to load {request.model_name!r}: {exc}") from None
        return pb.RepositoryModelLoadResponse()

    async def repository_model_unload(self, request, context) -> pb.RepositoryModelUnloadResponse:
        unsupported = sorted(k for k, v in request.parameters.items()
                             if not (k == "unload_dependents" and not v.bool_param))
        if unsupported:
            raise InvalidInput(f"unload: parameters {', '.join(unsupported)} are not supported")
        await self.runtime.unload_model(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    async def model_infer(self, raw: memoryview, context) -> pb.ModelInferResponse:
        # the regions it uses stay mapped until it ends
        with Lease(self.shared_memory, self.cuda_shared_memory) as regions:
            if len(raw) > DECODE_OFF_LOOP_BYTES:
                # Parsed and decoded (raw_input_contents copied out of it) in one job off the loop:
                # one hop to a thread and back, not one for each. Sized by the bytes received:
                # protobuf's ByteSize() serializes the whole message to count them (upb), 9% of
                # the loop's samples with camera frames on an H200.
                request, decoded = await asyncio.get_running_loop().run_in_executor(
                    None, _parse_and_decode, raw, regions.read_input)
                servable = self._servable(request)
            else:
                request = parse_message(raw, pb.ModelInferRequest)
                servable = self._servable(request)  # refused before decoding, as HTTP does
                decoded = decode_infer_request(request, regions.read_input)
            model = request.model_name
            targets = regions.output_targets(decoded.outputs)
            infer_request = to_infer_request(model, decoded, servable.config.batching.priority_levels)
            infer_request.finish_outputs = regions.device_outputs(targets)
            remaining = context.time_remaining()
            if infer_request.timeout_s is None and remaining is not None:
                infer_request.timeout_s = max(remaining, 0.0)  # the call's gRPC deadline, when no parameter set one
            response = await self.runtime.infer(infer_request)
            outputs, in_regions = await regions.write_outputs(response.outputs, targets)
        return encode_infer_response(model, response.id, outputs, response.parameters or None, in_regions)

    def _servable(self, request: pb.ModelInferRequest) -> Servable:
        """The request's model, or the error for an unknown one or a full queue."""
        servable = servable_for(self.runtime, request.model_name, request.model_version)
        servable.refuse_if_full()
        return servable


def _parse_and_decode(raw: memoryview, read_input: RegionReader) -> tuple[pb.ModelInferRequest, DecodedRequest]:
    request = parse_message(raw, pb.ModelInferRequest)
    return request, decode_infer_request(request, read_input)


def _tls_context(tls: tuple[str, str]) -> ssl.SSLContext:
    """TLS for the TCP listeners, offering HTTP/2 by ALPN as gRPC clients require."""
    cert, key = tls
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"[server] tls_cert/tls_key: {exc}") from None
    context.set_alpn_protocols(["h2"])
    return context
