"""MT-Bench acceptance: turn 2 carries turn 1 and the target's own answer; per-category stats; the script."""

import json
import runpy
from pathlib import Path

import pytest
import torch

from eagle31.convert import load_drafter
from eagle31.data.sources import MTBenchQuestion
from eagle31.errors import ConfigError
from eagle31.eval.acceptance import AcceptanceStats
from eagle31.eval.drafting import EagleProposer, TreeSpec
from eagle31.eval.mtbench import ALL, MTBenchConfig, evaluate_mt_bench, select_questions, trace_mt_bench
from eagle31.eval.speculative import speculative_generate
from eagle31_cli import parse_key_values
from tests.helpers import tiny_drafter
from tests.speculative_helpers import VOCAB, naive_greedy, save_target, tiny_tokenizer
from tests.tiny_targets import drafter_sized_llama

main = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "eval_acceptance.py"))["main"]

QUESTIONS = [
    MTBenchQuestion(1, "writing", ["write a python function", "return the sum of two"]),
    MTBenchQuestion(2, "math", ["the sum of x", "list the two"]),
    MTBenchQuestion(3, "writing", ["you are a helpful assistant", "code the def"]),
]


def write_questions(path, questions=QUESTIONS, extra=()):
    rows = [json.dumps({"question_id": q.question_id, "category": q.category, "turns": q.turns}) for q in questions]
    path.write_text("\n".join(rows + list(extra)) + "\n")
    return path


def test_turn_two_carries_turn_one_and_the_targets_own_answer():
    target, tok = drafter_sized_llama(dtype=torch.float32), tiny_tokenizer()
    drafter = tiny_drafter(vocab_size=VOCAB, dtype=torch.float32)
    eos = [tok.eos_token_id]
    turns = trace_mt_bench(
        target,
        tok,
        QUESTIONS[:2],
        aux_layer_ids=drafter.config.aux_layer_ids,
        max_new_tokens=6,
        draft_len=3,
        eos_token_ids=eos,
        system_prompt="you are a helpful assistant",
    )
    stats = evaluate_mt_bench(turns, EagleProposer(drafter), max_new_tokens=6, k=3, eos_token_ids=eos)

    expected = []
    for q in QUESTIONS[:2]:
        messages = [{"role": "system", "content": "you are a helpful assistant"}]
        for turn in q.turns:
            messages.append({"role": "user", "content": turn})
            prompt = tok(
                tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
            )["input_ids"]
            expected.append(prompt)
            answer = naive_greedy(target, torch.tensor(prompt), 6)[len(prompt) :].tolist()
            answer = answer[: answer.index(eos[0])] if eos[0] in answer else answer
            messages.append({"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)})
    assert [t.trace.tokens[: t.trace.prompt_len].tolist() for t in turns] == expected
    assert [t.category for t in turns] == ["writing", "writing", "math", "math"]
    assert "<|assistant|>" in tok.decode(expected[1]) and tok.decode(expected[1]).count("<|user|>") == 2
    assert set(stats) == {ALL, "writing", "math"}
    assert stats["writing"].prompts == stats["math"].prompts == 2 and stats[ALL].prompts == 4
    assert stats[ALL].rounds == stats["writing"].rounds + stats["math"].rounds
    assert stats[ALL].prompt_tokens == sum(map(len, expected))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_replayed_stats_equal_live_decoding(mode):
    """Per category, the replayed counts are those of live speculative decoding of the same prompts."""
    target, tok = drafter_sized_llama(dtype=torch.float32), tiny_tokenizer()
    drafter = tiny_drafter(vocab_size=VOCAB, dtype=torch.float32)
    tree = TreeSpec(top_k=2, depth=3, total_tokens=5) if mode == "tree" else None
    k, eos = (None if tree else 3), [tok.eos_token_id]
    turns = trace_mt_bench(
        target,
        tok,
        QUESTIONS,
        aux_layer_ids=drafter.config.aux_layer_ids,
        max_new_tokens=9,
        draft_len=3,
        eos_token_ids=eos,
    )
    replayed = evaluate_mt_bench(turns, EagleProposer(drafter), max_new_tokens=9, k=k, tree=tree, eos_token_ids=eos)
    live = {}
    for turn in turns:
        prompt = turn.trace.tokens[: turn.trace.prompt_len]
        generation = speculative_generate(
            target,
            EagleProposer(drafter),
            prompt,
            aux_layer_ids=drafter.config.aux_layer_ids,
            max_new_tokens=9,
            k=k,
            tree=tree,
            eos_token_ids=eos,
        )
        for key in (turn.category, ALL):
            live.setdefault(key, AcceptanceStats(draft_len=3)).add(generation, len(prompt))
    counts = ("prompts", "prompt_tokens", "rounds", "accepted", "accepted_at", "generated_tokens", "target_forwards")
    for key, stats in live.items():
        assert {c: getattr(replayed[key], c) for c in counts} == {c: getattr(stats, c) for c in counts}


def test_select_questions_keeps_the_first_of_each_category():
    assert [q.question_id for q in select_questions(QUESTIONS, 1)] == [1, 2]
    assert select_questions(QUESTIONS, None) == QUESTIONS


def test_config_modes_and_errors(tmp_path):
    target = save_target(tmp_path / "target")
    tiny_drafter(vocab_size=VOCAB, dtype=torch.float32).save(tmp_path / "d")
    base = [f"drafter={tmp_path}/d", f"target={target}"]
    config = parse_key_values(base + ["tree_top_k=2", "tree_depth=3", "tree_total_tokens=4"], MTBenchConfig)
    assert list(config.modes) == ["chain-k3", "chain-k5", "chain-k7", "tree-2x3-4"]
    assert list(parse_key_values(base + ["ks=2"], MTBenchConfig).modes) == ["chain-k2"]
    for bad, message in [
        (["ks=3,x"], "ks must be positive integers"),
        (["ks="], "nothing to run"),
        (["tree_top_k=2"], "needs all of tree_top_k"),
        (["max_new_tokens=0"], "max_new_tokens must be a positive integer"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_key_values(base + bad, MTBenchConfig)


@pytest.mark.slow
def test_script_end_to_end(tmp_path, capsys):
    target = save_target(tmp_path / "target")
    tiny_drafter(seed=0, vocab_size=VOCAB, dtype=torch.float32).save(tmp_path / "e31")
    tiny_drafter(seed=1, vocab_size=VOCAB, dtype=torch.float32, fc_norm=False, norm_output=False).save(tmp_path / "e3")
    questions = write_questions(tmp_path / "question.jsonl", extra=["{broken"])
    out = tmp_path / "mt"
    args = [
        "mtbench",
        f"drafter=eagle3={tmp_path}/e3,eagle31={tmp_path}/e31",
        f"target={target}",
        f"questions={questions}",
        "ks=2,3",
        "tree_top_k=2",
        "tree_depth=2",
        "tree_total_tokens=3",
        "max_new_tokens=5",
        f"out={out}",
        "device=cpu",
    ]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "skipped MT-Bench records: malformed 1" in captured.err
    report = json.loads((out / "mt_bench.json").read_text())
    assert report["settings"]["target_decoding_seconds"] > 0 and report["settings"]["target"] == str(target)
    keys = {(r["drafter"], r["mode"], r["split"]) for r in report["results"]}
    assert keys == {
        (d, m, s)
        for d in ("eagle3", "eagle31")
        for m in ("chain-k2", "chain-k3", "tree-2x2-3")
        for s in (ALL, "writing", "math")
    }
    for r in report["results"]:
        assert r["tau"] >= 1 and len(r["acceptance_rate"]) == (3 if r["mode"] == "chain-k3" else 2)
        if r["split"] == ALL:
            assert r["prompts"] == 6  # 3 questions x 2 turns
    table = (out / "mt_bench.md").read_text()
    assert "| drafter | mode | all | math | writing |" in table and "| eagle31 | tree-2x2-3 |" in table
    assert table.strip() in captured.out
    per_mode = json.loads((out / "chain-k3" / "acceptance.json").read_text())
    assert per_mode["settings"]["mode"] == "chain" and per_mode["settings"]["k"] == 3
    assert (out / "tree-2x2-3" / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    assert load_drafter(tmp_path / "e3").config.fc_norm is False

    history = tmp_path / "history.jsonl"
    history.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "write code " * 8},
                    {"role": "assistant", "content": "def x " * 8},
                ]
            }
        )
        + "\n"
    )
    long = args[:4] + ["ks=2", "max_new_tokens=3", f"history={history}", "history_tokens=30", f"out={out}/long"]
    assert main(long) == 0
    report = json.loads((out / "long" / "mt_bench.json").read_text())
    short = {
        (r["drafter"], r["split"]): r["mean_prompt_tokens"]
        for r in json.loads((out / "mt_bench.json").read_text())["results"]
        if r["mode"] == "chain-k2"
    }
    for r in report["results"]:
        assert r["mean_prompt_tokens"] > short[(r["drafter"], r["split"])] + 30
    assert "after >= 30 tokens of history" in (out / "long" / "mt_bench.md").read_text()

    assert main(["mtbench", f"drafter={tmp_path}/e3", f"target={target}", f"questions={tmp_path}/none.jsonl"]) == 2
    assert "FileNotFoundError" in capsys.readouterr().err
    assert main(args[:3] + ["ks=0"]) == 2
    assert capsys.readouterr().err.startswith("error: ks must be positive integers")


def test_long_histories_reach_the_length_and_alternate():
    from eagle31.data.sources import Conversation
    from eagle31.eval.acceptance import render
    from eagle31.eval.mtbench import long_histories

    tok = tiny_tokenizer()
    convs = [
        Conversation(
            [
                {"role": "system", "content": "you"},
                {"role": "user", "content": "write code"},
                {"role": "assistant", "content": "def x return y"},
                {"role": "user", "content": "dangling"},
            ]
        ),
        Conversation([{"role": "assistant", "content": "no user first"}]),
        Conversation([{"role": "user", "content": "list the sum"}, {"role": "assistant", "content": "sum of list"}]),
    ]
    histories = long_histories(tok, convs, count=3, min_tokens=20)
    assert len(histories) == 3
    for history in histories:
        assert [m["role"] for m in history] == ["user", "assistant"] * (len(history) // 2)
        assert len(render(tok, history, add_generation_prompt=False)) >= 20
    assert histories[1][0]["content"] == "list the sum"  # question i starts at conversation i (cyclically)
    with pytest.raises(ConfigError, match="shorter than history_tokens=500"):
        long_histories(tok, convs, count=1, min_tokens=500)


def test_prompts_render_with_the_template_kwargs_and_bad_ones_are_refused(kimi_tok, tmp_path):
    from eagle31.eval.acceptance import render

    messages = [{"role": "user", "content": "Hi"}]
    assert kimi_tok.decode(render(kimi_tok, messages)).endswith("<think>")
    assert kimi_tok.decode(render(kimi_tok, messages, template_kwargs={"thinking": False})).endswith("<think></think>")
    with pytest.raises(ConfigError, match="chat_template_kwargs must be a JSON object"):
        MTBenchConfig(drafter=str(tmp_path), target=str(tmp_path), chat_template_kwargs="{thinking: true}")
