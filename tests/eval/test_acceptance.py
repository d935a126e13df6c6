"""Acceptance evaluation: the metrics, prompts, arguments and the script end to end."""

import json
import runpy
from pathlib import Path

import pytest
import torch

from eagle31.convert import load_drafter
from eagle31.errors import ConfigError
from eagle31.eval.acceptance import (
    AcceptanceConfig,
    AcceptanceStats,
    check_drafter_fits,
    evaluate,
    greedy_traces,
    load_prompts,
    share_target_embedding,
)
from eagle31.eval.acceptance_report import format_table
from eagle31.eval.drafting import TreeSpec
from eagle31.eval.speculative import Generation
from eagle31.export import export_drafter
from eagle31_cli import parse_key_values
from tests.helpers import tiny_drafter
from tests.speculative_helpers import AUX, VOCAB, Oracle, naive_greedy, save_target, tiny_tokenizer
from tests.tiny_targets import drafter_sized_llama

# the script's main(argv), run in-process
main = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "eval_acceptance.py"))["main"]


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# ---------------------------------------------------------------------- metrics


def test_stats_follow_vllms_definitions():
    stats = AcceptanceStats(draft_len=3)
    stats.add(Generation(tokens=list(range(9)), accepted=[3, 1, 0, 2], target_forwards=5, seconds=2.0), 10)
    stats.add(Generation(tokens=list(range(3)), accepted=[1, 0], target_forwards=3, seconds=1.0), 20)
    s = stats.summary()
    assert s["rounds"] == 6 and s["accepted"] == 7
    assert s["tau"] == pytest.approx(1 + 7 / 6)
    assert s["acceptance_rate"] == pytest.approx([4 / 6, 2 / 6, 1 / 6])  # accepted >= 1, 2, 3
    assert s["conditional_acceptance_rate"] == pytest.approx([4 / 6, 2 / 4, 1 / 2])
    assert s["tau"] == pytest.approx(1 + sum(s["acceptance_rate"]))
    assert s["target_forwards_per_token"] == pytest.approx(8 / 12)
    assert s["tokens_per_second"] == pytest.approx(12 / 3)
    assert s["mean_prompt_tokens"] == 15


@pytest.mark.parametrize("tree", [None, TreeSpec(top_k=2, depth=3, total_tokens=6)])
def test_oracle_tau_is_k_plus_1_and_a_wrong_one_gets_1(tree):
    target = drafter_sized_llama()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (4, 9)]
    k, new = 3, 10
    refs = {p.numel(): naive_greedy(target, p, new + k + 1) for p in prompts}

    class PerPrompt(Oracle):  # the right reference for whichever prompt comes next
        def __init__(self, good):
            super().__init__(None, good)

        def extend(self, aux, next_tokens):
            if self.length == 0:
                self.ref = refs[next_tokens.numel()]
            super().extend(aux, next_tokens)

    traces = greedy_traces(target, [p.tolist() for p in prompts], aux_layer_ids=AUX, length=new + k)

    def tau(good, traces=None):
        stats = evaluate(
            target,
            PerPrompt(good),
            [p.tolist() for p in prompts],
            aux_layer_ids=AUX,
            max_new_tokens=new,
            k=None if tree else k,
            tree=tree,
            traces=traces,
        )
        return {key: v for key, v in stats.summary().items() if key not in ("seconds", "tokens_per_second")}

    right = tau(lambda r, k: k)
    assert right["tau"] == k + 1
    assert right["acceptance_rate"] == [1.0] * k
    wrong = tau(lambda r, k: 0)
    assert wrong["tau"] == 1
    assert wrong["target_forwards_per_token"] == 1.0  # no speed-up: one forward per token
    # verified from the target's greedy decoding of each prompt: the same counts
    some = lambda r, k: r % (k + 1)  # noqa: E731
    assert tau(some, traces) == tau(some) and 1 < tau(some)["tau"] < k + 1
    assert tau(lambda r, k: k, traces) == right


# ---------------------------------------------------------------------- prompts


def test_prompts_use_the_chat_template_without_the_answer(tmp_path):
    tok = tiny_tokenizer()
    chat = [{"role": "system", "content": "you are a helpful assistant"}, {"role": "user", "content": "write code"}]
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"messages": chat + [{"role": "assistant", "content": "def x"}]},
            "",
            {"conversations": [{"from": "human", "value": "write code"}]},
            {"prompt": "the sum of two"},
        ],
    )
    prompts = load_prompts(path, tok)
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompts[0] == tok(rendered, add_special_tokens=False)["input_ids"]
    assert tok.decode(prompts[1]) == "<s> <|user|> write code <end> <|assistant|>"
    assert prompts[2] == tok("the sum of two")["input_ids"]
    assert len(load_prompts(path, tok, max_prompts=2)) == 2


def test_prompts_are_rendered_with_the_template_options_training_used(tmp_path):
    from eagle31.targets.kimi_tokenizer import build_kimi_tokenizer

    tok = build_kimi_tokenizer()
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet them"},
        {"role": "user", "content": "2+2?"},
    ]
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": history}])
    [default] = load_prompts(path, tok)
    [kept] = load_prompts(path, tok, template_kwargs={"preserve_thinking": True})
    assert "greet them" not in tok.decode(default) and "<think>greet them</think>Hello!" in tok.decode(kept)
    [instant] = load_prompts(path, tok, template_kwargs={"thinking": False})
    assert tok.decode(instant).endswith("<|im_assistant|>assistant<|im_middle|><think></think>")


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"p.jsonl:2: invalid JSON"),
        ('{"text": "hi"}', r"p.jsonl:2: not a prompt"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}', r"p.jsonl:2: no messages"),
    ],
)
def test_bad_prompt_lines_are_named(tmp_path, line, message):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}, line])
    with pytest.raises(ConfigError, match=message):
        load_prompts(path, tiny_tokenizer())


# ---------------------------------------------------------------------- arguments


def test_arguments(tmp_path):
    for d in ("t", "d1", "d2", "corpus"):
        (tmp_path / d).mkdir()
    for split in ("heldout", "long_prompt"):
        write_jsonl(tmp_path / "corpus" / f"{split}.jsonl", [{"prompt": "x"}])
    base = [f"drafter={tmp_path}/d1,e31={tmp_path}/d2", f"target={tmp_path}/t", f"data={tmp_path}/corpus"]
    cfg = parse_key_values(base + ["k=5"], AcceptanceConfig)
    assert cfg.drafters == {"d1": f"{tmp_path}/d1", "e31": f"{tmp_path}/d2"}
    assert list(cfg.splits) == ["heldout", "long_prompt"]
    assert cfg.k == 5 and cfg.tree is None
    named = parse_key_values(
        base[:2]
        + [
            f"data=long={tmp_path}/corpus/long_prompt.jsonl",
            "tree_top_k=4",
            "tree_depth=3",
            "tree_total_tokens=10",
            "max_prompts=2",
        ],
        AcceptanceConfig,
    )
    assert named.splits == {"long": f"{tmp_path}/corpus/long_prompt.jsonl"}
    assert named.tree == TreeSpec(4, 3, 10) and named.max_prompts == 2 and named.template_kwargs == {}
    options = parse_key_values(base + ['chat_template_kwargs={"preserve_thinking": true}'], AcceptanceConfig)
    assert options.template_kwargs == {"preserve_thinking": True}
    for bad, message in [
        (["kk=3"], "unknown argument 'kk'"),
        (["k=0"], "k must be a positive integer"),
        (["max_new_tokens=lots"], "max_new_tokens must be an integer"),
        (["tree_top_k=2"], "needs all of tree_top_k"),
        (["tree_top_k=2", "tree_depth=0", "tree_total_tokens=3"], "tree.depth must be a positive integer"),
        ([f"drafter={tmp_path}/nope"], "drafter nope: not a directory"),
        ([f"drafter={tmp_path}/d1,{tmp_path}/d1"], "label 'd1' given twice"),
        ([f"data={tmp_path}/corpus/none.jsonl"], "data none: prompt file not found"),
        (["chat_template_kwargs={thinking: false}"], "chat_template_kwargs must be a JSON object"),
        (['chat_template_kwargs={"tools": []}'], "'tools' is an argument of apply_chat_template"),
    ]:
        args = [a for a in base if a.split("=")[0] not in {b.split("=")[0] for b in bad}] + bad
        with pytest.raises(ConfigError, match=message):
            parse_key_values(args, AcceptanceConfig)
    with pytest.raises(ConfigError, match="missing required argument"):
        parse_key_values(base[:2], AcceptanceConfig)


# ---------------------------------------------------------------------- drafter and target


def test_a_drafter_saved_without_embedding_reads_the_targets(tmp_path):
    target = drafter_sized_llama(dtype=torch.float32)
    own = tiny_drafter(vocab_size=VOCAB, dtype=torch.float32)
    own.save(tmp_path / "with")
    own.save(tmp_path / "without", include_embed=False)
    kept = share_target_embedding(load_drafter(tmp_path / "with"), target)
    torch.testing.assert_close(kept.embed_tokens.weight, own.embed_tokens.weight)
    export_drafter(
        own,
        tmp_path / "speculators",
        "speculators",
        dtype="float32",
        include_embed=False,
        target_name_or_path="org/target",
    )  # vLLM's layout without the embedding
    for name in ("without", "speculators"):
        shared = share_target_embedding(load_drafter(tmp_path / name), target)
        torch.testing.assert_close(shared.embed_tokens.weight, target.get_input_embeddings().weight)


def test_a_drafter_for_another_target_is_refused():
    drafter = tiny_drafter(vocab_size=VOCAB)
    target = drafter_sized_llama().config.to_dict()
    check_drafter_fits(drafter.config, target, "d")
    with pytest.raises(ConfigError, match="drafter d: vocab_size=40 but the target's vocab_size=50"):
        check_drafter_fits(drafter.config, {**target, "vocab_size": 50}, "d")
    with pytest.raises(ConfigError, match="out of range for a 4-layer target"):
        check_drafter_fits(drafter.config, {**target, "num_hidden_layers": 4}, "d")


# ---------------------------------------------------------------------- the script


@pytest.mark.slow
def test_script_end_to_end(tmp_path, capsys):
    target_dir = save_target(tmp_path / "target")
    tiny_drafter(seed=0, vocab_size=VOCAB, dtype=torch.float32).save(tmp_path / "a")
    # b: vLLM's speculators layout, without the embedding (it takes the target's)
    export_drafter(
        tiny_drafter(seed=1, vocab_size=VOCAB),
        tmp_path / "b",
        "speculators",
        dtype="float32",
        include_embed=False,
        target_name_or_path="org/target",
    )
    data = write_jsonl(
        tmp_path / "heldout.jsonl",
        [{"messages": [{"role": "user", "content": "write a python function"}]}, {"prompt": "the sum of two"}],
    )
    other = write_jsonl(tmp_path / "other.jsonl", [{"prompt": "def x in list"}])
    out = tmp_path / "report"
    args = [
        f"drafter={tmp_path}/a,{tmp_path}/b",
        f"target={target_dir}",
        f"data={data},sys={other}",
        "k=2",
        "max_new_tokens=6",
        f"out={out}",
        "device=cpu",
    ]
    assert main(args) == 0
    report = json.loads((out / "acceptance.json").read_text())
    assert [(r["drafter"], r["split"]) for r in report["results"]] == [
        ("a", "heldout"),
        ("a", "sys"),
        ("b", "heldout"),
        ("b", "sys"),
    ]
    for r in report["results"]:
        assert r["tau"] >= 1 and len(r["acceptance_rate"]) == 2
        assert r["generated_tokens"] == 6 * r["prompts"]  # the tiny target never says <end>
    assert (out / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert format_table(report) in printed and "acc@2" in printed
    assert format_table(report).startswith("Greedy speculative decoding (drafting=auto, k=2, max_new_tokens=6)")
    assert (out / "acceptance.md").read_text().strip() == format_table(report)
    # the tree option, and an error before any weights are read
    tree = ["tree_top_k=2", "tree_depth=2", "tree_total_tokens=3", f"out={out}/tree"]
    assert main([f"drafter={tmp_path}/b", args[1], f"data={other}"] + tree) == 0
    assert json.loads((out / "tree" / "acceptance.json").read_text())["settings"]["mode"] == "tree"
    assert main(args + ["tree_top_k=2"]) == 2
    assert "needs all of tree_top_k" in capsys.readouterr().err


def test_out_set_to_a_folder_of_the_user_is_refused_before_decoding(tmp_path, capsys):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep")
    target_dir = save_target(tmp_path / "target")
    tiny_drafter(seed=0, vocab_size=VOCAB, dtype=torch.float32).save(tmp_path / "a")
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "the sum of two"}])
    args = [f"drafter={tmp_path}/a", f"target={target_dir}", f"data={data}", f"out={user}", "device=cpu"]
    assert main(args) == 2
    assert "did not write" in capsys.readouterr().err
    assert [p.name for p in user.iterdir()] == ["notes.txt"]


@pytest.mark.slow
def test_replayed_verification_counts_as_live(tmp_path):
    """verification=replay decodes each prompt once and gives every drafter the counts live decoding gives."""
    target_dir = save_target(tmp_path / "target")
    for seed in (0, 1):
        tiny_drafter(seed=seed, vocab_size=VOCAB, dtype=torch.float32).save(tmp_path / f"d{seed}")
    data = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "the sum of two"}, {"prompt": "def x in list"}, {"prompt": "write"}]
    )
    base = [
        f"drafter={tmp_path}/d0,{tmp_path}/d1",
        f"target={target_dir}",
        f"data={data}",
        "k=3",
        "max_new_tokens=12",
        "device=cpu",
    ]
    reports = {}
    for mode in ("live", "replay"):
        assert main([*base, f"verification={mode}", f"out={tmp_path / mode}"]) == 0
        reports[mode] = json.loads((tmp_path / mode / "acceptance.json").read_text())
    assert reports["replay"]["settings"]["verification"] == "replay"
    assert "drafting tok/s" in format_table(reports["replay"]) and "drafting tok/s" not in format_table(reports["live"])
    counts = ("drafter", "split", "rounds", "accepted", "accepted_at", "generated_tokens", "target_forwards", "tau")
    live, replay = ([{c: r[c] for c in counts} for r in reports[m]["results"]] for m in ("live", "replay"))
    assert replay == live  # the counts with accepted drafts: test_oracle_tau_is_k_plus_1_and_a_wrong_one_gets_1
    with pytest.raises(ConfigError, match="verification"):
        parse_key_values([*base, "verification=later"], AcceptanceConfig)
