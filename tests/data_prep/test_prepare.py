"""data_prep/prepare.py: a recipe CLI; bad input exits 2 with one line (run in-process: see `run_script`)."""

import json
from pathlib import Path

import pytest

from tests.data.chat_helpers import write_jsonl
from tests.helpers import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "data_prep" / "prepare.py"


@pytest.mark.parametrize("case", ["missing", "unreadable"])
def test_bad_input_exits_2_with_one_line(tmp_path, llama_tok_dir, case, monkeypatch, capsys):
    if case == "missing":
        source = tmp_path / "nope.jsonl"
        expected = f"error: no readable conversation in {source}: missing_file 1 [{source}]"
    else:
        source = write_jsonl(tmp_path / "junk.jsonl", ["not json", "[1]"])
        expected = f"error: no readable conversation in {source}: malformed 2 [{source}:1 (invalid JSON"
    args = [
        "target.builtin=null",
        f"target.path={llama_tok_dir}",
        f"data.source={source}",
        f"data.prepared_dir={tmp_path / 'out'}",
    ]
    code, err = run_script(SCRIPT, args, monkeypatch), capsys.readouterr().err
    assert code == 2, err
    assert err.strip().count("\n") == 0 and err.startswith(expected), err
    assert not (tmp_path / "out").exists()


def test_prepares_a_recipe_with_a_local_tokenizer(tmp_path, llama_tok_dir, monkeypatch, capsys):
    chats = [
        {"messages": [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": "Hello!"}]}
        for i in range(6)
    ]
    a = write_jsonl(tmp_path / "a.jsonl", chats[:3])
    b = write_jsonl(tmp_path / "b.jsonl", chats[3:] + ["{"])
    args = [
        "target.builtin=null",
        f"target.path={llama_tok_dir}",
        f"data.source=[{a},{b}]",
        f"data.prepared_dir={tmp_path / 'out'}",
        "data.eval_fraction=0.3",
        "drafter.draft_vocab_size=16",
    ]
    code, (out, err) = run_script(SCRIPT, args, monkeypatch), capsys.readouterr()
    assert code == 0, err
    assert "4 train + 2 eval samples from 7 records" in out
    assert f"dropped malformed: 1 [{b}:4" in out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["draft_vocab_size"] == 16 and report["sources"] == [str(a), str(b)]


def test_a_prepared_dir_holding_the_source_keeps_the_users_files(tmp_path, llama_tok_dir, capsys):
    import runpy

    from eagle31_cli import recipe_main

    project = tmp_path / "project"
    project.mkdir()
    source = write_jsonl(
        project / "chats.jsonl",
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
    )
    (project / "notes.txt").write_text("mine")
    prepare = runpy.run_path(str(SCRIPT))["prepare"]
    recipes = SCRIPT.parents[1] / "recipes"
    args = [
        "target.builtin=null",
        f"target.path={llama_tok_dir}",
        f"data.source=[{source}]",
        f"data.prepared_dir={project}",
    ]
    assert recipe_main(prepare, recipes, args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "holds data.source" in err
    assert sorted(p.name for p in project.iterdir()) == ["chats.jsonl", "notes.txt"]
