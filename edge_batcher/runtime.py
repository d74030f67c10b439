"""The model table: loads the model repository into engines and runners, and routes requests.

Transports (HTTP on the Unix socket and TCP, MQTT) only ever talk to a Runtime: they decode a
payload into an InferRequest, call `infer`, and encode the InferResponse or the error.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from .config import DaemonConfig, ModelConfig, load_model_config
from .engines.registry import create_engine
from .errors import ConfigError, ModelNotFound
from .metrics import Metrics
from .scheduler.runner import ModelRunner
from .types import InferRequest, InferResponse

log = logging.getLogger(__name__)


def discover_models(repository: Path, only: list[str] | None = None) -> list[ModelConfig]:
    """Every <repository>/<name>/model.toml, validated (only the named ones when `only` is set)."""
    if not repository.is_dir():
        raise ConfigError(f"model repository {repository} is not a directory")
    found = {d.name: d for d in sorted(repository.iterdir()) if (d / "model.toml").is_file()}
    if only:
        missing = [n for n in only if n not in found]
        if missing:
            raise ConfigError(
                f"[models] load names {', '.join(map(repr, missing))}, not found in {repository} "
                f"(it has {', '.join(found) or 'no models'})"
            )
        found = {n: found[n] for n in only}
    return [load_model_config(d) for d in found.values()]


def load_runner(config: ModelConfig, metrics: Metrics, warmup: bool = True) -> ModelRunner:
    """Create, load and warm up every instance of one model. Blocking: run off the event loop."""
    engines = []
    try:
        for _ in range(config.instances):
            engine = create_engine(config)
            engine.load()
            engines.append(engine)
        runner = ModelRunner(config, engines, metrics)
        _check_batching(config, runner)
        if warmup:
            runner.warm_up()
    except Exception:
        for engine in engines:
            engine.close()
        raise
    return runner


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


class Runtime:
    def __init__(self, config: DaemonConfig, metrics: Metrics | None = None):
        self.config = config
        self.metrics = metrics or Metrics()
        self.runners: dict[str, ModelRunner] = {}
        self.ready = False

    async def start(self) -> None:
        """Load every model (in a worker thread: loads block for seconds) and start its runner."""
        loop = asyncio.get_running_loop()
        configs = await loop.run_in_executor(
            None, discover_models, Path(self.config.models.repository), self.config.models.load
        )
        if not configs:
            log.warning("model repository %s holds no models", self.config.models.repository)
        for mc in configs:
            runner = await loop.run_in_executor(None, load_runner, mc, self.metrics, self.config.models.warmup)
            await runner.start()
            self.runners[mc.name] = runner
            log.info(
                "model %s loaded: %d instance(s), sizes %s, inputs %s", mc.name, mc.instances,
                mc.batching.preferred_batch_sizes, ", ".join(f"{s.name}{list(s.shape)}:{s.datatype}" for s in runner.inputs),
            )
        self.ready = True

    def runner(self, name: str) -> ModelRunner:
        try:
            return self.runners[name]
        except KeyError:
            known = ", ".join(sorted(self.runners)) or "none"
            raise ModelNotFound(f"unknown model {name!r}; loaded models: {known}") from None

    async def infer(self, request: InferRequest) -> InferResponse:
        return await self.runner(request.model).infer(request)

    async def drain(self, timeout: float) -> None:
        self.ready = False
        await asyncio.gather(*(r.drain(timeout) for r in self.runners.values()))

    async def close(self) -> None:
        self.ready = False
        for runner in self.runners.values():
            await runner.close()
        self.runners.clear()
