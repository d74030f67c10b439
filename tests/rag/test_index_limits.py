"""Issue 31 row 15: `index add` kept a 2 MB line without spaces as one 2 MB passage (the
600-character limit not applied), and a long run said nothing after its first line. Now no
passage is longer than --max-chars (sentences cut at spaces, text without spaces at the limit),
and embedding reports its progress, at most 20 lines in a log."""

from __future__ import annotations

import json
import re

from edge_batcher.rag import index_cli
from edge_batcher.rag.passages import DEFAULT_MAX_CHARS, split_markdown, split_text


def test_no_passage_is_longer_than_max_chars_whatever_the_text():
    line = split_text("x" * 2_000_000, "line")
    assert len(line) == 3334 and {len(p.text) for p in line} == {DEFAULT_MAX_CHARS, 2_000_000 % DEFAULT_MAX_CHARS}
    assert "".join(p.text for p in line) == "x" * 2_000_000  # cut, nothing lost
    words = split_text("Intro. " + "word " * 1000, "words", max_chars=100)
    assert all(len(p.text) <= 100 for p in words)
    assert all(p.text.split() == ["word"] * len(p.text.split()) for p in words[1:])  # cut at spaces, not in words
    heading = split_markdown("# " + "h" * 5000 + "\n\nShort text.\n", "doc", max_chars=100)
    assert len(heading) == 1 and heading[0].title == "h" * 100 and heading[0].text == "Short text."


def test_index_add_cuts_a_line_without_spaces_and_reports_its_progress(tmp_path, minilm_dir, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "minilm").symlink_to(minilm_dir)
    line = tmp_path / "line.txt"
    line.write_text("y" * 30_000 + "\n")
    common = ["--model-repo", str(repo), "--index", str(tmp_path / "idx")]
    assert index_cli.main(["add", str(line), *common]) == 0
    err = capsys.readouterr().err
    steps = re.findall(r"index add: embedding new passages (\d+)/20: (\d+)/(\d+) texts", err)
    # 50 passages, their one sentence each and their one heading (the file's name, embedded once):
    # 7 chunks of at most 16 texts, a line each.
    assert [(int(step), int(done), int(total)) for step, done, total in steps] == [
        (3, 16, 101), (6, 32, 101), (9, 48, 101), (12, 64, 101), (15, 80, 101), (19, 96, 101), (20, 101, 101)], err

    assert index_cli.main(["list", "--json", *common]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert len(listed) == 50 and {p["chars"] for p in listed} == {DEFAULT_MAX_CHARS}

    for value, words in (("0", "the longest passage must be at least 1 character, got 0"),
                         ("5000", "--max-chars 5000 is longer than the 2048 characters embedding model 'minilm' "
                                  "reads ([tokenizer] max_chars)")):
        assert index_cli.main(["add", str(line), "--max-chars", value, *common]) == 2
        assert words in capsys.readouterr().err
