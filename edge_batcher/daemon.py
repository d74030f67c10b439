"""The daemon's lifecycle, in order:

  load config -> load + warm up engines -> listen (Unix socket, optional TCP and gRPC) -> MQTT (if enabled)
  -> sd_notify READY=1 -> serve until SIGTERM/SIGINT (SIGHUP: reload the model repository)
  -> drain: stop listening, take no new MQTT messages (they stay unacked for redelivery), answer
     everything queued and in flight (up to server.drain_timeout_s), publish and ack those MQTT
     replies, disconnect -> STOPPING=1 -> close engines -> remove the socket file.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import ssl
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from . import placement
from .config import DaemonConfig, parse_host_port
from .cpu_affinity import choose as choose_cpu
from .cpu_affinity import pin_this_thread
from .errors import ConfigError
from .gc_freeze import freeze_survivors, thaw
from .runtime import Runtime
from .scheduler.runner import WORKER_ON_EVERY_CPU_FROM_S
from .shared_memory.cuda_regions import CudaRegionRegistry, link_namespaces
from .shared_memory.regions import RegionLimits, RegionRegistry
from .systemd import Notifier, listen_fds, watchdog_interval
from .transports.auth import bearer_auth_middleware, tls_context
from .transports.descriptors import ACCEPT_BATCH, serve_with_small_accept_batches, summarise_accept_errors
from .transports.edge import build_edge
from .transports.http import create_app
from .transports.http_connections import GuardedAppRunner
from .transports.listeners import bind_tcp_socket, bind_unix_socket, remove_socket_file
from .transports.mqtt import MqttTransport

if TYPE_CHECKING:
    from .transports.grpc_v2.server import GrpcServer

log = logging.getLogger(__name__)

# Each model load asks systemd for this much more start-up time (EXTEND_TIMEOUT_USEC), so a
# long load or warm-up is not killed by TimeoutStartSec while the daemon is visibly progressing.
LOAD_TIMEOUT_EXTENSION_S = 300.0
# glibc malloc heaps ("arenas") shared by all threads; see limit_malloc_arenas.
MALLOC_ARENAS = 2
M_ARENA_MAX = -8  # mallopt parameter number, from glibc's malloc.h


def limit_malloc_arenas(count: int = MALLOC_ARENAS) -> None:
    """Let all threads share `count` glibc heaps instead of up to 8 per CPU. Large request bodies
    are decoded on executor threads; each would otherwise get a heap of its own, and glibc keeps
    those heaps' freed pages for good (measured: eight concurrent 15 MB JSON bodies left RSS
    84 MB above baseline, malloc_trim included; with 2 heaps, 29 MB). MALLOC_ARENA_MAX in the
    environment wins; a C library that is not glibc is left alone."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_ARENA_MAX, count)


class Daemon:
    def __init__(self, config: DaemonConfig):
        self.config = config
        self.runtime = Runtime(config)
        self.notifier = Notifier.from_env()
        self._stop = asyncio.Event()
        self._web: web.AppRunner | None = None
        self._sites: list[web.BaseSite] = []
        self._socket_file: tuple[Path, int] | None = None  # (path, inode) we created
        self._tasks: list[asyncio.Task] = []
        self.grpc: GrpcServer | None = None  # transports/grpc_v2/server.py's GrpcServer when [server] grpc is set
        s = config.server  # the shared memory regions HTTP and gRPC register and read (unmapped at the end)
        limits = RegionLimits(s.shm_max_regions, s.shm_max_bytes, frozenset(s.shm_allowed_uids))
        self.shared_memory = RegionRegistry(limits)
        # CUDA regions: the same limits, counted by themselves; CUDA is loaded at the first registration.
        self.cuda_shared_memory = CudaRegionRegistry(limits)
        link_namespaces(self.shared_memory, self.cuda_shared_memory)
        self._tls: ssl.SSLContext | None = None  # the TCP listener's, when [server] tls_cert is set
        # The limits every listener shares, and the token: an unreadable token file stops start-up here.
        self.edge = build_edge(config.server, offload_peers=len(config.offload.peers) if config.offload.enabled else 0)
        # Built here so a bad [mqtt] section stops start-up before any model loads.
        self.mqtt = mqtt = MqttTransport(config.mqtt, self.runtime) if config.mqtt.enabled else None
        self.health_checks = {"mqtt": (lambda: mqtt.state) if mqtt else (lambda: "disabled")}
        self.runtime.metrics.watch_transports(mqtt=self.mqtt, offload=self.runtime.offload)

    def request_stop(self) -> None:
        self._stop.set()

    def request_reload(self) -> None:
        self._tasks.append(asyncio.create_task(self._reload()))

    async def _reload(self) -> None:
        self.notifier.reloading("reloading the model repository")
        try:
            await self.runtime.reload()
        except Exception:  # e.g. the repository became unreadable: keep serving what is loaded
            log.exception("reload failed; still serving the models loaded before")
        self.notifier.ready(self._status_line())

    def _model_loading(self, name: str) -> None:
        self.notifier.extend_timeout(LOAD_TIMEOUT_EXTENSION_S)
        self.notifier.status(f"loading model {name}")

    @staticmethod
    def _pin(cpu: int | None) -> None:
        try:
            pin_this_thread(cpu)  # before any thread is started from here: they inherit it
            if cpu is not None:
                log.info("event loop on CPU %d ([server] loop_cpu); engine worker threads share it, "
                         "except those of models whose batches take %.1f ms or more",
                         cpu, WORKER_ON_EVERY_CPU_FROM_S * 1e3)
        except OSError as exc:  # a slower daemon, not a broken one
            log.warning("could not keep the event loop on CPU %s ([server] loop_cpu): %s; threads run on any CPU",
                        cpu, exc)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        c = self.config
        limit_malloc_arenas()  # before the first worker thread allocates
        summarise_accept_errors(loop)
        log.info("edge-batcher starting: config %s, model repository %s", c.source, c.models.repository)
        cpu = choose_cpu(c.server.loop_cpu)
        measure_placement = c.server.loop_cpu == "auto" and cpu is not None
        if not measure_placement:  # "auto" measures once the models are warm (placement.py)
            self._pin(cpu)
        log.info(
            "transports: unix socket %s, tcp %s, grpc %s, mqtt %s; offload %s",
            c.socket_path(), c.server.http or "off", ", ".join(c.server.grpc) or "off",
            f"{c.mqtt.host}:{c.mqtt.port}" if c.mqtt.enabled else "off",
            ", ".join(p.name or p.url for p in c.offload.peers) if c.offload.enabled else "off",
        )
        self.runtime.on_model_loading = self._model_loading
        try:
            # Sockets and ports first: a port in use or another daemon on the socket fails the
            # start in a moment, not after every model has loaded (connections made meanwhile
            # wait in the listen backlog, as with socket activation).
            listeners = self._bind()
            await self._bind_grpc()
            await self.runtime.start()
            if measure_placement and cpu is not None:
                self.notifier.extend_timeout(LOAD_TIMEOUT_EXTENSION_S)
                self.notifier.status("measuring the CPU placement")
                try:
                    choice = await placement.choose(cpu, self.runtime.local_runners())
                    log.info("%s", choice.describe())
                except OSError as exc:  # the system refused an affinity change: a slower daemon, not a broken one
                    log.warning("could not measure or apply the CPU placement ([server] loop_cpu = \"auto\"): %s; "
                                "threads run where the OS puts them", exc)
            await self._listen(listeners)
            if self.grpc is not None:
                await self.grpc.start()
            if self.mqtt is not None:
                await self.mqtt.start()
            loop.add_signal_handler(signal.SIGHUP, self.request_reload)  # only once serving
            if c.server.gc_freeze:
                freeze_survivors("ready")
                self.runtime.after_unload = freeze_survivors
            self.runtime.memory_watch.settle()
            self._tasks.append(asyncio.create_task(self._watch_memory()))
            self.notifier.ready(self._status_line())
            interval = watchdog_interval()
            if interval:
                self._tasks.append(asyncio.create_task(self._watchdog(interval)))
            log.info("ready: models %s", ", ".join(sorted(self.runtime.runners)) or "none")
            await self._stop.wait()
            log.info("stopping: draining queued and in-flight requests (up to %.0f s)", c.server.drain_timeout_s)
            self.notifier.stopping("draining")
            await self._drain()
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self.mqtt is not None:
                await self.mqtt.stop(timeout=0)  # already stopped after a drain; at once after an error
            if self._web is not None:
                await self._web.cleanup()
            if self.grpc is not None:
                await self.grpc.stop(0)  # at once after an error; already stopped after a drain
            await self.runtime.close()
            if c.server.gc_freeze:
                thaw()  # the runners closed above are the collector's again
            self.shared_memory.close()  # after the drain: no request reads a region any more
            await loop.run_in_executor(None, self.cuda_shared_memory.close)  # IPC mappings closed: CUDA calls
            if self._socket_file is not None:
                remove_socket_file(*self._socket_file)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            log.info("stopped")

    def _bind(self) -> list[tuple[socket.socket, str]]:
        """The HTTP listening sockets, bound now (the Unix socket, or those systemd passed; TCP
        when [server] http is set), each with what to log once it serves."""
        s = self.config.server
        if s.http and not self.edge.token:
            # TCP reaches beyond this device: a bearer token is required there (the Unix socket
            # is guarded by its file mode and needs none).
            raise ConfigError("[server] http is set: a bearer token is required on TCP; set token_file (or token)")
        listeners = []
        inherited = listen_fds()  # socket activation (systemd edge-batcher.socket)
        if inherited:
            for sock in inherited:
                sock.setblocking(False)
                listeners.append((sock, "a socket passed by systemd"))
        else:
            path = self.config.socket_path()
            sock = bind_unix_socket(path, int(s.socket_mode, 8))
            self._socket_file = (path, path.stat().st_ino)
            listeners.append((sock, f"unix://{path} (mode {s.socket_mode})"))
        if s.http:
            host, port = parse_host_port(s.http, "[server] http")
            self._tls = tls_context(s.tls_cert, s.tls_key) if s.tls_cert else None
            sock = bind_tcp_socket(host, port)
            scheme = "https" if self._tls is not None else "http"
            listeners.append((sock, f"{scheme}://{host}:{port} (bearer token required)"))
        return listeners

    async def check_listeners(self) -> list[str]:
        """Bind every listener the start binds, then let go of them (`serve --check`): the
        addresses, as bound."""
        listeners: list[tuple[socket.socket, str]] = []
        try:
            listeners = self._bind()
            await self._bind_grpc()
            return [where for _, where in listeners] + [f"grpc {a}" for a in (self.grpc.bound if self.grpc else [])]
        finally:
            for sock, _ in listeners:
                sock.close()
            if self._socket_file is not None:
                remove_socket_file(*self._socket_file)
            if self.grpc is not None:
                await self.grpc.stop(0)

    async def _listen(self, listeners: list[tuple[socket.socket, str]]) -> None:
        """Serve the v2 API on the sockets bound at start."""
        s = self.config.server
        middlewares: tuple = (bearer_auth_middleware(self.edge.token),) if s.http else ()  # create_app's
        app = create_app(self.runtime, max_body_bytes=s.max_body_bytes, health_checks=self.health_checks,
                         middlewares=middlewares, body_budget=self.edge.budget, shared_memory=self.shared_memory,
                         cuda_shared_memory=self.cuda_shared_memory)
        # Handlers still running at cleanup were already answered by the drain; don't wait long.
        # idle_timeout_s bounds the time to send a request header, after connecting or an answer
        # (http_connections.py); lingering_time: how long a body we answered without reading is drained.
        self._web = GuardedAppRunner(app, max_connections=self.edge.http_connections, handle_signals=False,
                                     access_log=None, shutdown_timeout=5.0,
                                     idle_timeout_s=s.idle_timeout_s, lingering_time=2.0)
        await self._web.setup()
        for sock, where in listeners:
            if self._tls is not None and sock.family != socket.AF_UNIX:
                # started per connection, so handshakes count against the limit
                self._web.serve_tls(sock.getsockname()[1], self._tls, s.idle_timeout_s)
            await self._add_site(web.SockSite(self._web, sock, backlog=ACCEPT_BATCH))
            serve_with_small_accept_batches(sock)
            log.info("serving the v2 API on %s", where)

    async def _bind_grpc(self) -> None:
        """The gRPC server with its addresses bound; started once the models are loaded."""
        s = self.config.server
        if not s.grpc:
            return
        try:  # only now: a daemon without [server] grpc never loads protobuf
            from .transports.grpc_v2.server import GrpcServer
        except ImportError as exc:
            raise ConfigError(f"[server] grpc needs the grpc extra: pip install 'edge-batcher[grpc]' ({exc})") from None
        if not self.edge.token and any(not a.startswith("unix:") for a in s.grpc):
            raise ConfigError(
                "[server] grpc has a TCP address: a bearer token is required on TCP; set token_file (or token)"
            )
        self.grpc = GrpcServer(self.runtime, s.grpc, limits=self.edge,
                               tls=(s.tls_cert, s.tls_key) if s.tls_cert else None, shared_memory=self.shared_memory,
                               cuda_shared_memory=self.cuda_shared_memory)
        self.grpc.bind()

    async def _add_site(self, site: web.BaseSite) -> None:
        await site.start()
        self._sites.append(site)

    async def _drain(self) -> None:
        for site in self._sites:
            await site.stop()  # no new connections; open ones finish their requests
        grpc_stopped = None
        if self.grpc is not None:  # no new calls; those in progress are answered by the drain below
            grpc_stopped = asyncio.create_task(self.grpc.stop(self.config.server.drain_timeout_s))
        if self.mqtt is not None:
            self.mqtt.pause()  # new messages stay unacked: the broker redelivers them after the restart
        await self.runtime.drain(self.config.server.drain_timeout_s)
        if self.mqtt is not None:
            await self.mqtt.stop()  # publishes and acks the replies of what the drain answered
        if grpc_stopped is not None:
            await grpc_stopped

    async def _watchdog(self, interval: float) -> None:
        # Sent from the event loop on purpose: if the loop is stuck, pings stop and systemd restarts us.
        while True:
            self.notifier.watchdog()
            self.notifier.status(self._status_line())
            await asyncio.sleep(interval)

    async def _watch_memory(self) -> None:
        # A read of the device probe and of the process's resident memory: cheap enough for the loop.
        while True:
            await asyncio.sleep(self.config.memory.check_interval_s)
            self.runtime.memory_watch.check()

    def _status_line(self) -> str:
        runners = self.runtime.runners
        depth = sum(len(r.queue) for r in runners.values())
        line = f"{len(runners)} model(s), {depth} queued, mqtt {self.health_checks['mqtt']()}"
        if self.runtime.offload is not None:
            peers = self.runtime.offload.status()
            usable = sum(1 for p in peers if p["healthy"] and p["state"] != "open")
            line += f", peers {usable}/{len(peers)} usable"
        return line


def serve(config: DaemonConfig) -> None:
    asyncio.run(Daemon(config).run())
