"""data.system_prompts: read from a list or a file, one drawn per conversation from the seed and its index, at
preparation and at regeneration (multi-turn included)."""

from __future__ import annotations

import json
from collections import Counter

import datasets
import pytest

from eagle31.data.prepare import DataConfig, prepare_dataset
from eagle31.data.regenerate.core import Reply, Settings, regenerate_conversation
from eagle31.data.sources import Conversation
from eagle31.data.system_prompts import data_system_prompts, draw_system_prompt, read_system_prompts
from eagle31.errors import ConfigError
from tests.data.chat_helpers import write_jsonl

PROMPTS = ["You are terse.", "You are a pirate.", "Answer in French."]


def test_prompts_are_read_from_a_list_a_text_file_or_a_jsonl_file(tmp_path):
    assert read_system_prompts(PROMPTS) == PROMPTS
    (tmp_path / "p.txt").write_text("You are terse.\n\nYou are a pirate.\n")
    assert read_system_prompts(str(tmp_path / "p.txt")) == PROMPTS[:2]
    (tmp_path / "p.jsonl").write_text(
        json.dumps("Line one\nline two") + "\n" + json.dumps({"content": "Be brief."}) + "\n"
    )
    assert read_system_prompts(tmp_path / "p.jsonl") == ["Line one\nline two", "Be brief."]
    assert read_system_prompts(None) == []


@pytest.mark.parametrize(
    "spec, message",
    [
        ([], "must be a non-empty list"),
        (["ok", ""], "must be a non-empty list of non-empty strings"),
        ("missing.txt", "data.system_prompts: no file"),
        ("bad.jsonl", "bad.jsonl:2 is not valid JSON"),
        ("number.jsonl", "number.jsonl:1 is neither a JSON string"),
        ("empty.txt", "holds no prompt"),
    ],
)
def test_bad_prompts_are_one_line_naming_the_field_file_or_line(tmp_path, spec, message):
    (tmp_path / "bad.jsonl").write_text('"fine"\n{oops\n')
    (tmp_path / "number.jsonl").write_text("3\n")
    (tmp_path / "empty.txt").write_text("\n\n")
    if isinstance(spec, str):
        spec = str(tmp_path / spec)
    with pytest.raises(ConfigError, match=message) as e:
        read_system_prompts(spec)
    assert "\n" not in str(e.value)


def test_the_draw_depends_on_the_seed_and_the_index_only_and_covers_every_prompt():
    draws = [draw_system_prompt(PROMPTS, 0, i) for i in range(300)]
    assert draws == [draw_system_prompt(list(PROMPTS), 0, i) for i in range(300)]  # deterministic
    assert set(Counter(draws)) == set(PROMPTS) and min(Counter(draws).values()) > 60  # about uniform
    assert draws != [draw_system_prompt(PROMPTS, 1, i) for i in range(300)]  # another seed, another draw
    assert draw_system_prompt([], 0, 0) is None


def test_one_prompt_and_a_list_of_them_together_are_refused(tmp_path):
    cfg = DataConfig(system_prompt="x", system_prompts=["y"])
    with pytest.raises(ConfigError, match="data.system_prompt and data.system_prompts are both set"):
        data_system_prompts(cfg)
    assert data_system_prompts(DataConfig(system_prompt="x")) == ["x"]


def test_prepare_gives_each_conversation_without_a_system_message_its_drawn_prompt(tmp_path, llama_tok):
    chats = [
        {"messages": [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": "Hello!"}]}
        for i in range(12)
    ]
    own = {"messages": [{"role": "system", "content": "Own prompt."}, *chats[0]["messages"]]}
    src = write_jsonl(tmp_path / "a.jsonl", chats + [own])
    cfg = DataConfig(
        source=[str(src)], prepared_dir=str(tmp_path / "out"), system_prompts=PROMPTS, eval_fraction=0.0, seed=7
    )
    report = prepare_dataset(cfg, llama_tok, draft_vocab_size=8)
    rows = datasets.load_from_disk(f"{cfg.prepared_dir}/train")
    texts = [llama_tok.decode(r["input_ids"]) for r in rows]
    for i, text in enumerate(texts[:12]):
        chosen = draw_system_prompt(PROMPTS, 7, i)
        assert chosen in text and not any(p in text for p in PROMPTS if p != chosen), i
    assert "Own prompt." in texts[12] and not any(p in texts[12] for p in PROMPTS)  # its own is kept
    assert len({draw_system_prompt(PROMPTS, 7, i) for i in range(12)}) > 1
    assert report.settings["system_prompts"] == PROMPTS


def test_multi_turn_regeneration_answers_each_kept_turn_on_the_regenerated_history_under_the_drawn_prompt():
    """regenerate.max_turns = 2 of 3 user turns: turn 2's prompt holds turn 1's regenerated reply (not the
    dataset's), after the system prompt drawn for the conversation's index."""
    prompts_seen = []

    def complete(messages, seed, template_options):
        prompts_seen.append([dict(m) for m in messages])
        return Reply(content=f"reply {len(prompts_seen)}", status="ok")

    users = ["first", "second", "third"]
    messages = [
        m
        for n, u in enumerate(users)
        for m in ({"role": "user", "content": u}, {"role": "assistant", "content": f"old {n}"})
    ]
    settings = Settings(max_turns=2, system_prompts=PROMPTS, seed=3)
    out = regenerate_conversation(Conversation(messages, where="x"), 5, settings, complete)
    system = {"role": "system", "content": draw_system_prompt(PROMPTS, 3, 5)}
    assert out.turns == 2 and len(prompts_seen) == 2
    assert prompts_seen[0] == [system, {"role": "user", "content": "first"}]
    assert prompts_seen[1] == [
        system,
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "reply 1"},
        {"role": "user", "content": "second"},
    ]
    assert out.record["messages"] == prompts_seen[1] + [{"role": "assistant", "content": "reply 2"}]
    assert "old" not in json.dumps(out.record)
    other = regenerate_conversation(Conversation(messages, where="x"), 6, settings, complete).record["messages"][0]
    assert other["role"] == "system" and other["content"] in PROMPTS
