"""experiments/eagle3_vs_eagle31/heldout_questions.py: first user turns after the training conversations, as MT-Bench
questions."""

import json

import pytest

from eagle31.data.sources import Tally, read_mt_bench
from eagle31.errors import ConfigError
from experiments.eagle3_vs_eagle31.heldout_questions import HeldoutConfig, heldout_questions, main


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


def test_messages_format_is_an_acceptance_prompt_file(tmp_path):
    """format=messages: the same prompts as chat prompts, after the system prompt when one is given."""
    from eagle31.data.sources import to_conversation

    source = write_source(tmp_path / "chats.jsonl")
    out = tmp_path / "unseen_system.jsonl"
    assert (
        main([f"source={source}", "skip=3", "count=2", "format=messages", "system_prompt=Be a pirate.", f"out={out}"])
        == 0
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records == [
        {"messages": [{"role": "system", "content": "Be a pirate."}, {"role": "user", "content": f"question {i}"}]}
        for i in (3, 4)
    ]
    assert [m["role"] for m in to_conversation(records[0], "line 1").messages] == [
        "system",
        "user",
    ]  # what acceptance reads

    assert main([f"source={source}", "skip=3", "count=1", "format=messages", f"out={out}"]) == 0
    assert json.loads(out.read_text()) == {
        "messages": [{"role": "user", "content": "question 3"}]
    }  # the target's default system


def test_a_system_prompt_without_messages_format_is_refused(tmp_path, capsys):
    assert (
        main([f"source={write_source(tmp_path / 'chats.jsonl')}", "system_prompt=x", f"out={tmp_path / 'o.jsonl'}"])
        == 2
    )
    assert "system_prompt needs format=messages" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()
