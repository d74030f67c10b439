"""PackedProperties writes the bytes paho's own Properties would: read back by paho itself."""

from __future__ import annotations

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge_batcher.transports.mqtt.messages import PackedProperties, Reply


@pytest.mark.parametrize("reply", [
    Reply("r/t", b"{}", 200, "application/json", correlation_data=b"\x00\x01abc"),
    Reply("r/t", b"{}", 404, "application/json"),  # no Correlation Data
    Reply("r/t", b"\x00" * 9, 200, "application/octet-stream", correlation_data=b"c" * 300,
          user_properties=(("Inference-Header-Content-Length", "42"), ("note", "grüße"))),  # length > 127
])
def test_paho_reads_back_what_was_packed(reply):
    packed = PackedProperties(reply).pack()
    read, used = Properties(PacketTypes.PUBLISH).unpack(packed)
    assert used == len(packed)
    assert getattr(read, "CorrelationData", None) == reply.correlation_data
    assert read.ContentType == reply.content_type
    assert read.UserProperty == [("status", str(reply.status)), *reply.user_properties]
    # The same properties, filled into paho's own class, pack to the same length.
    own = Properties(PacketTypes.PUBLISH)
    if reply.correlation_data is not None:
        own.CorrelationData = reply.correlation_data
    own.ContentType = reply.content_type
    own.UserProperty = [("status", str(reply.status)), *reply.user_properties]
    assert len(own.pack()) == len(packed)


def test_a_property_over_65535_bytes_is_refused():
    with pytest.raises(ValueError, match="65535"):
        PackedProperties(Reply("r/t", b"", 200, "application/json", correlation_data=b"x" * 70_000))
