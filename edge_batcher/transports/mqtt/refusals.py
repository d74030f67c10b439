"""What the broker refuses, learnt at the paho edge (issue 31): a reply it answers with a failure
reason code fails its waiter with ReplyRefused, and a refused topic (0x87 Not authorized, 0x90
Topic Name invalid) takes no reply for a minute, the replies paho still holds for it dropped at
once; after a connection lost with replies in flight, the next connection resends them one at a
time, and a reply that was alone in flight when the connection was lost twice is given up, with
every other reply to its request, and for a minute any later one (from a copy of the request
that the broker sent again, answered before the transport heard of the first refusal). Without
this, a broker that drops the connection over a refused publish (mosquitto 2.0 with
max_queued_messages 0; some ACLs) gets that reply resent first on every connection, and its
request redelivered, forever. docs/mqtt.md, "Replies that cannot be delivered"."""

from __future__ import annotations

from .batched_io import BatchedClient
from .publish_tracker import PublishTracker, ReplyKey
from .undeliverable import TOPICS_REMEMBERED_MAX, TOPICS_REMEMBERED_S, Remembered, ReplyRefused

TOPIC_REFUSALS = (0x87, 0x90)  # Not authorized, Topic Name invalid: every reply to that topic would be refused
LONE_LOSSES_TO_GIVE_UP = 2  # connections lost while one reply was the only one in flight: it is refused


class BrokerRefusals:
    """The refusals of one PahoClient's broker; every method runs on the event loop, inside paho's
    callbacks (never blocking)."""

    def __init__(self, client: BatchedClient, tracker: PublishTracker, window: int):
        self._client = client
        self._tracker = tracker
        self._window = window  # max_inflight
        self._topics: Remembered[str, ReplyRefused] = Remembered(TOPICS_REMEMBERED_S, TOPICS_REMEMBERED_MAX)
        self._requests: Remembered[ReplyKey, ReplyRefused] = Remembered(TOPICS_REMEMBERED_S, TOPICS_REMEMBERED_MAX)
        self._one_at_a_time = False  # since a connection was lost with replies in flight, until one is acked
        self._lone_losses: dict[int, int] = {}  # mid -> connections lost while it was the only reply in flight

    def of_reply(self, topic: str, correlation: bytes | None) -> ReplyRefused | None:
        """A fresh ReplyRefused when the broker refused `topic`, or a reply to this request (the
        same topic and Correlation Data) was given up, within the last minute."""
        refused = self._topics.get(topic) or self._requests.get((topic, correlation))
        return None if refused is None else ReplyRefused(refused.topic, refused.reason, refused.code)

    def accepted(self) -> None:
        """The broker acknowledged a reply: it takes replies again, so back to the full window."""
        if self._one_at_a_time:
            self._one_at_a_time = False
            self._lone_losses.clear()
            self._client.set_in_flight_window(self._window)  # paho fills it after this on_publish

    def refused(self, mid: int, reason: str, code: int) -> None:
        """The broker refused the reply `mid` (called from on_publish, while paho still holds it)."""
        topic = self._client.queued_topic(mid)
        if code in TOPIC_REFUSALS:
            self._topics.add(topic, ReplyRefused(topic, reason, code))
            # Before a reconnect sends them again (mosquitto may drop the connection for each);
            # paho itself drops `mid` once on_publish returns.
            self._give_up([m for m in self._client.queued_to(topic) if m != mid], topic, reason, code)
        self._lone_losses.pop(mid, None)
        self._tracker.done(mid, ReplyRefused(topic, reason, code))

    def connection_lost(self) -> None:
        """The connection was lost (once per connection, not when we closed it): was it over a
        reply? After a loss with replies in flight the next connection resends them one at a time
        until the broker acknowledges one: a broker that refuses the first says why before it
        closes (several sent together lose the reason in the connection reset), and a reply alone
        in flight at LONE_LOSSES_TO_GIVE_UP losses is given up with the other replies to its
        request."""
        mid = self._client.oldest_in_flight()
        if mid is None:
            return
        if not self._one_at_a_time:
            self._one_at_a_time = True
            self._client.set_in_flight_window(1)
            return
        losses = self._lone_losses[mid] = self._lone_losses.get(mid, 0) + 1
        if losses >= LONE_LOSSES_TO_GIVE_UP:
            reason = f"the broker closed the connection each of the last {losses} times it was the only reply in flight"
            topic, key = self._client.queued_topic(mid), self._tracker.key_of(mid)
            if key is not None:
                self._requests.add(key, ReplyRefused(topic, reason))
            self._give_up(self._tracker.same_request(mid) or [mid], topic, reason, 0)

    def _give_up(self, mids: list[int], topic: str, reason: str, code: int) -> None:
        self._client.drop_queued(mids)
        for mid in mids:
            self._lone_losses.pop(mid, None)
            self._tracker.done(mid, ReplyRefused(topic, reason, code))
