"""The demo corpus: the shipped standard-library functions as conversations, deterministic splits, the cache key."""

import json

import pytest

from eagle31.targets import demo_corpus
from eagle31.targets.demo import demo_key
from eagle31.targets.demo_corpus import CorpusSpec, make_splits, merge, write_splits
from tests.helpers import read_jsonl


@pytest.fixture(scope="module")
def functions():
    return demo_corpus.functions()


@pytest.mark.slow
def test_functions_are_documented_definitions_at_column_zero(functions):
    assert len(functions) > 1000
    names = {(f.module, f.name) for f in functions}
    assert ("string", "capwords") in names and ("textwrap", "TextWrapper.wrap") in names  # a function, a method
    for f in functions:
        assert f.code.startswith("def ") and f.code.isascii() and f.summary
        assert not f.name.split(".")[-1].startswith("_")
        assert not any(part.startswith("test") for part in f.module.split("."))  # no test suites
    wrap = next(f for f in functions if (f.module, f.name) == ("textwrap", "TextWrapper.wrap"))
    assert wrap.signature == "(self, text)" and wrap.code.splitlines()[1].startswith("    ")


@pytest.mark.slow
def test_splits_are_deterministic_and_disjoint(functions, tmp_path):
    spec = CorpusSpec(heldout=20, max_train=100, long_prompts=4, long_prompt_turns=3)
    splits = make_splits(functions, spec, seed=0)
    assert make_splits(functions, spec, seed=0) == splits and make_splits(functions, spec, seed=1) != splits
    assert {k: len(v) for k, v in splits.items()} == {"train": 100, "heldout": 20, "other_system": 20, "long_prompt": 4}
    answers = {split: {c["messages"][-1]["content"] for c in rows} for split, rows in splits.items()}
    assert not answers["train"] & answers["heldout"]
    assert answers["other_system"] == answers["heldout"]
    assert {c["messages"][0]["content"] for c in splits["other_system"]} == {demo_corpus.OTHER_SYSTEM_PROMPT}
    long = splits["long_prompt"][0]["messages"]
    assert [m["role"] for m in long] == ["system"] + ["user", "assistant"] * 4  # 3 earlier turns + the request
    paths = write_splits(splits, tmp_path)
    assert sorted(paths) == sorted(demo_corpus.SPLITS)
    assert read_jsonl(paths["train"]) == splits["train"]
    assert json.loads(paths["heldout"].read_text().splitlines()[0]) == splits["heldout"][0]


def test_merge_keeps_the_first_system_prompt():
    a = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "1"}]}
    b = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "2"}]}
    assert [m["content"] for m in merge([a, b])["messages"]] == ["S", "1", "2"]


def test_the_corpus_is_the_shipped_file_and_keys_the_cache(tmp_path, monkeypatch):
    """The same functions under every Python; another corpus file builds another cached target."""
    shipped = demo_corpus.functions()
    assert len(shipped) == 2763 and (shipped[0].module, shipped[0].name) == ("_aix_support", "aix_buildtag")
    key = demo_key()
    edited = tmp_path / "stdlib_functions.jsonl"
    edited.write_text(demo_corpus.CORPUS_FILE.read_text().replace("Return", "Returns", 1))
    monkeypatch.setattr(demo_corpus, "CORPUS_FILE", edited)
    assert demo_key() != key and demo_key().split("-")[:2] == key.split("-")[:2]
