"""The [mqtt] section checked beyond its types (ranges, enumerations, topic syntax, files), the
password read from its file, and the default client id: everything the transport needs from the
settings before it talks to a broker, each mistake a ConfigError naming the key."""

from __future__ import annotations

import hashlib
import os
import string

from paho.mqtt.client import topic_matches_sub

from ...config import DaemonConfig, MqttSettings, StreamMapping
from ...errors import ConfigError


def validate_settings(s: MqttSettings, where: str = "[mqtt]") -> None:
    """Check what config.py does not: ranges, enumerations, topic syntax, files. Raises ConfigError
    naming the key, e.g. ``[mqtt] qos: expected 0, 1 or 2, got 3``."""
    if not s.host:
        raise ConfigError(f"{where} host: expected the broker's host name or address, got an empty string")
    if not 0 < s.port < 65536:
        raise ConfigError(f"{where} port: expected 1..65535, got {s.port}")
    if s.qos not in (0, 1, 2):
        raise ConfigError(f"{where} qos: expected 0, 1 or 2, got {s.qos}")
    if not 0 <= s.keepalive_s <= 65535:
        raise ConfigError(f"{where} keepalive_s: expected 0..65535 seconds, got {s.keepalive_s}")
    if not 0 <= s.session_expiry_s <= 0xFFFFFFFF:
        raise ConfigError(f"{where} session_expiry_s: expected 0..4294967295 seconds, got {s.session_expiry_s}")
    for key in ("max_inflight", "max_queued", "max_pending", "max_held_bytes"):
        value = getattr(s, key)
        if value < 1:  # paho reads 0 as "unbounded": never allow it
            raise ConfigError(f"{where} {key}: expected a positive number (0 would be unbounded), got {value}")
    if s.reconnect_min_s <= 0:
        raise ConfigError(f"{where} reconnect_min_s: expected a positive number of seconds, got {s.reconnect_min_s}")
    if s.reconnect_max_s < s.reconnect_min_s:
        raise ConfigError(
            f"{where} reconnect_max_s: expected at least reconnect_min_s ({s.reconnect_min_s}), got {s.reconnect_max_s}"
        )
    for key in ("device_id", "topic_prefix", "shared_group"):
        value = getattr(s, key)
        if any(c in value for c in "+#\0"):
            raise ConfigError(f"{where} {key}: must not contain the MQTT wildcards '+' or '#', got {value!r}")
    if s.topic_prefix and (s.topic_prefix.endswith("/") or s.topic_prefix.startswith("$")):
        raise ConfigError(f"{where} topic_prefix: must not end with '/' or start with '$', got {s.topic_prefix!r}")
    if "/" in s.shared_group:
        raise ConfigError(f"{where} shared_group: must not contain '/', got {s.shared_group!r}")
    if s.password and s.password_file:
        raise ConfigError(f"{where} password_file: set password or password_file, not both")
    if (s.password or s.password_file) and not s.username:
        raise ConfigError(f"{where} username: a password is set, so set the user name too")
    if s.password_file and not os.access(s.password_file, os.R_OK):
        raise ConfigError(f"{where} password_file: {s.password_file} does not exist or is not readable")
    for key in ("ca_file", "cert_file", "key_file"):
        path = getattr(s, key)
        if path and not os.path.isfile(path):
            raise ConfigError(f"{where} {key}: {path} is not a file")
        if path and not s.tls:
            raise ConfigError(f"{where} {key}: set tls = true to use it")
    if s.key_file and not s.cert_file:
        raise ConfigError(f"{where} key_file: a client key needs its certificate: set cert_file too")
    for i, stream in enumerate(s.streams):
        _validate_stream(stream, f"{where} streams[{i}]")


def _validate_stream(m: StreamMapping, where: str) -> None:
    _check_filter(m.topic, f"{where} topic")
    if m.encoding not in ("json", "raw"):
        raise ConfigError(f"{where} encoding: expected json or raw, got {m.encoding!r}")
    if not m.model:
        raise ConfigError(f"{where} model: name the model this stream feeds")
    if m.output_topic:
        wildcards = sum(1 for level in m.topic.split("/") if level in ("+", "#"))
        try:
            fields = [f for _, f, spec, conv in string.Formatter().parse(m.output_topic) if f is not None]
        except ValueError as exc:
            raise ConfigError(f"{where} output_topic: {m.output_topic!r} is not a valid template: {exc}") from None
        for f in fields:
            if not f.isdigit() or not 1 <= int(f) <= wildcards:
                allowed = ", ".join(f"{{{i}}}" for i in range(1, wildcards + 1)) or "none (the filter has no wildcards)"
                raise ConfigError(
                    f"{where} output_topic: {{{f}}} is not a wildcard of {m.topic!r}; allowed: {allowed}"
                )
        sample = m.output_topic.format("", *(["x"] * wildcards))
        if any(c in sample for c in "+#"):
            raise ConfigError(f"{where} output_topic: must not contain '+' or '#', got {m.output_topic!r}")
        if topic_matches_sub(m.topic, sample):
            raise ConfigError(
                f"{where} output_topic: {m.output_topic!r} matches the stream's own filter {m.topic!r}: "
                f"results would be fed back in"
            )


def _check_filter(topic: str, where: str) -> None:
    if not topic or "\0" in topic:
        raise ConfigError(f"{where}: expected an MQTT topic filter like sensors/+/vibration, got {topic!r}")
    if topic.startswith("$share/"):
        raise ConfigError(f"{where}: use [mqtt] shared_group instead of a $share/ filter, got {topic!r}")
    levels = topic.split("/")
    for i, level in enumerate(levels):
        if ("+" in level or "#" in level) and level not in ("+", "#"):
            raise ConfigError(f"{where}: a wildcard must fill a whole level, got {topic!r}")
        if level == "#" and i != len(levels) - 1:
            raise ConfigError(f"{where}: '#' must be the last level, got {topic!r}")


def read_password(s: MqttSettings, where: str) -> str | None:
    """The broker password: `password`, or the first line of `password_file`."""
    if s.password_file:
        try:
            with open(s.password_file, encoding="utf-8") as fh:
                return fh.read().rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(f"{where} password_file: cannot read {s.password_file}: {exc.strerror}") from None
    return s.password or None


def default_client_id(device_id: str, config: DaemonConfig) -> str:
    """``edge-batcher-<device id>-<8 hex digits of the Unix socket's path>``. The socket path tells
    daemons on one host apart (two cannot share it), so the service and a bench run beside it do
    not take each other's session, while a restarted daemon finds its persistent session again."""
    path = str(config.socket_path())
    return f"edge-batcher-{device_id}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"
