"""edge_batcher.systemd, systemd/*.{service,socket} and tools/install-service.sh.

Real sockets and real subprocesses throughout: the notify tests bind the datagram socket systemd
would own, the socket-activation tests hand real listening sockets to a child process at fd 3..,
exactly as PID 1 does, and the unit files are checked with the real systemd-analyze when present.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import io
import json
import logging
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from edge_batcher.systemd import (
    JournaldFormatter,
    JsonFormatter,
    Notifier,
    configure_logging,
    listen_fds,
    listen_fds_with_names,
    under_journald,
    watchdog_interval,
)

REPO = Path(__file__).resolve().parent.parent
SERVICE = REPO / "systemd" / "edge-batcher.service"
SOCKET_UNIT = REPO / "systemd" / "edge-batcher.socket"
INSTALLER = REPO / "tools" / "install-service.sh"
CHILD_ENV = {**os.environ, "PYTHONPATH": str(REPO)}


# --------------------------------------------------------------------------------------------
# sd_notify
# --------------------------------------------------------------------------------------------


@pytest.fixture
def notify_socket(tmp_path):
    """The AF_UNIX datagram socket systemd listens on, bound at a real path."""
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    yield path, sock
    sock.close()


def test_notifier_ready_sends_one_datagram_with_status(notify_socket):
    path, server = notify_socket
    notifier = Notifier.from_env({"NOTIFY_SOCKET": str(path)})
    assert notifier.enabled
    assert notifier.ready("serving 2 models") is True
    assert server.recv(4096) == b"READY=1\nSTATUS=serving 2 models\n"
    assert notifier.ready() is True
    assert server.recv(4096) == b"READY=1\n"


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda n: n.status("loading resnet50 (2/3)"), b"STATUS=loading resnet50 (2/3)\n"),
        (lambda n: n.stopping(), b"STOPPING=1\n"),
        (lambda n: n.stopping("draining 4 requests"), b"STOPPING=1\nSTATUS=draining 4 requests\n"),
        (lambda n: n.watchdog(), b"WATCHDOG=1\n"),
        (lambda n: n.extend_timeout(2.5), b"EXTEND_TIMEOUT_USEC=2500000\n"),
        (lambda n: n.extend_timeout(120), b"EXTEND_TIMEOUT_USEC=120000000\n"),
        (lambda n: n.notify(STATUS="line one\nline two"), b"STATUS=line one line two\n"),
        (lambda n: n.notify(READY=True, ERRNO=0), b"READY=1\nERRNO=0\n"),
    ],
    ids=["status", "stopping", "stopping-status", "watchdog", "extend", "extend-int", "newline", "bool"],
)
def test_notifier_datagram_contents(notify_socket, call, expected):
    path, server = notify_socket
    assert call(Notifier(str(path))) is True
    assert server.recv(4096) == expected


def test_notifier_reloading_carries_monotonic_timestamp(notify_socket):
    path, server = notify_socket
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert Notifier(str(path)).reloading("re-reading config") is True
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    lines = server.recv(4096).decode().splitlines()
    assert lines[0] == "RELOADING=1"
    assert lines[2] == "STATUS=re-reading config"
    key, _, usec = lines[1].partition("=")
    assert key == "MONOTONIC_USEC" and before <= int(usec) <= after


def test_notifier_sender_pid_is_main_pid_even_from_a_thread(notify_socket):
    """NotifyAccess=main: systemd accepts a datagram only if SCM_CREDENTIALS say it came from
    the main PID. Threads share the PID, so pinging from a helper thread must be attributed to it."""
    path, server = notify_socket
    server.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    notifier = Notifier(str(path))
    results = []
    thread = threading.Thread(target=lambda: results.append(notifier.watchdog()))
    thread.start()
    thread.join(5)
    assert results == [True]
    ucred_size = struct.calcsize("iII")
    data, ancdata, _, _ = server.recvmsg(4096, socket.CMSG_SPACE(ucred_size))
    assert data == b"WATCHDOG=1\n"
    creds = [d for level, kind, d in ancdata if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS]
    assert creds, "kernel attached no SCM_CREDENTIALS"
    pid, uid, _gid = struct.unpack("iII", creds[0][:ucred_size])
    assert (pid, uid) == (os.getpid(), os.getuid())


def test_notifier_abstract_namespace_socket():
    name = f"edge-batcher-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind("\0" + name)
        server.settimeout(5)
        notifier = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert notifier.enabled
        assert notifier.ready("up") is True
        assert server.recv(4096) == b"READY=1\nSTATUS=up\n"


def test_notifier_disabled_without_notify_socket():
    for environ in ({}, {"NOTIFY_SOCKET": ""}):
        notifier = Notifier.from_env(environ)
        assert not notifier.enabled
        assert notifier.ready("x") is False
        assert notifier.watchdog() is False
        assert notifier.extend_timeout(10) is False


def test_notifier_missing_socket_returns_false_and_logs_at_debug(tmp_path, caplog):
    notifier = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert notifier.enabled
    with caplog.at_level(logging.DEBUG, logger="edge_batcher.systemd"):
        assert notifier.ready() is False
        assert notifier.watchdog() is False
    assert any(r.levelno == logging.DEBUG and "sd_notify" in r.getMessage() for r in caplog.records)


def test_notifier_non_unix_address_is_disabled():
    assert not Notifier.from_env({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled


def test_extend_timeout_rejects_non_positive(notify_socket):
    path, _ = notify_socket
    with pytest.raises(ValueError, match="positive"):
        Notifier(str(path)).extend_timeout(0)


# --------------------------------------------------------------------------------------------
# watchdog
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "pid", "expected"),
    [
        ({}, None, None),
        ({"WATCHDOG_USEC": "30000000"}, None, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, None, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None, None),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 4242, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 4243, None),
        ({"WATCHDOG_USEC": "500000"}, None, 0.25),
        ({"WATCHDOG_USEC": "0"}, None, None),
        ({"WATCHDOG_USEC": "-5"}, None, None),
        ({"WATCHDOG_USEC": "thirty"}, None, None),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "me"}, None, None),
    ],
)
def test_watchdog_interval(environ, pid, expected):
    assert watchdog_interval(environ, pid=pid) == expected


# --------------------------------------------------------------------------------------------
# socket activation
# --------------------------------------------------------------------------------------------

# Runs as the activated daemon: takes the passed sockets, reports what it got, serves one
# connection on each. argv[1] selects the API under test.
ACTIVATED_CHILD = r"""
import fcntl, json, os, socket, sys
from edge_batcher.systemd import listen_fds, listen_fds_with_names
if sys.argv[1] == "names":
    pairs = listen_fds_with_names()
else:
    pairs = [("-", s) for s in listen_fds()]
report = {
    "fds": [s.fileno() for _, s in pairs],
    "names": [n for n, _ in pairs],
    "families": [s.family.name for _, s in pairs],
    "types": [s.type.name for _, s in pairs],
    "cloexec": [bool(fcntl.fcntl(s.fileno(), fcntl.F_GETFD) & fcntl.FD_CLOEXEC) for _, s in pairs],
    "env_left": sorted(k for k in os.environ if k.startswith("LISTEN_")),
}
for name, s in pairs:
    s.settimeout(20)
    conn, _ = s.accept()
    with conn:
        conn.sendall(("hello from %s pid %d\n" % (name, os.getpid())).encode())
print(json.dumps(report), flush=True)
"""


def _high_dup(sock: socket.socket) -> int:
    """Duplicate to an fd >= 10 so the shell's `3<&N` never collides with 3, 4, ..."""
    return fcntl.fcntl(sock.fileno(), fcntl.F_DUPFD, 10)


def _spawn_activated(fds: list[int], names: str | None, mode: str) -> subprocess.Popen:
    """Start the child the way systemd does: sockets at fd 3.., LISTEN_PID = the child's own PID.

    The child's PID is unknown before it exists, so a shell sets LISTEN_PID=$$ and exec()s
    Python in place (same PID), after dup2()ing each passed socket onto 3, 4, ... and closing
    the originals. bash, not sh: dash only accepts single-digit fds in redirections.
    """
    redirs = " ".join(f"{3 + i}<&{fd} {fd}<&-" for i, fd in enumerate(fds))
    env_names = f" LISTEN_FDNAMES={names}" if names is not None else ""
    script = f'export LISTEN_PID=$$ LISTEN_FDS={len(fds)}{env_names}; exec "$0" -c "$1" "$2" {redirs}'
    return subprocess.Popen(
        [shutil.which("bash") or "/bin/bash", "-c", script, sys.executable, ACTIVATED_CHILD, mode],
        pass_fds=fds,
        env=CHILD_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _recv_line(sock: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode()


def test_listen_fds_unix_socket_passed_at_fd3(tmp_path):
    path = str(tmp_path / "api.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(8)
        fd = _high_dup(listener)
        try:
            proc = _spawn_activated([fd], names=None, mode="plain")
        finally:
            os.close(fd)
    # The parent closed its copy: only the child holds the listening socket now.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(20)
        client.connect(path)
        greeting = _recv_line(client)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert greeting == f"hello from - pid {proc.pid}\n"
    report = json.loads(out.strip().splitlines()[-1])
    assert report == {
        "fds": [3],
        "names": ["-"],
        "families": ["AF_UNIX"],
        "types": ["SOCK_STREAM"],
        "cloexec": [True],
        "env_left": [],
    }


def test_listen_fds_two_sockets_with_names(tmp_path):
    path = str(tmp_path / "api.sock")
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with unix, tcp:
        unix.bind(path)
        unix.listen(8)
        tcp.bind(("127.0.0.1", 0))
        tcp.listen(8)
        port = tcp.getsockname()[1]
        fds = [_high_dup(unix), _high_dup(tcp)]
        try:
            proc = _spawn_activated(fds, names="api:peer", mode="names")
        finally:
            for fd in fds:
                os.close(fd)
    greetings = []
    for family, address in ((socket.AF_UNIX, path), (socket.AF_INET, ("127.0.0.1", port))):
        with socket.socket(family, socket.SOCK_STREAM) as client:
            client.settimeout(20)
            client.connect(address)
            greetings.append(_recv_line(client))
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert greetings == [f"hello from api pid {proc.pid}\n", f"hello from peer pid {proc.pid}\n"]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["fds"] == [3, 4]
    assert report["names"] == ["api", "peer"]
    assert report["families"] == ["AF_UNIX", "AF_INET"]
    assert report["cloexec"] == [True, True]
    assert report["env_left"] == []


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None, reason="systemd-socket-activate not installed")
def test_listen_fds_under_systemd_socket_activate(tmp_path):
    """The same protocol as produced by systemd's own implementation (src/activate)."""
    path = str(tmp_path / "api.sock")
    proc = subprocess.Popen(
        [
            "systemd-socket-activate", "--listen", path, "--fdname=api",
            f"--setenv=PYTHONPATH={REPO}",
            sys.executable, "-c", ACTIVATED_CHILD, "names",
        ],
        env=CHILD_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        # systemd-socket-activate binds and listens asynchronously: the path exists from bind(),
        # and a connect is refused until listen().
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "systemd-socket-activate never listened on the socket"
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                client.settimeout(20)
                client.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                client.close()
                time.sleep(0.02)
        with client:
            greeting = _recv_line(client)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert greeting.startswith("hello from api pid ")
    report = json.loads(out.strip().splitlines()[-1])
    assert report["fds"] == [3] and report["names"] == ["api"] and report["families"] == ["AF_UNIX"]


def test_listen_fds_ignores_sockets_meant_for_another_pid():
    environ = {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1", "LISTEN_FDNAMES": "api", "OTHER": "x"}
    assert listen_fds(environ) == []
    # Unset regardless of the outcome (as sd_listen_fds does), other variables untouched.
    assert environ == {"OTHER": "x"}


def test_listen_fds_without_variables_or_with_garbage():
    assert listen_fds({}) == []
    assert listen_fds({"LISTEN_PID": "abc", "LISTEN_FDS": "1"}) == []
    assert listen_fds({"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "0"}) == []
    kept = {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1"}
    assert listen_fds_with_names(kept, unset=False) == []
    assert kept == {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1"}


# --------------------------------------------------------------------------------------------
# journald detection and formatters
# --------------------------------------------------------------------------------------------


def test_under_journald_matches_dev_ino_of_the_stream(tmp_path):
    target = tmp_path / "stream"
    other = tmp_path / "other"
    with open(target, "w") as stream, open(other, "w") as other_stream:
        st = os.fstat(stream.fileno())
        environ = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        assert under_journald(environ, fd=stream.fileno()) is True
        assert under_journald(environ, fd=other_stream.fileno()) is False
        assert under_journald({}, fd=stream.fileno()) is False
        assert under_journald({"JOURNAL_STREAM": "garbage"}, fd=stream.fileno()) is False
        assert under_journald({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"}, fd=stream.fileno()) is False


def _run_logging_child(code: str, stderr_path: Path, extra_env: dict[str, str]) -> str:
    """Run `code` in a fresh interpreter with stderr going to a real file; return that file."""
    env = {k: v for k, v in CHILD_ENV.items() if k != "JOURNAL_STREAM"}
    env.update(extra_env)
    with open(stderr_path, "w") as err:
        proc = subprocess.run([sys.executable, "-c", code], stderr=err, env=env, timeout=60)
    text = stderr_path.read_text()
    assert proc.returncode == 0, text
    return text


LOGGING_CHILD = r"""
import logging, sys
from edge_batcher.systemd import configure_logging, under_journald
configure_logging("INFO", sys.argv[1] if len(sys.argv) > 1 else "auto")
configure_logging("INFO", sys.argv[1] if len(sys.argv) > 1 else "auto")  # idempotent: one handler
log = logging.getLogger("edge_batcher.x")
log.debug("hidden")
log.info("message")
log.warning("careful", extra={"model": "resnet"})
"""


def test_configure_logging_auto_uses_journald_format_when_stderr_is_the_journal_stream(tmp_path):
    stream = tmp_path / "journal-stream"
    stream.touch()
    st = os.stat(stream)
    text = _run_logging_child(
        LOGGING_CHILD, stream, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
    )
    assert text.splitlines() == ["<6>edge_batcher.x: message", "<4>edge_batcher.x: careful"]


def test_configure_logging_auto_is_plain_when_stderr_is_not_the_journal_stream(tmp_path):
    # JOURNAL_STREAM inherited but stderr redirected elsewhere: must not use <N> prefixes.
    text = _run_logging_child(LOGGING_CHILD, tmp_path / "err", {"JOURNAL_STREAM": "1:2"})
    lines = text.splitlines()
    assert len(lines) == 2
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    assert re.fullmatch(stamp + r" INFO edge_batcher\.x: message", lines[0]), lines[0]
    assert re.fullmatch(stamp + r" WARNING edge_batcher\.x: careful", lines[1]), lines[1]


def test_configure_logging_json(tmp_path):
    code = LOGGING_CHILD.replace('sys.argv[1] if len(sys.argv) > 1 else "auto"', '"json"')
    lines = _run_logging_child(code, tmp_path / "err", {}).splitlines()
    docs = [json.loads(line) for line in lines]
    assert [(d["level"], d["logger"], d["message"]) for d in docs] == [
        ("INFO", "edge_batcher.x", "message"),
        ("WARNING", "edge_batcher.x", "careful"),
    ]
    assert docs[1]["model"] == "resnet"


def test_configure_logging_rejects_bad_values():
    with pytest.raises(ValueError, match="DEBUG, INFO, WARNING, ERROR, CRITICAL"):
        configure_logging("LOUD")
    with pytest.raises(ValueError, match="auto, plain, journald, json"):
        configure_logging("INFO", "xml")


def _capture(formatter: logging.Formatter, name: str) -> tuple[logging.Logger, io.StringIO]:
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(formatter)
    log = logging.getLogger(name)
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.DEBUG)
    return log, buffer


def test_journald_formatter_priorities_and_multiline():
    log, buffer = _capture(JournaldFormatter(), "edge_batcher.test.journald")
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("e")
    log.critical("c")
    log.log(25, "custom level between INFO and WARNING")
    try:
        _ = 1 / 0
    except ZeroDivisionError:
        log.exception("engine failed")
    lines = buffer.getvalue().splitlines()
    name = "edge_batcher.test.journald"
    assert lines[:6] == [
        f"<7>{name}: d",
        f"<6>{name}: i",
        f"<4>{name}: w",
        f"<3>{name}: e",
        f"<2>{name}: c",
        f"<6>{name}: custom level between INFO and WARNING",
    ]
    traceback_lines = lines[6:]
    assert traceback_lines[0] == f"<3>{name}: engine failed"
    assert len(traceback_lines) > 3 and all(line.startswith("<3>") for line in traceback_lines)
    assert traceback_lines[-1] == "<3>ZeroDivisionError: division by zero"


def test_json_formatter_fields_extras_and_exceptions():
    log, buffer = _capture(JsonFormatter(), "edge_batcher.test.json")
    before = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=1)
    marker = object()
    log.info("loaded %s in %.1f s", "resnet", 1.25, extra={"model": "resnet", "batch": 8, "obj": marker, "level": "x"})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.error("batch failed", exc_info=True)
    first, second = (json.loads(line) for line in buffer.getvalue().splitlines())
    ts = dt.datetime.fromisoformat(first["ts"])
    assert ts.tzinfo is not None and before <= ts <= dt.datetime.now(dt.timezone.utc)
    assert first["level"] == "INFO"
    assert first["logger"] == "edge_batcher.test.json"
    assert first["message"] == "loaded resnet in 1.2 s"
    assert first["model"] == "resnet" and first["batch"] == 8
    assert first["obj"] == str(marker)  # not JSON-serialisable -> str()
    assert first["extra_level"] == "x"  # colliding extra kept, fixed field wins
    assert "exc" not in first and "args" not in first and "msg" not in first
    assert second["level"] == "ERROR" and second["message"] == "batch failed"
    assert "RuntimeError: boom" in second["exc"]


# --------------------------------------------------------------------------------------------
# unit files (systemd-analyze)
# --------------------------------------------------------------------------------------------

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None,
    reason="systemd-analyze not installed (Debian/Ubuntu package 'systemd'); unit files not checked",
)

# Measured 1.6 with systemd 252 (Debian 12). systemd rates 1.0-4.9 "OK", 5.0-7.4 "MEDIUM".
# 2.5 keeps the documented, unavoidable exposures (no PrivateDevices/PrivateUsers/PrivateNetwork,
# MemoryDenyWriteExecute=no for the CUDA JIT, GPU DeviceAllow entries) plus headroom for the
# per-version scoring drift of newer systemd releases, but fails if a major knob is dropped:
# removing SystemCallFilter= alone takes it to 3.1, also dropping ProtectSystem/ProtectHome to 3.4.
EXPOSURE_THRESHOLD = 2.5


def _unit_copy(tmp_path: Path) -> Path:
    """Copy both units, with ExecStart's binary replaced by /bin/true (arguments kept).

    `systemd-analyze verify` checks that ExecStart's binary exists and is executable; the real
    one (/opt/edge-batcher/venv/bin/edge-batcher) only exists after tools/install-service.sh
    ran. Pointing it at an existing binary keeps every other check, instead of filtering the
    message (which would also hide a typo in the path).
    """
    text = SERVICE.read_text()
    exec_line = "ExecStart=/opt/edge-batcher/venv/bin/edge-batcher serve --config /etc/edge-batcher/config.toml"
    assert exec_line in text.splitlines()
    (tmp_path / SERVICE.name).write_text(
        text.replace(exec_line, "ExecStart=/bin/true serve --config /etc/edge-batcher/config.toml")
    )
    shutil.copy(SOCKET_UNIT, tmp_path / SOCKET_UNIT.name)
    return tmp_path / SERVICE.name


@needs_analyze
def test_units_pass_systemd_analyze_verify(tmp_path):
    service = _unit_copy(tmp_path)
    proc = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", service.name, SOCKET_UNIT.name],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    output = proc.stdout + proc.stderr
    # Messages about other units installed on this host are not ours to judge.
    ours = [line for line in output.splitlines() if "edge-batcher" in line]
    assert proc.returncode == 0 and ours == [], output


@needs_analyze
def test_verify_does_check_execstart(tmp_path):
    """Guards the workaround above: verify does reject the uninstalled binary path, so the copy
    with /bin/true is what makes the check meaningful rather than vacuous."""
    shutil.copy(SERVICE, tmp_path / SERVICE.name)
    proc = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", SERVICE.name], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert "/opt/edge-batcher/venv/bin/edge-batcher" in proc.stderr


@needs_analyze
def test_service_security_exposure_is_below_threshold(tmp_path):
    service = _unit_copy(tmp_path)
    proc = subprocess.run(
        [SYSTEMD_ANALYZE, "security", "--offline=true", "--no-pager", str(service)],
        capture_output=True, text=True, timeout=120,
    )
    if (proc.returncode != 0 and "offline" in proc.stderr
            and ("unrecognized" in proc.stderr or "unknown" in proc.stderr)):
        pytest.skip(f"systemd-analyze too old for --offline (needs systemd >= 250): {proc.stderr.strip()}")
    match = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", proc.stdout + proc.stderr)
    assert match, proc.stdout + proc.stderr
    exposure = float(match.group(1))
    assert exposure <= EXPOSURE_THRESHOLD, proc.stdout


# --------------------------------------------------------------------------------------------
# installer
# --------------------------------------------------------------------------------------------


def _installer(*args: str, unprivileged: bool = False) -> subprocess.CompletedProcess:
    cmd = ["bash", str(INSTALLER), *args]
    if unprivileged and os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root and setpriv(1) is missing: cannot drop privileges")
        cmd = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)


def test_installer_dry_run_without_root_prints_plan_and_changes_nothing(tmp_path):
    prefix = tmp_path / "opt" / "edge-batcher"
    proc = _installer("--dry-run", "--prefix", str(prefix), unprivileged=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for expected in (
        "DRY RUN",
        "edge-batcher",  # the user is created unless it already exists
        f"python3 -m venv {prefix}/venv" if not (prefix / "venv").exists() else "venv exists",
        f"{prefix}/venv/bin/pip install",
        "/etc/edge-batcher/config.toml",
        "/var/lib/edge-batcher/engines",
        "/etc/systemd/system/edge-batcher.service",
        f"ExecStart={prefix}/venv/bin/edge-batcher",
        "systemctl daemon-reload",
        "systemctl enable --now edge-batcher",
    ):
        assert expected in out, f"{expected!r} missing from:\n{out}"
    if subprocess.run(["getent", "passwd", "edge-batcher"], capture_output=True).returncode != 0:
        assert "useradd --system --no-create-home" in out and "--shell /usr/sbin/nologin" in out
    assert not prefix.exists() and not (tmp_path / "opt").exists()


def test_installer_dry_run_socket_activation_and_extras():
    proc = _installer("--dry-run", "--socket-activation", "--extras", "gpu,tensorrt")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    pip_line = next(line for line in out.splitlines() if "/bin/pip install" in line)
    assert "gpu" in pip_line and "tensorrt" in pip_line
    assert "/etc/systemd/system/edge-batcher.socket" in out
    assert "RuntimeDirectoryPreserve=yes" in out
    assert "systemctl enable --now edge-batcher.socket" in out


def test_installer_help_and_bad_arguments():
    help_proc = _installer("--help")
    assert help_proc.returncode == 0
    for option in ("--prefix", "--config", "--extras", "--socket-activation", "--dry-run"):
        assert option in help_proc.stdout
    bad = _installer("--frobnicate")
    assert bad.returncode == 2 and "unknown option: --frobnicate" in bad.stderr
    injected = _installer("--dry-run", "--extras", "gpu;rm -rf /")
    assert injected.returncode != 0 and "--extras" in injected.stderr
    relative = _installer("--dry-run", "--prefix", "opt")
    assert relative.returncode != 0 and "absolute" in relative.stderr


def test_installer_refuses_to_run_for_real_without_root():
    if os.geteuid() != 0:
        proc = _installer()
    else:
        proc = _installer(unprivileged=True)
    assert proc.returncode != 0
    assert "must run as root" in proc.stderr
