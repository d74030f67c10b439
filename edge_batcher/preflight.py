"""`edge-batcher serve --check`: what would stop the daemon from starting, found in a second
or two without loading a model. It builds the daemon as `serve` does (the configuration, the
token and TLS files, the MQTT settings), binds and lets go of every listener the daemon would
bind, checks each model's table, backend and model file, and adds up what loading the models
would take against the memory budget (memory/device.py's load_need, the figure the start
refuses a model with). Every problem is listed, not only the first; the exit status is 2 when
there is one. A model file is checked to be readable, and an ONNX file to be whole (its
top-level fields within the file: engines/onnx_file.py), not loaded: only the load proves it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from .config import DaemonConfig, OffloadSettings
from .daemon import Daemon
from .engines.onnx_file import onnx_file_problem
from .engines.registry import REMOTE, create_engine, is_service
from .errors import ConfigError
from .memory.device import load_need
from .memory.wiring import MiB, build_budget
from .model_config import ModelConfig, discover_models, models_used_by
from .runtime import served_by_peers


@dataclass
class Finding:
    what: str  # "listeners", "model NAME", "memory", ...
    problem: bool
    detail: str


def preflight(config: DaemonConfig) -> list[Finding]:
    """Every check of `serve --check`, in the order the start meets them."""
    findings = [Finding("config", False, str(config.source))]
    try:
        daemon = Daemon(config)  # token file, TLS settings, [mqtt]: what the start reads first
    except ConfigError as exc:
        return findings + [Finding("settings", True, exc.message)]
    try:
        bound = asyncio.run(daemon.check_listeners())
        findings.append(Finding("listeners", False, "can bind " + ", ".join(bound)))
    except ConfigError as exc:
        findings.append(Finding("listeners", True, exc.message))
    try:
        configs = discover_models(Path(config.models.repository), config.models.load)
    except ConfigError as exc:
        return findings + [Finding("models", True, exc.message)]
    if not configs:
        findings.append(Finding("models", False, f"the repository {config.models.repository} holds no models"))
    names = {c.name for c in configs}
    local = []
    for mc in configs:
        finding = _check_model(mc, names, config.offload)
        findings.append(finding)
        if not finding.problem and not is_service(mc.backend) and not served_by_peers(mc, config.offload):
            local.append(mc)
    findings.append(_check_memory(config, local))
    return findings


def _check_model(mc: ModelConfig, names: set[str], offload: OffloadSettings) -> Finding:
    what = f"model {mc.name}"
    if is_service(mc.backend):
        used = models_used_by(mc)
        missing = sorted(used - names)
        if missing:
            return Finding(what, True, f"{mc.backend} service: uses {', '.join(map(repr, missing))}, "
                                       "which this daemon does not load")
        return Finding(what, False, f"{mc.backend} service" + (f" over {', '.join(sorted(used))}" if used else ""))
    try:
        remote_only = served_by_peers(mc, offload)
    except ConfigError as exc:  # backend "remote" without [offload]
        return Finding(what, True, exc.message)
    if mc.backend == REMOTE:
        return Finding(what, False, "runs on offload peers only")
    try:
        create_engine(mc)  # the backend is importable and its table valid; nothing is loaded
    except ConfigError as exc:
        return Finding(what, True, exc.message)
    path = mc.model_path
    try:
        with path.open("rb") as f:
            empty = not f.read(1)
    except OSError as exc:
        return Finding(what, True, f"cannot read its model file {path}: {exc.strerror or exc}")
    if empty:
        return Finding(what, True, f"its model file {path} is empty")
    try:
        problem = onnx_file_problem(path)
    except OSError as exc:
        return Finding(what, True, f"cannot read its model file {path}: {exc.strerror or exc}")
    if problem is not None:
        return Finding(what, True, f"its model file {path} is not a whole ONNX model: {problem}")
    where = "runs on offload peers only ([offload] remote_only)" if remote_only else f"{mc.instances} instance(s)"
    return Finding(what, False, f"{mc.backend}, {path.name} {path.stat().st_size / MiB:.1f} MiB, {where}")


def _check_memory(config: DaemonConfig, configs: list[ModelConfig]) -> Finding:
    """The models' loads added up, in the order the start loads them, against what the budget
    has available now (a running daemon's models count against it)."""
    try:
        budget = build_budget(config.memory)
    except ConfigError as exc:
        return Finding("memory", True, exc.message)
    budget.refresh()
    available = budget.available()
    if budget.probe.name == "fixed":
        return Finding("memory", False, f"a fixed budget of {available / MiB:.0f} MiB: each model's measured "
                                        "memory is checked against it as it loads")
    held, peak, refused = 0, 0, []
    for mc in configs:
        need = load_need(mc, budget.probe, mc.instances)
        if need is None:
            continue
        if held + need[0] > available:
            refused.append(f"{mc.name} (its load needs {need[0] / MiB:.0f} MiB, {held / MiB:.0f} MiB held before it)")
            continue
        # What a loaded model keeps is at least its weights; the start measures the rest.
        peak = max(peak, held + need[0])
        held += mc.model_path.stat().st_size * mc.instances
    summary = (f"the models' weights hold about {held / MiB:.1f} MiB, the loads peak near {peak / MiB:.1f} MiB; "
               f"the budget has {available / MiB:.0f} MiB available now (probe {budget.probe.name})")
    if not refused:
        return Finding("memory", False, summary)
    return Finding("memory", True, f"{summary}: the start would refuse {'; '.join(refused)}")


def print_findings(findings: list[Finding]) -> int:
    """Print one line per check; the exit status: 0 when nothing stops the start, else 2."""
    width = max(len(f.what) for f in findings)
    for f in findings:
        print(f"{'FAIL' if f.problem else 'ok':<4}  {f.what:<{width}}  {f.detail}")
    problems = sum(f.problem for f in findings)
    print(f"\n{problems} problem(s): the daemon would not start" if problems
          else "\nnothing found that would stop the start (a model's load itself is not tried)")
    return 2 if problems else 0
