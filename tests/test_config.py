"""Configuration: validation names the key, env overrides, CLI exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from edge_batcher.config import load_config, load_model_config, resolve_socket_path
from edge_batcher.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "config.toml"
    p.write_text(text)
    return p


def test_the_embedded_default_loads_and_points_at_the_repo_engines():
    c = load_config(ROOT / "configs" / "default.toml")
    assert Path(c.models.repository) == ROOT / "engines"
    assert c.server.unix_socket == "auto" and c.server.socket_mode == "0660"


@pytest.mark.parametrize(
    "text, words",
    [
        ("[server]\nunix_sockt = 'x'\n", "[server]: unknown key 'unix_sockt'"),
        ("[servr]\n", "unknown section [servr]"),
        ("[server]\nmax_body_bytes = 'big'\n", "[server] max_body_bytes: expected an integer, got 'big'"),
        ("[server]\nmax_body_bytes = -1\n", "max_body_bytes: expected a positive number"),
        ("[server]\nlog_level = 'LOUD'\n", "log_level: expected one of DEBUG"),
        ("[server]\nhttp = 'localhost'\n", "[server] http: expected HOST:PORT"),
        ("[server]\nsocket_mode = '999'\n", "socket_mode: expected an octal string"),
        ("[server]\nloop_cpu = 'first'\n", "loop_cpu: expected \"auto\", \"off\" or a CPU number"),
        ("[server]\nloop_cpu = 3\n", "[server] loop_cpu: expected a string, got 3"),
        ("[memory]\nreserve_fraction = 1.5\n", "reserve_fraction: expected 0 <= value < 1"),
        ("[models]\nwarmup = 'yes'\n", "warmup: expected true or false"),
        ("[server\n", "not valid TOML"),
    ],
)
def test_invalid_daemon_config_names_the_key(tmp_path, text, words):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert words in str(info.value)
    assert str(tmp_path) in str(info.value)  # the file is named too


def test_environment_overrides_config_values(tmp_path):
    path = write(tmp_path, "[server]\nmax_body_bytes = 100\n")
    env = {"EDGE_BATCHER_SERVER_MAX_BODY_BYTES": "200", "EDGE_BATCHER_MODELS_LOAD": "a,b",
           "EDGE_BATCHER_MODELS_WARMUP": "false", "EDGE_BATCHER_MQTT_PORT": "1884"}
    c = load_config(path, environ=env)
    assert c.server.max_body_bytes == 200
    assert c.models.load == ["a", "b"]
    assert c.models.warmup is False
    assert c.mqtt.port == 1884
    with pytest.raises(ConfigError, match="EDGE_BATCHER_SERVER_MAX_BODY_BYTES: expected int"):
        load_config(path, environ={"EDGE_BATCHER_SERVER_MAX_BODY_BYTES": "lots"})


def test_a_misspelled_environment_override_is_an_error_naming_the_setting(tmp_path):
    """Unknown TOML keys stop start-up; an EDGE_BATCHER_ variable that names no setting does too
    (it did nothing, silently)."""
    path = write(tmp_path, "")
    with pytest.raises(ConfigError, match="environment EDGE_BATCHER_SERVER_DRAIN_TIMOUT_S: no such setting; "
                                          "did you mean EDGE_BATCHER_SERVER_DRAIN_TIMEOUT_S"):
        load_config(path, environ={"EDGE_BATCHER_SERVER_DRAIN_TIMOUT_S": "3"})
    with pytest.raises(ConfigError, match="EDGE_BATCHER_NONSENSE: no such setting"):
        load_config(path, environ={"EDGE_BATCHER_NONSENSE": "1"})
    # the CUDA binding choice is not a setting, and stays allowed
    assert load_config(path, environ={"EDGE_BATCHER_CUDA_BINDING": "pycuda"}).server.drain_timeout_s == 30.0


def test_the_origin_of_every_setting_is_kept(tmp_path):
    path = write(tmp_path, "[server]\nmax_body_bytes = 100\n")
    c = load_config(path, environ={"EDGE_BATCHER_SERVER_DRAIN_TIMEOUT_S": "3"})
    assert c.origins["server.max_body_bytes"] == "config file"
    assert c.origins["server.drain_timeout_s"] == "environment EDGE_BATCHER_SERVER_DRAIN_TIMEOUT_S"
    assert "server.loop_cpu" not in c.origins  # the default


def test_relative_repository_is_resolved_against_the_config_file(tmp_path):
    c = load_config(write(tmp_path, "[models]\nrepository = 'models'\n"))
    assert Path(c.models.repository) == tmp_path / "models"


def test_auto_socket_path_prefers_systemd_then_xdg_then_tmp():
    assert resolve_socket_path("auto", {"RUNTIME_DIRECTORY": "/run/edge-batcher"}) == Path(
        "/run/edge-batcher/edge-batcher.sock")
    assert resolve_socket_path("auto", {"XDG_RUNTIME_DIR": "/run/user/1000"}) == Path(
        "/run/user/1000/edge-batcher/edge-batcher.sock")
    assert str(resolve_socket_path("auto", {})).startswith("/tmp/edge-batcher-")
    assert resolve_socket_path("/x/y.sock", {"RUNTIME_DIRECTORY": "/run"}) == Path("/x/y.sock")


def model_dir(tmp_path: Path, text: str) -> Path:
    d = tmp_path / "m1"
    d.mkdir()
    (d / "model.toml").write_text(text)
    return d


def test_model_config_defaults(tmp_path):
    c = load_model_config(model_dir(tmp_path, "backend = 'onnxruntime'\n"))
    assert c.name == "m1"
    assert c.batching.preferred_batch_sizes == [2, 4, 8]
    assert c.batching.max_batch_size == 8
    assert [ep.name for ep in c.onnxruntime.execution_providers] == ["CPUExecutionProvider"]


def test_execution_provider_chain_with_options(tmp_path):
    c = load_model_config(model_dir(tmp_path, """
[onnxruntime]
execution_providers = [
  { name = "TensorrtExecutionProvider", options = { trt_fp16_enable = true } },
  "CUDAExecutionProvider",
  "CPUExecutionProvider",
]
"""))
    eps = c.onnxruntime.execution_providers
    assert [e.name for e in eps] == ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert eps[0].options == {"trt_fp16_enable": True}


@pytest.mark.parametrize(
    "text, words",
    [
        ("bakend = 'onnxruntime'\n", "unknown key 'bakend'"),
        ("[batching]\npreferred_batch_sizes = [4, 2]\n", "expected ascending distinct positive sizes"),
        ("[batching]\npreferred_batch_sizes = [2, 4]\nmax_batch_size = 1\n", "max_batch_size 1 is smaller"),
        ("[batching]\npriority_levels = 2\ndefault_priority = 2\n", "default_priority: expected 0..1"),
        ("[batching]\ndefault_timeout_ms = 100\nmax_timeout_ms = 10\n", "max_timeout_ms 10.0 is below"),
        ("[sequence]\ninputs = ['x']\naxis = 0\nbuckets = [8]\n", "axis: expected >= 1"),
        ("[sequence]\ninputs = ['x']\nbuckets = [16, 8]\n", "buckets: expected ascending"),
        ("[sequence]\naxis = 1\n", "missing required key 'inputs'"),
        ("instances = 0\n", "instances: expected a positive number"),
        ("[onnxruntime]\nintra_op_threads = 'two'\n", "intra_op_threads: expected an integer"),
        ("[onnxruntime]\nallow_spinning = 'no'\n", "allow_spinning: expected true or false"),
    ],
)
def test_invalid_model_config_names_the_key(tmp_path, text, words):
    with pytest.raises(ConfigError) as info:
        load_model_config(model_dir(tmp_path, text))
    assert words in str(info.value)
    assert "model.toml" in str(info.value)


def test_serve_with_a_bad_config_exits_2_with_the_message(tmp_path):
    path = write(tmp_path, "[server]\nmax_body_bytes = 'big'\n")
    proc = subprocess.run([sys.executable, "-m", "edge_batcher.cli", "serve", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "configuration error" in proc.stderr and "max_body_bytes" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_with_a_missing_model_file_exits_2(tmp_path):
    d = tmp_path / "engines" / "broken"
    d.mkdir(parents=True)
    (d / "model.toml").write_text("backend = 'onnxruntime'\n")
    proc = subprocess.run([sys.executable, "-m", "edge_batcher.cli", "serve", "--models", str(tmp_path / "engines"),
                           "--unix-socket", str(tmp_path / "s.sock")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "model 'broken'" in proc.stderr and "not found" in proc.stderr


def _config_cases(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Issue 31 row 12: mistakes that ended in a traceback instead of one clear line."""
    non_utf8 = tmp_path / "latin1.toml"
    non_utf8.write_bytes('[server]\nlog_level = "d\u00e9bug"\n'.encode("latin-1"))
    directory = tmp_path / "config.d"
    directory.mkdir()
    repo = tmp_path / "engines"
    (repo / "binary").mkdir(parents=True)
    (repo / "binary" / "model.toml").write_bytes(bytes(range(256)))
    (repo / "system").mkdir()
    (repo / "system" / "model.toml").write_text('backend = "os:system"\n')
    for name in ("binary", "system"):
        (tmp_path / name).mkdir()
    models = {name: write(tmp_path / name, f'[models]\nrepository = "{repo}"\nload = ["{name}"]\n'
                                            '[memory]\nprobe = "fixed"\nbudget_mb = 512\n')
              for name in ("binary", "system")}
    (tmp_path / "tcp").mkdir()
    token = tmp_path / "tcp" / "token"
    token.write_bytes(b"\xffsecret\n")
    token_config = write(tmp_path / "tcp", f'[server]\nhttp = "127.0.0.1:9"\ntoken_file = "{token}"\n')
    return {
        "non-utf8 token_file": (token_config, f"[server] token_file: {token} is not UTF-8 text"),
        "non-utf8 config": (non_utf8, f"{non_utf8}: not UTF-8 text (byte 0xe9 at offset 23); "
                                      "a TOML file must be UTF-8"),
        "config is a directory": (directory, f"{directory}: is a directory, not a TOML file"),
        "binary model.toml": (models["binary"], f"{repo / 'binary' / 'model.toml'}: not UTF-8 text (byte 0x80 at "
                                                "offset 128); a TOML file must be UTF-8"),
        "backend os:system": (models["system"], f"{repo / 'system' / 'model.toml'}: backend 'os:system' is not an "
                                                "engine class: expected a class with load, infer, close"),
    }


@pytest.mark.parametrize("case", ["non-utf8 config", "config is a directory", "binary model.toml",
                                  "backend os:system", "non-utf8 token_file"])
def test_unreadable_config_files_and_non_engine_backends_are_one_line_errors(tmp_path, case):
    path, message = _config_cases(tmp_path)[case]
    proc = subprocess.run([sys.executable, "-m", "edge_batcher.cli", "serve", "--config", str(path),
                           "--unix-socket", str(tmp_path / "s.sock")],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"edge-batcher: configuration error: {message}" in proc.stderr
