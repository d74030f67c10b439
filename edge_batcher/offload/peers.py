"""The offload peers: ordered, each with its client, circuit breaker and health.

``PeerPool`` holds the ``[[offload.peers]]`` in configuration order. A peer is *usable* for a
model when its breaker allows a request, its last health check passed (or none has run yet),
and it has not answered 404 for that model since its last check. ``infer`` tries the usable
peers in order and records every outcome in the peer's breaker; ``healthy_peer`` and
``estimated_latency`` let the scheduler's policy ask before it decides.

A background task checks every peer every ``health_interval_s`` with ``GET /v2/health/ready``:
a failed check counts as a breaker failure, and a passing check lets an open breaker go
half-open at once (the next request is the trial) instead of waiting out ``breaker_reset_s``.
Models a peer said it lacks are asked about again (``/v2/models/{m}/ready``) on each check.

State changes (breaker opened/half-open/closed, peer healthy/unhealthy) are logged once each,
never per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..config import OffloadSettings
from ..errors import InvalidInput, ModelNotFound
from ..scheduler.policy import OffloadView
from ..types import TensorSpec
from .breaker import Breaker
from .client import PeerClient, PeerError
from .conform import conform_outputs, spec_mismatches

log = logging.getLogger(__name__)


@dataclass
class Peer:
    name: str
    url: str
    client: PeerClient
    breaker: Breaker
    healthy: bool | None = None  # None: not checked yet (usable until a check says otherwise)
    missing_models: set[str] = field(default_factory=set)  # local names the peer answered 404 for
    specs_checked: set[str] = field(default_factory=set)  # remote models whose metadata was compared
    spec_mismatches: dict[str, list[str]] = field(default_factory=dict)  # model -> what disagrees

    def usable(self, model: str) -> bool:
        """Could a request for `model` go to this peer now (without taking a trial permit)?"""
        return self.healthy is not False and model not in self.missing_models and self.breaker.would_allow()


class PeerPool:
    """The ordered offload peers; see the module docstring. Use ``async with`` or
    ``await start()`` / ``await stop()``; all methods run on one event loop."""

    def __init__(self, settings: OffloadSettings, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        # The inputs and outputs of the models served by peers only (offload/remote_model.py),
        # compared with each peer's metadata; the runtime adds and removes them (add_remote_model).
        self.declared: dict[str, tuple[list[TensorSpec], list[TensorSpec]]] = {}
        self.peers: list[Peer] = []
        for ps in settings.peers:
            client = PeerClient(ps, request_timeout_s=settings.request_timeout_s)
            name = client.name
            breaker = Breaker(
                settings.breaker_failures, settings.breaker_reset_s, clock=clock,
                on_change=functools.partial(self._breaker_changed, name),
            )
            self.peers.append(Peer(name=name, url=ps.url, client=client, breaker=breaker))
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()

    # -- lifecycle

    async def start(self) -> None:
        """Start the periodic health check (the first round runs at once, in the background)."""
        if self._task is None and self.peers:
            self._stop = asyncio.Event()
            self._task = asyncio.create_task(self._health_loop(), name="offload-health")

    async def stop(self) -> None:
        """Stop the health check and close every peer's connections."""
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for peer in self.peers:
            await peer.client.close()

    async def __aenter__(self) -> PeerPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def add_remote_model(self, model: str, inputs: list[TensorSpec], outputs: list[TensorSpec]) -> None:
        """A model served by peers only (backend "remote", or listed in remote_only): its inputs
        and outputs are compared with each healthy peer's metadata (a mismatch is logged once)."""
        self.declared[model] = (inputs, outputs)
        for peer in self.peers:  # a reloaded declaration is compared afresh
            peer.specs_checked.discard(model)
            peer.spec_mismatches.pop(model, None)

    def remove_remote_model(self, model: str) -> None:
        """The model runs here again (reloaded with a local backend), or was unloaded."""
        self.declared.pop(model, None)

    # -- queries for the policy

    def healthy_peer(self, model: str) -> Peer | None:
        """The first peer, in configuration order, that could take `model` now."""
        for peer in self.peers:
            if peer.usable(model):
                return peer
        return None

    def estimated_latency(self, model: str) -> float | None:
        """Measured round trip (EWMA, seconds) of `model` on the peer a request would go to
        now; None when no peer is usable or it has not served this model yet."""
        peer = self.healthy_peer(model)
        return None if peer is None else peer.client.latency_estimate(model)

    def view(self, model: str) -> OffloadView:
        """What the scheduler's policy needs to know about offloading `model` right now."""
        peer = self.healthy_peer(model)
        return OffloadView(
            peer_available=peer is not None,
            peer_latency_s=None if peer is None else peer.client.latency_estimate(model),
            on_backlog=self.settings.offload_on_backlog,
            max_rows=self.settings.max_rows,
        )

    @property
    def max_rows(self) -> int:
        """The largest batch sent in one request; infer splits larger ones."""
        return self.settings.max_rows

    def status(self) -> list[dict]:
        """One entry per peer, for the stats endpoint and logs."""
        return [
            {
                "name": p.name,
                "url": p.url,
                "state": p.breaker.state,
                "healthy": p.healthy,
                "latency_s": {m: round(s, 6) for m, s in sorted(p.client.latencies().items())},
                "missing_models": sorted(p.missing_models),
                "spec_mismatches": dict(p.spec_mismatches),
                "breaker": p.breaker.snapshot(),
                "last_error": p.client.last_error,
            }
            for p in self.peers
        ]

    # -- inference

    async def infer(
        self, model: str, inputs: dict[str, np.ndarray], timeout_s: float, *,
        conform_to: list[TensorSpec] | None = None,
    ) -> tuple[dict[str, np.ndarray], str]:
        """Run `inputs` (a batch) on the first peer that can serve it; (outputs, peer name).
        With `conform_to` (the local model's outputs) the outputs are shaped and typed as the
        local model would answer (conform.py); a real mismatch raises PeerError.

        Peers are tried in order until one answers; a peer that fails (down, 5xx, timeout)
        counts against its breaker and the next one is tried while time is left. A peer's 404
        (it lacks the model) moves on to the next peer without counting as a failure. A peer's
        other 4xx (bad input) is raised at once as InvalidInput. When no peer could serve it,
        PeerError (502) says why for each peer. Batches over ``max_rows`` go in slices.
        """
        rows = _rows(inputs)
        if rows is not None and rows > self.settings.max_rows:
            outputs, peer = await self._infer_sliced(model, inputs, rows, timeout_s)
        else:
            outputs, peer = await self._infer_one(model, inputs, timeout_s)
        if conform_to is not None and rows is not None:
            outputs = conform_outputs(outputs, conform_to, rows, peer, model)
        return outputs, peer

    async def _infer_sliced(
        self, model: str, inputs: dict[str, np.ndarray], rows: int, timeout_s: float
    ) -> tuple[dict[str, np.ndarray], str]:
        step = self.settings.max_rows
        slices = [{k: v[i:i + step] for k, v in inputs.items()} for i in range(0, rows, step)]
        tasks = [asyncio.ensure_future(self._infer_one(model, s, timeout_s)) for s in slices]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:  # one slice failed (or we were cancelled): the rest is moot
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        names = list(dict.fromkeys(name for _, name in results))
        outputs = {k: np.concatenate([out[k] for out, _ in results]) for k in results[0][0]}
        return outputs, ",".join(names)

    async def _infer_one(
        self, model: str, inputs: dict[str, np.ndarray], timeout_s: float
    ) -> tuple[dict[str, np.ndarray], str]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        reasons: list[str] = []
        for peer in self.peers:
            if peer.healthy is False:
                reasons.append(f"{peer.name}: unhealthy ({peer.client.last_error or 'health check failed'})")
                continue
            if model in peer.missing_models:
                reasons.append(f"{peer.name}: does not serve {model!r}")
                continue
            if not peer.breaker.allow():
                reasons.append(f"{peer.name}: breaker {peer.breaker.state}")
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                peer.breaker.release()
                reasons.append("deadline passed")
                break
            try:
                outputs = await peer.client.infer(model, inputs, timeout_s=remaining)
            except PeerError as exc:
                if exc.breaker_failure:
                    peer.breaker.record_failure()
                else:
                    peer.breaker.release()
                reasons.append(exc.message)
                continue
            except ModelNotFound as exc:
                peer.breaker.record_success()  # it answered: healthy, just not this model
                if model not in peer.missing_models:
                    log.warning("offload peer %s does not serve model %s (%s); trying the next peer",
                                peer.name, model, exc.message)
                peer.missing_models.add(model)
                reasons.append(exc.message)
                continue
            except InvalidInput:
                peer.breaker.record_success()  # it answered: the input was bad, not the peer
                raise
            except BaseException:  # cancelled (the caller gave up), or a bug: no verdict
                peer.breaker.release()
                raise
            peer.breaker.record_success()
            self._set_healthy(peer, True)
            return outputs, peer.name
        detail = "; ".join(reasons) if reasons else "no peers configured"
        raise PeerError(f"no offload peer could serve {model!r}: {detail}")

    # -- health

    async def check_now(self) -> None:
        """One health-check round over every peer (the background task runs this)."""
        await asyncio.gather(*(self._check(peer) for peer in self.peers))

    async def _health_loop(self) -> None:
        while not self._stop.is_set():
            try:
                await self.check_now()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not end health checking for good
                log.exception("offload health check failed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=self.settings.health_interval_s)

    async def _check(self, peer: Peer) -> None:
        # As long as the interval, but at least 1 s (a loaded peer is slow, not dead), at most
        # request_timeout_s.
        timeout = min(self.settings.request_timeout_s, max(self.settings.health_interval_s, 1.0))
        ok = await peer.client.health(timeout_s=timeout)
        if ok:
            self._set_healthy(peer, True)
            peer.breaker.half_open_now()  # no-op unless open: the next request is the trial
            if peer.client.settings.binary:
                # Learn the wire format now, so a first offload near its deadline does not
                # spend its time on GET /v2.
                with contextlib.suppress(Exception):
                    await peer.client.supports_binary(deadline=asyncio.get_running_loop().time() + timeout)
            for model in sorted(peer.missing_models):
                if await peer.client.model_ready(model, timeout_s=timeout):
                    peer.missing_models.discard(model)
                    log.info("offload peer %s now serves model %s", peer.name, model)
            await self._check_specs(peer, timeout)
        else:
            self._set_healthy(peer, False)
            peer.breaker.record_failure()

    async def _check_specs(self, peer: Peer, timeout: float) -> None:
        """Compare each remote model's declared inputs and outputs with the peer's metadata,
        once per peer (again after a reload); a peer that cannot say yet is asked next time."""
        for model, (inputs, outputs) in sorted(self.declared.items()):
            if model in peer.specs_checked:
                continue
            metadata = await peer.client.model_metadata(model, timeout_s=timeout)
            if metadata is None:
                continue
            peer.specs_checked.add(model)
            problems = spec_mismatches(inputs, outputs, metadata)
            if problems:
                peer.spec_mismatches[model] = problems
                log.warning("offload peer %s serves model %s unlike its declaration here (model.toml): %s; "
                            "its answers will fail or be refused", peer.name, model, "; ".join(problems))

    def _set_healthy(self, peer: Peer, healthy: bool) -> None:
        if peer.healthy == healthy:
            return
        was, peer.healthy = peer.healthy, healthy
        if healthy:
            log.info("offload peer %s (%s) is %s", peer.name, peer.url, "ready" if was is None else "healthy again")
        else:
            log.warning("offload peer %s (%s) is unhealthy: %s", peer.name, peer.url,
                        peer.client.last_error or "health check failed")

    def _breaker_changed(self, name: str, old: str, new: str) -> None:
        if new == "open":
            peer = next((p for p in self.peers if p.name == name), None)
            last = peer.client.last_error if peer is not None else None
            log.warning("offload peer %s: circuit breaker opened (%s); no requests for %.1f s",
                        name, last or "repeated failures", self.settings.breaker_reset_s)
        elif new == "half_open":
            log.info("offload peer %s: circuit breaker half-open; the next request is a trial", name)
        else:
            log.info("offload peer %s: circuit breaker closed; the peer serves again", name)


def _rows(inputs: dict[str, np.ndarray]) -> int | None:
    for array in inputs.values():
        return int(array.shape[0]) if np.ndim(array) else None
    return None
