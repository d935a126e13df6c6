"""The demo corpus: the Python standard library's documented functions as chat conversations (docs/demo_target.md)."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle31.io import atomic_write_text

SPLITS = ("train", "heldout", "other_system", "long_prompt")
SYSTEM_PROMPT = "You are a helpful assistant that writes Python code."
OTHER_SYSTEM_PROMPT = "You are a senior engineer. Reply with one Python function in a code block."
CORPUS_FILE = Path(__file__).parent / "corpus" / "stdlib_functions.jsonl"

_REQUESTS = (
    "Write a Python function `{name}{signature}` that {summary_lc}",
    "Implement `{name}{signature}` from the `{module}` module. {summary}",
    "In `{module}`, how is `{name}` written? It should: {summary}",
    "Show me the code of `{module}.{name}`: {summary}",
)


@dataclass(frozen=True)
class Function:
    """One documented function or method of the standard library."""

    module: str  # dotted, e.g. "json.decoder"
    name: str  # "dumps" or "JSONDecoder.decode"
    signature: str  # "(obj, *, skipkeys=False)"
    summary: str  # the docstring's first line
    code: str  # the source of the definition (methods dedented)


def functions(path: str | Path = CORPUS_FILE) -> list[Function]:
    """The corpus's functions, in the shipped file's order."""
    return [Function(**json.loads(line)) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def conversation(fns: list[Function], rng: random.Random, system: str = SYSTEM_PROMPT) -> dict:
    """One conversation asking for each function in turn (one turn per function)."""
    messages = [{"role": "system", "content": system}]
    for fn in fns:
        request = rng.choice(_REQUESTS).format(**asdict(fn), summary_lc=fn.summary[:1].lower() + fn.summary[1:])
        answer = f"Here is `{fn.name}`:\n\n```python\n{fn.code}\n```"
        messages += [{"role": "user", "content": request}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def merge(conversations: list[dict]) -> dict:
    """Consecutive single-turn conversations as one multi-turn conversation (the first system prompt)."""
    messages = list(conversations[0]["messages"])
    for c in conversations[1:]:
        messages += [m for m in c["messages"] if m["role"] != "system"]
    return {"messages": messages}


@dataclass(frozen=True)
class CorpusSpec:
    heldout: int = 200
    max_train: int = 2400
    long_prompts: int = 48
    long_prompt_turns: int = 6  # earlier turns before the request: ~6 x 180 tokens of history


def make_splits(functions: list[Function], spec: CorpusSpec, seed: int) -> dict[str, list[dict]]:
    """Deterministic train / heldout / other_system / long_prompt conversations."""
    rng = random.Random(seed)
    order = list(functions)
    rng.shuffle(order)
    held, train = order[: spec.heldout], order[spec.heldout : spec.heldout + spec.max_train]
    long_prompt = []
    for i, fn in enumerate(held[: spec.long_prompts]):
        history = [held[(i + 1 + j) % len(held)] for j in range(spec.long_prompt_turns)]
        long_prompt.append(conversation(history + [fn], rng))
    return {
        "train": [conversation([fn], rng) for fn in train],
        "heldout": [conversation([fn], rng) for fn in held],
        "other_system": [conversation([fn], rng, system=OTHER_SYSTEM_PROMPT) for fn in held],
        "long_prompt": long_prompt,
    }


def write_splits(splits: dict[str, list[dict]], out_dir: str | Path) -> dict[str, Path]:
    """Write each split as `<name>.jsonl` (atomically); returns the paths."""
    paths = {}
    for name, rows in splits.items():
        paths[name] = Path(out_dir) / f"{name}.jsonl"
        atomic_write_text(paths[name], "".join(json.dumps(row) + "\n" for row in rows))
    return paths
