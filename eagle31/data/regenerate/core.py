"""The settings replies depend on, a reply, and one conversation answered again turn by turn."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from eagle31.data.sources import Conversation
from eagle31.data.system_prompts import draw_for_conversation, draw_system_prompt
from eagle31.errors import ConfigError, choose


class RegenerateBackend(StrEnum):
    hf = "hf"  # the target in this process
    endpoint = "endpoint"  # an OpenAI-compatible server (vLLM, SGLang)


class OnLength(StrEnum):
    drop = "drop"  # a reply cut at max_new_tokens ends its conversation before that turn
    keep = "keep"  # kept, its end of turn unsupervised; the conversation ends with it


@dataclass
class Settings:
    """What the replies depend on (saved as settings.json; a resume must match it)."""

    max_new_tokens: int = 256  # per reply, reasoning included
    max_turns: int | None = None  # user turns kept per conversation (the first ones)
    max_prompt_tokens: int | None = None  # hf backend: longer prompts do not fit (set near data.max_len)
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    shard_size: int = 64  # conversations per output shard
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the chat template (HF) or the server
    system_prompts: list[str] | None = None  # one drawn per conversation without a system message
    # data.chat_template_variants: one drawn per conversation, the reply asked under it and the record keeping it
    chat_template_variants: list[dict[str, Any]] | None = None
    on_length: str = "drop"  # a reply cut at max_new_tokens: drop the conversation from it on, or keep it

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "max_turns", "max_prompt_tokens", "shard_size"):
            value, nullable = getattr(self, name), name in ("max_turns", "max_prompt_tokens")
            if (value is not None or not nullable) and value < 1:
                raise ConfigError(f"regenerate.{name} must be >= 1{' or null' if nullable else ''}, got {value}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"regenerate.temperature must be >= 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}"
            )
        self.on_length = str(choose(OnLength, str(self.on_length), "regenerate.on_length"))


@dataclass
class Reply:
    content: str  # the answer
    status: str  # "ok"; "cut": it reached max_new_tokens; "too_long": the prompt does not fit
    reasoning: str | None = None  # the thinking, split off the answer
    new_tokens: int = 0  # counted by the HF backend only


class RegenerateError(RuntimeError):
    """The backend failed for a reason a later rerun may fix (server down); the failing shards are not written."""


def template_options(settings: Settings, index: int) -> dict[str, Any] | None:
    """The chat-template options conversation `index` is asked under: its drawn variant, or the run's options."""
    if settings.chat_template_variants:
        return draw_for_conversation(settings.chat_template_variants, settings.seed, index, "template-variant")
    return settings.chat_template_kwargs


class ServerRefusedError(ConfigError):
    """The server refused a request for a reason other than its context length: retrying cannot help."""


def request_seed(seed: int, conversation: int, turn: int) -> int:
    """The sampling seed of one request: from the run's seed, the conversation's input index and the turn."""
    digest = hashlib.blake2b(f"{seed}/{conversation}/{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def user_turns(conv: Conversation, max_turns: int | None) -> tuple[list[dict], list[str]]:
    """(leading system messages, the user messages' contents); raises ValueError(reason) to drop it."""
    if any(m["role"] == "tool" or m.get("tool_calls") for m in conv.messages):
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
    conv: Conversation, index: int, settings: Settings, complete: Callable[[list[dict], int, dict | None], Reply]
) -> Outcome:
    """Ask `complete(messages, seed, template_options)` for each of conversation `index`'s turns, in order."""
    try:
        system, users = user_turns(conv, settings.max_turns)
    except ValueError as e:
        return Outcome(None, dropped=(str(e), ""))
    if not system and settings.system_prompts:
        system = [{"role": "system", "content": draw_system_prompt(settings.system_prompts, settings.seed, index)}]
    options = template_options(settings, index)
    out = Outcome(None)
    messages = system
    for turn, user in enumerate(users):
        prompt = messages + [{"role": "user", "content": user}]
        reply = complete(prompt, request_seed(settings.seed, index, turn), options)
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
    if settings.chat_template_variants:
        out.record["chat_template_kwargs"] = options  # eagle31.data.prepare renders the record with them
    return out
