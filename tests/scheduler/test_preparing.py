"""A model's prepare hook runs off the event loop (scheduler/preparing.py): the requests of one
loop turn are prepared in one job on the model's prepare thread, then queued; the queue's
capacity counts them; a request whose preparation fails is answered alone; drain waits for
them; close answers them. ModelRunner in-process with a small engine written here whose prepare
hook turns text into token ids (as the embedding model's does, without a tokenizer file)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest

from edge_batcher.config import BatchingSettings, ModelConfig, SequenceSettings
from edge_batcher.errors import InvalidInput, Overloaded, Unavailable
from edge_batcher.metrics import Metrics
from edge_batcher.scheduler.runner import ModelRunner
from edge_batcher.types import InferRequest, TensorSpec


class WordIdsEngine:
    """text [rows] -> ids [rows, longest] (one id per word: its length), then y = sum of ids per
    row. prepare records the thread it ran on and may wait on a gate or refuse a word."""

    def __init__(self):
        self.inputs = [TensorSpec("text", "BYTES", (-1,))]
        self.batch_inputs = [TensorSpec("ids", "INT64", (-1, -1))]
        self.outputs = [TensorSpec("y", "INT64", (-1,))]
        self.prepared_on: list[int] = []
        self.prepared_texts: list[list[bytes]] = []
        self.gate: threading.Event | None = None

    def load(self) -> None:
        pass

    def prepare(self, inputs):
        if self.gate is not None:
            self.gate.wait(5)
        self.prepared_on.append(threading.get_ident())
        texts = [bytes(t) for t in inputs["text"]]
        self.prepared_texts.append(texts)
        if any(b"forbidden" in t for t in texts):
            raise InvalidInput("the word 'forbidden' cannot be tokenized")
        rows = [[len(w) for w in t.split()] for t in texts]
        longest = max(len(r) for r in rows)
        ids = np.zeros((len(rows), longest), np.int64)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = r
        return {"ids": ids}, longest

    def infer(self, inputs):
        return {"y": inputs["ids"].sum(axis=1)}

    def close(self) -> None:
        pass


def runner_for(engine: WordIdsEngine, **batching) -> ModelRunner:
    batching.setdefault("max_batch_size", 8)
    config = ModelConfig(name="words", directory=Path("."), batching=BatchingSettings(**batching),
                         sequence=SequenceSettings(inputs=["ids"], axis=1, buckets=[4, 16]))
    return ModelRunner(config, [engine], Metrics())


def ask(text: str) -> InferRequest:
    return InferRequest("words", {"text": np.array([text.encode()], dtype=object)})


async def test_a_loop_turns_requests_are_prepared_together_off_the_loop_and_answered():
    engine = WordIdsEngine()
    runner = runner_for(engine)
    await runner.start()
    texts = ["a bb ccc", "dddd", "e ff", "a b c d e f g"]  # the last one's 7 words: bucket 16
    answers = await asyncio.gather(*(runner.infer(ask(t)) for t in texts))
    assert [int(a.outputs["y"][0]) for a in answers] == [6, 4, 3, 7]
    assert threading.get_ident() not in engine.prepared_on  # never on the loop's thread
    assert len(set(engine.prepared_on)) == 1  # the model's prepare thread
    # one job for the turn, in arrival order
    assert [t for call in engine.prepared_texts for t in call] == [t.encode() for t in texts]
    await runner.close()


async def test_the_queue_capacity_counts_requests_being_prepared():
    engine = WordIdsEngine()
    engine.gate = threading.Event()  # hold the prepare thread: everything stays "being prepared"
    runner = runner_for(engine, queue_capacity=3)
    await runner.start()
    taken = [runner.infer(ask("a b")) for _ in range(3)]
    with pytest.raises(Overloaded, match="queue full: 3 requests waiting"):
        runner.infer(ask("c d"))
    with pytest.raises(Overloaded):
        runner.refuse_if_full()  # what transports ask before reading a body
    engine.gate.set()
    assert [int(a.outputs["y"][0]) for a in await asyncio.gather(*taken)] == [2, 2, 2]
    runner.infer(ask("e"))  # room again
    await runner.close()


async def test_a_request_whose_preparation_fails_is_answered_alone():
    engine = WordIdsEngine()
    runner = runner_for(engine)
    await runner.start()
    results = await asyncio.gather(runner.infer(ask("a bb")), runner.infer(ask("a forbidden word")),
                                   runner.infer(ask("a b c d e f g h i j k l m n o p q")),  # 17 tokens
                                   runner.infer(ask("ccc")), return_exceptions=True)
    assert int(results[0].outputs["y"][0]) == 3 and int(results[3].outputs["y"][0]) == 3
    assert isinstance(results[1], InvalidInput) and "forbidden" in str(results[1])
    assert isinstance(results[2], InvalidInput) and "17" in str(results[2])  # longer than the last bucket
    counts = {key[1]: value for key, value in runner.metrics.requests_total.values.items() if key[0] == "words"}
    assert counts == {"200": 2, "400": 2}  # each counted once, as it was answered
    await runner.close()


async def test_a_caller_that_gave_up_while_its_request_was_prepared_is_skipped():
    engine = WordIdsEngine()
    engine.gate = threading.Event()
    runner = runner_for(engine)
    await runner.start()
    gone, kept = runner.infer(ask("a b")), runner.infer(ask("ccc"))
    await asyncio.sleep(0.01)
    gone.cancel()
    engine.gate.set()
    assert int((await kept).outputs["y"][0]) == 3
    assert len(runner.queue) == 0
    await runner.close()


async def held_request() -> tuple[WordIdsEngine, ModelRunner, asyncio.Future]:
    """A runner with one request taken and held on its prepare thread (the gate is shut)."""
    engine = WordIdsEngine()
    engine.gate = threading.Event()
    runner = runner_for(engine)
    await runner.start()
    held = runner.infer(ask("a bb"))
    await asyncio.sleep(0.01)
    return engine, runner, held


async def test_drain_waits_for_requests_being_prepared():
    engine, runner, held = await held_request()
    draining = asyncio.ensure_future(runner.drain(timeout=5))
    await asyncio.sleep(0.05)
    assert not draining.done()  # the request is still being prepared
    with pytest.raises(Unavailable, match="draining"):
        runner.infer(ask("late"))
    engine.gate.set()
    await draining
    assert int((await held).outputs["y"][0]) == 3  # accepted before the drain: served
    await runner.close()


async def test_close_answers_the_requests_being_prepared():
    engine, runner, held = await held_request()
    closing = asyncio.ensure_future(runner.close())
    await asyncio.sleep(0.05)
    engine.gate.set()
    await closing
    with pytest.raises(Unavailable, match="was unloaded"):
        await held


async def test_a_request_taken_in_the_loop_turn_the_model_closes_in_is_answered():
    runner = runner_for(WordIdsEngine())
    await runner.start()
    taken = runner.infer(ask("a b"))  # its turn's job is not handed to the thread yet
    await runner.close()
    with pytest.raises(Unavailable, match="was unloaded"):
        await asyncio.wait_for(taken, 5)
