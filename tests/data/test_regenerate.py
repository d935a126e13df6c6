"""Regeneration: the target's own replies, turn by turn, from both backends; resume, ranks, accounting."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from eagle31.data.regenerate.backends import EndpointBackend, HFBackend
from eagle31.data.regenerate.core import RegenerateError, Settings
from eagle31.data.regenerate.pool import regenerate
from eagle31.data.regenerate.shards import prepare_output, write_report
from eagle31.data.sources import Conversation, Tally, read_conversations
from eagle31.errors import ConfigError
from tests.data.chat_helpers import write_jsonl

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def conv(*users: str, system: bool = True, where: str = "") -> Conversation:
    messages = [SYSTEM] if system else []
    for n, u in enumerate(users):
        messages += [{"role": "user", "content": u}, {"role": "assistant", "content": f"original answer {n}"}]
    return Conversation(messages, where=where or users[0])


@pytest.fixture(scope="module")
def tiny_target(llama_tok, tmp_path_factory):
    """A random tiny Llama with the test chat tokenizer, saved as a target directory (context 96).

    A random model never writes `<|eot_id|>`; its eos is a token it writes third or fourth after
    the prompt (system, "Hi"), so that some replies end before `max_new_tokens` (that one within 4).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(llama_tok),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=96,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    text = llama_tok.apply_chat_template(
        [SYSTEM, {"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    ids = llama_tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        new = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)[0, ids.shape[1] :].tolist()
    eos = next(t for n, t in enumerate(new) if n >= 2 and t not in new[:n])  # a reply of 2 or 3 tokens
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    path = tmp_path_factory.mktemp("tiny_chat_target")
    model.save_pretrained(path)
    llama_tok.save_pretrained(path)
    return path


def greedy_reply(model, tok, messages, max_new_tokens: int) -> tuple[str, bool]:
    """The reference: the chat template, then one argmax step at a time, unbatched, to the eos or the limit.

    Returns (text, cut at the limit)."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    new = []
    eos = model.config.eos_token_id
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
            if nxt == eos:
                return tok.decode(new, skip_special_tokens=True), False
            new.append(nxt)
    return tok.decode(new, skip_special_tokens=True), True


def run(conversations, backend, out, settings, **kw):
    prepare_output(out, settings, {"sources": ["x"]})
    regenerate(conversations, backend, out, settings, **kw)
    return [
        json.loads(line) for p in sorted((out / "conversations").glob("*.jsonl")) for line in p.read_text().splitlines()
    ]


@pytest.mark.parametrize("on_length", ["drop", "keep"])
def test_hf_replies_are_the_targets_greedy_turns_on_the_regenerated_history(tiny_target, tmp_path, on_length):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    settings = Settings(max_new_tokens=2, shard_size=2, on_length=on_length)
    backend = HFBackend(tiny_target, settings, batch_size=3)
    conversations = [
        conv("Hello there", "What is two plus two?"),
        conv("Tell me the weather", system=False),
        conv("Hi", "And?", "Bye"),
        conv("Hello", "Go on", "More"),
    ]
    records = run(conversations, backend, tmp_path / "out", settings)

    model, tok = AutoModelForCausalLM.from_pretrained(tiny_target).eval(), AutoTokenizer.from_pretrained(tiny_target)
    expected_records, cuts = [], 0
    for original in conversations:
        expected, users = [], [m for m in original.messages if m["role"] == "user"]
        if original.messages[0]["role"] == "system":
            expected.append(SYSTEM)
        for user in users:
            # turn j sees the regenerated replies of turns < j, never the dataset's
            text, cut = greedy_reply(model, tok, expected + [user], 2)
            cuts += cut
            if cut and on_length == "drop":
                break  # the conversation ends before a cut reply
            expected += [user, {"role": "assistant", "content": text} | ({"finish_reason": "length"} if cut else {})]
            if cut:
                break  # kept, and the conversation ends with it
        if any(m["role"] == "assistant" for m in expected):
            expected_records.append({"messages": expected, "source": original.where})
    assert 0 < cuts and records == expected_records
    assert "original answer" not in json.dumps(records)
    report = write_report(tmp_path / "out", Tally(), len(conversations))
    assert report["replies_cut"] == cuts and report["conversations_out"] == len(expected_records)
    if on_length == "drop":
        lost = report["dropped"].get("reply_cut", {}).get("count", 0) + report["truncated"].get("reply_cut", {}).get(
            "count", 0
        )
        assert lost == cuts


def test_sampling_is_seeded_per_request_and_differs_from_greedy(tiny_target):
    greedy = HFBackend(tiny_target, Settings(max_new_tokens=8))
    sampled = HFBackend(tiny_target, Settings(max_new_tokens=8, temperature=1.5))
    prompt = [[SYSTEM, {"role": "user", "content": "Hello there"}]] * 4
    a, b, c = (sampled.generate(prompt, seeds) for seeds in ([1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]))
    assert [r.content for r in a] == [r.content for r in b]
    assert [r.content for r in a] != [r.content for r in c]
    assert len({r.content for r in a}) > 1  # rows sample independently
    # a reply depends on its own seed, not on the batch it ran in
    assert [sampled.complete(prompt[0], seed).content for seed in (3, 1)] == [a[2].content, a[0].content]
    assert len({r.content for r in greedy.generate(prompt, [1, 2, 3, 4])}) == 1


def test_hf_replies_split_reasoning_on_the_templates_think_markers(kimi_tok):
    from eagle31.data.chat import split_reasoning, think_markers

    think = think_markers(kimi_tok)
    ids = lambda text: kimi_tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    opened = ids("<|im_assistant|>assistant<|im_middle|><think>")  # Kimi's generation prompt in thinking mode
    closed = ids("<|im_assistant|>assistant<|im_middle|><think></think>")  # instant mode
    assert split_reasoning(opened, ids("I add them.</think>Four."), think) == (ids("I add them."), ids("Four."))
    assert split_reasoning(opened, ids("I add them and"), think) == (ids("I add them and"), [])  # cut while thinking
    assert split_reasoning(closed, ids("Four."), think) == (None, ids("Four."))
    assert split_reasoning(closed, ids("<think>Hm.</think>Four."), think) == (
        ids("Hm."),
        ids("Four."),
    )  # opened by the reply
    assert split_reasoning(opened, ids("Four."), None) == (None, ids("Four."))  # a template without markers


def test_drops_and_truncations_are_counted(tiny_target, tmp_path):
    settings = Settings(max_new_tokens=4, shard_size=10)
    backend = HFBackend(tiny_target, settings)  # context 96 tokens: prompt + 4 must fit
    long = "the weather is sunny and warm " * 12
    tool = Conversation(
        [
            {"role": "user", "content": "w?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]},
            {"role": "tool", "content": "sunny"},
        ],
        where="tool",
    )
    no_user = Conversation([SYSTEM, {"role": "assistant", "content": "hi"}], where="no_user")
    conversations = [
        tool,
        no_user,
        conv(long, where="first_too_long"),
        conv("Hi", long, where="second_too_long"),
        conv("Hi", where="fine"),
    ]
    out = tmp_path / "out"
    records = run(conversations, backend, out, settings)
    report = write_report(out, Tally(), len(conversations))
    assert [r["source"] for r in records] == ["second_too_long", "fine"]
    assert [m["role"] for m in records[0]["messages"]] == ["system", "user", "assistant"]  # cut before the long turn
    assert {k: v["count"] for k, v in report["dropped"].items()} == {
        "tool_turns": 1,
        "no_user_turn": 1,
        "prompt_too_long": 1,
    }
    assert report["truncated"] == {"prompt_too_long": {"count": 1, "examples": ["second_too_long (after 1 turns)"]}}
    assert report["complete"] and report["conversations_in"] == 5 and report["conversations_out"] == 2


def test_max_prompt_tokens_drops_long_first_prompts(tiny_target, tmp_path):
    settings = Settings(max_new_tokens=2, max_prompt_tokens=50)
    backend = HFBackend(tiny_target, settings)
    short, long = [SYSTEM, {"role": "user", "content": "Hi"}], [SYSTEM, {"role": "user", "content": "Hi " * 8}]
    assert len(backend.prompt_ids(short)) <= 50 < len(backend.prompt_ids(long)) <= 96 - 2  # it fits the context
    statuses = [r.status for r in backend.generate([long, short], [0, 0])]
    assert statuses[0] == "too_long" and statuses[1] != "too_long"


class KilledAt:
    """Wraps a backend; raises, as a killed process stops, at the first request of conversation
    "Hello {at}" (None: never). Records the conversations asked."""

    def __init__(self, backend, at=None):
        self.backend, self.at, self.asked, self.workers = backend, at, [], 1

    def complete(self, messages, seed=0, template_options=None):
        user = next(m["content"] for m in messages if m["role"] == "user")
        if user == f"Hello {self.at}":
            raise KeyboardInterrupt("killed")
        self.asked.append(user)
        return self.backend.complete(messages, seed, template_options)


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_resume_after_a_kill_keeps_finished_shards_and_matches_one_run(tiny_target, tmp_path, temperature):
    settings = Settings(max_new_tokens=3, shard_size=2, temperature=temperature)
    backend = HFBackend(tiny_target, settings)
    conversations = [conv(f"Hello {i}", "And more?") for i in range(5)]  # 3 shards, 2 turns each
    whole = run(conversations, backend, tmp_path / "whole", settings)

    out = tmp_path / "killed"
    prepare_output(out, settings, {"sources": ["x"]})
    with pytest.raises(KeyboardInterrupt):
        regenerate(conversations, KilledAt(backend, at=2), out, settings)  # in shard 1
    assert sorted(p.name for p in (out / "conversations").iterdir()) == ["shard-00000.jsonl"]
    assert not write_report(out, Tally(), 5)["complete"]
    resumed_backend = KilledAt(backend)
    counts = regenerate(conversations, resumed_backend, out, settings)
    assert counts == {"written": 2, "skipped": 1} and not {"Hello 0", "Hello 1"} & set(resumed_backend.asked)
    resumed = [
        json.loads(line) for p in sorted((out / "conversations").glob("*.jsonl")) for line in p.read_text().splitlines()
    ]
    assert resumed == whole and write_report(out, Tally(), 5)["complete"]
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]


def test_a_resume_over_an_edited_source_is_refused_before_any_request(tiny_target, tmp_path):
    """Finished shards are of the conversations they were regenerated from: a source edited since (a conversation
    changed, or fewer of them) is refused in one line naming the shard, before anything is asked, instead of
    pairing old shards with new conversations."""
    settings = Settings(max_new_tokens=2, shard_size=2)
    backend = HFBackend(tiny_target, settings)
    conversations = [conv(f"Hello {i}") for i in range(6)]  # 3 shards
    out = tmp_path / "out"
    prepare_output(out, settings, {"sources": ["x"]})
    with pytest.raises(KeyboardInterrupt):
        regenerate(conversations, KilledAt(backend, at=4), out, settings)  # shards 0 and 1 written
    edited = [*conversations[:3], conv("Hello 3, edited"), *conversations[4:]]  # in shard 1
    asked = KilledAt(backend)
    with pytest.raises(
        ConfigError, match=r"shard-00001 was regenerated from other conversations than conversations 2-3 of the source"
    ):
        regenerate(edited, asked, out, settings)
    assert asked.asked == []
    assert regenerate(conversations, asked, out, settings) == {"written": 1, "skipped": 2}  # the same source resumes
    with pytest.raises(
        ConfigError, match=r"holds shard-00002, beyond the 2 shards of the 4 conversations of the source"
    ):
        regenerate(conversations[:4], asked, out, settings)


def test_a_resume_over_shards_without_a_record_of_their_inputs_says_so_before_any_request(tmp_path):
    """Shards written by an eagle31 that did not record their input: the refusal says that, names the folder
    and what to do, rather than calling the source edited."""
    from eagle31.data.regenerate.shards import ShardStats, write_shard

    settings = Settings(max_new_tokens=2, shard_size=2)
    conversations = [conv(f"Hello {i}") for i in range(4)]
    out = tmp_path / "out"
    prepare_output(out, settings, {"sources": ["x"]})
    write_shard(out, 0, [{"messages": conversations[0].messages}], ShardStats())
    stats = out / "stats" / "shard-00000.json"
    stats.write_text(json.dumps({k: v for k, v in json.loads(stats.read_text()).items() if k != "input_sha256"}))
    asked = KilledAt(None)
    with pytest.raises(ConfigError) as refused:
        regenerate(conversations, asked, out, settings)
    said = str(refused.value)
    assert said.startswith(
        f"{out}: shard-00000 was written by an older eagle31, without a record of the conversations it was "
        "regenerated from"
    ), said
    assert "edited" not in said and "a new regenerate.output_dir" in said
    assert asked.asked == []


def test_a_full_disk_during_regeneration_is_one_line_and_the_rerun_completes(tiny_target, small_disk):
    from eagle31.errors import DiskFullError
    from tests.helpers import fill_disk

    settings = Settings(max_new_tokens=3, shard_size=1)
    backend = HFBackend(tiny_target, settings)
    conversations = [conv(f"Hello {i}") for i in range(5)]
    out = small_disk / "regenerated"
    prepare_output(out, settings, {"sources": ["x"]})
    ballast = fill_disk(small_disk, leave_pages=3)  # room for a shard and a half (4 KiB pages: stats, then JSONL)
    with pytest.raises(
        DiskFullError,
        match=r"^the disk holding the regenerated shard .*shard-\d{5}.jsonl filled up; the finished shards are kept",
    ):
        regenerate(conversations, backend, out, settings)
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
    written = sorted(
        p.name for p in (out / "conversations").iterdir()
    )  # whole, or not there (the pool finishes shards in any order)
    assert 1 <= len(written) < 5
    for name in written:
        assert [json.loads(line) for line in (out / "conversations" / name).read_text().splitlines()]
    ballast.unlink()  # space freed
    assert write_report(out, Tally(), 5)["shards"]["done"] == len(
        written
    )  # a shard's stats alone are not taken for the shard
    assert regenerate(conversations, backend, out, settings) == {"written": 5 - len(written), "skipped": len(written)}
    assert write_report(out, Tally(), 5)["complete"]


def test_ranks_split_the_shards(tiny_target, tmp_path):
    settings = Settings(max_new_tokens=2, shard_size=1)
    backend = HFBackend(tiny_target, settings)
    conversations = [conv(f"Hello {i}") for i in range(5)]
    out = tmp_path / "out"
    prepare_output(out, settings, {"sources": ["x"]})
    assert regenerate(conversations, backend, out, settings, rank=1, world_size=2) == {"written": 2, "skipped": 0}
    assert sorted(p.stem for p in (out / "conversations").iterdir()) == ["shard-00001", "shard-00003"]
    assert not write_report(out, Tally(), 5)["complete"]
    regenerate(conversations, backend, out, settings, rank=0, world_size=2)
    assert write_report(out, Tally(), 5)["shards"] == {"done": 5, "expected": 5}


def test_a_rerun_with_other_settings_is_refused(tmp_path):
    prepare_output(tmp_path / "out", Settings(max_new_tokens=4), {"sources": ["a.jsonl"]})
    prepare_output(tmp_path / "out", Settings(max_new_tokens=4), {"sources": ["a.jsonl"]})  # the same: resume
    with pytest.raises(ConfigError, match="made with other settings"):
        prepare_output(tmp_path / "out", Settings(max_new_tokens=8), {"sources": ["a.jsonl"]})
    with pytest.raises(ConfigError, match="made with other sources"):
        prepare_output(tmp_path / "out", Settings(max_new_tokens=4), {"sources": ["b.jsonl"]})


def test_output_is_what_prepare_reads(tiny_target, tmp_path, llama_tok):
    from omegaconf import OmegaConf

    from eagle31.data.prepare import DataConfig, prepare_dataset

    settings = Settings(max_new_tokens=4, shard_size=2)
    out = tmp_path / "out"
    records = run(
        [conv("Hello there", "Again"), conv("Hi"), conv("Weather?")], HFBackend(tiny_target, settings), out, settings
    )
    write_report(out, Tally(), 3)
    tally = Tally()
    read = list(read_conversations([str(out / "conversations")], tally))
    assert [c.messages for c in read] == [r["messages"] for r in records] and not tally.counts
    data = OmegaConf.structured(
        DataConfig(source=[str(out / "conversations")], prepared_dir=str(tmp_path / "prep"), eval_fraction=0.0)
    )
    report = prepare_dataset(data, llama_tok, draft_vocab_size=64)
    assert report.samples["train"] == 3 and not report.dropped


# ---------------------------------------------------------------------------- the endpoint backend


class ChatServer:
    """A small OpenAI-compatible chat server on 127.0.0.1 serving a HF model with transformers' generate.

    It answers as vLLM's /v1/chat/completions does: the chat template with a generation
    prompt, `max_tokens` new tokens at most, `finish_reason` "stop" (eos) or "length", and
    HTTP 400 with an error object when prompt + max_tokens exceeds the model's context.
    """

    def __init__(self, target_dir, name="tiny-target"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
        self.tok = AutoTokenizer.from_pretrained(target_dir)
        self.name, self.requests, self.fail_next = name, [], 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": server.name, "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                if server.fail_next:
                    server.fail_next -= 1
                    self._send(503, {"error": {"message": "busy"}})
                    return
                code, obj = server.complete(body)
                self._send(code, obj)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def complete(self, body):
        text = self.tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        ids = self.tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        limit = self.model.config.max_position_embeddings
        if ids.shape[1] + body["max_tokens"] > limit:
            message = f"This model's maximum context length is {limit} tokens."
            return 400, {"object": "error", "message": message, "type": "BadRequestError", "code": 400}
        with self.lock, torch.no_grad():  # one generate at a time, as a single-sequence engine would
            out = self.model.generate(ids, max_new_tokens=body["max_tokens"], do_sample=False, pad_token_id=0)
        new = out[0, ids.shape[1] :].tolist()
        eos = self.model.config.eos_token_id
        finish = "stop" if eos in new else "length"
        new = new[: new.index(eos)] if eos in new else new
        return 200, {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": self.name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": self.tok.decode(new, skip_special_tokens=True)},
                    "finish_reason": finish,
                }
            ],
            "usage": {"prompt_tokens": ids.shape[1], "completion_tokens": len(new)},
        }

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_endpoint_backend_gives_the_same_conversations_as_the_hf_backend(tiny_target, tmp_path):
    settings = Settings(max_new_tokens=5, shard_size=2)
    long = "the weather is sunny and warm " * 12
    conversations = [conv("Hello there", "What is two plus two?"), conv("Hi", long), conv(long), conv("Weather?")]
    local = run(conversations, HFBackend(tiny_target, settings), tmp_path / "hf", settings)
    with ChatServer(tiny_target) as server:
        backend = EndpointBackend(server.url, settings, concurrency=3)
        assert backend.model == "tiny-target"
        served = run(conversations, backend, tmp_path / "endpoint", settings)
        body = server.requests[0]
    assert served == local and len(served) == 3
    assert body["model"] == "tiny-target" and body["max_tokens"] == 5 and body["temperature"] == 0.0
    assert body["messages"][0] == SYSTEM and "chat_template_kwargs" not in body
    report = write_report(tmp_path / "endpoint", Tally(), 4)
    assert report["dropped"]["prompt_too_long"]["count"] == 1 and report["truncated"]["prompt_too_long"]["count"] == 1


def test_template_variants_are_asked_per_conversation_by_both_backends_and_kept_in_the_record(tiny_target, tmp_path):
    """data.chat_template_variants at regeneration: each conversation is asked under the variant drawn for its
    index (the server gets it as chat_template_kwargs, the HF backend renders it), and its record keeps it."""
    from eagle31.data.system_prompts import draw_for_conversation

    variants = [{"brief": True}, {"brief": False}]
    settings = Settings(
        max_new_tokens=3, shard_size=4, seed=1, chat_template_kwargs={"brief": False}, chat_template_variants=variants
    )
    conversations = [conv(f"Hello {i}") for i in range(8)]
    drawn = [draw_for_conversation(variants, 1, i, "template-variant") for i in range(8)]
    assert {d["brief"] for d in drawn} == {True, False}
    with ChatServer(tiny_target) as server:
        records = run(
            conversations, EndpointBackend(server.url, settings, concurrency=3), tmp_path / "endpoint", settings
        )
        asked = {r["messages"][-1]["content"]: r["chat_template_kwargs"] for r in server.requests}
    assert asked == {f"Hello {i}": drawn[i] for i in range(8)}
    assert [r["chat_template_kwargs"] for r in records] == drawn

    backend = HFBackend(tiny_target, settings)  # a template that reads the option
    backend.tokenizer.chat_template = "{% if brief %}BRIEF {% endif %}" + backend.tokenizer.chat_template
    prompt = [SYSTEM, {"role": "user", "content": "Hi"}]
    brief, plain = backend.prompt_ids(prompt, {"brief": True}), backend.prompt_ids(prompt, {"brief": False})
    assert backend.tokenizer.decode(brief).startswith("BRIEF") and backend.prompt_ids(prompt) == plain != brief
    seen = {}  # the conversations are asked from a pool: in any order

    def prompt_ids(messages, options=None):
        seen[messages[-1]["content"]] = options
        return plain

    backend.prompt_ids = prompt_ids
    assert [r["chat_template_kwargs"] for r in run(conversations, backend, tmp_path / "hf", settings)] == drawn
    assert seen == {f"Hello {i}": drawn[i] for i in range(8)}
    plain_run = Settings(max_new_tokens=3, chat_template_kwargs={"brief": False})
    assert "chat_template_kwargs" not in run(conversations[:1], backend, tmp_path / "plain", plain_run)[0]


def test_endpoint_retries_server_errors_then_fails_in_one_line(tiny_target):
    settings = Settings(max_new_tokens=2, chat_template_kwargs={"enable_thinking": False})
    with ChatServer(tiny_target) as server:
        backend = EndpointBackend(server.url, settings, model="tiny-target", retries=1, backoff_s=0.01)
        server.fail_next = 1
        reply = backend.complete([{"role": "user", "content": "Hi"}])
        assert reply.status in ("ok", "cut") and len(server.requests) == 2
        assert server.requests[-1]["chat_template_kwargs"] == {"enable_thinking": False}
        server.fail_next = 5
        with pytest.raises(RegenerateError, match=r"chat/completions failed 2 times over 0 s: HTTP 503: busy"):
            backend.complete([{"role": "user", "content": "Hi"}])


def test_an_endpoint_that_is_down_is_a_config_error():
    with pytest.raises(ConfigError, match=r"regenerate.endpoint http://127.0.0.1:9/v1: cannot list models"):
        EndpointBackend("http://127.0.0.1:9/v1", Settings())


# ---------------------------------------------------------------------------- the CLI


@pytest.mark.slow
def test_cli_regenerates_then_resumes_and_rejects_bad_settings(tiny_target, tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    from eagle31_cli import recipe_main

    script = Path(__file__).resolve().parents[2] / "data_prep" / "regenerate.py"
    spec = importlib.util.spec_from_file_location("regenerate_cli", script)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    RECIPES, main = cli.RECIPES, cli.main

    source = write_jsonl(
        tmp_path / "chats.jsonl", [{"messages": conv(f"Hello {i}").messages} for i in range(3)] + ["{bad"]
    )
    args = [
        "recipe=demo",
        "target.builtin=null",
        f"target.path={tiny_target}",
        f"output_dir={tmp_path / 'run'}",
        f"regenerate.source={source}",
        "regenerate.max_new_tokens=3",
        "regenerate.shard_size=2",
        "regenerate.device=cpu",
    ]
    assert recipe_main(main, RECIPES, args) == 0
    out = capsys.readouterr().out
    assert "regenerated 3 of 3 conversations" in out and "this run wrote 2 shards, kept 0" in out
    assert "dropped malformed: 1" in out
    report = json.loads((tmp_path / "run" / "regenerated" / "report.json").read_text())
    assert report["complete"] and report["dropped"]["malformed"]["count"] == 1
    assert recipe_main(main, RECIPES, args) == 0
    assert "this run wrote 0 shards, kept 2" in capsys.readouterr().out

    assert recipe_main(main, RECIPES, args[:-1] + ["regenerate.max_new_tokens=4"]) == 2
    assert "made with other settings" in capsys.readouterr().err
    assert recipe_main(main, RECIPES, args + ["regenerate.backend=vllm"]) == 2
    assert "'vllm', expected one of [hf, endpoint]" in capsys.readouterr().err
    assert recipe_main(main, RECIPES, args + ["regenerate.backend=endpoint"]) == 2
    assert "needs regenerate.endpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_reads_a_demo_split_as_data_source_does(tiny_target, tmp_path, capsys, monkeypatch):
    import importlib.util
    from pathlib import Path

    import eagle31.targets.demo
    from eagle31_cli import recipe_main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_jsonl(corpus / "train.jsonl", [{"messages": conv(f"Hello {i}").messages} for i in range(2)])
    monkeypatch.setattr(eagle31.targets.demo, "demo_corpus_dir", lambda seed=0: corpus)
    script = Path(__file__).resolve().parents[2] / "data_prep" / "regenerate.py"
    spec = importlib.util.spec_from_file_location("regenerate_cli", script)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    args = ["recipe=demo", "target.builtin=null", f"target.path={tiny_target}", f"output_dir={tmp_path / 'run'}"]
    args += ["regenerate.source=[demo:train]", "regenerate.max_new_tokens=3", "regenerate.device=cpu"]
    assert recipe_main(cli.main, cli.RECIPES, args) == 0
    assert "regenerated 2 of 2 conversations" in capsys.readouterr().out
