"""Regeneration: a conversation dataset's assistant turns replaced by the target's own replies.

    backend = HFBackend(target_dir, settings)                 # the target in this process
    backend = EndpointBackend("http://host:8000/v1", settings)   # a vLLM / SGLang server
    report = regenerate(conversations, backend, out_dir, settings, rank=0, world_size=1)

A drafter learns the target's distribution; trained on another model's answers (ShareGPT
holds ChatGPT's), its labels disagree with what the target will write at serving time.
Regeneration keeps the users' messages (and a leading system message) and asks the target
for every assistant turn, turn by turn: the prompt of turn `j` is the conversation so far
*as regenerated*, rendered with the target's chat template (by the HF tokenizer in-process,
by the server for an endpoint). Replies are greedy when `temperature == 0`, else sampled.

A conversation is dropped when it has no user turn (`no_user_turn`), carries tool turns
(`tool_turns`: their results cannot be regenerated) or its first prompt does not fit the
context (`prompt_too_long`). It is truncated — kept up to its last complete turn — when a
later prompt does not fit, or when a reply reaches `max_new_tokens` (kept, and the
conversation ends there: the next turn would answer a cut reply).

Output (`out_dir`, the format `eagle31.data.sources` and data_prep/prepare.py read):

    conversations/shard-00000.jsonl   {"messages": [...], "source": "<where>"} per conversation
    stats/shard-00000.json            that shard's counts (written just before its JSONL)
    settings.json                     what the replies depend on; a rerun with others is refused
    report.json                       totals over the shards (`write_report`)

The input, in order, is cut into shards of `shard_size` conversations; rank `r` of `W`
takes shards `r, r+W, ...`. Each shard is written atomically when complete, so a killed
run resumes by skipping the shards that exist.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from eagle31.config import ConfigError
from eagle31.data.sources import Conversation, Tally
from eagle31.io import atomic_write_json, atomic_write_text, claim_output_dir, write_errors

OUTPUT_KIND = "regenerated-conversations"
STATUSES = ("ok", "cut", "too_long")  # reply complete; reply reached max_new_tokens; prompt does not fit


@dataclass
class Settings:
    """What the replies depend on (saved as settings.json; a resume must match it)."""

    max_new_tokens: int = 256  # per reply
    max_turns: int | None = None  # user turns kept per conversation (the first ones)
    # hf backend: longer prompts count as not fitting (an endpoint applies its server's context).
    # Set near data.max_len: a prompt that prepare would cut before its reply is not worth generating for.
    max_prompt_tokens: int | None = None
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    shard_size: int = 64  # conversations per output shard
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the chat template (HF) or the server

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"regenerate.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_turns is not None and self.max_turns < 1:
            raise ConfigError(f"regenerate.max_turns must be >= 1 or null, got {self.max_turns}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"regenerate.temperature must be >= 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ConfigError(f"regenerate.max_prompt_tokens must be >= 1 or null, got {self.max_prompt_tokens}")
        if self.shard_size < 1:
            raise ConfigError(f"regenerate.shard_size must be >= 1, got {self.shard_size}")


@dataclass
class Reply:
    text: str
    status: str  # one of STATUSES
    new_tokens: int = 0


class RegenerateError(RuntimeError):
    """The backend failed for a reason a retry later may fix (server down); the shard is not written."""


# ---------------------------------------------------------------------------- backends


class HFBackend:
    """The target in this process: its chat template, batched `generate`, left padding."""

    def __init__(self, target_dir: str | Path, settings: Settings, *, device: str = "cpu", dtype=None, batch_size: int = 16):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.settings, self.batch_size, self.device = settings, batch_size, torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"target {target_dir}: its tokenizer has no chat template to render prompts with")
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype or torch.float32).to(self.device).eval()
        config = self.model.config.get_text_config()
        self.context = int(getattr(config, "max_position_embeddings", 0) or self.tokenizer.model_max_length)
        eos = self.model.generation_config.eos_token_id
        self.eos = {eos} if isinstance(eos, int) else set(eos or ())
        if self.tokenizer.eos_token_id is not None:
            self.eos.add(self.tokenizer.eos_token_id)
        if not self.eos:
            raise ConfigError(f"target {target_dir}: no eos token id (generation_config or tokenizer)")
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(self.settings.chat_template_kwargs or {})
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(self, prompts: Sequence[list[dict]], seed: int = 0) -> list[Reply]:
        """One reply per prompt (a message list ending with a user turn); `seed` fixes sampling."""
        ids = [self.prompt_ids(m) for m in prompts]
        replies: list[Reply | None] = [None] * len(ids)
        limit = min(self.context - self.settings.max_new_tokens, self.settings.max_prompt_tokens or self.context)
        fits = [i for i, p in enumerate(ids) if len(p) <= limit]
        for i in set(range(len(ids))) - set(fits):
            replies[i] = Reply("", "too_long")
        fits.sort(key=lambda i: len(ids[i]))  # similar lengths together: less padding
        for start in range(0, len(fits), self.batch_size):
            batch = fits[start : start + self.batch_size]
            for i, reply in zip(batch, self._generate_batch([ids[i] for i in batch], seed * 7919 + start)):
                replies[i] = reply
        return replies  # type: ignore[return-value]

    def _generate_batch(self, prompts: list[list[int]], seed: int) -> list[Reply]:
        import torch

        width = max(map(len, prompts))
        input_ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)  # [B, T]
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        s = self.settings
        sampling = dict(do_sample=True, temperature=s.temperature, top_p=s.top_p) if s.temperature > 0 else dict(do_sample=False)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=s.max_new_tokens,
                eos_token_id=sorted(self.eos),
                pad_token_id=self.pad,
                top_k=None,
                **sampling,
            )
        replies = []
        for row in out[:, width:].tolist():  # [B, <= max_new_tokens]
            end = next((n for n, t in enumerate(row) if t in self.eos), None)
            tokens = row if end is None else row[:end]
            status = "ok" if end is not None else "cut"
            replies.append(Reply(self.tokenizer.decode(tokens, skip_special_tokens=True), status, len(tokens)))
        return replies


class EndpointBackend:
    """Any OpenAI-compatible server (`POST <base_url>/chat/completions`); the server applies the template.

    Requests run `concurrency` at a time. A 400 answer is taken as a prompt that does not fit
    (vLLM and SGLang answer 400 when prompt + max_tokens exceeds the context); connection
    errors and 5xx answers are retried `retries` times, then raise RegenerateError.
    """

    def __init__(self, base_url: str, settings: Settings, *, model: str | None = None, concurrency: int = 16,
                 timeout_s: float = 600.0, retries: int = 3, api_key: str | None = None):  # fmt: skip
        self.base_url = base_url.rstrip("/")
        self.settings, self.concurrency, self.timeout_s, self.retries = settings, concurrency, timeout_s, retries
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.model = model or self._first_model()

    def _request(self, path: str, body: dict | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers)
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return json.loads(response.read())

    def _first_model(self) -> str:
        try:
            models = self._request("/models").get("data") or []
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise ConfigError(f"regenerate.endpoint {self.base_url}: cannot list models ({e}); is the server up?") from None
        if not models:
            raise ConfigError(f"regenerate.endpoint {self.base_url}: the server lists no model; set regenerate.model")
        return models[0]["id"]

    def generate(self, prompts: Sequence[list[dict]], seed: int = 0) -> list[Reply]:
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(self._one, prompts, [seed] * len(prompts)))

    def _one(self, messages: list[dict], seed: int) -> Reply:
        s = self.settings
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "seed": seed,
        }
        if s.chat_template_kwargs:
            body["chat_template_kwargs"] = s.chat_template_kwargs
        for attempt in range(self.retries + 1):
            try:
                choice = self._request("/chat/completions", body)["choices"][0]
                break
            except urllib.error.HTTPError as e:
                if e.code == 400:
                    return Reply("", "too_long")
                error: Exception = e
            except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as e:
                error = e
            if attempt == self.retries:
                raise RegenerateError(f"{self.base_url}/chat/completions failed {self.retries + 1} times: {error}")
            time.sleep(min(2**attempt, 30))
        text = choice["message"].get("content") or ""
        return Reply(text, "cut" if choice.get("finish_reason") == "length" else "ok")


# ---------------------------------------------------------------------------- conversations


def user_turns(conv: Conversation, max_turns: int | None) -> tuple[list[dict], list[str]]:
    """(leading system messages, the user messages' contents); raises ValueError(reason) to drop it."""
    roles = {m["role"] for m in conv.messages}
    if "tool" in roles or any(m.get("tool_calls") for m in conv.messages):
        raise ValueError("tool_turns")
    system = [{"role": "system", "content": m["content"]} for m in conv.messages[:1] if m["role"] == "system"]
    users = [m["content"] for m in conv.messages if m["role"] == "user" and m["content"].strip()]
    if not users:
        raise ValueError("no_user_turn")
    return system, users[:max_turns] if max_turns else users


@dataclass
class ShardStats:
    conversations_in: int = 0
    conversations_out: int = 0
    turns: int = 0  # assistant replies written
    reply_tokens: int = 0  # counted by the HF backend only
    replies_cut: int = 0
    seconds: float = 0.0
    dropped: Tally = field(default_factory=Tally)
    truncated: Tally = field(default_factory=Tally)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["dropped"], d["truncated"] = self.dropped.to_dict(), self.truncated.to_dict()
        return d


def regenerate_shard(
    conversations: list[Conversation], backend, settings: Settings, index: int = 0
) -> tuple[list[dict], ShardStats]:
    """Regenerate shard `index` in lock step: every live conversation's turn j in one call.

    Sampling is seeded from (settings.seed, index, turn), so a resumed run samples what an
    uninterrupted one would have.
    """
    stats = ShardStats(conversations_in=len(conversations))
    started = time.time()
    live = []  # [conversation, messages so far, user turns still to answer]
    for conv in conversations:
        try:
            system, users = user_turns(conv, settings.max_turns)
        except ValueError as e:
            stats.dropped.add(str(e), conv.where)
            continue
        live.append([conv, system, users])
    done: dict[int, list[dict]] = {}
    turn = 0
    while live:
        prompts = [messages + [{"role": "user", "content": users[0]}] for _, messages, users in live]
        replies = backend.generate(prompts, seed=(settings.seed * 1_000_003 + index) * 1009 + turn)
        turn += 1
        still = []
        for (conv, messages, users), prompt, reply in zip(live, prompts, replies):
            if reply.status == "too_long":
                answered = sum(m["role"] == "assistant" for m in messages)
                if answered:
                    stats.truncated.add("prompt_too_long", conv.where, f"after {answered} turns")
                    done[id(conv)] = messages
                else:
                    stats.dropped.add("prompt_too_long", conv.where)
                continue
            messages = prompt + [{"role": "assistant", "content": reply.text}]
            stats.turns += 1
            stats.reply_tokens += reply.new_tokens
            if reply.status == "cut":
                stats.replies_cut += 1
                if len(users) > 1:
                    stats.truncated.add("reply_cut", conv.where, f"at turn {sum(m['role'] == 'user' for m in messages)}")
                done[id(conv)] = messages
            elif len(users) == 1:
                done[id(conv)] = messages
            else:
                still.append([conv, messages, users[1:]])
        live = still
    records = [{"messages": done[id(c)], "source": c.where} for c in conversations if id(c) in done]
    stats.conversations_out = len(records)
    stats.seconds = time.time() - started
    return records, stats


# ---------------------------------------------------------------------------- the run


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def shards(conversations: Iterable[Conversation], size: int) -> Iterator[tuple[int, list[Conversation]]]:
    it = iter(conversations)
    index = 0
    while chunk := list(islice(it, size)):
        yield index, chunk
        index += 1


def prepare_output(out_dir: str | Path, settings: Settings, identity: dict[str, Any]) -> Path:
    """Claim `out_dir` and save the settings, or check them against a previous run's (resume)."""
    out = claim_output_dir(out_dir, OUTPUT_KIND)
    saved = {"settings": asdict(settings), **identity}
    path = out / "settings.json"
    if path.is_file():
        previous = json.loads(path.read_text())
        for key in saved:
            if previous.get(key) != saved[key]:
                raise ConfigError(f"{out} holds regenerated data made with other {key} ({previous.get(key)!r}, now {saved[key]!r}); choose another output directory")
    else:
        atomic_write_json(path, saved)
    (out / "conversations").mkdir(exist_ok=True)
    (out / "stats").mkdir(exist_ok=True)
    return out


def regenerate(
    conversations: Iterable[Conversation],
    backend,
    out_dir: str | Path,
    settings: Settings,
    *,
    rank: int = 0,
    world_size: int = 1,
    progress: Callable[[int], None] = lambda n: None,
) -> dict[str, int]:
    """Write this rank's missing shards of `out_dir` (prepared by `prepare_output`); returns counts.

    `progress(n)` is called with the number of input conversations each finished or skipped shard held.
    """
    out = Path(out_dir)
    counts = {"written": 0, "skipped": 0}
    for index, chunk in shards(conversations, settings.shard_size):
        if index % world_size != rank:
            continue
        path = out / "conversations" / f"{shard_name(index)}.jsonl"
        if path.is_file() and (out / "stats" / f"{shard_name(index)}.json").is_file():
            counts["skipped"] += 1
            progress(len(chunk))
            continue
        records, stats = regenerate_shard(chunk, backend, settings, index)
        kept = "the finished shards are kept (a shard counts once both its files are whole); a rerun regenerates the rest"
        with write_errors(f"the regenerated shard {path}", kept):
            atomic_write_json(out / "stats" / f"{shard_name(index)}.json", stats.to_dict())
            atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        counts["written"] += 1
        progress(len(chunk))
    return counts


def write_report(out_dir: str | Path, read_rejects: Tally, total_conversations: int) -> dict[str, Any]:
    """report.json: totals over the shards' stats, the reader's rejects, and whether every shard is done."""
    out = Path(out_dir)
    settings = json.loads((out / "settings.json").read_text())["settings"]
    expected = -(-total_conversations // settings["shard_size"])
    totals: dict[str, Any] = {k: 0 for k in ("conversations_in", "conversations_out", "turns", "reply_tokens", "replies_cut")}
    totals["seconds"] = 0.0
    dropped: dict[str, dict] = {r: {"count": n, "examples": read_rejects.examples[r]} for r, n in read_rejects.counts.items()}
    truncated: dict[str, dict] = {}
    found = 0
    for index in range(expected):
        stats_path = out / "stats" / f"{shard_name(index)}.json"
        if not (stats_path.is_file() and (out / "conversations" / f"{shard_name(index)}.jsonl").is_file()):
            continue
        found += 1
        stats = json.loads(stats_path.read_text())
        for key in totals:
            totals[key] += stats[key]
        for target, source in ((dropped, stats["dropped"]), (truncated, stats["truncated"])):
            for reason, entry in source.items():
                slot = target.setdefault(reason, {"count": 0, "examples": []})
                slot["count"] += entry["count"]
                slot["examples"] = (slot["examples"] + entry["examples"])[:5]
    report = {
        "complete": found == expected,
        "shards": {"done": found, "expected": expected},
        **totals,
        "dropped": dropped,
        "truncated": truncated,
        "settings": settings,
    }
    atomic_write_json(out / "report.json", report)
    return report
