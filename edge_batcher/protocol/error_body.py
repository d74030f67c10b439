"""The error body every edge-batcher transport answers with, ``{"error": "..."}``, read back by
a client: the user-facing clients and the offload client turn a failed answer into a message."""

from __future__ import annotations

import json


def error_message(body: bytes) -> str:
    """The `error` text of an error body; the body itself (as text) when it is not one."""
    try:
        doc = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip() or "(empty body)"
    if isinstance(doc, dict) and isinstance(message := doc.get("error"), str):
        return message
    return body.decode("utf-8", "replace").strip()
