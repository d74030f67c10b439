"""Replies that cannot be delivered, so that their requests are acknowledged and dropped instead of
redelivered forever (issue 31): `reply_topic_problem` names a topic no broker takes (`$...`,
wildcards, empty, too long) before anything is published to it; `ReplyRefused` is a reply the
broker refused; `UndeliverableReplies` counts the messages dropped for it, logs them at most once
per topic per minute (`ThrottledLog`, however many messages a client sends) and remembers for
ten minutes the requests whose reply was refused, so that the broker's redelivery of one
(mosquitto drops the connection over a refused publish with `max_queued_messages 0`, and some
brokers' ACLs always do) is acknowledged without a second try; `Remembered` is that memory, also
of the topics the broker refused (refusals.py)."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Hashable
from typing import Any, Generic, TypeVar

from .messages import Message

MAX_TOPIC_BYTES = 65535  # an MQTT string's two-byte length
REQUESTS_REMEMBERED_S = 600.0  # a refused request is acked on redelivery within this long (reconnect, outage)
REQUESTS_REMEMBERED_MAX = 1024
TOPICS_REMEMBERED_S = 60.0  # a topic the broker refused takes no reply for this long (an ACL may be fixed)
TOPICS_REMEMBERED_MAX = 256
LOG_INTERVAL_S = 60.0
LOG_KEYS_MAX = 256  # topics throttled separately; beyond that they share one key


def reply_topic_problem(topic: str) -> str | None:
    """Why `topic` cannot take a reply, or None. Topics starting with '$' belong to the broker
    (`$SYS/...`, `$share/...`): mosquitto refuses a publish there, and drops the connection for it
    with `max_queued_messages 0`. Wildcards are for subscribing only."""
    if not topic:
        return "is empty"
    if topic.startswith("$"):
        return "starts with '$' (topics reserved for the broker, such as $SYS/ and $share/)"
    if "+" in topic or "#" in topic:
        return "holds a wildcard ('+' or '#'), which only a subscription may"
    if "\0" in topic:
        return "holds U+0000"
    if len(topic.encode("utf-8", "surrogatepass")) > MAX_TOPIC_BYTES:
        return f"is longer than {MAX_TOPIC_BYTES} bytes"
    return None


class ReplyRefused(Exception):
    """A reply that cannot be delivered: the broker refused it (an MQTT 5 reason code of 0x80 or
    more, e.g. 0x87 Not authorized) or it cannot be sent at all. Its request is acknowledged and
    dropped, since a redelivery would meet the same refusal."""

    def __init__(self, topic: str, reason: str, code: int = 0):
        where = f" (reason code 0x{code:02X})" if code else ""
        super().__init__(f"cannot deliver a reply to {topic!r}: {reason}{where}")
        self.topic = topic
        self.reason = reason
        self.code = code


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Remembered(Generic[K, V]):
    """A value per key for `seconds`, at most `most` keys (the oldest go first)."""

    def __init__(self, seconds: float, most: int):
        self.seconds = seconds
        self.most = most
        self._entries: collections.OrderedDict[K, tuple[float, V]] = collections.OrderedDict()

    def add(self, key: K, value: V) -> None:
        self._entries[key] = (time.monotonic() + self.seconds, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.most:
            self._entries.popitem(last=False)

    def get(self, key: K) -> V | None:
        if not self._entries:  # the usual case: nothing remembered
            return None
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[0] < time.monotonic():
            del self._entries[key]
            return None
        return entry[1]

    def __bool__(self) -> bool:
        return bool(self._entries)


class UndeliverableReplies:
    """The messages acknowledged and dropped because their reply cannot be delivered: counted (and
    in the metric, by reason), logged once per topic per minute, and the requests among them whose
    reply was refused remembered for REQUESTS_REMEMBERED_S, so that the broker's redelivery of one
    is dropped without a second try."""

    def __init__(self, logger: logging.Logger, metric: Any):
        self.count = 0
        self._metric = metric  # edge_batcher_mqtt_undeliverable_total{reason}
        self._log = ThrottledLog(logger)
        self._requests: Remembered[int, ReplyRefused] = Remembered(REQUESTS_REMEMBERED_S, REQUESTS_REMEMBERED_MAX)

    def refused(self, msg: Message, refused: ReplyRefused) -> None:
        self._requests.add(request_key(msg), refused)
        self._dropped(msg, refused, "broker_refused" if refused.code else "unsendable")

    def refused_before(self, msg: Message) -> bool:
        """True (and `msg` counted as dropped) when the reply to an earlier copy of it was refused:
        the broker sends a request again on every connection until it is acked, and a copy may be
        answered while an earlier one's reply is still being refused."""
        refused = self._requests.get(request_key(msg)) if self._requests else None
        if refused is not None:
            self._dropped(msg, refused, "redelivered")
        return refused is not None

    def _dropped(self, msg: Message, refused: ReplyRefused, reason: str) -> None:
        self.count += 1
        self._metric.inc(reason=reason)
        self._log.warning(refused.topic, "MQTT: %s; the message on %s is acknowledged and dropped unanswered",
                          refused, msg.topic)


def request_fields(msg: Message) -> tuple:
    """What identifies a request when the broker sends it again: its topic, Response Topic,
    Correlation Data and payload."""
    return msg.topic, msg.response_topic, msg.correlation_data, msg.payload


def request_key(msg: Message) -> int:
    """request_fields hashed, so that a remembered request costs a few dozen bytes; Python's hash
    of bytes is keyed per process (and cached on the payload), so no client can make two collide
    on purpose."""
    return hash(request_fields(msg))


class ThrottledLog:
    """Warnings logged at most once per key (a topic) per LOG_INTERVAL_S; the next one says how
    many were left out meanwhile."""

    def __init__(self, logger: logging.Logger):
        self._log = logger
        self._last: dict[str, float] = {}
        self._skipped: collections.Counter[str] = collections.Counter()

    def warning(self, key: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if key not in self._last and len(self._last) >= LOG_KEYS_MAX:
            self._forget_before(now - LOG_INTERVAL_S)
            if len(self._last) >= LOG_KEYS_MAX:
                key = "(other topics)"
        last = self._last.get(key)
        if last is not None and now - last < LOG_INTERVAL_S:
            self._skipped[key] += 1
            return
        self._last[key] = now
        skipped = self._skipped.pop(key, 0)
        if skipped:
            message += " (%d more like this in the last %d s)"
            args = (*args, skipped, int(LOG_INTERVAL_S))
        self._log.warning(message, *args)

    def _forget_before(self, cutoff: float) -> None:
        for key in [k for k, t in self._last.items() if t < cutoff]:
            del self._last[key]
            self._skipped.pop(key, None)
