"""Token streaming over MQTT: one message per chunk, all with the request's Correlation Data."""

from __future__ import annotations

import json

from tests.support.mqtt import TestClient, wait_mqtt


def question(text: str, **parameters) -> bytes:
    return json.dumps({"id": "q1", "parameters": parameters,
                       "inputs": [{"name": "question", "shape": [1], "datatype": "BYTES", "data": [text]}]}).encode()


PREFIX = "edge-batcher/stream-test"


def serving_over_mqtt(start_daemon, broker, models: list[str]):
    """A daemon serving `models` over MQTT (subscribed: ready means serving, and MQTT subscribes
    on its own time, so a request sent before is not seen), and a test client listening on its
    response topic: (daemon, client); the caller closes the client."""
    daemon = start_daemon(f'[models]\nload = {json.dumps(models)}\n[mqtt]\nenabled = true\n'
                          f'host = "127.0.0.1"\nport = {broker.port}\ntopic_prefix = "{PREFIX}"\n')
    wait_mqtt(daemon)
    client = TestClient(broker.port)
    try:
        client.subscribe(client.response_topic)
    except BaseException:
        client.close()
        raise
    return daemon, client


def test_generated_answer_streams_as_mqtt_messages_with_one_correlation(start_daemon, broker):
    _, client = serving_over_mqtt(start_daemon, broker, ["minilm", "tinylm", "raggen"])
    try:
        client.publish(f"{PREFIX}/infer/raggen", question("How long does the battery last?", max_new_tokens=6),
                       correlation=b"whole")
        (whole,) = client.collect(1, timeout=30)
        client.publish(f"{PREFIX}/infer/raggen", question("How long does the battery last?", stream=True,
                                                          max_new_tokens=6), correlation=b"stream")
        chunks = []
        while not chunks or not chunks[-1].json()["parameters"]["triton_final_response"]:
            chunks += client.collect(1, timeout=30)
    finally:
        client.close()
    assert whole.status == "200" and whole.correlation == b"whole"
    assert len(chunks) > 2 and {c.correlation for c in chunks} == {b"stream"}
    assert all(c.status == "200" for c in chunks)
    finals = [c.json()["parameters"]["triton_final_response"] for c in chunks]
    assert finals == [False] * (len(chunks) - 1) + [True]
    streamed = "".join(c.json()["outputs"][0]["data"][0] for c in chunks if c.json()["outputs"][0]["name"] == "answer")
    answer = next(o for o in whole.json()["outputs"] if o["name"] == "answer")["data"][0]
    assert streamed == answer  # greedy: the stream spells out the same answer


def test_streaming_a_model_that_does_not_stream_is_a_clear_error(start_daemon, broker):
    _, client = serving_over_mqtt(start_daemon, broker, ["minilm"])
    try:
        payload = json.dumps({"parameters": {"stream": True},
                              "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]})
        client.publish(f"{PREFIX}/infer/minilm", payload, correlation=b"c")
        (reply,) = client.collect(1, timeout=30)
    finally:
        client.close()
    assert reply.status == "400" and "does not stream" in reply.json()["error"]


def test_sigterm_during_an_mqtt_stream_publishes_it_to_its_final_message(start_daemon, broker):
    """Graceful drain on MQTT with generation under way: a question streaming its answer over
    MQTT when SIGTERM comes gets every chunk, the last one final, before the daemon exits 0."""
    import signal

    daemon, client = serving_over_mqtt(start_daemon, broker, ["minilm", "tinylm", "raggen"])
    try:
        client.publish(f"{PREFIX}/infer/raggen", question("How long does the battery last?", stream=True,
                                                          max_new_tokens=200, ignore_stop=True),
                       correlation=b"stream")
        chunks = client.collect(1, timeout=30)  # streaming now
        daemon.proc.send_signal(signal.SIGTERM)
        while not chunks[-1].json()["parameters"]["triton_final_response"]:
            chunks += client.collect(1, timeout=30)
    finally:
        client.close()
    assert all(c.status == "200" for c in chunks), [c.status for c in chunks]
    tokens = sum(1 for c in chunks if c.json()["outputs"][0]["name"] == "answer")
    assert tokens >= 100, tokens  # the stream ran on after SIGTERM (about a token a message)
    assert daemon.proc.wait(timeout=60) == 0
