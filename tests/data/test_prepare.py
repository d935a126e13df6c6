"""prepare_dataset: splits, counts, draft vocabulary, report, max_len, atomic output."""

import json
import re

import datasets
import pytest
import torch
from safetensors.torch import load_file

from eagle31.data.prepare import DataConfig, prepare_dataset
from eagle31.data.sources import DataError
from eagle31.errors import ConfigError
from eagle31.vocab import build_draft_vocab, count_supervised_tokens
from tests.data.chat_helpers import supervised_spans, write_jsonl


def chat(i: int, reply: str = "Hello!") -> dict:
    return {"messages": [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": reply}]}


def config(tmp_path, sources, **kw) -> DataConfig:
    return DataConfig(source=[str(s) for s in sources], prepared_dir=str(tmp_path / "out"), **kw)


def load_split(cfg, split):
    return datasets.load_from_disk(f"{cfg.prepared_dir}/{split}")


def test_outputs_are_consistent(tmp_path, llama_tok):
    good = [chat(i, "Hello! " * (1 + i % 3) + "It is sunny.") for i in range(20)]
    no_assistant = {"messages": [{"role": "user", "content": "x"}]}
    src = write_jsonl(tmp_path / "a.jsonl", good[:10] + ["{", no_assistant] + good[10:])
    cfg = config(tmp_path, [src, tmp_path / "nope.jsonl"], eval_fraction=0.2)
    report = prepare_dataset(cfg, llama_tok, draft_vocab_size=40)

    train, held_out = load_split(cfg, "train"), load_split(cfg, "eval")
    assert (len(train), len(held_out)) == (16, 4)  # ceil(0.2 * 20)
    assert train.features["input_ids"].feature.dtype == "int32" and train.features["loss_mask"].feature.dtype == "int8"
    for row in list(train) + list(held_out):
        assert len(row["input_ids"]) == len(row["loss_mask"]) and any(row["loss_mask"])

    V = len(llama_tok)
    counts = load_file(f"{cfg.prepared_dir}/token_counts.safetensors")["counts"]
    assert counts.dtype == torch.int64 and counts.shape == (V,)
    expected = sum(
        count_supervised_tokens(torch.tensor(r["input_ids"]), torch.tensor(r["loss_mask"]), V) for r in train
    )
    assert torch.equal(counts, expected)
    vocab = load_file(f"{cfg.prepared_dir}/vocab.safetensors")
    d2t, t2d = build_draft_vocab(counts, 40)
    assert torch.equal(vocab["d2t"], d2t) and torch.equal(vocab["t2d"], t2d)
    assert vocab["d2t"].dtype == torch.int64 and vocab["t2d"].dtype == torch.bool and int(t2d.sum()) == 40

    on_disk = json.loads((tmp_path / "out" / "report.json").read_text())
    assert on_disk == report.to_dict()
    assert report.records == 22 and report.samples == {"train": 16, "eval": 4}
    assert report.supervised_tokens["train"] == int(counts.sum())
    assert report.tokens["train"] == sum(len(r["input_ids"]) for r in train)
    assert report.dropped == {
        "malformed": {
            "count": 1,
            "examples": [f"{src}:11 (invalid JSON: Expecting property name enclosed in double quotes)"],
        },
        "missing_file": {"count": 1, "examples": [f"{tmp_path}/nope.jsonl"]},
        "no_assistant_tokens": {"count": 1, "examples": [f"{src}:12"]},
    }
    assert report.draft_vocab_size == 40 and 0 < report.draft_vocab_coverage <= 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "out"]  # no temporary left


def test_split_is_seeded_capped_and_keeps_input_order(tmp_path, llama_tok):
    src = write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(30)])

    def split(**kw):
        cfg = config(tmp_path, [src], **kw)
        prepare_dataset(cfg, llama_tok, draft_vocab_size=8)
        return [llama_tok.decode(r["input_ids"]).split("Hi ")[1].split("<")[0] for r in load_split(cfg, "eval")], len(
            load_split(cfg, "train")
        )

    held_out, n_train = split(eval_fraction=0.2, seed=1)
    assert len(held_out) == 6 and n_train == 24 and held_out == sorted(held_out, key=int)
    assert split(eval_fraction=0.2, seed=1)[0] == held_out
    assert split(eval_fraction=0.2, seed=2)[0] != held_out
    assert len(split(eval_fraction=0.5, eval_max_samples=3)[0]) == 3
    assert split(eval_fraction=0.0) == ([], 30)


def test_max_len_truncate_and_drop_are_counted(tmp_path, llama_tok):
    long_reply = chat(1, "Hello! " * 30)
    long_prompt = {"messages": [{"role": "user", "content": "Tell me " * 40}, {"role": "assistant", "content": "Ok"}]}
    src = write_jsonl(tmp_path / "a.jsonl", [chat(0), long_reply, long_prompt, chat(3)])

    cfg = config(tmp_path, [src], max_len=32, eval_fraction=0.0)
    report = prepare_dataset(cfg, llama_tok, draft_vocab_size=8)
    rows = list(load_split(cfg, "train"))
    assert len(rows) == 3 and max(len(r["input_ids"]) for r in rows) == 32
    assert report.truncated["count"] == 2
    assert [e.split(" ")[0] for e in report.truncated["examples"]] == [f"{src}:2", f"{src}:3"]
    assert report.dropped == {"no_assistant_tokens_after_truncation": {"count": 1, "examples": [f"{src}:3"]}}

    cfg = config(tmp_path, [src], max_len=32, overflow="drop", eval_fraction=0.0)
    report = prepare_dataset(cfg, llama_tok, draft_vocab_size=8)
    assert len(load_split(cfg, "train")) == 2 and report.truncated["count"] == 0
    assert report.dropped["too_long"]["count"] == 2
    assert [e.split(" ")[0] for e in report.dropped["too_long"]["examples"]] == [f"{src}:2", f"{src}:3"]


KIMI_RECORD = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet them"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add them"},
    ]
}


def test_kimi_conversations_prepare_with_golden_masks(tmp_path, kimi_tok, caplog):
    src = write_jsonl(tmp_path / "a.jsonl", [KIMI_RECORD] * 3)
    cfg = config(tmp_path, [src], eval_fraction=0.0, chat_template_kwargs={"preserve_thinking": True})
    report = prepare_dataset(cfg, kimi_tok, draft_vocab_size=32000, vocab_size=600)
    row = load_split(cfg, "train")[0]
    assert supervised_spans(kimi_tok, row["input_ids"], row["loss_mask"]) == [
        "greet them</think>Hello!<|im_end|>",
        "add them</think>4<|im_end|>",
    ]
    assert report.unrendered_reasoning["turns"] == 6 and report.unrendered_reasoning["unrendered_turns"] == 0
    assert report.settings["chat_template_kwargs"] == {"preserve_thinking": True}
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    # the model's vocabulary may exceed the tokenizer's; Vd is clamped to it
    assert report.vocab_size == 600 and report.draft_vocab_size == 600 and report.draft_vocab_size_requested == 32000
    assert "clamped" in report.summary()
    vocab = load_file(f"{cfg.prepared_dir}/vocab.safetensors")
    assert vocab["t2d"].shape == (600,) and bool(vocab["t2d"].all())


def test_reasoning_the_template_drops_is_counted_and_warned_about(tmp_path, kimi_tok, caplog):
    src = write_jsonl(tmp_path / "a.jsonl", [KIMI_RECORD] * 3)
    cfg = config(tmp_path, [src], eval_fraction=0.0)  # no preserve_thinking: Kimi blanks it all
    report = prepare_dataset(cfg, kimi_tok, draft_vocab_size=32000, vocab_size=600)
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert re.fullmatch(
        r"warning: most reasoning is not in the prepared data: 6 of 6 turns, (\d+) of \1 tokens; .*", warning
    )
    tokens = 3 * (len(kimi_tok("greet them")["input_ids"]) + len(kimi_tok("add them")["input_ids"]))
    r = report.unrendered_reasoning
    assert (r["turns"], r["tokens"], r["unrendered_turns"], r["unrendered_tokens"]) == (6, tokens, 6, tokens)
    assert "preserve_thinking" in r["why"] and "reasoning not rendered: 6 of 6 turns" in report.summary()
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["unrendered_reasoning"]["unrendered_tokens"] == tokens
    row = load_split(cfg, "train")[0]
    assert supervised_spans(kimi_tok, row["input_ids"], row["loss_mask"]) == [
        "</think>Hello!<|im_end|>",
        "</think>4<|im_end|>",
    ]


def test_chat_template_kwargs_are_checked_before_any_work(tmp_path, kimi_tok):
    src = write_jsonl(tmp_path / "a.jsonl", [KIMI_RECORD])
    cfg = config(tmp_path, [src], chat_template_kwargs={"tokenize": True})
    with pytest.raises(ConfigError, match="data.chat_template_kwargs: 'tokenize'"):
        prepare_dataset(cfg, kimi_tok, draft_vocab_size=8)
    assert not (tmp_path / "out").exists()


def test_nothing_left_is_a_data_error_and_keeps_the_previous_output(tmp_path, llama_tok):
    src = write_jsonl(tmp_path / "a.jsonl", [chat(0), chat(1)])
    cfg = config(tmp_path, [src], eval_fraction=0.0)
    prepare_dataset(cfg, llama_tok, draft_vocab_size=8)
    before = (tmp_path / "out" / "report.json").read_text()

    write_jsonl(src, [{"messages": [{"role": "user", "content": "x"}]}, "{"])
    with pytest.raises(DataError, match=r"no sample left .* malformed 1 .*; no_assistant_tokens 1"):
        prepare_dataset(cfg, llama_tok, draft_vocab_size=8)
    assert (tmp_path / "out" / "report.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "out"]

    write_jsonl(src, [chat(i) for i in range(5)])  # a new run replaces the old output
    assert prepare_dataset(cfg, llama_tok, draft_vocab_size=8).samples["train"] == 5
    assert len(load_split(cfg, "train")) == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "out"]


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("source", [], "data.source is empty"),
        ("max_len", 0, "data.max_len"),
        ("eval_fraction", 1.0, "data.eval_fraction"),
        ("eval_max_samples", -1, "data.eval_max_samples"),
    ],
)
def test_bad_settings_are_config_errors(tmp_path, llama_tok, field, value, match):
    cfg = config(tmp_path, [tmp_path / "a.jsonl"])
    setattr(cfg, field, value)
    with pytest.raises(ConfigError, match=match):
        prepare_dataset(cfg, llama_tok, draft_vocab_size=8)
    assert not (tmp_path / "out").exists()


def test_token_ids_outside_the_target_vocabulary_are_a_config_error(tmp_path, llama_tok):
    src = write_jsonl(tmp_path / "a.jsonl", [chat(0)])
    with pytest.raises(ConfigError, match="outside the target vocab_size=10"):
        prepare_dataset(config(tmp_path, [src]), llama_tok, draft_vocab_size=8, vocab_size=10)


def test_the_kimi_k26_recipe_supervises_the_reasoning_of_every_turn(tmp_path, kimi_tok):
    from pathlib import Path

    from omegaconf import OmegaConf

    from eagle31.recipe import load_recipe

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes", ["recipe=kimi_k26"])
    src = write_jsonl(tmp_path / "a.jsonl", [KIMI_RECORD] * 2)
    data = OmegaConf.merge(
        recipe.data, {"source": [str(src)], "prepared_dir": str(tmp_path / "out"), "eval_fraction": 0.0}
    )
    report = prepare_dataset(data, kimi_tok, draft_vocab_size=64)
    row = load_split(data, "train")[0]
    assert supervised_spans(kimi_tok, row["input_ids"], row["loss_mask"]) == [
        "greet them</think>Hello!<|im_end|>",
        "add them</think>4<|im_end|>",
    ]
    assert report.unrendered_reasoning["unrendered_turns"] == 0 and report.unrendered_reasoning["turns"] == 4


def test_a_full_disk_during_prepare_keeps_the_earlier_set_and_leaves_no_partial_one(tmp_path, llama_tok, small_disk):
    from eagle31.errors import DiskFullError
    from tests.helpers import fill_disk

    cfg = DataConfig(
        source=[str(write_jsonl(tmp_path / "c.jsonl", [chat(i) for i in range(20)]))],
        prepared_dir=str(small_disk / "prepared"),
    )
    prepare_dataset(cfg, llama_tok, draft_vocab_size=40)
    before = {p.name: p.read_bytes() for p in (small_disk / "prepared").rglob("*") if p.is_file()}
    fill_disk(small_disk, leave_pages=2)
    with pytest.raises(DiskFullError) as full:
        prepare_dataset(cfg, llama_tok, draft_vocab_size=40)
    assert str(full.value) == (
        f"the disk holding data.prepared_dir {small_disk / 'prepared'} filled up; nothing was left half-written "
        "(the partial directory was removed, an earlier prepared set there is untouched); free space, then rerun the "
        "same command"
    )
    assert sorted(p.name for p in small_disk.iterdir()) == ["ballast", "prepared"]
    assert {p.name: p.read_bytes() for p in (small_disk / "prepared").rglob("*") if p.is_file()} == before


def test_a_write_denied_during_prepare_is_one_line(tmp_path, llama_tok, monkeypatch):
    import errno

    import datasets

    from eagle31.errors import FileAccessError

    def denied(ds, path, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", denied)
    cfg = config(tmp_path, [write_jsonl(tmp_path / "c.jsonl", [chat(i) for i in range(4)])])
    with pytest.raises(
        FileAccessError, match=r"^cannot write data.prepared_dir .*out: Permission denied \(.*train\); nothing was left"
    ):
        prepare_dataset(cfg, llama_tok, draft_vocab_size=40)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_merge_turns_makes_long_multi_turn_samples_of_the_same_turns(tmp_path, llama_tok):
    """data.merge_turns=4: consecutive conversations become samples of 1..4 of them, every turn once and in order,
    every assistant turn supervised; a malformed record and a conversation with tools stay out of the merging,
    and the report still counts every record read."""
    from eagle31.data.merge_turns import TurnMerger
    from eagle31.data.sources import Conversation

    convs = [{"messages": [{"role": "system", "content": "Be brief."}, *chat(i)["messages"]]} for i in range(30)]
    tools = {
        "messages": chat(99)["messages"],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    }
    src = write_jsonl(tmp_path / "a.jsonl", convs[:12] + ["{", tools] + convs[12:])
    one = prepare_dataset(config(tmp_path / "one", [src], eval_fraction=0.0), llama_tok, draft_vocab_size=40)
    cfg = config(tmp_path, [src], eval_fraction=0.0, merge_turns=4)
    report = prepare_dataset(cfg, llama_tok, draft_vocab_size=40)

    assert report.records == one.records == 32 and report.settings["merge_turns"] == 4
    assert report.samples["train"] < one.samples["train"] == 31
    assert report.supervised_tokens == one.supervised_tokens  # the same replies, supervised once each
    train = load_split(cfg, "train")
    users = [llama_tok.decode(r["input_ids"]).count("Hi ") for r in train]
    assert sum(users) == 31 and max(users) > 1 and max(users) <= 4

    merger = TurnMerger(4, seed=0)
    merged = list(merger.merge([Conversation(c["messages"], where=f"a:{i}") for i, c in enumerate(convs)]))
    assert merger.read == 30 and [m["content"] for c in merged for m in c.messages if m["role"] == "user"] == [
        f"Hi {i}" for i in range(30)
    ]
    assert all([m["role"] for m in c.messages].count("system") == 1 for c in merged)
    assert merged[0].where.startswith("a:0") and merged == list(
        TurnMerger(4, seed=0).merge(Conversation(c["messages"], where=f"a:{i}") for i, c in enumerate(convs))
    )


def test_merge_turns_below_one_is_refused(tmp_path, llama_tok):
    src = write_jsonl(tmp_path / "a.jsonl", [chat(0)])
    with pytest.raises(ConfigError, match=r"^data.merge_turns must be >= 1 \(1: no merging\), got 0$"):
        prepare_dataset(config(tmp_path, [src], merge_turns=0), llama_tok, draft_vocab_size=40)


def test_template_variants_render_each_conversation_with_the_option_set_drawn_for_it(tmp_path, kimi_tok):
    """data.chat_template_variants: Kimi's history reasoning rendered (preserve_thinking) for some conversations and
    not for others, each as preparing with that option alone does, the draw following the seed and the index."""
    from eagle31.data.system_prompts import draw_for_conversation

    src = write_jsonl(tmp_path / "a.jsonl", [KIMI_RECORD] * 12)
    variants = [{"preserve_thinking": True}, {"preserve_thinking": False}]
    cfg = config(tmp_path, [src], eval_fraction=0.0, chat_template_variants=variants)
    report = prepare_dataset(cfg, kimi_tok, draft_vocab_size=600, vocab_size=600)
    alone = {}
    for v in variants:
        one = config(tmp_path / str(v["preserve_thinking"]), [src], eval_fraction=0.0, chat_template_kwargs=v)
        prepare_dataset(one, kimi_tok, draft_vocab_size=600, vocab_size=600)
        alone[v["preserve_thinking"]] = load_split(one, "train")[0]["loss_mask"]
    masks = [row["loss_mask"] for row in load_split(cfg, "train")]
    drawn = [draw_for_conversation(variants, 0, i, "template-variant")["preserve_thinking"] for i in range(12)]
    assert masks == [alone[d] for d in drawn] and len(set(drawn)) == 2  # both options, each where it was drawn
    assert report.settings["chat_template_variants"] == variants
    assert report.unrendered_reasoning["unrendered_turns"] == 2 * drawn.count(False)  # as the option alone counts them
    with pytest.raises(ConfigError, match=r"^data.chat_template_variants\[1\]: 'tokenize'"):
        prepare_dataset(
            config(tmp_path / "bad", [src], chat_template_variants=[{}, {"tokenize": True}]),
            kimi_tok,
            draft_vocab_size=600,
        )


def test_a_regenerated_record_is_rendered_with_the_template_options_it_was_answered_under(tmp_path, kimi_tok):
    """A record's own chat_template_kwargs (regeneration with variants) wins over the data's variants; merging
    stops at a change of options; a malformed value drops the record, an option that is no option stops in one line."""
    records = [dict(KIMI_RECORD, chat_template_kwargs={"preserve_thinking": i % 2 == 0}) for i in range(6)]
    src = write_jsonl(tmp_path / "a.jsonl", records)
    cfg = config(
        tmp_path / "own", [src], eval_fraction=0.0, chat_template_variants=[{"preserve_thinking": False}, {"x": 1}]
    )
    report = prepare_dataset(cfg, kimi_tok, draft_vocab_size=600, vocab_size=600)
    alone = {}
    for v in (True, False):
        one = config(
            tmp_path / str(v),
            [write_jsonl(tmp_path / f"{v}.jsonl", [KIMI_RECORD])],
            eval_fraction=0.0,
            chat_template_kwargs={"preserve_thinking": v},
        )
        prepare_dataset(one, kimi_tok, draft_vocab_size=600, vocab_size=600)
        alone[v] = load_split(one, "train")[0]["input_ids"]
    assert alone[True] != alone[False]
    assert [row["input_ids"] for row in load_split(cfg, "train")] == [alone[i % 2 == 0] for i in range(6)]
    assert report.unrendered_reasoning["unrendered_turns"] == 2 * 3

    merged = config(tmp_path / "merged", [src], eval_fraction=0.0, merge_turns=4)
    assert prepare_dataset(merged, kimi_tok, draft_vocab_size=600, vocab_size=600).samples["train"] == 6

    bad = write_jsonl(tmp_path / "bad.jsonl", [dict(KIMI_RECORD, chat_template_kwargs=[1]), KIMI_RECORD])
    report = prepare_dataset(
        config(tmp_path / "bad", [bad], eval_fraction=0.0), kimi_tok, draft_vocab_size=600, vocab_size=600
    )
    assert report.dropped["malformed"]["count"] == 1 and report.samples["train"] == 1
    wrong = write_jsonl(tmp_path / "wrong.jsonl", [dict(KIMI_RECORD, chat_template_kwargs={"tokenize": True})])
    with pytest.raises(ConfigError, match=r"wrong.jsonl:1: chat_template_kwargs: 'tokenize' is an argument"):
        prepare_dataset(config(tmp_path / "wrong", [wrong]), kimi_tok, draft_vocab_size=600, vocab_size=600)
