"""The output directory: settings.json, one JSONL and one stats file per shard, report.json (docs/regeneration.md)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle31.data.regenerate.core import Outcome, Settings
from eagle31.data.sources import Conversation, Tally
from eagle31.errors import ConfigError
from eagle31.io import atomic_write_json, atomic_write_text, claim_output_dir, write_errors

OUTPUT_KIND = "regenerated-conversations"


@dataclass
class ShardStats:
    conversations_in: int = 0
    conversations_out: int = 0
    turns: int = 0  # assistant replies written
    reply_tokens: int = 0  # counted by the HF backend only
    replies_cut: int = 0  # replies that reached max_new_tokens (kept or not, per on_length)
    reasoning_turns: int = 0  # replies written with reasoning
    seconds: float = 0.0  # from the shard's first request to its last answer
    input_sha256: str = ""  # of the conversations it was regenerated from (`input_sha256`)
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


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def prepare_output(out_dir: str | Path, settings: Settings, identity: dict[str, Any]) -> Path:
    """Claim `out_dir` and save the settings, or check them against a previous run's (resume)."""
    out = claim_output_dir(out_dir, OUTPUT_KIND)
    saved = {"settings": asdict(settings), **identity}
    path = out / "settings.json"
    if path.is_file():
        previous = json.loads(path.read_text())
        for key in saved:
            if previous.get(key) != saved[key]:
                raise ConfigError(
                    f"{out} holds regenerated data made with other {key} ({previous.get(key)!r}, now {saved[key]!r}); "
                    "choose another output directory"
                )
    else:
        atomic_write_json(path, saved)
    (out / "conversations").mkdir(exist_ok=True)
    (out / "stats").mkdir(exist_ok=True)
    return out


def input_sha256(conversations: list[Conversation]) -> str:
    """The content of a shard's input: its conversations' messages and tools, in order."""
    records = ({"messages": conv.messages, "tools": conv.tools} for conv in conversations)
    text = "".join(json.dumps(record, sort_keys=True, ensure_ascii=False) + "\n" for record in records)
    return hashlib.sha256(text.encode()).hexdigest()


def check_resumable(out: Path, chunks: list[tuple[int, list[Conversation]]], size: int) -> None:
    """Refuse to resume over finished shards of other conversations (an edited source) or an older eagle31's."""
    for index, chunk in chunks:
        if not shard_done(out, index):
            continue
        recorded = json.loads((out / "stats" / f"{shard_name(index)}.json").read_text()).get("input_sha256")
        if not recorded:
            raise ConfigError(
                f"{out}: {shard_name(index)} was written by an older eagle31, without a record of the conversations it "
                "was regenerated from, so a resume cannot check it against the source; regenerate into a new "
                "regenerate.output_dir (this one is left as it is)"
            )
        if recorded != input_sha256(chunk):
            first = index * size
            raise ConfigError(
                f"{out}: {shard_name(index)} was regenerated from other conversations than conversations "
                f"{first}-{first + len(chunk) - 1} of the source now (edited since); restore the source or choose "
                "another output directory"
            )
    beyond = sorted(
        p.stem
        for p in (out / "conversations").glob("shard-*.jsonl")
        if int(p.stem.removeprefix("shard-")) >= len(chunks)
    )
    if beyond:
        total = sum(len(chunk) for _, chunk in chunks)
        raise ConfigError(
            f"{out} holds {', '.join(beyond)}, beyond the {len(chunks)} shards of the {total} conversations of the "
            "source now (edited since); restore the source or choose another output directory"
        )


def shard_done(out: Path, index: int) -> bool:
    name = shard_name(index)
    return (out / "conversations" / f"{name}.jsonl").is_file() and (out / "stats" / f"{name}.json").is_file()


def write_shard(out: Path, index: int, records: list[dict], stats: ShardStats) -> None:
    """A finished shard: its stats, then its conversations (the JSONL's presence marks it done)."""
    path = out / "conversations" / f"{shard_name(index)}.jsonl"
    kept = "the finished shards are kept (a shard counts once both its files are whole); a rerun regenerates the rest"
    with write_errors(f"the regenerated shard {path}", kept):
        atomic_write_json(out / "stats" / f"{shard_name(index)}.json", stats.to_dict())
        atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def write_report(out_dir: str | Path, read_rejects: Tally, total_conversations: int) -> dict[str, Any]:
    """report.json: totals over the shards' stats, the reader's rejects, and whether every shard is done."""
    out = Path(out_dir)
    settings = json.loads((out / "settings.json").read_text())["settings"]
    expected = -(-total_conversations // settings["shard_size"])
    totals: dict[str, Any] = {k: v for k, v in asdict(ShardStats()).items() if isinstance(v, int | float)}
    dropped: dict[str, dict] = read_rejects.to_dict()
    truncated: dict[str, dict] = {}
    done = [index for index in range(expected) if shard_done(out, index)]
    for index in done:
        stats = json.loads((out / "stats" / f"{shard_name(index)}.json").read_text())
        for key in totals:
            totals[key] += stats.get(key, 0)
        for target, source in ((dropped, stats["dropped"]), (truncated, stats["truncated"])):
            for reason, entry in source.items():
                slot = target.setdefault(reason, {"count": 0, "examples": []})
                slot["count"] += entry["count"]
                slot["examples"] = (slot["examples"] + entry["examples"])[:5]
    report = {
        "complete": len(done) == expected,
        "shards": {"done": len(done), "expected": expected},
        **totals,
        "dropped": dropped,
        "truncated": truncated,
        "settings": settings,
    }
    atomic_write_json(out / "report.json", report)
    return report
