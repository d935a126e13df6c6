"""What answers one request: the target in this process (`HFBackend`), or an OpenAI-compatible server."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from itertools import count
from pathlib import Path
from typing import Any

from eagle31.data.chat import split_reasoning, think_markers
from eagle31.data.regenerate.core import RegenerateError, Reply, ServerRefusedError, Settings
from eagle31.errors import ConfigError

CONTEXT_LENGTH_ERROR = "maximum context length"  # in the text of each context-length 400 of vLLM 0.33
_MAX_BACKOFF_S = 30.0


class HFBackend:
    """The target in-process: thread-safe `complete`s batched into one `generate`, each row with its own seed."""

    gather_s = 0.02  # how long the batcher waits for more prompts after the first

    def __init__(
        self, target_dir: str | Path, settings: Settings, *, device: str = "cpu", dtype=None, batch_size: int = 16
    ):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.settings, self.batch_size, self.device = settings, batch_size, torch.device(device)
        self.workers = batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"target {target_dir}: its tokenizer has no chat template to render prompts with")
        self.model = (
            AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype or torch.float32).to(self.device).eval()
        )
        config = self.model.config.get_text_config()
        self.context = int(getattr(config, "max_position_embeddings", 0) or self.tokenizer.model_max_length)
        eos = self.model.generation_config.eos_token_id
        self.eos = {*([eos] if isinstance(eos, int) else eos or ()), self.tokenizer.eos_token_id} - {None}
        if not self.eos:
            raise ConfigError(f"target {target_dir}: no eos token id (generation_config or tokenizer)")
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos)
        self.think = think_markers(self.tokenizer)
        self._queue: list[tuple[list[int], int, Future]] = []
        self._wake = threading.Condition()
        threading.Thread(target=self._batcher, daemon=True, name="hf-batcher").start()

    def prompt_ids(self, messages: list[dict], template_options: dict | None = None) -> list[int]:
        options = template_options if template_options is not None else self.settings.chat_template_kwargs
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(options or {})
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def complete(self, messages: list[dict], seed: int = 0, template_options: dict | None = None) -> Reply:
        """One reply to `messages` (ending with a user turn), rendered with `template_options` (None: the settings')."""
        ids = self.prompt_ids(messages, template_options)
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
            for (_, _, future), reply in zip(batch, replies, strict=False):
                future.set_result(reply)

    def _generate_batch(self, prompts: list[list[int]], seeds: list[int]) -> list[Reply]:
        import torch
        from transformers import LogitsProcessorList

        width = max(map(len, prompts))
        input_ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)  # [B, T]
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        s = self.settings
        sampling = [_row_seeded_sampling(seeds, s.temperature, s.top_p, self.device)] if s.temperature > 0 else []
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
        for prompt, row in zip(prompts, out[:, width:].tolist(), strict=False):  # [B, <= max_new_tokens]
            end = next((n for n, t in enumerate(row) if t in self.eos), None)
            tokens = row if end is None else row[:end]
            reasoning, answer = split_reasoning(prompt, tokens, self.think)
            decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
            replies.append(Reply(decode(answer), "ok" if end is not None else "cut",
                                 None if reasoning is None else decode(reasoning), len(tokens)))  # fmt: skip
        return replies


def _row_seeded_sampling(seeds: Sequence[int], temperature: float, top_p: float, device) -> Callable:
    """Sampling as a logits processor: Gumbel-max within the top-p nucleus, each row's noise from its generator."""
    import torch

    generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def sample(input_ids, scores):  # scores [B, V]
        logits = torch.log_softmax(scores.float() / temperature, dim=-1)
        if top_p < 1:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            outside = sorted_logits.exp().cumsum(-1) - sorted_logits.exp() >= top_p  # the nucleus keeps >= 1 token
            logits = logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
        uniform = torch.stack([torch.rand(logits.shape[-1], generator=g, device=logits.device) for g in generators])
        return logits - torch.log(-torch.log(uniform.clamp(1e-10, 1 - 1e-7)))

    return sample


class _Transient(Exception):
    """A failure worth retrying: the server down or restarting, overloaded, or slow."""


class EndpointBackend:
    """An OpenAI-compatible server; `complete` (thread-safe) retries while a wait may fix it (regeneration.md)."""

    def __init__(self, base_url: str, settings: Settings, *, model: str | None = None, concurrency: int = 16,
                 timeout_s: float = 1800.0, retries: int = 3, backoff_s: float = 1.0, restart_window_s: float = 0.0,
                 api_key: str | None = None):  # fmt: skip
        bounds = (("concurrency", concurrency, 1), ("timeout_s", timeout_s, 1e-3), ("retries", retries, 0),
                  ("backoff_s", backoff_s, 0), ("restart_window_s", restart_window_s, 0))  # fmt: skip
        for name, value, low in bounds:
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
            raise ConfigError(
                f"regenerate.endpoint {self.base_url}: cannot list models ({e}); is the server up?"
            ) from None
        if not models:
            raise ConfigError(f"regenerate.endpoint {self.base_url}: the server lists no model; set regenerate.model")
        return models[0]["id"]

    def body(self, messages: list[dict], seed: int, template_options: dict | None = None) -> dict[str, Any]:
        s = self.settings
        options = template_options if template_options is not None else s.chat_template_kwargs
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "seed": seed,
        }
        if options:
            body["chat_template_kwargs"] = options
        return body

    def complete(self, messages: list[dict], seed: int = 0, template_options: dict | None = None) -> Reply:
        body = self.body(messages, seed, template_options)
        first_failure = None
        for attempt in count():
            try:
                return self._answer(body)
            except _Transient as e:
                now = time.monotonic()
                first_failure = first_failure if first_failure is not None else now
                if attempt >= self.retries and now - first_failure >= self.restart_window_s:
                    failed = f"failed {attempt + 1} times over {now - first_failure:.0f} s"
                    raise RegenerateError(f"{self.base_url}/chat/completions {failed}: {e}") from None
                time.sleep(min(self.backoff_s * 2**attempt, _MAX_BACKOFF_S))
        raise AssertionError("unreachable")

    def _answer(self, body: dict) -> Reply:
        """One attempt: a Reply, or _Transient, or ServerRefusedError."""
        try:
            choice = self._request("/chat/completions", body)["choices"][0]
        except urllib.error.HTTPError as e:
            error = _error_message(e)
            if e.code == 400 and CONTEXT_LENGTH_ERROR in error:
                return Reply("", "too_long")
            if 400 <= e.code < 500 and e.code not in (408, 429):
                raise ServerRefusedError(
                    f"regenerate.endpoint {self.base_url}: the server refused a request with HTTP {e.code}: {error}"
                ) from None
            raise _Transient(f"HTTP {e.code}: {error}") from None
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
    raw = ""
    with suppress(OSError):
        raw = error.read().decode("utf-8", "replace")
    try:
        obj = json.loads(raw)
    except ValueError:
        obj = None
    inner = obj.get("error", obj) if isinstance(obj, dict) else obj
    text = inner.get("message") if isinstance(inner, dict) else inner
    return " ".join((text if isinstance(text, str) else raw or str(error.reason)).split())[:500]
