"""data_prep/prepare.py: a Hydra app over the recipes; bad input exits 2 with one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.data.chat_helpers import write_jsonl

SCRIPT = Path(__file__).resolve().parents[2] / "data_prep" / "prepare.py"


def run_cli(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *overrides], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("case", ["missing", "unreadable"])
def test_bad_input_exits_2_with_one_line(tmp_path, llama_tok_dir, case):
    if case == "missing":
        source = tmp_path / "nope.jsonl"
        expected = f"error: no readable conversation in {source}: missing_file 1 [{source}]"
    else:
        source = write_jsonl(tmp_path / "junk.jsonl", ["not json", "[1]"])
        expected = f"error: no readable conversation in {source}: malformed 2 [{source}:1 (invalid JSON"
    out = run_cli(
        tmp_path,
        "target.builtin=null",
        f"target.path={llama_tok_dir}",
        f"data.source={source}",
        f"data.prepared_dir={tmp_path / 'out'}",
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().count("\n") == 0 and out.stderr.startswith(expected), out.stderr
    assert not (tmp_path / "out").exists()


def test_prepares_a_recipe_with_a_local_tokenizer(tmp_path, llama_tok_dir):
    chats = [
        {"messages": [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": "Hello!"}]}
        for i in range(6)
    ]
    a = write_jsonl(tmp_path / "a.jsonl", chats[:3])
    b = write_jsonl(tmp_path / "b.jsonl", chats[3:] + ["{"])
    out = run_cli(
        tmp_path,
        "target.builtin=null",
        f"target.path={llama_tok_dir}",
        f"data.source=[{a},{b}]",
        f"data.prepared_dir={tmp_path / 'out'}",
        "data.eval_fraction=0.3",
        "drafter.draft_vocab_size=16",
    )
    assert out.returncode == 0, out.stderr
    assert "4 train + 2 eval samples from 7 records" in out.stdout
    assert f"dropped malformed: 1 [{b}:4" in out.stdout
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["draft_vocab_size"] == 16 and report["sources"] == [str(a), str(b)]


def test_a_prepared_dir_holding_the_source_keeps_the_users_files(tmp_path, llama_tok_dir, capsys):
    import runpy

    from eagle31.cli import recipe_main

    project = tmp_path / "project"
    project.mkdir()
    source = write_jsonl(project / "chats.jsonl", [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}])
    (project / "notes.txt").write_text("mine")
    prepare = runpy.run_path(str(SCRIPT))["prepare"]
    recipes = SCRIPT.parents[1] / "recipes"
    args = ["target.builtin=null", f"target.path={llama_tok_dir}", f"data.source=[{source}]", f"data.prepared_dir={project}"]
    assert recipe_main(prepare, recipes, args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "holds data.source" in err
    assert sorted(p.name for p in project.iterdir()) == ["chats.jsonl", "notes.txt"]
