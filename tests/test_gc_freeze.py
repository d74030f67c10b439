"""[server] gc_freeze (gc_freeze.py): once ready, the daemon's objects leave the cyclic collector's
walks, and a model unloaded later is still collected, though its runner is a reference cycle
among frozen objects (with offload peers configured: the runner and its Offloader refer to each
other)."""

from __future__ import annotations

import gc
import re
import shutil
import weakref

import pytest

from edge_batcher.config import DaemonConfig, PeerSettings
from edge_batcher.gc_freeze import freeze_survivors
from edge_batcher.runtime import Runtime
from tests.support.ports import free_port


@pytest.fixture
def thawed_afterwards():
    yield
    gc.unfreeze()  # the rest of the suite runs with a collector as Python sets it


def _runtime_with_a_peer(repo) -> Runtime:
    config = DaemonConfig()
    config.models.repository = str(repo)
    config.models.load = ["vibration"]
    config.memory.probe = "cpu"
    config.offload.enabled = True  # nobody listens there: the peer is unhealthy, the Offloader is built all the same
    config.offload.peers = [PeerSettings(url=f"http://127.0.0.1:{free_port()}", name="nobody")]
    return Runtime(config)


async def test_a_model_unloaded_with_the_heap_frozen_is_collected(model_repo, thawed_afterwards):
    runtime = _runtime_with_a_peer(model_repo)
    await runtime.start()
    try:
        runner = weakref.ref(runtime.runners["vibration"])
        freeze_survivors("ready")
        await runtime.unload_model("vibration")  # no after_unload yet: what gc.freeze alone would leave
        gc.collect()
        assert runner() is not None, "the unloaded runner is no longer a reference cycle: the refreeze may be moot"

        freeze_survivors("model vibration unloaded")
        assert runner() is None
    finally:
        await runtime.close()


async def test_each_way_of_unloading_hands_the_old_runner_to_the_collector(model_repo, tmp_path, thawed_afterwards):
    repo = tmp_path / "engines"
    shutil.copytree(model_repo / "vibration", repo / "vibration")
    runtime = _runtime_with_a_peer(repo)
    unloads: list[str] = []

    def after_unload(what: str) -> None:
        unloads.append(what)
        freeze_survivors(what)

    runtime.after_unload = after_unload
    await runtime.start()
    try:
        freeze_survivors("ready")
        first = weakref.ref(runtime.runners["vibration"])
        assert await runtime.load_model("vibration") == "reloaded"  # the repository API's load
        assert first() is None

        second = weakref.ref(runtime.runners["vibration"])
        toml = repo / "vibration" / "model.toml"
        toml.write_text(toml.read_text() + "\n# changed\n")
        assert (await runtime.reload())["changed"] == ["vibration"]  # SIGHUP
        assert second() is None

        third = weakref.ref(runtime.runners["vibration"])
        await runtime.unload_model("vibration")  # the repository API's unload
        assert third() is None
        assert unloads == ["model vibration's old version unloaded", "reload: vibration unloaded",
                           "model vibration unloaded"]
    finally:
        await runtime.close()


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_the_daemon_freezes_once_ready_and_again_after_an_unload(start_daemon):
    d = start_daemon('[models]\nload = ["vibration"]\n[memory]\nprobe = "cpu"\n')
    metrics = d.client().metrics()
    frozen = _metric(metrics, "edge_batcher_gc_frozen_objects")
    assert frozen > 10_000  # modules, configs, aiohttp and the engine's Python side
    assert 'python_gc_collections_total{generation="2"}' in metrics
    assert d.log_lines_with("gc: ready: ", within_s=5)

    d.client().unload_model("vibration")
    assert d.log_lines_with("gc: model vibration unloaded: ", within_s=10)


def test_gc_freeze_off_leaves_the_collector_as_python_sets_it(start_daemon):
    d = start_daemon('[server]\ngc_freeze = false\n[models]\nload = ["vibration"]\n[memory]\nprobe = "cpu"\n')
    # Only what the interpreter freezes itself (0 on Python 3.11, 375 on 3.12), not the daemon's ~20k+.
    assert _metric(d.client().metrics(), "edge_batcher_gc_frozen_objects") < 1_000
    assert "gc: " not in d.log_text()
