"""The MQTT transport (paho-mqtt 2.x, MQTT 5): KServe v2 requests through a broker, and sensor
streams. ``settings`` checks the [mqtt] section, ``streams`` maps sensor topics onto model inputs,
``paho_client`` is the adapter that serves paho's socket from the event loop (``batched_io`` its
lean packet path, ``publish_tracker`` the replies it waits on), ``messages`` the immutable
Message and Reply at its edge, ``inbox`` bounds what is held,
``transport`` the MqttTransport that routes, answers and acknowledges (at least once).
docs/mqtt.md is the reference: topics, the delivery guarantee and its limits, the internals."""

from .inbox import MESSAGE_OVERHEAD_BYTES
from .messages import Message
from .paho_client import tcp_no_delay
from .settings import default_client_id, validate_settings
from .transport import MqttTransport

__all__ = ["MESSAGE_OVERHEAD_BYTES", "Message", "MqttTransport", "default_client_id", "tcp_no_delay",
           "validate_settings"]
