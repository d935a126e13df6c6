"""The demo corpus: the Python standard library's documented functions as chat conversations (docs/demo_target.md).

Each conversation asks for one function (name, signature, module, docstring summary) and answers with its code;
the splits are `SPLITS`, JSONL in OpenAI messages form. Deterministic for a given Python version: files and
functions in sorted order, every random choice from `random.Random(seed)`.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from eagle31.io import atomic_write_text

SPLITS = ("train", "heldout", "other_system", "long_prompt")
SYSTEM_PROMPT = "You are a helpful assistant that writes Python code."
OTHER_SYSTEM_PROMPT = "You are a senior engineer. Reply with one Python function in a code block."

# Parts of the standard library that are tests, demos, GUIs or vendored code.
_SKIP_DIRS = {"idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "pydoc_data", "site-packages",
              "dist-packages", "lib-dynload", "__phello__", "venv"}  # fmt: skip
_MAX_CODE_CHARS = 800  # keeps a conversation under ~384 tokens of the demo tokenizer
_MIN_CODE_CHARS = 80
_MIN_FUNCTIONS = 1000

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


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_functions(root: Path | None = None) -> list[Function]:
    """Public, documented, ASCII functions and methods of modest size, in sorted order."""
    root = root or stdlib_root()
    found: dict[tuple[str, str], Function] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in _SKIP_DIRS or part.startswith("test") for part in rel.parts):
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        lines = source.splitlines()
        for prefix, node in _definitions(tree):
            fn = _function(module, prefix, node, lines)
            if fn is not None:
                found.setdefault((fn.module, fn.name), fn)
    return list(found.values())


def _definitions(tree: ast.Module):
    """(name prefix, def node) for top-level functions and the methods of top-level classes."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield "", node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef):
                    yield node.name + ".", sub


def _function(module: str, prefix: str, node: ast.FunctionDef, lines: list[str]) -> Function | None:
    end = node.end_lineno or node.lineno  # always set by ast.parse
    if node.name.startswith("_") or end - node.lineno > 40:
        return None
    doc = ast.get_docstring(node)
    if not doc:
        return None
    summary = doc.strip().splitlines()[0].strip()
    # the definition's lines (decorators excluded), dedented to column 0
    body = lines[node.lineno - 1 : end]
    indent = " " * node.col_offset
    if not all(line.startswith(indent) or not line.strip() for line in body):
        return None
    code = "\n".join(line[node.col_offset :].rstrip() for line in body)
    if not (_MIN_CODE_CHARS <= len(code) <= _MAX_CODE_CHARS) or "\t" in code or not code.isascii():
        return None
    if not summary or len(summary) > 120 or not summary.isascii():
        return None
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    signature = f"({ast.unparse(node.args)}){returns}"
    return Function(module, prefix + node.name, signature, summary, code)


def request(fn: Function, rng: random.Random) -> str:
    summary_lc = fn.summary[:1].lower() + fn.summary[1:]
    return rng.choice(_REQUESTS).format(
        name=fn.name, signature=fn.signature, module=fn.module, summary=fn.summary, summary_lc=summary_lc
    )


def answer(fn: Function) -> str:
    return f"Here is `{fn.name}`:\n\n```python\n{fn.code}\n```"


def conversation(fns: list[Function], rng: random.Random, system: str = SYSTEM_PROMPT) -> dict:
    """One conversation asking for each function in turn (one turn per function)."""
    messages = [{"role": "system", "content": system}]
    for fn in fns:
        messages += [{"role": "user", "content": request(fn, rng)}, {"role": "assistant", "content": answer(fn)}]
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
    if len(functions) < _MIN_FUNCTIONS:  # e.g. a zipped or stripped standard library
        raise RuntimeError(
            f"only {len(functions)} usable functions found under {stdlib_root()}; the demo corpus needs "
            f"the standard library's .py sources (a full CPython install has ~2700)"
        )
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


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a JSONL split."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
