"""The MQTT transport's inbox: the messages taken from the broker and not answered yet, bounded
in bytes (``max_held_bytes``) and, for QoS 0, in number (``max_pending``). paho's reader admits a
message and the transport releases it once answered, both on the event loop; those not started
yet wait in arrival order. What does not fit is the transport's to defer (QoS 1/2, fetched again
by a reconnect) or refuse (429). When the broker resumes the session, the messages of an earlier
connection still waiting keep their place, and the copy the broker sends again of one is adopted
by it instead of taking room: dropping them for those copies lost every one the broker no longer
had (a crash that restored an older save: issue 31, 1,987 of 10,000 requests)."""

from __future__ import annotations

import collections
from dataclasses import dataclass

from .messages import Message
from .undeliverable import request_fields, request_key

MESSAGE_OVERHEAD_BYTES = 2048  # a held message's Python objects, properties, bookkeeping (~1.9 KiB measured)


class Inbox:
    """Bookkeeping of the messages taken from the broker and not answered yet: their bytes (each
    counted as its payload plus MESSAGE_OVERHEAD_BYTES of Python objects), how many are QoS 0,
    and those not started yet (`waiting`), in arrival order."""

    def __init__(self, max_bytes: int, max_qos0: int):
        self.max_bytes = max_bytes
        self.max_qos0 = max_qos0
        self.bytes = 0
        self.count = 0
        self.qos0 = 0
        self.waiting: collections.deque[Held] = collections.deque()  # admitted, not started yet
        self._superseded: dict[int, Held] = {}  # waiting messages of an earlier connection, by request_key

    def admit(self, qos: int, cost: int) -> bool:
        """Take a message of `cost` bytes. A QoS 0 message needs one of max_pending places; a QoS 1/2
        message needs room in max_bytes (an empty inbox always takes one, however large)."""
        if qos == 0:
            if self.qos0 >= self.max_qos0:
                return False
            self.qos0 += 1
        elif self.count and self.bytes + cost > self.max_bytes:
            return False
        self.bytes += cost
        self.count += 1
        return True

    def release(self, qos: int, cost: int) -> None:
        self.bytes -= cost
        self.count -= 1
        if qos == 0:
            self.qos0 -= 1

    def next_waiting(self) -> Held:
        held = self.waiting.popleft()
        if not self.waiting:
            self._superseded.clear()  # a copy of a started message is answered again: a duplicate, not a loss
        return held

    def session_resumed(self, connection: int) -> None:
        """The broker resumed the session on `connection`: it sends again every QoS 1/2 message of
        an earlier one that was not acked."""
        self._superseded = {request_key(h.msg): h for h in self.waiting if h.msg.qos and h.msg.connection != connection}

    def adopt(self, msg: Message) -> bool:
        """True when `msg` is the broker's copy of a message still waiting: that one takes its packet
        id and connection, so that its ack reaches the broker, and `msg` takes no room."""
        if not self._superseded or not msg.qos:
            return False
        held = self._superseded.pop(request_key(msg), None)
        if held is None or held.started or request_fields(held.msg) != request_fields(msg):
            return False
        held.msg = msg
        return True


@dataclass(eq=False)
class Held:
    """A message in the inbox: what it costs and when it came, for its deadline (times are
    time.monotonic(), which is also the event loop's clock)."""

    msg: Message
    cost: int
    received: float  # when paho handed it over
    started: float = 0.0  # when it left the inbox to be answered
