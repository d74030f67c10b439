"""The generate extension's own request parsing (issue 14): bad deadlines and bodies the JSON
layer accepts but the service cannot use answer 400 with {"error": ...}, over a real daemon."""

from __future__ import annotations

import json

from tests.support import rawhttp

GENERATE = "/v2/models/tinylm/generate"


def test_bad_timeouts_and_bodies_answer_400_and_the_daemon_keeps_serving(start_daemon, tiny_repo):
    daemon = start_daemon(repo=tiny_repo)
    cases = [
        (json.dumps({"text_input": "hi", "parameters": {"timeout_ms": value}}).encode(), words)
        for value, words in [
            (float("nan"), "parameters.timeout_ms must be a finite number >= 0, got nan"),
            (float("inf"), "parameters.timeout_ms must be a finite number >= 0, got inf"),
            (-1, "parameters.timeout_ms must be a finite number >= 0, got -1"),
            (10**400, "parameters.timeout_ms must be a finite number >= 0"),
            ("5", "parameters.timeout_ms must be a number, got '5'"),
            (False, "parameters.timeout_ms must be a number, got False"),
        ]
    ] + [
        # Triton's clients send the deadline as `timeout`, in microseconds: read (and checked) as in /infer.
        (json.dumps({"text_input": "hi", "parameters": {"timeout": value}}).encode(), words)
        for value, words in [
            (-1, "parameters.timeout must be a finite number >= 0, got -1"),
            ("5", "parameters.timeout must be a number, got '5'"),
        ]
    ] + [
        (b'{"text_input": "hi", "timeout_ms": NaN}', "parameters.timeout_ms must be a finite number"),
        (b'{"text_input": "hi", "parameters": {"priority": 0.5}}', "parameters.priority must be an integer"),
        (b'{"text_input": "\\ud800"}', "'text_input' is not valid unicode"),
        (b'{"text_input": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "request body is not valid JSON"),
    ]
    for body, words in cases:
        status, got = rawhttp.request(daemon.socket, "POST", GENERATE, body)
        assert status == 400, (words, got)
        assert isinstance(got, dict) and words in got["error"], (words, got)

    status, got = rawhttp.request(daemon.socket, "POST", GENERATE,
                                  json.dumps({"text_input": "hi", "parameters": {"max_new_tokens": 2,
                                                                                  "timeout_ms": 20000}}))
    assert status == 200 and isinstance(got["text_output"], str), got
    # A Triton `timeout` of 0 us is a deadline already passed: the service answers 504, not 200.
    status, got = rawhttp.request(daemon.socket, "POST", GENERATE,
                                  json.dumps({"text_input": "hi", "parameters": {"max_new_tokens": 2, "timeout": 0}}))
    assert status == 504 and "has already passed" in got["error"], got
    status, got = rawhttp.request(daemon.socket, "POST", GENERATE,
                                  json.dumps({"text_input": "hi", "max_new_tokens": 2, "timeout": 20_000_000}))
    assert status == 200 and isinstance(got["text_output"], str), got
    log = daemon.log_text()
    assert "unhandled error" not in log and "Traceback" not in log, log[-3000:]
