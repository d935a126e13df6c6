"""A choice per conversation, drawn from the seed and its index: `data.system_prompts`, template variants."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from eagle31.data.sources import plain
from eagle31.errors import ConfigError


def read_system_prompts(spec: Any, what: str = "data.system_prompts") -> list[str]:
    """The prompts of `spec`: a list of strings, a path to a file of them, or None (none); checked."""
    if spec is None:
        return []
    if isinstance(spec, (str, Path)):
        return _read_file(Path(spec), what)
    prompts = list(spec)
    bad = [p for p in prompts if not isinstance(p, str) or not p.strip()]
    if bad or not prompts:
        raise ConfigError(
            f"{what} must be a non-empty list of non-empty strings (or a file of them), got {bad[:1] or prompts!r}"
        )
    return prompts


def _read_file(path: Path, what: str) -> list[str]:
    if not path.is_file():
        raise ConfigError(f"{what}: no file {path}")
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError:
        raise ConfigError(f"{what}: {path} is not a text file") from None
    prompts = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            prompts.append(line)
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{what}: {path}:{n} is not valid JSON ({e.msg})") from None
        if isinstance(value, dict):
            value = value.get("content")
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(
                f"{what}: {path}:{n} is neither a JSON string nor an object with a non-empty content string"
            )
        prompts.append(value)
    if not prompts:
        raise ConfigError(f"{what}: {path} holds no prompt")
    return prompts


def data_system_prompts(data_cfg: Any) -> list[str]:
    """The prompts of a `data` section: `system_prompts`, or the one `system_prompt`; both set is refused."""
    many, one = getattr(data_cfg, "system_prompts", None), getattr(data_cfg, "system_prompt", None)
    if many is not None and one:
        raise ConfigError(
            "data.system_prompt and data.system_prompts are both set: give the one prompt as a list of one"
        )
    return read_system_prompts(plain(many)) if many is not None else ([one] if one else [])


def draw_system_prompt(prompts: list[str], seed: int, index: int) -> str | None:
    """The prompt of conversation `index`; None without prompts."""
    return draw_for_conversation(prompts, seed, index, "system-prompt")


def draw_for_conversation(choices: list, seed: int, index: int, what: str):
    """One of `choices` for conversation `index`, from a hash of `what` (each its own draw), the seed and the index."""
    if not choices:
        return None
    digest = hashlib.blake2b(f"{what}/{seed}/{index}".encode(), digest_size=8).digest()
    return choices[int.from_bytes(digest, "little") % len(choices)]
