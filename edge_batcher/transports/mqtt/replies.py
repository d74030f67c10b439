"""What a message's reply holds and where it goes: the request's Response Topic, or the result
topic `<prefix>/result/<model>` when it has none or one that no broker takes (then the reply is
the 400 of `bad_response_topic`, naming it); an error reply is `{"error", "id"}` there, or
`{"topic", "error"}` on a stream's output topic; the answers given at the hand-off without
parsing the payload (`overloaded`, `stopping`); the binary request's header length
(`header_length`). Every reply carries the request's Correlation Data."""

from __future__ import annotations

import json
from typing import Any

from ...config import MqttSettings
from ...errors import EdgeBatcherError, InvalidInput, Overloaded, Unavailable
from ...protocol import v2
from .messages import Message, Reply
from .undeliverable import reply_topic_problem

JSON = v2.JSON_CONTENT_TYPE
BINARY = v2.BINARY_CONTENT_TYPE

# Where a message goes: ("infer", model name) or ("stream", StreamRoute).
Route = tuple[str, Any]


def make(msg: Message, topic: str, body: bytes, status: int, content_type: str,
         user_properties: tuple[tuple[str, str], ...] = ()) -> Reply:
    return Reply(topic, body, status, content_type, msg.correlation_data, user_properties)


def topic_for(msg: Message, prefix: str, model: str) -> str:
    """The request's Response Topic; the result topic when it has none, or one that no broker takes."""
    topic = msg.response_topic
    if topic is None or reply_topic_problem(topic) is not None:
        return f"{prefix}/result/{model}"
    return topic


def bad_response_topic(msg: Message) -> InvalidInput | None:
    """The 400 for a Response Topic no broker takes (`$...`, wildcards): the request is not run."""
    topic = msg.response_topic
    problem = None if topic is None else reply_topic_problem(topic)
    if problem is None:
        return None
    return InvalidInput(f"Response Topic {topic!r} {problem}: no reply can be published there; "
                        f"this error goes to the result topic instead")


def error(msg: Message, route: Route, exc: EdgeBatcherError, request_id: str | None, prefix: str) -> Reply:
    """The reply for a failed message: on the request's reply topic, or the stream's output topic."""
    body: dict[str, Any] = {"error": exc.message}
    if route[0] == "infer":
        topic = topic_for(msg, prefix, route[1])
        if request_id is not None:
            body["id"] = request_id
    else:
        topic = route[1].output_topic(msg.topic, prefix)
        body = {"topic": msg.topic, **body}
    return make(msg, topic, json.dumps(body).encode(), exc.status, JSON)


def overloaded(qos: int, settings: MqttSettings, device_id: str) -> Overloaded:
    """The 429 for a message the inbox cannot take and nothing would send again."""
    if qos == 0:
        return Overloaded(f"overloaded: {settings.max_pending} QoS 0 messages are already pending on {device_id}; "
                          f"retry later, or publish with QoS 1 to be served late instead")
    return Overloaded(f"overloaded: the inbox on {device_id} is full (max_held_bytes {settings.max_held_bytes}), "
                      f"and with session_expiry_s = 0 the broker keeps nothing for a later connection; retry later")


def stopping(device_id: str) -> Unavailable:
    """The 503 for a message a stopping daemon will not run and nothing would send again."""
    return Unavailable(f"unavailable: the daemon on {device_id} is stopping; retry later")


def header_length(msg: Message) -> int | None:
    """Inference-Header-Content-Length from the user properties; required for a binary request."""
    value = None
    for name, val in msg.user_properties:
        if name.lower() == v2.HEADER_LENGTH.lower():
            value = val
    if value is None:
        if msg.content_type == BINARY:
            raise InvalidInput(
                f"binary request (Content Type {BINARY}) without the user property {v2.HEADER_LENGTH} "
                f"giving the JSON header's length"
            )
        return None
    return v2.parse_header_length(value)
