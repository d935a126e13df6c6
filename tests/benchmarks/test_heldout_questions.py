"""benchmarks/heldout_questions.py: first user turns after the training conversations, as MT-Bench questions."""

import json

import pytest

from benchmarks.heldout_questions import HeldoutConfig, heldout_questions, main
from eagle31.config import ConfigError
from eagle31.data.sources import Tally, read_mt_bench


def write_source(path, n=8):
    rows = []
    for i in range(n):
        user = "x" * 50 if i == 5 else f"question {i}"  # one prompt too long for max_chars=20
        rows.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": f"answer {i}"}]})
    rows.insert(2, {"messages": []})  # a bad record is not counted as a conversation
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_skips_the_training_conversations_and_long_prompts(tmp_path):
    source = write_source(tmp_path / "chats.jsonl")
    questions = heldout_questions(HeldoutConfig(out="", source=str(source), skip=3, count=3, max_chars=20))
    assert [q["turns"] for q in questions] == [["question 3"], ["question 4"], ["question 6"]]
    assert [q["question_id"] for q in questions] == [3, 4, 6] and {q["category"] for q in questions} == {"heldout"}

    out = tmp_path / "heldout.jsonl"
    assert main([f"source={source}", "skip=3", "count=2", f"out={out}"]) == 0
    assert [q.turns for q in read_mt_bench(out, Tally())] == [["question 3"], ["question 4"]]


def test_too_few_prompts_is_one_clear_error(tmp_path):
    source = write_source(tmp_path / "chats.jsonl")
    with pytest.raises(ConfigError, match="only 5 prompts after the first 3, 9 wanted"):
        heldout_questions(HeldoutConfig(out="", source=str(source), skip=3, count=9))
