"""Regeneration: a conversation dataset's assistant turns replaced by the target's own replies.

    backend = HFBackend(target_dir, settings)                      # the target in this process
    backend = EndpointBackend("http://host:8000/v1", settings)     # a vLLM / SGLang server
    counts = regenerate(conversations, backend, out_dir, settings, rank=0, world_size=1)

A drafter learns the target's distribution; trained on another model's answers (ShareGPT
holds ChatGPT's), its labels disagree with what the target will write at serving time.
Regeneration keeps the users' messages (and a leading system message, else
`settings.system_prompt`: the prompt training will render) and asks the target for every
assistant turn, turn by turn: the prompt of turn `j` is the conversation so far *as
regenerated*, reasoning included, rendered with the target's chat template and
`settings.chat_template_kwargs` (by the HF tokenizer in-process, by the server for an
endpoint). Replies are greedy when `temperature == 0`, else sampled with a seed per request,
derived from `settings.seed`, the conversation's index in the input and the turn, so that
a resumed run, another rank split or another concurrency samples the same replies.

A reply is (reasoning, answer): an endpoint returns the reasoning its server's reasoning
parser split off (`message.reasoning` in vLLM 0.33, `message.reasoning_content` in SGLang
and older vLLM); the HF backend splits the generated tokens on the template's think
markers. The reasoning is stored as the assistant message's `reasoning_content`, which
prepare renders with the target's template (`eagle31.data.chat`).

A conversation is dropped when it has no user turn (`no_user_turn`), carries tool turns
(`tool_turns`: their results cannot be regenerated), or its first prompt does not fit the
context (`prompt_too_long`: for an endpoint, only the server's own context-length error).
A reply cut at `max_new_tokens` (`finish_reason=length`) is handled by `on_length`:
`drop` ends the conversation before that turn (dropped `reply_cut` when it is the first),
`keep` stores the turn with `finish_reason: "length"` (prepare leaves the end of turn that
the target never wrote unsupervised) and ends the conversation there. A later prompt that
does not fit truncates the conversation to its complete turns. Each is counted.

Requests: one pool of `backend.workers` conversations in flight across all of this rank's
shards (each conversation's turns in order, conversations never waiting for each other);
the first request goes first and the others wait for its answer (up to a second: an engine
refuses a request when it validates it, before generating), so that a server refusing
requests (an HTTP 4xx other than its context-length error: an unknown parameter, a template
error) stops the run in one line (`ServerRefusedError`) before any shard is written. Connection errors, time-outs, 5xx
and 429 answers are retried with back-off until `retries` retries are used and the
server has been failing for `restart_window_s`; then `RegenerateError`.

Output (`out_dir`, the format `eagle31.data.sources` and data_prep/prepare.py read):

    conversations/shard-00000.jsonl   {"messages": [...], "source": "<where>"} per conversation
    stats/shard-00000.json            that shard's counts (written just before its JSONL)
    settings.json                     what the replies depend on; a rerun with others is refused
    report.json                       totals over the shards (`write_report`)

The input, in order, is cut into shards of `shard_size` conversations; rank `r` of `W`
takes shards `r, r+W, ...`. A shard is written, atomically, only when each of its
conversations is answered or dropped for a counted reason, so a killed or failed run
resumes by redoing exactly the shards that are missing.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from itertools import count, islice
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from eagle31.config import ConfigError
from eagle31.data.chat import split_reasoning, think_markers
from eagle31.data.sources import Conversation, Tally
from eagle31.io import atomic_write_json, atomic_write_text, claim_output_dir, write_errors

OUTPUT_KIND = "regenerated-conversations"
STATUSES = ("ok", "cut", "too_long")  # reply complete; reply reached max_new_tokens; prompt does not fit
ON_LENGTH = ("drop", "keep")
# The context-length errors of vLLM 0.33 (HTTP 400): renderers/params.py::TokenizeParams._token_len_check
# and ::_text_len_check ("This model's maximum context length is N tokens. However, your prompt ..."),
# serve/utils/api_utils.py::get_max_tokens ("Input length (N) exceeds model's maximum context length (M).").
CONTEXT_LENGTH_ERROR = "maximum context length"
_MAX_BACKOFF_S = 30.0


@dataclass
class Settings:
    """What the replies depend on (saved as settings.json; a resume must match it)."""

    max_new_tokens: int = 256  # per reply, reasoning included
    max_turns: int | None = None  # user turns kept per conversation (the first ones)
    # hf backend: longer prompts count as not fitting (an endpoint applies its server's context).
    # Set near data.max_len: a prompt that prepare would cut before its reply is not worth generating for.
    max_prompt_tokens: int | None = None
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    shard_size: int = 64  # conversations per output shard
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the chat template (HF) or the server
    system_prompt: str | None = None  # for conversations without a system message (data.system_prompt)
    on_length: str = "drop"  # a reply cut at max_new_tokens: drop the conversation from it on, or keep it

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
        self.on_length = str(self.on_length)
        if self.on_length not in ON_LENGTH:
            raise ConfigError(f"regenerate.on_length must be one of {list(ON_LENGTH)}, got {self.on_length!r}")


@dataclass
class Reply:
    content: str  # the answer
    status: str  # one of STATUSES
    reasoning: str | None = None  # the thinking, split off the answer
    new_tokens: int = 0  # counted by the HF backend only


class RegenerateError(RuntimeError):
    """The backend failed for a reason a rerun later may fix (server down); the failing shards are not written."""


class ServerRefusedError(ConfigError):
    """The server refused a request for a reason other than its context length: retrying cannot help."""


def request_seed(seed: int, conversation: int, turn: int) -> int:
    """The sampling seed of one request: from the run's seed, the conversation's input index and the turn."""
    digest = hashlib.blake2b(f"{seed}/{conversation}/{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


# ---------------------------------------------------------------------------- backends


class HFBackend:
    """The target in this process: its chat template, batched `generate`, left padding.

    `complete` (one request, thread-safe) queues the prompt for a batcher thread that runs
    up to `batch_size` queued prompts in one `generate`. Each row samples with its own seed
    (Gumbel noise from a generator per row), so a reply does not depend on its batch.
    """

    gather_s = 0.02  # how long the batcher waits for more prompts after the first

    def __init__(self, target_dir: str | Path, settings: Settings, *, device: str = "cpu", dtype=None, batch_size: int = 16):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.settings, self.batch_size, self.device = settings, batch_size, torch.device(device)
        self.workers = batch_size
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
        self.think = think_markers(self.tokenizer)
        self._queue: list[tuple[list[int], int, Future]] = []
        self._wake = threading.Condition()
        threading.Thread(target=self._batcher, daemon=True, name="hf-batcher").start()

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(self.settings.chat_template_kwargs or {})
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def complete(self, messages: list[dict], seed: int = 0) -> Reply:
        """One reply to `messages` (ending with a user turn), in a batch with other threads' prompts."""
        ids = self.prompt_ids(messages)
        limit = min(self.context - self.settings.max_new_tokens, self.settings.max_prompt_tokens or self.context)
        if len(ids) > limit:
            return Reply("", "too_long")
        future: Future = Future()
        with self._wake:
            self._queue.append((ids, seed, future))
            self._wake.notify()
        return future.result()

    def generate(self, prompts: Sequence[list[dict]], seeds: Sequence[int]) -> list[Reply]:
        """One reply per prompt, each sampled with its seed, in batches of `batch_size`."""
        with ThreadPoolExecutor(self.batch_size) as pool:
            return list(pool.map(self.complete, prompts, seeds))

    def _batcher(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._queue)
                deadline = time.monotonic() + self.gather_s
                while len(self._queue) < self.batch_size and (left := deadline - time.monotonic()) > 0:
                    self._wake.wait(left)
                batch, self._queue = self._queue[: self.batch_size], self._queue[self.batch_size :]
            try:
                replies = self._generate_batch([ids for ids, _, _ in batch], [seed for _, seed, _ in batch])
            except BaseException as e:  # the callers raise it
                for _, _, future in batch:
                    future.set_exception(e)
                continue
            for (_, _, future), reply in zip(batch, replies):
                future.set_result(reply)

    def _generate_batch(self, prompts: list[list[int]], seeds: list[int]) -> list[Reply]:
        import torch
        from transformers import LogitsProcessorList

        width = max(map(len, prompts))
        input_ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)  # [B, T]
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        s = self.settings
        sampling = [_RowSeededSampling(seeds, s.temperature, s.top_p, self.device)] if s.temperature > 0 else []
        with torch.no_grad():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=s.max_new_tokens,
                eos_token_id=sorted(self.eos),
                pad_token_id=self.pad,
                do_sample=False,  # argmax, of the Gumbel-perturbed scores when sampling
                top_k=None,
                logits_processor=LogitsProcessorList(sampling),
            )
        replies = []
        for prompt, row in zip(prompts, out[:, width:].tolist()):  # [B, <= max_new_tokens]
            end = next((n for n, t in enumerate(row) if t in self.eos), None)
            tokens = row if end is None else row[:end]
            reasoning, answer = split_reasoning(prompt, tokens, self.think)
            decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
            replies.append(Reply(decode(answer), "ok" if end is not None else "cut",
                                 None if reasoning is None else decode(reasoning), len(tokens)))  # fmt: skip
        return replies


class _RowSeededSampling:
    """Sampling as a logits processor: argmax of log-probs / temperature plus Gumbel noise (the
    Gumbel-max trick) within the top-p nucleus, the noise of each row from its own generator."""

    def __init__(self, seeds: Sequence[int], temperature: float, top_p: float, device):
        import torch

        self.temperature, self.top_p = temperature, top_p
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def __call__(self, input_ids, scores):  # scores [B, V]
        import torch

        logits = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        if self.top_p < 1:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            outside = sorted_logits.exp().cumsum(-1) - sorted_logits.exp() >= self.top_p  # the nucleus keeps >= 1 token
            logits = logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
        uniform = torch.stack([torch.rand(logits.shape[-1], generator=g, device=logits.device) for g in self.generators])
        return logits - torch.log(-torch.log(uniform.clamp(1e-10, 1 - 1e-7)))


class _Transient(Exception):
    """A failure worth retrying: the server down or restarting, overloaded, or slow."""


class EndpointBackend:
    """Any OpenAI-compatible server (`POST <base_url>/chat/completions`); the server applies the template.

    `complete` is one request (thread-safe); `workers` = `concurrency` requests are kept in
    flight by `regenerate`. Failures that a wait may fix (connection errors, time-outs after
    `timeout_s`, 5xx, 408/429) are retried after `backoff_s * 2**attempt` seconds (at most 30)
    until `retries` retries are used and the server has been failing for `restart_window_s`.
    """

    def __init__(self, base_url: str, settings: Settings, *, model: str | None = None, concurrency: int = 16,
                 timeout_s: float = 1800.0, retries: int = 3, backoff_s: float = 1.0, restart_window_s: float = 0.0,
                 api_key: str | None = None):  # fmt: skip
        for name, value, low in (("concurrency", concurrency, 1), ("timeout_s", timeout_s, 1e-3), ("retries", retries, 0),
                                 ("backoff_s", backoff_s, 0), ("restart_window_s", restart_window_s, 0)):  # fmt: skip
            if value < low:
                raise ConfigError(f"regenerate.{name} must be >= {low}, got {value}")
        self.base_url = base_url.rstrip("/")
        self.settings, self.workers, self.timeout_s = settings, concurrency, timeout_s
        self.retries, self.backoff_s, self.restart_window_s = retries, backoff_s, restart_window_s
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

    def body(self, messages: list[dict], seed: int) -> dict[str, Any]:
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
        return body

    def complete(self, messages: list[dict], seed: int = 0) -> Reply:
        body = self.body(messages, seed)
        first_failure = None
        for attempt in count():
            try:
                return self._answer(body)
            except _Transient as e:
                now = time.monotonic()
                first_failure = first_failure if first_failure is not None else now
                if attempt >= self.retries and now - first_failure >= self.restart_window_s:
                    raise RegenerateError(
                        f"{self.base_url}/chat/completions failed {attempt + 1} times over {now - first_failure:.0f} s: {e}"
                    ) from None
                time.sleep(min(self.backoff_s * 2**attempt, _MAX_BACKOFF_S))
        raise AssertionError("unreachable")

    def _answer(self, body: dict) -> Reply:
        """One attempt: a Reply, or _Transient, or ServerRefusedError."""
        try:
            choice = self._request("/chat/completions", body)["choices"][0]
        except urllib.error.HTTPError as e:
            message = _error_message(e)
            if e.code == 400 and CONTEXT_LENGTH_ERROR in message:
                return Reply("", "too_long")
            if 400 <= e.code < 500 and e.code not in (408, 429):
                raise ServerRefusedError(
                    f"regenerate.endpoint {self.base_url}: the server refused a request with HTTP {e.code}: {message}"
                ) from None
            raise _Transient(f"HTTP {e.code}: {message}") from None
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError) as e:
            raise _Transient(f"{type(e).__name__}: {e}") from None
        finish = choice.get("finish_reason")
        if finish not in ("stop", "length", None):  # e.g. vLLM's "abort", "error": the request did not complete
            raise _Transient(f"the reply finished with finish_reason={finish!r}")
        message = choice.get("message") or {}
        reasoning = message.get("reasoning") or message.get("reasoning_content")  # vLLM 0.33; SGLang, older vLLM
        return Reply(message.get("content") or "", "cut" if finish == "length" else "ok", reasoning or None)


def _error_message(error: urllib.error.HTTPError) -> str:
    """The server's error text: vLLM's `{"error": {"message": ...}}`, an older flat `{"message": ...}`, or the body."""
    try:
        raw = error.read().decode("utf-8", "replace")
    except OSError:
        raw = ""
    try:
        obj = json.loads(raw)
        inner = obj.get("error", obj) if isinstance(obj, dict) else obj
        text = inner.get("message") if isinstance(inner, dict) else None
        if not isinstance(text, str):
            text = inner if isinstance(inner, str) else raw
    except ValueError:
        text = raw or str(error.reason)
    return " ".join(text.split())[:500]


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
class Outcome:
    """One conversation regenerated: its record (None: dropped) and what happened to it."""

    record: dict | None
    turns: int = 0
    reply_tokens: int = 0
    replies_cut: int = 0
    reasoning_turns: int = 0
    dropped: tuple[str, str] | None = None  # (reason, detail)
    truncated: tuple[str, str] | None = None


def assistant_message(reply: Reply, cut: bool = False) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if cut:
        message["finish_reason"] = "length"  # prepare leaves the end of this turn unsupervised
    return message


def regenerate_conversation(
    conv: Conversation, index: int, settings: Settings, complete: Callable[[list[dict], int], Reply]
) -> Outcome:
    """Ask `complete(messages, seed)` for each of conversation `index`'s turns, in order."""
    try:
        system, users = user_turns(conv, settings.max_turns)
    except ValueError as e:
        return Outcome(None, dropped=(str(e), ""))
    if not system and settings.system_prompt:
        system = [{"role": "system", "content": settings.system_prompt}]
    out = Outcome(None)
    messages = system
    for turn, user in enumerate(users):
        prompt = messages + [{"role": "user", "content": user}]
        reply = complete(prompt, request_seed(settings.seed, index, turn))
        last = turn == len(users) - 1
        if reply.status == "too_long":
            if turn == 0:
                return Outcome(None, dropped=("prompt_too_long", ""))
            out.truncated = ("prompt_too_long", f"after {turn} turns")
            break
        out.replies_cut += reply.status == "cut"
        if reply.status == "cut" and settings.on_length == "drop":
            if turn == 0:
                return Outcome(None, replies_cut=1, dropped=("reply_cut", "at turn 1"))
            out.truncated = ("reply_cut", f"dropped from turn {turn + 1}")
            break
        messages = prompt + [assistant_message(reply, cut=reply.status == "cut")]
        out.turns += 1
        out.reply_tokens += reply.new_tokens
        out.reasoning_turns += bool(reply.reasoning)
        if reply.status == "cut":  # kept; the next turn would answer a cut reply
            if not last:
                out.truncated = ("reply_cut", f"kept cut at turn {turn + 1}")
            break
    out.record = {"messages": messages, "source": conv.where}
    return out


@dataclass
class ShardStats:
    conversations_in: int = 0
    conversations_out: int = 0
    turns: int = 0  # assistant replies written
    reply_tokens: int = 0  # counted by the HF backend only
    replies_cut: int = 0  # replies that reached max_new_tokens (kept or not, per on_length)
    reasoning_turns: int = 0  # replies written with reasoning
    seconds: float = 0.0  # from the shard's first request to its last answer
    dropped: Tally = field(default_factory=Tally)
    truncated: Tally = field(default_factory=Tally)

    def add(self, outcome: Outcome, where: str) -> None:
        self.conversations_in += 1
        self.conversations_out += outcome.record is not None
        for key in ("turns", "reply_tokens", "replies_cut", "reasoning_turns"):
            setattr(self, key, getattr(self, key) + getattr(outcome, key))
        for tally, entry in ((self.dropped, outcome.dropped), (self.truncated, outcome.truncated)):
            if entry is not None:
                tally.add(entry[0], where, entry[1])

    def to_dict(self) -> dict:
        d = asdict(self)
        d["dropped"], d["truncated"] = self.dropped.to_dict(), self.truncated.to_dict()
        return d


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


def shard_done(out: Path, index: int) -> bool:
    return (out / "conversations" / f"{shard_name(index)}.jsonl").is_file() and (out / "stats" / f"{shard_name(index)}.json").is_file()


def write_shard(out: Path, index: int, records: list[dict], stats: ShardStats) -> None:
    """A finished shard: its stats, then its conversations (the JSONL's presence marks it done)."""
    path = out / "conversations" / f"{shard_name(index)}.jsonl"
    kept = "the finished shards are kept (a shard counts once both its files are whole); a rerun regenerates the rest"
    with write_errors(f"the regenerated shard {path}", kept):
        atomic_write_json(out / "stats" / f"{shard_name(index)}.json", stats.to_dict())
        atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


class _Shard:
    def __init__(self, index: int, conversations: list[Conversation]):
        self.index, self.conversations = index, conversations
        self.outcomes: list[Outcome | None] = [None] * len(conversations)
        self.left, self.started = len(conversations), None

    def stats(self) -> tuple[list[dict], ShardStats]:
        stats = ShardStats()
        for conv, outcome in zip(self.conversations, self.outcomes):
            stats.add(outcome, conv.where)  # type: ignore[arg-type]
        stats.seconds = time.monotonic() - (self.started or time.monotonic())
        return [o.record for o in self.outcomes if o is not None and o.record is not None], stats


class _FirstRequestGate:
    """Lets one request through first, so that a server refusing every request stops the run after
    one; `stop` makes requests not yet sent raise instead.

    The others wait for its answer, but at most `wait_s`: a serving engine refuses a request when it
    validates it, before generating (vLLM's 4xx come back at once), so a first request still running
    after that was accepted, and the pool need not idle for a whole reply. Nothing is written before
    the first answer either way (`open`)."""

    def __init__(self, wait_s: float = 1.0):
        self.open, self.stop, self._first = threading.Event(), threading.Event(), threading.Lock()
        self.wait_s = wait_s

    def call(self, complete: Callable[[list[dict], int], Reply], messages: list[dict], seed: int) -> Reply:
        if not self.open.is_set():
            if self._first.acquire(blocking=False):  # this is the first request (the lock is never released)
                self._check()
                try:
                    reply = complete(messages, seed)
                except BaseException:
                    self.stop.set()  # the requests waiting here are not sent
                    raise
                self.open.set()
                return reply
            self.open.wait(self.wait_s)
        self._check()
        return complete(messages, seed)

    def _check(self) -> None:
        if self.stop.is_set():
            raise _Stopped()


class _Stopped(Exception):
    """Another request failed; this conversation is not asked further."""


class _DaemonPool:
    """`workers` daemon threads running submitted calls: unlike ThreadPoolExecutor's, an interrupted
    run exits at once instead of waiting at interpreter exit for requests still in flight."""

    def __init__(self, workers: int):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, daemon=True, name=f"regenerate-{i}") for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._jobs.put((fn, args, future))
        return future

    def close(self) -> None:
        """Stop each thread after its current call; calls not started are cancelled."""
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # the caller raises it
                    future.set_exception(e)


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

    `backend.complete(messages, seed)` answers one request; `backend.workers` conversations are
    in flight at a time. `progress(n)` is called with the number of conversations each finished
    or skipped shard held.
    """
    out = Path(out_dir)
    counts = {"written": 0, "skipped": 0}
    todo: list[_Shard] = []
    for index, chunk in shards(conversations, settings.shard_size):
        if index % world_size != rank:
            continue
        if shard_done(out, index):
            counts["skipped"] += 1
            progress(len(chunk))
        else:
            todo.append(_Shard(index, chunk))
    jobs = ((shard, i) for shard in todo for i in range(len(shard.conversations)))
    gate = _FirstRequestGate()
    finished: list[_Shard] = []  # complete, waiting for the gate to open (nothing is written before the first answer)

    def run(shard: _Shard, i: int) -> Outcome:
        shard.started = shard.started or time.monotonic()
        index = shard.index * settings.shard_size + i  # the conversation's index in the input
        return regenerate_conversation(shard.conversations[i], index, settings, lambda m, s: gate.call(backend.complete, m, s))

    def flush(end: bool = False) -> None:
        while finished and (gate.open.is_set() or end):
            shard = finished.pop(0)
            write_shard(out, shard.index, *shard.stats())
            counts["written"] += 1
            progress(len(shard.conversations))

    pending: dict[Future, tuple[_Shard, int]] = {}
    pool = _DaemonPool(backend.workers)
    try:
        while True:
            while not gate.stop.is_set() and len(pending) < 2 * backend.workers and (job := next(jobs, None)) is not None:
                pending[pool.submit(run, *job)] = job
            if not pending:
                break
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            failure = None
            for future in done:
                shard, i = pending.pop(future)
                if future.exception() is not None:  # this shard is never written
                    if not isinstance(future.exception(), _Stopped):  # the cause (stopped ones follow it)
                        failure = failure or future.exception()
                    continue
                shard.outcomes[i] = future.result()
                shard.left -= 1
                if shard.left == 0:
                    finished.append(shard)
            flush()
            if failure is not None:
                raise failure
        if gate.stop.is_set():  # every failure was a stopped conversation: cannot happen without a cause
            raise RegenerateError("regeneration stopped")
        flush(end=True)  # shards that needed no request (every conversation dropped before asking)
    except BaseException:
        gate.stop.set()
        for future in pending:
            future.cancel()
        raise
    finally:
        pool.close()
    return counts


def write_report(out_dir: str | Path, read_rejects: Tally, total_conversations: int) -> dict[str, Any]:
    """report.json: totals over the shards' stats, the reader's rejects, and whether every shard is done."""
    out = Path(out_dir)
    settings = json.loads((out / "settings.json").read_text())["settings"]
    expected = -(-total_conversations // settings["shard_size"])
    keys = ("conversations_in", "conversations_out", "turns", "reply_tokens", "replies_cut", "reasoning_turns")
    totals: dict[str, Any] = {k: 0 for k in keys}
    totals["seconds"] = 0.0
    dropped: dict[str, dict] = {r: {"count": n, "examples": read_rejects.examples[r]} for r, n in read_rejects.counts.items()}
    truncated: dict[str, dict] = {}
    found = 0
    for index in range(expected):
        if not shard_done(out, index):
            continue
        found += 1
        stats = json.loads((out / "stats" / f"{shard_name(index)}.json").read_text())
        for key in totals:
            totals[key] += stats.get(key, 0)
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
