"""The RAG models in a real daemon over the Unix socket: v2 infer with BYTES tensors, bad inputs,
the embedding model on its own, and an index rebuilt while the daemon runs."""

from __future__ import annotations

import asyncio
import json
import shutil

import numpy as np
import pytest

from edge_batcher.client import AsyncClient, ClientError
from edge_batcher.rag import index_cli

CONFIG = '[models]\nwarmup = false\n[memory]\nprobe = "fixed"\nbudget_mb = 1024\n'


def text(*values: str) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = [v.encode() for v in values]
    return out


def test_rag_answers_with_sources_over_the_socket(start_daemon):
    daemon = start_daemon(CONFIG)
    with daemon.client() as client:
        out = client.infer("rag", {"question": text("What torque should I use to tighten the sensor's mounting stud?",
                                                     "Is it okay to attach the sensor with a magnet?")})
        answers = [a.decode() for a in out["answer"]]
        sources = [json.loads(s) for s in out["sources"]]
        assert "5 N·m" in answers[0] and sources[0][0]["id"] == "vibration-sensor-manual#stud-mounting"
        assert sources[1][0]["id"] == "vibration-sensor-manual#adhesive-and-magnet-mounting"
        assert [s["rank"] for s in sources[0]] == [1, 2, 3] and sources[0][0]["score"] >= sources[0][1]["score"]
        assert sources[0][0]["source"] == "vibration-sensor-manual.md"

        # A close call between the first two passages is marked in the first source (issue 29): the
        # first question ranks a wrong passage first, 0.3% ahead of the right one.
        out = client.infer("rag", {"question": text("what happens if I overtighten the sensor stud",
                                                     "How do I update the sensor firmware?")})
        close, clear = [json.loads(s) for s in out["sources"]]
        assert close[0]["ambiguous"] is True and 0 <= close[0]["margin"] < 0.05, close[0]
        assert "vibration-sensor-manual#stud-mounting" in [s["id"] for s in close[:2]]
        assert clear[0]["ambiguous"] is False and clear[0]["margin"] > 0.3, clear[0]
        assert all("margin" not in s and "ambiguous" not in s for s in close[1:] + clear[1:])

        # The embedding model is a model of its own: text in, unit-length 384-d vectors out.
        emb = client.infer("minilm", {"text": text("bearing fault", "battery voltage")})["embedding"]
        assert emb.shape == (2, 384) and np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)

        for inputs, message in [
            ({"question": text("")}, "is empty"),
            ({"question": np.array([1.0], dtype=np.float32)}, "datatype FP32, model 'rag' expects BYTES"),
            ({"question": text("why " * 300)}, "more than the 128 the embedding model 'minilm' reads"),
            ({"query": text("battery")}, "has no input 'query'"),
        ]:
            with pytest.raises(ClientError) as info:
                client.infer("rag", inputs)
            assert info.value.status == 400 and message in info.value.message, info.value.message
        meta = client.model_metadata("rag")
        assert [i["name"] for i in meta["inputs"]] == ["question"] and meta["inputs"][0]["datatype"] == "BYTES"
        assert [o["name"] for o in meta["outputs"]] == ["answer", "sources"]


def test_concurrent_questions_share_embedding_batches(start_daemon):
    daemon = start_daemon(CONFIG)
    questions = ["When does the sensor battery need to be replaced?", "How do I fix an unbalanced fan rotor?",
                 "What does misalignment look like in the spectrum?",
                 "How can I tell that a rolling bearing is damaged?",
                 "On which MQTT topic does a sensor publish its vibration windows?",
                 "Is it okay to attach the sensor with a magnet?",
                 "At what vibration velocity should an alarm be raised?",
                 "How often does the sensor measure and at which sample rate?"]

    async def ask():
        async with AsyncClient(daemon.url) as client:
            return await asyncio.gather(*(client.infer("rag", {"question": text(q)}) for q in questions))

    results = asyncio.run(ask())
    firsts = [json.loads(r["sources"][0])[0]["id"] for r in results]
    assert firsts[:2] == ["vibration-sensor-manual#battery", "vibration-sensor-manual#correcting-imbalance"]
    with daemon.client() as client:
        embed = client.stats("minilm")["model_stats"][0]
        rag = client.stats("rag")["model_stats"][0]
    # Only the questions: extractive answers rank their passages' sentences by the index's vectors.
    assert rag["sentences_from_index"] > len(questions) and rag["sentences_embedded"] == 0
    assert embed["inference_count"] == len(questions)
    assert embed["execution_count"] < embed["inference_count"] / 2  # embedded together, in batches
    assert rag["inference_count"] == len(questions) and rag["answers"]["extractive"] == len(questions)
    padding = rag["embedding"]
    assert padding["batch_tokens"] > padding["real_tokens"] > 0 and 0 < padding["token_padding_ratio"] < 1


def test_daemon_picks_up_a_rebuilt_index(start_daemon, rag_repo, tmp_path):
    repo = tmp_path / "repo"
    (repo / "rag").mkdir(parents=True)
    (repo / "minilm").symlink_to(rag_repo / "minilm")
    index = tmp_path / "index"
    shutil.copytree(rag_repo / "index", index)
    (repo / "rag" / "model.toml").write_text(f'backend = "rag"\n[rag]\nindex_dir = "{index}"\ntop_k = 2\n')
    daemon = start_daemon(CONFIG, repo=repo)
    question = {"question": text("Where are the spare sensors kept?")}
    with daemon.client() as client:
        before = json.loads(client.infer("rag", question)["sources"][0])
        assert all(s["id"].startswith("vibration-sensor-manual#") for s in before)

        notes = tmp_path / "spares.md"
        notes.write_text("# Spare parts\n\n## Spare sensors\n\nSpare VS-200 sensors and ER14505 cells are kept in "
                         "cabinet B4 of the workshop; the key is at the gate house.\n")
        assert index_cli.main(["add", str(notes), "--model-repo", str(repo)]) == 0  # [rag] index_dir of repo/rag

        after = client.infer("rag", question)
        assert json.loads(after["sources"][0])[0]["id"] == "spares#spare-sensors"
        assert "cabinet B4" in after["answer"][0].decode()
        stats = client.stats("rag")["model_stats"][0]["index"]
        assert stats["version"] == 2 and stats["reloads"] == 1 and stats["passages"] == 36
