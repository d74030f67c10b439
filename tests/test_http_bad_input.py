"""Payloads that crashed the v2 decoder or were misread (issue 14), sent to a real daemon over its
Unix socket: each must answer 400 with {"error": ...} naming the problem, nothing may be logged
as an internal error, and the daemon must keep serving."""

from __future__ import annotations

import json

import pytest

from edge_batcher.errors import InvalidInput
from edge_batcher.protocol.parameters import to_infer_request
from edge_batcher.protocol.v2 import HEADER_LENGTH, MAX_DIMS, decode_request
from tests.support import rawhttp
from tests.support.signals import windows

INFER = "/v2/models/vibration/infer"


def infer_body(inputs=None, **extra) -> bytes:
    """A v2 request; json.dumps writes NaN/Infinity tokens and integers of any size as given."""
    if inputs is None:
        inputs = [{"name": "signal", "shape": [1, 256], "datatype": "FP32", "data": [0.1] * 256}]
    return json.dumps({"inputs": inputs, **extra}).encode()


def tensor(datatype: str, shape: list, data: list) -> list[dict]:
    return [{"name": "signal", "shape": shape, "datatype": datatype, "data": data}]


BAD_TENSORS = [
    (infer_body(tensor("FP32", [1, 2], [0.5, 10**400])),
     "input 'signal': data for FP32 has an integer too large for any floating-point number"),
    (infer_body(tensor("INT32", [1], [2**70])), "input 'signal': data for INT32 are out of range"),
    (infer_body(tensor("FP32", [1] * 65, [0.5])),
     f"input 'signal': shape has 65 dimensions, more than the {MAX_DIMS} supported"),
    (infer_body(tensor("FP32", [2**64, 0], [])), "input 'signal': shape [18446744073709551616, 0] is too large"),
]

BAD_PARAMETERS = [
    (name, value, words)
    for name in ("timeout_ms", "timeout")
    for value, words in [
        (float("nan"), "must be a finite number >= 0, got nan"),
        (float("inf"), "must be a finite number >= 0, got inf"),
        (-float("inf"), "must be a finite number >= 0, got -inf"),
        (-5, "must be a finite number >= 0, got -5"),
        (10**400, "must be a finite number >= 0"),
        ("100", "must be a number, got '100'"),
        (True, "must be a number, got True"),
        ([100], "must be a number, got [100]"),
    ]
] + [("priority", 1.5, "must be an integer, got 1.5"), ("priority", "1", "must be an integer, got '1'")]


def test_values_shapes_and_parameters_the_decoder_cannot_hold_answer_400(daemon):
    answers = []
    for body, words in BAD_TENSORS:
        answers.append((rawhttp.request(daemon.socket, "POST", INFER, body), words))
        # The same tensors as binary-extension headers: decoded by the same checks.
        header = json.loads(body)
        entry = header["inputs"][0]
        entry.pop("data")
        entry["parameters"] = {"binary_data_size": 0}
        head = json.dumps(header).encode()
        binary = rawhttp.request(daemon.socket, "POST", INFER, head,
                                 {HEADER_LENGTH: str(len(head)), "Content-Type": "application/octet-stream"})
        if "data for" not in words:  # data errors need data; shape errors come first anyway
            answers.append((binary, words))
    for name, value, words in BAD_PARAMETERS:
        body = infer_body(parameters={name: value})
        answers.append((rawhttp.request(daemon.socket, "POST", INFER, body), f"parameters.{name} {words}"))
    # Python's json accepts the NaN/Infinity tokens (the decoder keeps them for float tensors);
    # as a deadline they mean nothing, and NaN used to expire at once: 504 instead of 400.
    for token in (b"NaN", b"Infinity", b"-Infinity"):
        body = b'{"parameters": {"timeout_ms": %s}, "inputs": %s' % (token, infer_body()[len(b'{"inputs": '):])
        answers.append((rawhttp.request(daemon.socket, "POST", INFER, body),
                        "parameters.timeout_ms must be a finite number >= 0"))

    for (status, got), words in answers:
        assert status == 400, (words, got)
        assert isinstance(got, dict) and words in got["error"], (words, got)

    with daemon.client() as client:
        assert client.infer("vibration", {"signal": windows(2)}, timeout_ms=5000)["class_id"].shape == (2,)
    log = daemon.log_text()
    assert "unhandled error" not in log and "Traceback" not in log, log[-3000:]


def _decoded(parameters: dict):
    return decode_request(infer_body(parameters=parameters))


def test_request_parameters_that_are_deadlines_and_priorities():
    assert to_infer_request("m", _decoded({"timeout_ms": 250, "priority": 1})).timeout_s == 0.25
    assert to_infer_request("m", _decoded({"timeout": 1_500_000})).timeout_s == 1.5  # Triton's µs
    assert to_infer_request("m", _decoded({"timeout_ms": 0})).timeout_s == 0.0  # the model answers 504
    assert to_infer_request("m", _decoded({"timeout_ms": 1e300})).timeout_s == 1e297  # capped by the model
    assert to_infer_request("m", _decoded({})).timeout_s is None
    for name, value, words in BAD_PARAMETERS:
        with pytest.raises(InvalidInput) as info:
            to_infer_request("m", _decoded({name: value}))
        assert f"parameters.{name} {words}" in info.value.message
