"""A generator on a nearby server: an OpenAI-compatible chat-completions endpoint or Triton's
generate extension, streamed.

Where the device is too small for the language model, retrieval stays here and generation runs
on a peer that speaks `POST /v1/chat/completions` with `"stream": true` (what vLLM, llama.cpp's
server, Ollama, TensorRT-LLM's and Edge-LLM's servers expose). The prompt the rag model
assembled goes as one user message; the peer's server-sent events (`data: {...}` lines with
`choices[0].delta.content`, ended by `data: [DONE]`) become the same ("token", text) ...
("done", result) events a local generator gives, so HTTP generate_stream and MQTT stream them
unchanged. With `kind = "triton"` the peer is a Triton-style server instead and the prompt goes
to `/v2/models/{model}/generate_stream` (peer_protocols.py has both APIs). model.toml of the
rag model::

    [rag.peer]
    kind = "openai"                  # or "triton": Triton's generate extension (another edge-batcher too)
    url = "http://10.0.0.5:8000"     # base URL; /v1/chat/completions is appended
    model = "qwen2.5-0.5b-instruct"  # the peer's model name
    parameter_names = {}             # triton: our parameter -> the peer's key ({} = TensorRT-LLM's names)
    token = ""                       # or token_file = "/etc/edge-batcher/peer-token": Bearer token
    ca_file = ""                     # verify https:// peers against this CA (default: system CAs)
    tls_insecure = false             # testing only
    connect_timeout_s = 2.0
    first_token_timeout_s = 10.0     # also the longest silence between two events
    request_timeout_s = 120.0        # a whole generation, at most (the request's deadline is tighter)
    health_path = "/v1/models"       # GET every health_interval_s; "" turns health checks off
                                     # (triton: /v2/models/{model}/ready unless set otherwise)
    health_interval_s = 5.0
    breaker_failures = 3             # consecutive failures that open the circuit breaker
    breaker_reset_s = 10.0

It is configured like an offload peer and shares its circuit breaker (offload/breaker.py): a
failed request or health check counts against the peer, an open breaker sends nothing until
reset_s has passed or a health check passes. A peer that fails before its first token is a
`PeerError`; the rag service then answers extractively and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from .. import __version__
from ..config import PeerSettings, read_secret
from ..errors import ConfigError
from ..offload.breaker import Breaker
from ..offload.client import PeerError, client_ssl_context
from .peer_protocols import KINDS, TRITON_PARAMETER_NAMES, OpenAIChat, protocol

log = logging.getLogger(__name__)


@dataclass
class ChatPeerSettings:
    url: str = ""
    model: str = ""
    kind: str = "openai"  # or "triton" (peer_protocols.py)
    parameter_names: dict[str, str] = field(default_factory=dict)  # triton: {} = TRITON_PARAMETER_NAMES
    name: str = ""
    token: str = ""
    token_file: str = ""
    ca_file: str = ""
    tls_insecure: bool = False
    connect_timeout_s: float = 2.0
    first_token_timeout_s: float = 10.0
    request_timeout_s: float = 120.0
    health_path: str = "/v1/models"
    health_interval_s: float = 5.0
    breaker_failures: int = 3
    breaker_reset_s: float = 10.0


@dataclass
class PeerResult:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    peer: str
    first_token_s: float = 0.0

    def parameters(self) -> dict:
        return {"finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "peer": self.peer}


class ChatPeer:
    """One OpenAI-compatible peer: streaming generation, health checks, circuit breaker."""

    def __init__(self, settings: ChatPeerSettings, where: str):
        self.settings = settings
        if not settings.url.startswith(("http://", "https://")):
            raise ConfigError(f"{where} url: expected http://HOST:PORT or https://..., got {settings.url!r}")
        for key in ("connect_timeout_s", "first_token_timeout_s", "request_timeout_s", "health_interval_s",
                    "breaker_reset_s"):
            if getattr(settings, key) <= 0:
                raise ConfigError(f"{where} {key}: must be > 0, got {getattr(settings, key)}")
        if settings.kind not in KINDS:
            raise ConfigError(f"{where} kind: expected one of {', '.join(KINDS)}, got {settings.kind!r}")
        unknown = set(settings.parameter_names) - set(TRITON_PARAMETER_NAMES)
        if unknown:
            raise ConfigError(f"{where} parameter_names: unknown {', '.join(sorted(unknown))}; the parameters sent are "
                              f"{', '.join(TRITON_PARAMETER_NAMES)}")
        self.protocol = protocol(settings.kind)
        self.parameter_names = settings.parameter_names or dict(TRITON_PARAMETER_NAMES)
        self.health_path = settings.health_path
        if settings.health_path == OpenAIChat.health_path and settings.kind != "openai":
            self.health_path = self.protocol.health_path  # the default follows the kind
        self.health_path = self.health_path.replace("{model}", settings.model)
        self.url = settings.url.rstrip("/")
        self.name = settings.name or self.url
        token = read_secret(settings.token, settings.token_file, f"{where} token")
        self._headers = {"User-Agent": f"edge-batcher/{__version__} (rag peer)", "Accept": "text/event-stream"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        tls = PeerSettings(url=settings.url, ca_file=settings.ca_file, tls_insecure=settings.tls_insecure)
        self._ssl = client_ssl_context(tls, where) if self.url.startswith("https://") else None
        self.breaker = Breaker(settings.breaker_failures, settings.breaker_reset_s, on_change=self._breaker_changed)
        self.healthy: bool | None = None  # None: not checked yet
        self.last_error: str | None = None
        self._session = None
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.health_path and self._task is None:
            self._task = asyncio.create_task(self._health_loop(), name=f"rag-peer-health-{self.name}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self):
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers)
        return self._session

    # ------------------------------------------------------------------ state

    def usable(self) -> bool:
        """Could a request go to the peer now (without taking the breaker's trial permit)?"""
        return self.healthy is not False and self.breaker.would_allow()

    def status(self) -> dict:
        return {"name": self.name, "kind": self.settings.kind, "url": self.url, "model": self.settings.model,
                "healthy": self.healthy, "breaker": self.breaker.snapshot(), "last_error": self.last_error}

    # ------------------------------------------------------------------ generation

    async def stream(self, prompt: str, generation: dict, timeout_s: float | None = None
                     ) -> AsyncGenerator[tuple[str, object], None]:
        """("token", text) ..., ("done", PeerResult). Raises PeerError when the peer is not usable,
        fails, times out or answers something that is not a stream of its kind."""
        import aiohttp

        if not self.breaker.allow():
            raise PeerError(f"generation peer {self.name}: circuit breaker {self.breaker.state} "
                            f"({self.last_error or 'repeated failures'})", peer=self.name)
        s = self.settings
        total = s.request_timeout_s if timeout_s is None else min(timeout_s, s.request_timeout_s)
        timeout = aiohttp.ClientTimeout(total=total, connect=s.connect_timeout_s, sock_read=s.first_token_timeout_s)
        started = time.monotonic()
        pieces: list[str] = []
        verdict = False
        try:
            body = self.protocol.body(s.model, prompt, generation, self.parameter_names)
            async with self._client().post(self.url + self.protocol.path(s.model), json=body,
                                           timeout=timeout, ssl=self._ssl) as response:
                if response.status != 200:
                    detail = (await response.text())[:300]
                    raise PeerError(f"generation peer {self.name}: HTTP {response.status}: {detail}", peer=self.name)
                usage: dict = {}  # as Update.usage
                finish, first = "stop", 0.0
                async for event in _sse_events(response.content):
                    if event == "[DONE]":
                        break
                    try:
                        chunk = json.loads(event)
                    except ValueError:
                        raise PeerError(f"generation peer {self.name}: an event is not JSON: {event[:100]!r}",
                                        peer=self.name) from None
                    if not isinstance(chunk, dict):
                        raise PeerError(f"generation peer {self.name}: an event is not a JSON object: {event[:100]!r}",
                                        peer=self.name)
                    update = self.protocol.read(chunk)
                    if update.error is not None:
                        raise PeerError(f"generation peer {self.name}: {update.error}", peer=self.name)
                    usage = update.usage or usage
                    finish = update.finish_reason or finish
                    if update.text:
                        if not pieces:
                            first = time.monotonic() - started
                        pieces.append(update.text)
                        yield "token", update.text
            self.breaker.record_success()
            verdict = True
            self._set_healthy(True)
            yield "done", PeerResult("".join(pieces), finish, int(usage.get("prompt_tokens", 0)),
                                     int(usage.get("completion_tokens", len(pieces))), self.name, first)
        except PeerError as exc:
            self._failed(exc.message)
            verdict = True
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            message = f"generation peer {self.name}: {type(exc).__name__}: {exc}".rstrip(": ")
            self._failed(message)
            verdict = True
            raise PeerError(message, peer=self.name) from None
        finally:
            if not verdict:  # the caller went away: no verdict on the peer
                self.breaker.release()

    def _failed(self, message: str) -> None:
        self.last_error = message
        self.breaker.record_failure()

    # ------------------------------------------------------------------ health

    async def check(self) -> bool:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=max(1.0, min(self.settings.health_interval_s, 10.0)),
                                        connect=self.settings.connect_timeout_s)
        try:
            async with self._client().get(self.url + self.health_path, timeout=timeout,
                                          ssl=self._ssl) as response:
                ok = response.status == 200
                if not ok:
                    self.last_error = f"health check {self.health_path}: HTTP {response.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            ok = False
            self.last_error = f"health check: {type(exc).__name__}: {exc}".rstrip(": ")
        if ok:
            self._set_healthy(True)
            self.breaker.half_open_now()  # the next request is the trial
        else:
            self._set_healthy(False)
            self.breaker.record_failure()
        return ok

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not end health checking for good
                log.exception("generation peer %s: health check failed", self.name)
            await asyncio.sleep(self.settings.health_interval_s)

    def _set_healthy(self, healthy: bool) -> None:
        if self.healthy == healthy:
            return
        was, self.healthy = self.healthy, healthy
        if healthy:
            log.info("generation peer %s is %s", self.name, "ready" if was is None else "healthy again")
        else:
            log.warning("generation peer %s is unhealthy: %s", self.name, self.last_error)

    def _breaker_changed(self, old: str, new: str) -> None:
        if new == "open":
            log.warning("generation peer %s: circuit breaker opened (%s); answering without it for %.1f s",
                        self.name, self.last_error or "repeated failures", self.settings.breaker_reset_s)
        else:
            log.info("generation peer %s: circuit breaker %s", self.name, new.replace("_", "-"))


async def _sse_events(content) -> AsyncIterator[str]:
    """The data of each server-sent event (multi-line data joined by newlines; comments skipped)."""
    data: list[str] = []
    async for raw in content:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
    if data:
        yield "\n".join(data)
