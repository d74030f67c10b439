"""The MQTT transport's own message types at paho's edge: a received Message, decoded from the
PUBLISH packet as it arrives (immutable, stamped with its connection), and a Reply to publish,
whose MQTT 5 properties PackedProperties encodes once (the status travels in the user property
"status", before any other). Both codecs stand in for paho's Properties class, which costs
~40 us to decode a request's PUBLISH and ~37 us to fill and pack a reply's properties (issue
20); tests/mqtt/test_batched_io.py and test_packed_properties.py hold them to paho's own
decoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, cast

from paho.mqtt.client import MQTTMessage
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

STATUS_PROPERTY = "status"


class Message(NamedTuple):
    """A message from the broker, decoded as it arrives (a named tuple: built once per request,
    a third of the cost of a frozen dataclass)."""

    topic: str
    payload: bytes
    qos: int
    mid: int
    dup: bool
    connection: int  # the connection (counted by CONNACKs) it arrived on: its ack goes back only there
    response_topic: str | None = None
    correlation_data: bytes | None = None
    content_type: str | None = None
    user_properties: tuple[tuple[str, str], ...] = ()
    expiry_s: int | None = None  # the MQTT 5 Message Expiry Interval left when it arrived


@dataclass(frozen=True)
class Reply:
    """A message to publish: the status travels in the user property "status", before any other."""

    topic: str
    payload: bytes
    status: int
    content_type: str
    correlation_data: bytes | None = None
    user_properties: tuple[tuple[str, str], ...] = ()


def decode_publish(command: int, packet: bytes | bytearray, connection: int) -> Message:
    """The Message in an MQTT 5 PUBLISH: `command` is its first byte, `packet` what follows the
    remaining length. MalformedPacket when it breaks the framing (paho then drops the connection,
    as it does for what its own decoder refuses)."""
    qos = (command >> 1) & 3
    if qos == 3:
        raise MalformedPacket("a PUBLISH with QoS 3")
    data = memoryview(packet)
    try:
        raw_topic, pos = _length_prefixed(data, 0, len(data))
        topic = _text(raw_topic)
        mid = 0
        if qos:
            mid = _u16(data, pos)
            pos += 2
        size, pos = _variable_byte_integer_at(data, pos)
        end = pos + size
        if end > len(data):
            raise MalformedPacket("the properties run past the packet")
        fields = _publish_properties(data, pos, end)
    except IndexError:
        raise MalformedPacket("truncated PUBLISH") from None
    return Message(topic=topic, payload=bytes(data[end:]), qos=qos, mid=mid, dup=bool(command & 0x08),
                   connection=connection, **fields)


_TEXT_FIELDS = {3: "content_type", 8: "response_topic"}


def _publish_properties(data: memoryview, pos: int, end: int) -> dict:
    """The PUBLISH properties in data[pos:end] that a Message keeps, by field name."""
    fields: dict = {}
    users: list[tuple[str, str]] = []
    while pos < end:
        ident = data[pos]
        pos += 1
        if ident in _TEXT_FIELDS:  # Content Type, Response Topic
            raw, pos = _length_prefixed(data, pos, end)
            _set_once(fields, _TEXT_FIELDS[ident], _text(raw))
        elif ident == 9:  # Correlation Data
            raw, pos = _length_prefixed(data, pos, end)
            _set_once(fields, "correlation_data", bytes(raw))
        elif ident == 38:  # User Property: a pair of strings, may repeat
            name, pos = _length_prefixed(data, pos, end)
            value, pos = _length_prefixed(data, pos, end)
            users.append((_text(name), _text(value)))
        elif ident == 2:  # Message Expiry Interval
            if pos + 4 > end:
                raise MalformedPacket("truncated four-byte integer")
            _set_once(fields, "expiry_s", int.from_bytes(data[pos:pos + 4], "big"))
            pos += 4
        elif ident == 1:  # Payload Format Indicator: not kept
            pos += 1
        elif ident == 35:  # Topic Alias: never enabled by us (no Topic Alias Maximum), ignored as paho does
            pos += 2
        elif ident == 11:  # Subscription Identifier: not kept, may repeat
            _, pos = _variable_byte_integer_at(data, pos)
        else:
            raise MalformedPacket(f"property {ident} does not belong in a PUBLISH")
        if pos > end:
            raise MalformedPacket("a property runs past the properties")
    if users:
        fields["user_properties"] = tuple(users)
    return fields


def _set_once(fields: dict, name: str, value: object) -> None:
    if name in fields:
        raise MalformedPacket(f"property {name} must not occur more than once")
    fields[name] = value


def _u16(data: memoryview, pos: int) -> int:
    return (data[pos] << 8) | data[pos + 1]  # IndexError when truncated


def _length_prefixed(data: memoryview, pos: int, end: int) -> tuple[memoryview, int]:
    """A two-byte length and that many bytes, all before `end`; and the position after them."""
    stop = pos + 2 + _u16(data, pos)
    if stop > end:
        raise MalformedPacket("a length-prefixed field runs past its packet or properties")
    return data[pos + 2:stop], stop


def _text(raw: memoryview) -> str:
    """A UTF-8 string of MQTT (1.5.4): no U+0000, no surrogates (which strict decoding refuses)."""
    try:
        text = str(raw, "utf-8")
    except UnicodeDecodeError:
        raise MalformedPacket("a string is not valid UTF-8") from None
    if "\x00" in text:
        raise MalformedPacket("a string holds U+0000")
    return text


def _variable_byte_integer_at(data: memoryview, pos: int) -> tuple[int, int]:
    """The variable byte integer at `pos` (MQTT 1.5.5), and the position after it."""
    value = 0
    for shift in (0, 7, 14, 21):
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
    raise MalformedPacket("a variable byte integer longer than 4 bytes")


def message_from_paho(msg: MQTTMessage, connection: int) -> Message:
    """The Message in paho's MQTTMessage: for QoS 2, which paho decodes itself (it must keep the
    message until PUBREL)."""
    props = msg.properties
    return Message(
        topic=msg.topic,
        payload=cast(bytes, msg.payload),  # bytes when received (paho's struct.unpack); bytearray is outgoing
        qos=msg.qos,
        mid=msg.mid,
        dup=bool(msg.dup),
        connection=connection,
        response_topic=getattr(props, "ResponseTopic", None),
        correlation_data=getattr(props, "CorrelationData", None),
        content_type=getattr(props, "ContentType", None),
        user_properties=tuple((name, value) for name, value in getattr(props, "UserProperty", None) or ()),
        expiry_s=getattr(props, "MessageExpiryInterval", None),
    )


class PackedProperties:
    """A reply's MQTT 5 PUBLISH properties, encoded once. paho only calls `pack()` on the
    properties it is given (to write the packet, and again to resend it after a reconnect), and
    its own Properties class costs ~37 us per reply to fill and pack (a tenth of the MQTT path's
    CPU per request, issue 20); this writes the same bytes in ~3 us (tested against paho's
    Properties.unpack)."""

    packetType = PacketTypes.PUBLISH  # noqa: N815 - paho's attribute name

    def __init__(self, reply: Reply):
        out = bytearray()
        if reply.correlation_data is not None:
            out += b"\x09" + _binary(reply.correlation_data)
        out += b"\x03" + _binary(reply.content_type.encode())
        for name, value in ((STATUS_PROPERTY, str(reply.status)), *reply.user_properties):
            out += b"\x26" + _binary(name.encode()) + _binary(value.encode())
        self._packed = _variable_byte_integer(len(out)) + bytes(out)

    def pack(self) -> bytes:
        return self._packed

    def __str__(self) -> str:  # paho's debug log names the properties of what it sends
        return f"[{len(self._packed)} bytes of properties]"


def _binary(data: bytes) -> bytes:
    if len(data) > 0xFFFF:
        raise ValueError(f"an MQTT property holds at most 65535 bytes, got {len(data)}")
    return len(data).to_bytes(2, "big") + data


def _variable_byte_integer(n: int) -> bytes:
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def publish_properties(reply: Reply) -> Properties:
    """What paho's publish() takes as properties for `reply`."""
    return cast(Properties, PackedProperties(reply))
