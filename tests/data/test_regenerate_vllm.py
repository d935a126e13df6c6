"""Regeneration against a server that answers as vLLM 0.33 does (tests/data/vllm_like_server.py: vLLM's
own request validation, context-length check, errors, kimi_k2 reasoning parser and response models),
with the Kimi K2.6 chat template: reasoning kept through the turns and supervised as the template
renders it, cut replies, errors counted or stopping the run, restarts, the pool, a killed run resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle31.data.chat import ChatEncoder
from eagle31.data.regenerate.backends import EndpointBackend
from eagle31.data.regenerate.core import RegenerateError, ServerRefusedError, Settings, request_seed
from eagle31.data.regenerate.pool import regenerate
from eagle31.data.regenerate.shards import prepare_output, write_report
from eagle31.data.sources import Conversation, Tally, read_conversations
from eagle31_cli import recipe_main
from tests.data.chat_helpers import supervised_spans, write_jsonl
from tests.data.vllm_like_server import VLLMLikeServer
from tests.peers import peer_python

pytestmark = pytest.mark.slow  # a vLLM process to start (~20 s on 2 cores), a killed run, restarts: ~100 s in all
ROOT = Path(__file__).resolve().parents[2]
THINKING = {"thinking": True, "preserve_thinking": True}  # recipe=kimi_k26's data.chat_template_kwargs
SYSTEM_PROMPT = "You are a careful assistant."
BASE = {
    "max_model_len": 512,
    "reasoning_parser": "kimi_k2",
    "reasoning_field": "reasoning",
    "latency_s": 0.0,
    "gather_in_flight": 0,
    "refuse_parameter": None,
    "answer_words": 0,
}


@pytest.fixture(scope="module")
def server(kimi_tok, tmp_path_factory):
    python = peer_python("0.33.0")
    work = tmp_path_factory.mktemp("vllm_like")
    kimi_tok.save_pretrained(work / "tokenizer")
    with VLLMLikeServer(python, {"tokenizer": str(work / "tokenizer"), "model": "kimi-k2.6-test", **BASE}, work) as s:
        yield s


@pytest.fixture
def srv(server):
    server.control(**BASE)  # every test starts from the same behaviour
    return server


def chats(*turns_per_conversation: list[str]) -> list[Conversation]:
    out = []
    for n, users in enumerate(turns_per_conversation):
        messages = []
        for u in users:
            messages += [
                {"role": "user", "content": u},
                {"role": "assistant", "content": "an answer from another model"},
            ]
        out.append(Conversation(messages, where=f"chats.jsonl:{n + 1}"))
    return out


def load_cli():
    """data_prep/regenerate.py as a module (its `main` and `RECIPES`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("regenerate_cli", ROOT / "data_prep" / "regenerate.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def run(conversations, backend, out, settings):
    prepare_output(out, settings, {"sources": ["chats.jsonl"]})
    counts = regenerate(conversations, backend, out, settings)
    records = [
        json.loads(line) for p in sorted((out / "conversations").glob("*.jsonl")) for line in p.read_text().splitlines()
    ]
    return counts, records, write_report(out, Tally(), len(conversations))


def turn_spans(encoder, messages) -> list[str]:
    """The supervised text of each assistant turn, in order, as prepare's mask selects it."""
    return supervised_spans(encoder.tokenizer, *encoder.encode(Conversation(messages)))


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])  # vLLM 0.33; SGLang and older vLLM
def test_thinking_replies_keep_their_reasoning_through_the_turns_and_prepare_supervises_it(
    srv, kimi_tok, tmp_path, field
):
    srv.control(reasoning_field=field)
    settings = Settings(
        max_new_tokens=120, shard_size=2, chat_template_kwargs=THINKING, system_prompts=[SYSTEM_PROMPT], temperature=0.7
    )
    conversations = chats(["two plus two", "and times three"], ["hello"], ["name a colour", "another", "one more"])
    counts, records, report = run(
        conversations, EndpointBackend(srv.url, settings, concurrency=4), tmp_path / "out", settings
    )

    assert counts == {"written": 2, "skipped": 0} and len(records) == 3
    assert report["turns"] == report["reasoning_turns"] == 6 and report["replies_cut"] == 0 and not report["dropped"]
    for index, (record, original) in enumerate(zip(records, conversations)):
        messages = record["messages"]
        assert messages[0] == {"role": "system", "content": SYSTEM_PROMPT}  # the prompt training renders
        users = [m["content"] for m in original.messages if m["role"] == "user"]
        for turn, user in enumerate(users):
            prompt, reply = messages[: 2 + 2 * turn], messages[2 + 2 * turn]
            # the server saw the regenerated history, reasoning included, rendered by Kimi's template
            rendered = kimi_tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **THINKING)
            n_prompt = len(kimi_tok(rendered, add_special_tokens=False)["input_ids"])
            seed = request_seed(0, index, turn)
            assert reply == {
                "role": "assistant",
                "content": f"The answer to {user} is {n_prompt}.",
                "reasoning_content": f"Turn {turn + 1}: the user asks {user}; seed {seed}.",
            }

    tally = Tally()
    read = list(read_conversations([str(tmp_path / "out" / "conversations")], tally))
    encoder = ChatEncoder(kimi_tok, template_kwargs=THINKING, system_prompt=SYSTEM_PROMPT)
    for conversation in read:
        replies = [m for m in conversation.messages if m["role"] == "assistant"]
        # each turn supervises what the target generated after `<think>`: reasoning, `</think>`, answer, end of turn
        expected = [f"{m['reasoning_content']}</think>{m['content']}<|im_end|>" for m in replies]
        assert turn_spans(encoder, conversation.messages) == expected
    assert encoder.reasoning.turns == 6 and encoder.reasoning.unrendered_turns == 0


def test_a_server_without_a_reasoning_parser_is_seen_in_the_report(srv, tmp_path):
    srv.control(reasoning_parser=None)  # vLLM's default skip_special_tokens drops `</think>`: one merged text
    settings = Settings(max_new_tokens=120, chat_template_kwargs=THINKING)
    _, records, report = run(chats(["two plus two"]), EndpointBackend(srv.url, settings), tmp_path / "out", settings)
    assert report["turns"] == 1 and report["reasoning_turns"] == 0
    assert records[0]["messages"][-1]["content"].startswith("Turn 1: the user asks two plus two")


@pytest.mark.parametrize("on_length", ["drop", "keep"])
def test_replies_cut_at_max_tokens_follow_on_length(srv, kimi_tok, tmp_path, on_length):
    settings = Settings(max_new_tokens=40, shard_size=8, chat_template_kwargs=THINKING, on_length=on_length)
    # a reply to "hi" is 30 tokens; one to a long question is cut while thinking (its reasoning repeats the question)
    conversations = chats(
        ["hi", "please explain at great length why the sky is blue " * 2], ["please explain why the sea is salty " * 3]
    )
    _, records, report = run(conversations, EndpointBackend(srv.url, settings), tmp_path / "out", settings)
    assert report["replies_cut"] == 2
    if on_length == "drop":
        assert [len(r["messages"]) for r in records] == [2]  # the conversation ends before its cut reply
        assert report["dropped"]["reply_cut"]["count"] == 1 and report["truncated"]["reply_cut"]["count"] == 1
        return
    assert [len(r["messages"]) for r in records] == [4, 2]
    for record in records:
        cut = record["messages"][-1]
        assert (
            cut["finish_reason"] == "length" and cut["content"] == "" and cut["reasoning_content"].startswith("Turn ")
        )
    [conversation, _] = read_conversations([str(tmp_path / "out" / "conversations")], Tally())
    spans = turn_spans(ChatEncoder(kimi_tok, template_kwargs=THINKING), conversation.messages)
    whole, cut = conversation.messages[1], conversation.messages[3]
    # a cut reply supervises what was generated, not the `</think>` and end of turn the template closes it with
    assert spans == [f"{whole['reasoning_content']}</think>{whole['content']}<|im_end|>", cut["reasoning_content"]]


def test_only_the_context_length_error_counts_as_too_long(srv, tmp_path):
    settings = Settings(max_new_tokens=60, shard_size=4, chat_template_kwargs=THINKING)
    long = "word " * 300  # 901 tokens: over max_model_len 512
    conversations = chats([long], ["hi", long], ["hi"])
    _, records, report = run(conversations, EndpointBackend(srv.url, settings), tmp_path / "out", settings)
    assert report["dropped"] == {"prompt_too_long": {"count": 1, "examples": ["chats.jsonl:1"]}}
    assert report["truncated"] == {"prompt_too_long": {"count": 1, "examples": ["chats.jsonl:2 (after 1 turns)"]}}
    assert [r["source"] for r in records] == ["chats.jsonl:2", "chats.jsonl:3"] and report["complete"]


@pytest.mark.parametrize("problem", ["unknown_parameter", "max_tokens_over_the_context"])
def test_any_other_4xx_stops_at_the_first_request_and_a_rerun_writes_everything(srv, tmp_path, problem, capsys):
    good = Settings(max_new_tokens=60, shard_size=1, chat_template_kwargs=THINKING)
    settings = good
    if problem == "unknown_parameter":
        srv.control(refuse_parameter="seed")
        match = r"HTTP 400: Unsupported request parameter: seed"
    else:
        settings = Settings(max_new_tokens=1000, shard_size=1, chat_template_kwargs=THINKING)
        match = r"HTTP 400: max_tokens=1000 cannot be greater than max_model_len=512"
    conversations = chats(["hi"], ["hello"], ["hey"], ["yo"])
    before = srv.stats()["requests"]
    out = tmp_path / "out"
    prepare_output(out, settings, {"sources": ["x"]})
    with pytest.raises(ServerRefusedError, match=match):
        regenerate(conversations, EndpointBackend(srv.url, settings, concurrency=4), out, settings)
    assert srv.stats()["requests"] - before == 1  # stopped at the first request
    assert not list((out / "conversations").iterdir()) and not list((out / "stats").iterdir())
    if problem == "unknown_parameter":  # the command line: one line, exit code 2, no shard
        source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c.messages} for c in conversations])
        args = [
            "recipe=kimi_k26_mini",
            f"output_dir={tmp_path / 'cli'}",
            f"regenerate.source={source}",
            "regenerate.backend=endpoint",
            f"regenerate.endpoint={srv.url}",
            "regenerate.max_new_tokens=60",
        ]
        cli = load_cli()
        assert recipe_main(cli.main, cli.RECIPES, args) == 2
        err = [
            line
            for line in capsys.readouterr().err.splitlines()
            if line.strip() and not line.startswith("regenerate (rank")
        ]
        assert (
            len(err) == 1
            and "the server refused a request with HTTP 400: Unsupported request parameter: seed" in err[0]
        )
        assert not list((tmp_path / "cli" / "regenerated" / "conversations").iterdir())

    srv.control(refuse_parameter=None)  # the server fixed (or the setting): nothing was skipped for good
    counts, records, report = run(conversations, EndpointBackend(srv.url, good), tmp_path / "fixed", good)
    assert counts == {"written": 4, "skipped": 0} and len(records) == 4 and report["complete"]


def test_a_server_restart_within_the_window_loses_nothing_and_one_beyond_it_keeps_finished_shards(srv, tmp_path):
    settings = Settings(max_new_tokens=60, shard_size=2, chat_template_kwargs=THINKING)
    conversations = chats(*[[f"question {i}", "and then?"] for i in range(6)])
    _, whole, _ = run(conversations, EndpointBackend(srv.url, settings, concurrency=2), tmp_path / "whole", settings)

    srv.control(down_s=2.0)  # the port is closed when this returns, for 2 s
    backend = EndpointBackend(
        srv.url, settings, model="kimi-k2.6-test", concurrency=2, retries=1, backoff_s=0.1, restart_window_s=30
    )
    _, records, report = run(conversations, backend, tmp_path / "waited", settings)
    assert records == whole and report["complete"]

    srv.control(latency_s=0.5)
    out = tmp_path / "failed"
    prepare_output(out, settings, {"sources": ["chats.jsonl"]})
    impatient = EndpointBackend(
        srv.url, settings, model="kimi-k2.6-test", concurrency=2, retries=1, backoff_s=0.1, restart_window_s=0.5
    )
    downs: list[int] = []

    def down_after_the_first_shard(n: int) -> None:  # called once a shard is written
        if not downs:
            downs.append(n)
            srv.control(down_s=4.0)  # mid-run, for longer than the window (and its retries) and until it returns

    with pytest.raises(RegenerateError, match=r"failed \d+ times over \d+ s: URLError: .*Connection refused"):
        regenerate(conversations, impatient, out, settings, progress=down_after_the_first_shard)
    written = sorted(p.name for p in (out / "conversations").iterdir())
    assert downs and 0 < len(written) < 3  # the first shard before the server went down; never the last
    srv.wait_up()
    srv.control(latency_s=0.0)
    counts, records, report = run(conversations, EndpointBackend(srv.url, settings, concurrency=2), out, settings)
    assert counts["skipped"] == len(written) and records == whole and report["complete"]


def test_one_pool_keeps_concurrency_requests_in_flight_across_shards(srv, tmp_path):
    """The server holds the first requests until `concurrency` of them are in flight together (at most 60 s):
    a pool that kept fewer in flight, or one shard's conversations only, would never get there."""
    concurrency, shard_size = 16, 3
    srv.control(gather_in_flight=concurrency, reset_stats=True)
    settings = Settings(max_new_tokens=60, shard_size=shard_size, chat_template_kwargs=THINKING)
    conversations = chats(*[[f"question {i}", "and then?"] for i in range(40)])
    _, records, report = run(
        conversations, EndpointBackend(srv.url, settings, concurrency=concurrency), tmp_path / "out", settings
    )
    turns = 2 * len(conversations)
    assert [r["source"] for r in records] == [c.where for c in conversations] and report["turns"] == turns
    assert srv.stats()["max_in_flight"] == concurrency > shard_size  # more than one shard at a time
    assert srv.stats()["requests"] == turns


def test_a_killed_run_resumes_without_losing_or_duplicating_a_conversation(srv, tmp_path):
    srv.control(latency_s=0.5)
    source = write_jsonl(
        tmp_path / "chats.jsonl",
        [{"messages": c.messages} for c in chats(*[[f"question {i}", "more?"] for i in range(24)])],
    )
    args = [
        "recipe=kimi_k26_mini",
        f"output_dir={tmp_path / 'run'}",
        f"regenerate.source={source}",
        "regenerate.backend=endpoint",
        f"regenerate.endpoint={srv.url}",
        "regenerate.shard_size=2",
        "regenerate.concurrency=4",
        "regenerate.max_new_tokens=60",
        f"data.system_prompt='{SYSTEM_PROMPT}'",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "data_prep" / "regenerate.py"), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    shards = tmp_path / "run" / "regenerated" / "conversations"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(shards.glob("*.jsonl")) if shards.is_dir() else []) < 2:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = len(list(shards.glob("*.jsonl")))
    assert 2 <= written < 12

    cli = load_cli()
    assert recipe_main(cli.main, cli.RECIPES, args) == 0
    report = json.loads((tmp_path / "run" / "regenerated" / "report.json").read_text())
    assert report["complete"] and report["conversations_in"] == 24 and report["conversations_out"] == 24
    records = [json.loads(line) for p in sorted(shards.glob("*.jsonl")) for line in p.read_text().splitlines()]
    assert [r["source"] for r in records] == [f"{source}:{n}" for n in range(1, 25)]  # each once, in order

    settings = Settings(max_new_tokens=60, shard_size=2, chat_template_kwargs=THINKING, system_prompts=[SYSTEM_PROMPT])
    fresh = [json.loads(line) for line in source.read_text().splitlines()]
    conversations = [Conversation(f["messages"], where=f"{source}:{n}") for n, f in enumerate(fresh, start=1)]
    _, whole, _ = run(conversations, EndpointBackend(srv.url, settings, concurrency=4), tmp_path / "whole", settings)
    assert records == whole
