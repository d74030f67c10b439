"""The MQTT transport's inbox: the messages taken from the broker and not answered yet, bounded
in bytes (``max_held_bytes``) and, for QoS 0, in number (``max_pending``). paho's reader admits a
message and the transport releases it once answered, both on the event loop. What does not
fit is the transport's to defer (QoS 1/2, fetched again by a reconnect) or refuse (QoS 0: 429)."""

from __future__ import annotations

from dataclasses import dataclass

from .messages import Message

MESSAGE_OVERHEAD_BYTES = 2048  # a held message's Python objects, properties, bookkeeping (~1.9 KiB measured)


class Inbox:
    """Bookkeeping of the messages taken from the broker and not answered yet: their bytes (each
    counted as its payload plus MESSAGE_OVERHEAD_BYTES of Python objects) and how many are QoS 0."""

    def __init__(self, max_bytes: int, max_qos0: int):
        self.max_bytes = max_bytes
        self.max_qos0 = max_qos0
        self.bytes = 0
        self.count = 0
        self.qos0 = 0

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


@dataclass(eq=False)
class Held:
    """A message in the inbox: what it costs and when it came, for its deadline (times are
    time.monotonic(), which is also the event loop's clock)."""

    msg: Message
    cost: int
    received: float  # when paho handed it over
    started: float = 0.0  # when it left the inbox to be answered
