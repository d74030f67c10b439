"""The model table: loads the model repository into servables, and routes requests.

A servable (servable.py) is a runner (one engine model: scheduler/runner.py), a service (RAG,
generation) or a model served by offload peers only (offload/remote_model.py). Transports (HTTP
on the Unix socket and TCP, MQTT) only ever talk to a Runtime: they decode a payload into an
InferRequest, call `infer`, and encode the InferResponse or the error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

from .config import DaemonConfig, ModelConfig, OffloadSettings, discover_models, load_model_config
from .cpu_affinity import full_affinity
from .engines.registry import REMOTE, create_engine, is_service, service_class
from .errors import ConfigError, InvalidInput, ModelNotFound
from .memory.budget import MemoryBudget
from .memory.device import DeviceLoad, ModelDoesNotFit
from .memory.heap import trim_heap
from .memory.wiring import MiB, build_budget, model_admission, release_resident
from .memory_watch import MemoryWatch
from .metrics import Metrics
from .model_config import models_used_by, repository_models
from .offload.remote_model import RemoteModel, declared_specs
from .scheduler.runner import ModelRunner
from .servable import Servable
from .shared_memory.device_tensor import holds_device_tensor
from .types import InferRequest, InferResponse

__all__ = ["Runtime", "discover_models", "load_runner", "model_fingerprint"]

log = logging.getLogger(__name__)


def load_runner(config: ModelConfig, metrics: Metrics, warmup: bool = True,
                budget: MemoryBudget | None = None, calibrate: bool = False, offload=None) -> ModelRunner:
    """Create, load and warm up every instance of one model. Blocking: run off the event loop.
    With every CPU of the process, whatever the calling thread's mask: the engines' native
    thread pools are started here (cpu_affinity.py)."""
    with full_affinity():
        return _load_runner(config, metrics, warmup, budget, calibrate, offload)


def _load_runner(config: ModelConfig, metrics: Metrics, warmup: bool, budget: MemoryBudget | None,
                 calibrate: bool, offload) -> ModelRunner:
    runner = _load_within_budget(config, metrics, budget, calibrate, offload)
    profile = runner.admission.device if runner.admission is not None else None
    if profile is not None and profile.over_budget and profile.smallest_failed is not None:
        # A size took the model past the budget, and its engines' arenas hold what it took:
        # load them again, serving only the sizes below it (measured afresh).
        capped = [s for s in config.batching.preferred_batch_sizes if s < profile.smallest_failed]
        _discard(runner, budget)
        if not capped:
            raise ModelDoesNotFit(f"model {config.name!r}: {next(iter(profile.failed.values()))}")
        log.warning("model %s: reloading it with batch sizes %s to stay within the memory budget",
                    config.name, capped)
        config = dataclasses.replace(config, batching=dataclasses.replace(
            config.batching, preferred_batch_sizes=capped, max_batch_size=capped[-1]))
        runner = _load_within_budget(config, metrics, budget, calibrate, offload, profile.fixed_bytes)
        profile = runner.admission.device if runner.admission is not None else None
        if profile is not None and profile.over_budget:
            _discard(runner, budget)
            raise ModelDoesNotFit(f"model {config.name!r}: {next(iter(profile.failed.values()))}")
    try:
        _check_batching(config, runner)
        if warmup:
            runner.warm_up()
    except BaseException:
        _discard(runner, budget)
        raise
    return runner


def _discard(runner: ModelRunner, budget: MemoryBudget | None) -> None:
    """Close a runner that never served and give its memory back to the budget."""
    runner.close_unstarted()
    if budget is not None:
        release_resident(budget, runner.resident_bytes)


def _load_within_budget(config: ModelConfig, metrics: Metrics, budget: MemoryBudget | None, calibrate: bool,
                        offload, known_load_bytes: int | None = None) -> ModelRunner:
    """The model's engines loaded and its memory measured on their serving threads, the sizes
    the budget cannot hold left out (memory/device.py). Not warmed up yet."""
    created = [create_engine(config) for _ in range(config.instances)]
    load = DeviceLoad(budget, config.instances, known_load_bytes)  # memory before the load (memory/device.py)
    engines = []
    try:
        with load.held(config):
            for engine in created:
                load.prepare(engine)
                engine.load()
                engines.append(engine)
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    runner = ModelRunner(config, engines, metrics, offload=offload)
    try:
        admission, resident = model_admission(config, runner.engines, metrics, budget, calibrate, load,
                                              run=runner.infer_on)
    except BaseException:
        runner.close_unstarted()
        raise
    runner.set_admission(admission, resident)  # given back to the budget when unloaded
    try:
        _serve_what_fits(runner, offload is not None)
    except BaseException:
        _discard(runner, budget)
        raise
    return runner


def _serve_what_fits(runner: ModelRunner, has_peer: bool) -> None:
    """A model of which not even the smallest batch fits the memory budget (in some length
    bucket) serves nothing here: refused (ModelDoesNotFit), unless an offload peer can take its
    batches. The sizes that do not fit are never planned (admission.fits)."""
    admission = runner.admission
    if admission is None:
        return
    sizes = runner.settings.preferred_batch_sizes
    buckets = runner.config.sequence.buckets if runner.config.sequence else [0]
    device = admission.device
    unservable = [b for b in buckets if not admission.fits(sizes[0], b)]
    if not unservable:
        return
    why = (device.failed.get((sizes[0], unservable[0])) if device is not None else None) or admission.explain(
        sizes[0], unservable[0])
    if not has_peer:
        raise ModelDoesNotFit(f"model {runner.name!r}: not even its smallest batch fits the memory budget: {why}")
    log.warning("model %s: not even its smallest batch fits the memory budget here (%s): its batches%s go to the "
                "offload peers", runner.name, why,
                "" if len(unservable) == len(buckets) else f" of length {', '.join(map(str, unservable))}")


def _check_batching(config: ModelConfig, runner: ModelRunner) -> None:
    for spec in runner.inputs:
        batch_dim = spec.shape[0] if spec.shape else None
        if batch_dim is None:
            raise ConfigError(f"model {config.name!r}: input {spec.name!r} is a scalar; models need a batch dimension")
        if batch_dim != -1 and list(config.batching.preferred_batch_sizes) != [batch_dim]:
            raise ConfigError(
                f"model {config.name!r}: input {spec.name!r} has a fixed batch dimension {batch_dim}, so "
                f"[batching] preferred_batch_sizes must be [{batch_dim}], not {config.batching.preferred_batch_sizes}"
            )


def model_fingerprint(config: ModelConfig) -> tuple:
    """What identifies a model's version on disk: its model.toml text and its model file's
    size and modification time. A reload reloads the models whose fingerprint changed."""
    toml = (config.directory / "model.toml").read_bytes()
    try:
        st = config.model_path.stat()
        model_file = (st.st_size, st.st_mtime_ns)
    except OSError:
        model_file = None
    return (toml, model_file)


class Runtime:
    def __init__(self, config: DaemonConfig, metrics: Metrics | None = None):
        self.config = config
        self.metrics = metrics or Metrics()
        self.runners: dict[str, Servable] = {}
        self.budget = build_budget(config.memory)
        self.metrics.collectors.append(self._collect_memory)
        self.ready = False
        # Called with a model's name before it loads (the daemon extends systemd's start timeout).
        self.on_model_loading: Callable[[str], None] | None = None
        # Called with what happened once a model is unloaded and no longer referenced here (the
        # daemon collects its runner's reference cycles then: gc_freeze.py).
        self.after_unload: Callable[[str], object] | None = None
        self._fingerprints: dict[str, tuple] = {}
        # Peers for offloading (docs/offload.md); every runner gets it as its offload port.
        self.offload = None
        if config.offload.enabled:
            from .offload.peers import PeerPool

            self.offload = PeerPool(config.offload)
        self._reload_lock = asyncio.Lock()
        self.memory_watch = MemoryWatch(self.budget, lambda: list(self.runners.values()))  # memory_watch.py

    def _collect_memory(self) -> None:
        import psutil

        m = self.metrics
        m.memory_budget_bytes.set(self.budget.available())
        for name, runner in self.runners.items():
            m.memory_resident_bytes.set(runner.resident_bytes, model=name)
        for meter, value in self.memory_watch.planned().items():
            m.memory_planned_bytes.set(value, meter=meter)
        m.process_resident_bytes.set(psutil.Process().memory_info().rss)
        for name, (waiting, waits, seconds) in self.budget.line_report().items():
            m.memory_waiting.set(1 if waiting else 0, model=name)
            m.memory_waits_total.set_total(waits, model=name)
            m.memory_wait_seconds_total.set_total(seconds, model=name)
        snapshot = self.budget.snapshot
        if snapshot is not None:
            m.device_memory_bytes.set(snapshot.total_bytes, kind="total")
            m.device_memory_bytes.set(snapshot.free_bytes, kind="free")

    async def start(self) -> None:
        """Load every model (in a worker thread: loads block for seconds) and start its runner."""
        loop = asyncio.get_running_loop()
        configs = await loop.run_in_executor(
            None, discover_models, Path(self.config.models.repository), self.config.models.load
        )
        snapshot = self.budget.refresh()
        self.memory_watch.start()
        log.info(
            "memory: probe %s, %.0f MiB free of %.0f MiB; budget available %.0f MiB",
            snapshot.source, snapshot.free_bytes / MiB, snapshot.total_bytes / MiB, self.budget.available() / MiB,
        )
        if not configs:
            log.warning("model repository %s holds no models", self.config.models.repository)
        if self.offload is not None:
            await self.offload.start()
            await self.offload.check_now()  # know which peers are up before the first request
            for peer in self.offload.status():
                log.info("offload peer %s (%s): %s", peer["name"], peer["url"],
                         "healthy" if peer["healthy"] else "not reachable yet")
        for mc in _services_last(configs):
            self.runners[mc.name] = await self._load(mc)
        if self.offload is not None and self.offload.declared:
            await self.offload.check_now()  # compare remote models' declarations with the peers now
        self.ready = True

    async def _load(self, mc: ModelConfig) -> Servable:
        loop = asyncio.get_running_loop()
        if self.on_model_loading is not None:
            self.on_model_loading(mc.name)
        runner: Servable
        placement = f"{mc.instances} instance(s)"
        if is_service(mc.backend):
            # off the loop: a generator reads its tokenizer and sets up ONNX Runtime (0.2 s here)
            runner = await loop.run_in_executor(None, service_class(mc.backend), mc, self)
        elif served_by_peers(mc, self.config.offload):
            runner = await self._remote_model(mc)
            placement = "runs on offload peers only (nothing to warm up here)"
        else:
            runner = await loop.run_in_executor(
                None, load_runner, mc, self.metrics, self.config.models.warmup, self.budget,
                self.config.memory.calibrate_at_warmup, self.offload,
            )
            if self.offload is not None:
                self.offload.remove_remote_model(mc.name)  # in case it was reloaded from backend "remote"
        await runner.start()
        self._fingerprints[mc.name] = await loop.run_in_executor(None, model_fingerprint, mc)
        log.info(
            "model %s loaded: %s, sizes %s, inputs %s", mc.name,
            placement,
            mc.batching.preferred_batch_sizes,
            ", ".join(f"{s.name}{list(s.shape)}:{s.datatype}" for s in runner.inputs),
        )
        return runner

    async def _remote_model(self, mc: ModelConfig) -> RemoteModel:
        """A model served by peers only, its specs declared in model.toml (backend "remote") or
        read from its model file (an engine loaded once for them, then closed), and compared
        with each peer's metadata."""
        if mc.backend == REMOTE:
            inputs, outputs = declared_specs(mc)
        else:
            inputs, outputs = await asyncio.get_running_loop().run_in_executor(None, _model_file_specs, mc)
        assert self.offload is not None  # served_by_peers() checked: [offload] is enabled
        self.offload.add_remote_model(mc.name, inputs, outputs)
        return RemoteModel(mc, inputs, outputs, self.offload, self.metrics)

    async def _unload(self, runner: Servable, timeout: float) -> None:
        """Answer what the runner has queued and in flight, then free it."""
        await runner.drain(timeout)
        await runner.close()
        release_resident(self.budget, runner.resident_bytes)

    async def reload(self) -> dict[str, list[str]]:
        """Re-read the model repository (SIGHUP): load added models, reload changed ones, unload
        removed ones. Requests for the other models are untouched. A changed model keeps serving
        on its old version until the new one is loaded and warm; then new requests go to the new
        one and the old one finishes what it has. A model that fails to load is logged and the
        old version (if any) stays."""
        with self.memory_watch.changing("a reload of the model repository"):
            async with self._reload_lock:
                changes = await self._reload()
            if changes["changed"] or changes["removed"]:
                await self._unloaded(f"reload: {', '.join(changes['changed'] + changes['removed'])} unloaded")
        return changes

    async def _unloaded(self, what: str) -> None:
        # Called by the public methods after the coroutine that unloaded has returned: its frame,
        # which held the old runner, is gone, so the runner is garbage by now. Then the C heap's
        # free pages go back to the system (off the loop: ~8 ms for SmolLM2's ~160 MiB): glibc
        # kept most of an unloaded ONNX Runtime session, held by the process as far as any meter
        # can tell, and reused by the next load unseen.
        if self.after_unload is not None:
            self.after_unload(what)
        await asyncio.get_running_loop().run_in_executor(None, trim_heap)

    async def _reload(self) -> dict[str, list[str]]:
        """reload()'s work, under its lock; returns the models added, changed, removed, failed."""
        loop = asyncio.get_running_loop()
        configs = await loop.run_in_executor(
            None, discover_models, Path(self.config.models.repository), self.config.models.load
        )
        wanted = {mc.name: mc for mc in configs}
        changes: dict[str, list[str]] = {"added": [], "changed": [], "removed": [], "failed": []}
        for mc in _services_last(configs):
            if mc.name in self.runners:
                fingerprint = await loop.run_in_executor(None, model_fingerprint, mc)
                if fingerprint == self._fingerprints.get(mc.name):
                    continue
            kind = "changed" if mc.name in self.runners else "added"
            try:
                new = await self._load(mc)
            except Exception as exc:  # a bad new version must not take the daemon down
                log.error("reload: model %s could not be loaded, keeping what was there: %s", mc.name, exc)
                changes["failed"].append(mc.name)
                continue
            old = self.runners.get(mc.name)
            self.runners[mc.name] = new
            if old is not None:
                await self._unload(old, self.config.server.drain_timeout_s)
            changes[kind].append(mc.name)
        for name in [n for n in self.runners if n not in wanted]:
            old = self.runners.pop(name)
            self._fingerprints.pop(name, None)
            await self._unload(old, self.config.server.drain_timeout_s)
            changes["removed"].append(name)
        log.info("reload: %s", ", ".join(f"{k} {v}" for k, v in changes.items() if v) or "no changes")
        return changes

    async def load_model(self, name: str) -> str:
        """Load (or load again) one model of the repository, as Triton's repository extension
        does (POST /v2/repository/models/{m}/load): a version already serving keeps serving until
        the new one is loaded and warm, then drains. The memory plan is checked as at start: a
        model that does not fit is not loaded (ModelDoesNotFit) and the old version stays.
        Returns "loaded" or "reloaded"."""
        with self.memory_watch.changing(f"loading model {name}"):
            try:
                async with self._reload_lock:
                    outcome = await self._load_model(name)
            except ModelNotFound:
                raise
            except Exception as exc:  # answered to the caller; the operator reads the journal
                log.warning("model %s: loading it through the API failed (%s): %s", name,
                            "the version serving stays" if name in self.runners else "not loaded", exc)
                raise
            if outcome == "reloaded":
                await self._unloaded(f"model {name}'s old version unloaded")
        return outcome

    async def _load_model(self, name: str) -> str:
        repository = Path(self.config.models.repository)
        found = repository_models(repository)
        if name not in found:
            raise ModelNotFound(f"no model {name!r} in the repository {repository} (it has "
                                f"{', '.join(found) or 'none'})")
        mc = await asyncio.get_running_loop().run_in_executor(None, load_model_config, found[name])
        new = await self._load(mc)
        old = self.runners.get(name)
        self.runners[name] = new
        if old is not None:
            await self._unload(old, self.config.server.drain_timeout_s)
        log.info("model %s %s through the API", name, "reloaded" if old is not None else "loaded")
        return "reloaded" if old is not None else "loaded"

    async def unload_model(self, name: str) -> None:
        """Take one model out of service (POST /v2/repository/models/{m}/unload): it stops taking
        requests, answers what it has, and its memory goes back to the budget. A model a loaded
        service uses (rag's embedding model, its generator) is refused: unload that one first."""
        with self.memory_watch.changing(f"unloading model {name}"):
            async with self._reload_lock:
                await self._unload_model(name)
            await self._unloaded(f"model {name} unloaded")

    async def _unload_model(self, name: str) -> None:
        runner = self.runner(name)  # ModelNotFound
        users = [other for other, servable in sorted(self.runners.items())
                 if other != name and name in models_used_by(servable.config)]
        if users:
            raise InvalidInput(f"model {name!r} is used by {', '.join(users)}: unload "
                               f"{'it' if len(users) == 1 else 'them'} first")
        del self.runners[name]
        self._fingerprints.pop(name, None)
        await self._unload(runner, self.config.server.drain_timeout_s)
        log.info("model %s unloaded through the API", name)

    def not_ready(self) -> dict[str, str]:
        """The loaded models that cannot serve a request now, and why (the readiness endpoints)."""
        return {name: why for name, runner in sorted(self.runners.items()) if (why := runner.not_ready()) is not None}

    def local_runners(self) -> list[ModelRunner]:
        """The models served by engines in this process (not by a peer, not RAG services)."""
        return [r for r in self.runners.values() if isinstance(r, ModelRunner)]

    def runner(self, name: str) -> Servable:
        try:
            return self.runners[name]
        except KeyError:
            known = ", ".join(sorted(self.runners)) or "none"
            raise ModelNotFound(f"unknown model {name!r}; loaded models: {known}") from None

    async def infer(self, request: InferRequest) -> InferResponse:
        servable = self.runner(request.model)
        if not isinstance(servable, ModelRunner) and holds_device_tensor(request.inputs):
            raise InvalidInput(f"model {request.model!r} is not run by a local engine here: inputs in CUDA shared "
                               "memory are taken only by models with one; send the data or use system shared memory")
        return await servable.infer(request)

    async def drain(self, timeout: float) -> None:
        self.ready = False
        await asyncio.gather(*(r.drain(timeout) for r in self.runners.values()))

    async def close(self) -> None:
        self.ready = False
        for runner in self.runners.values():
            await runner.close()
        self.runners.clear()
        if self.offload is not None:
            await self.offload.stop()


def _model_file_specs(config: ModelConfig) -> tuple[list, list]:
    """(inputs, outputs) of a model as its engine reads them from the model file. Blocking."""
    engine = create_engine(config)
    try:
        engine.load()
        return engine.inputs, engine.outputs
    finally:
        engine.close()


def served_by_peers(mc: ModelConfig, offload: OffloadSettings) -> bool:
    """Backend "remote", or listed in [offload] remote_only while offloading is on."""
    if mc.backend == REMOTE:
        if not offload.enabled:
            raise ConfigError(
                f"model {mc.name!r} has backend {mc.backend!r}: it runs on offload peers only, "
                f"so [offload] must be enabled with at least one [[offload.peers]]"
            )
        return True
    return offload.enabled and mc.name in offload.remote_only


def _services_last(configs: list[ModelConfig]) -> list[ModelConfig]:
    """Engine models first: services (pipelines, generators) use them."""
    return sorted(configs, key=lambda c: is_service(c.backend))
