"""`ChatEncoder.encode`: input ids and loss mask from the target chat template (docs/data.md, The loss mask)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eagle31.data.sources import BadInput, Conversation
from eagle31.errors import ConfigError

_MAX_SCAFFOLD = 64  # most tokens a template may add to an assistant turn when it is the final one
# apply_chat_template's own arguments: never template options.
_RENDER_ARGUMENTS = ("conversation", "tools", "documents", "tokenize", "add_generation_prompt", "chat_template",
                     "continue_final_message", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                     "padding", "truncation", "max_length", "tokenizer_kwargs")  # fmt: skip


def check_template_kwargs(kwargs: Any, name: str = "data.chat_template_kwargs") -> dict[str, Any]:
    """Template options as a plain dict; ConfigError for a non-mapping or a key that is not an option."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ConfigError(f"{name} must be a mapping of template options, got {kwargs!r}")
    for key in kwargs:
        if not isinstance(key, str) or not key.isidentifier():
            raise ConfigError(f"{name}: option names are identifiers, got {key!r}")
        if key in _RENDER_ARGUMENTS:
            raise ConfigError(f"{name}: {key!r} is an argument of apply_chat_template, not a template option")
    return dict(kwargs)


def parse_template_kwargs(text: str | None, name: str = "chat_template_kwargs") -> dict[str, Any]:
    """Template options given on a command line as a JSON object (`'{"thinking": true}'`); checked."""
    if not text:
        return {}
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{name} must be a JSON object, got {text!r} ({e.msg})") from None
    return check_template_kwargs(kwargs, name)


@dataclass
class ReasoningTally:
    """Assistant reasoning seen by an encoder, and the part its template did not render."""

    turns: int = 0  # assistant messages with reasoning
    tokens: int = 0  # their reasoning's tokens
    unrendered_turns: int = 0
    unrendered_tokens: int = 0


class ChatTemplateError(BadInput, ValueError):
    """No reliable mask for one conversation; `reason` names the failure for reports."""


class ChatEncoder:
    """Conversations -> (input_ids, loss_mask) with a tokenizer's chat template; `reasoning` tallies what it saw."""

    def __init__(self, tokenizer: Any, *, last_turn_only: bool = False, system_prompt: str | None = None,
                 template_kwargs: Mapping[str, Any] | None = None):  # fmt: skip
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"tokenizer {tokenizer.name_or_path!r} has no chat template")
        self.tokenizer, self.last_turn_only, self.system_prompt = tokenizer, last_turn_only, system_prompt
        self.template_kwargs = check_template_kwargs(template_kwargs)
        self.reasoning = ReasoningTally()
        self._special_ids = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        # what closes a cut turn: the special tokens, and `</think>` where it is an added token that is not
        # special (Qwen3), so that a reply cut while thinking does not supervise the marker the template wrote
        markers = think_markers(tokenizer)
        self._closing_ids = self._special_ids | ({markers[1]} if markers else set())

    def encode(self, conversation: Conversation, system_prompt: str | None = None) -> tuple[list[int], list[int]]:
        """(input_ids, loss_mask); `system_prompt`, this conversation's, is added when it has no system message."""
        messages = list(conversation.messages)
        system_prompt = system_prompt or self.system_prompt
        if system_prompt and (not messages or messages[0]["role"] != "system"):
            messages.insert(0, {"role": "system", "content": system_prompt})
        tools = conversation.tools
        full_text = self._render(messages, tools, generation_prompt=False)
        messages = self._drop_unrendered_reasoning(messages, tools, full_text)
        full = self._tokenize(full_text)
        mask = [0] * len(full)
        turns = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
        for j in turns[-1:] if self.last_turn_only else turns:
            start = self._turn_start(messages, j, tools, full)
            end = len(full) if j == len(messages) - 1 else self._turn_end(messages, j, tools, full)
            end = self._trim_glue(full, start, end)
            if messages[j].get("finish_reason") == "length":
                end = self._trim_closing(full, start, end)
            mask[start:end] = [1] * (end - start)
        return full, mask

    def _turn_start(self, messages: list[dict], j: int, tools: Any, full: list[int]) -> int:
        """First token after assistant message j's prompt (header, prefilled scaffold)."""
        prompt = self._tokenize(self._render(messages[:j], tools, generation_prompt=True))
        if full[: len(prompt)] == prompt:
            return len(prompt)
        # The generation prompt prefills a scaffold the recorded turn does not start with.
        history = self._tokenize(self._render(messages[:j], tools, generation_prompt=False))
        if full[: len(history)] != history:
            detail = f"the render of the first {j} messages is not a prefix of the full render"
            raise ChatTemplateError("unstable_template", detail)
        start = _common_prefix_len(prompt, full)
        if start < len(history):
            raise ChatTemplateError("unstable_template", f"generation prompt of message {j} rewrites the history")
        return start

    def _turn_end(self, messages: list[dict], j: int, tools: Any, full: list[int]) -> int:
        """End of assistant message j (not the last message): where `render(messages[:j+1])` ends in `full`."""
        ids = self._tokenize(self._render(messages[: j + 1], tools, generation_prompt=False))
        if full[: len(ids)] == ids:
            return len(ids)
        # As the final turn, message j carries a scaffold its history form lacks (Qwen3's
        # empty think block): the render is full[:c] + scaffold + tail, with tail = full[c:end].
        c = _common_prefix_len(ids, full)
        for x in range(1, min(_MAX_SCAFFOLD, len(ids) - c - 1) + 1):
            tail = ids[c + x :]
            if full[c : c + len(tail)] == tail:
                return c + len(tail)
        raise ChatTemplateError("unstable_template", f"message {j} renders differently as the final turn")

    def _drop_unrendered_reasoning(self, messages: list[dict], tools: Any, full_text: str) -> list[dict]:
        """The messages without the reasoning whose removal leaves the full render unchanged; counted in `reasoning`."""
        messages = list(messages)
        for i, m in enumerate(messages):
            if not m.get("reasoning_content"):
                continue
            n_tokens = len(self._tokenize(m["reasoning_content"]))
            self.reasoning.turns += 1
            self.reasoning.tokens += n_tokens
            without = {k: v for k, v in m.items() if k != "reasoning_content"}
            trial = [*messages[:i], without, *messages[i + 1 :]]
            if self._render(trial, tools, generation_prompt=False) == full_text:
                messages[i] = without
                self.reasoning.unrendered_turns += 1
                self.reasoning.unrendered_tokens += n_tokens
        return messages

    def _trim_glue(self, ids: list[int], start: int, end: int) -> int:
        """`end` moved before whitespace that follows a special (end-of-turn) token."""
        k = end
        while k > start and self.tokenizer.decode(ids[k - 1 : k]).isspace():
            k -= 1
        return k if k < end and k > start and ids[k - 1] in self._special_ids else end

    def _trim_closing(self, ids: list[int], start: int, end: int) -> int:
        """`end` moved before the special and whitespace tokens that close a cut turn (`</think>`, end of turn)."""
        while end > start and (
            ids[end - 1] in self._closing_ids or self.tokenizer.decode(ids[end - 1 : end]).isspace()
        ):
            end -= 1
        return end

    def _render(self, messages: list[dict], tools: Any, *, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt, **self.template_kwargs
            )
        except Exception as e:  # templates raise anything on data they reject (jinja2 errors, TypeError, ...)
            raise ChatTemplateError("template_error", f"{type(e).__name__}: {e}".splitlines()[0]) from None

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def think_markers(tokenizer) -> tuple[int, int] | None:
    """The ids of `<think>` and `</think>` when each is one token of the vocabulary (Kimi, Qwen3, DeepSeek-R1)."""
    vocab = tokenizer.get_vocab()
    ids = vocab.get("<think>"), vocab.get("</think>")
    return ids if None not in ids else None


def split_reasoning(
    prompt: list[int], reply: list[int], think: tuple[int, int] | None
) -> tuple[list[int] | None, list[int]]:
    """(reasoning or None, answer) tokens of a reply: up to `</think>` if the prompt or reply opens a think block."""
    if think is None:
        return None, reply
    open_id, close_id = think
    last = lambda ids, t: max((i for i, x in enumerate(ids) if x == t), default=-1)  # noqa: E731
    inside = last(prompt, open_id) > last(prompt, close_id)
    if not inside and reply[:1] == [open_id]:
        inside, reply = True, reply[1:]
    if not inside:
        return None, reply
    end = reply.index(close_id) if close_id in reply else len(reply)  # no `</think>`: all reasoning
    return reply[:end], reply[end + 1 :]


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
