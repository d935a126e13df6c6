"""The "original replies" side of the regenerated-data lever: the regenerated conversations' own prompts (the same
users' turns, the same system message) with the replies their source shipped instead of the target's.

    python -m experiments.default_recipe.original_replies <source> <regenerated conversations dir> <out.jsonl>
    python -m experiments.default_recipe.original_replies sharegpt: runs/smollm2/regenerated/conversations \\
        runs/smollm2/original_replies.jsonl

Each regenerated record names the source record it answered again (`source`, as `data.source` reads it); its
original keeps as many user turns as the regenerated one has, each with the source's own reply.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eagle31.data.sources import Tally, read_conversations, resolve_sources
from eagle31.io import atomic_write_text


def with_original_replies(record: dict, original: list[dict]) -> dict:
    """`record`'s system message and user turns, each user turn followed by `original`'s reply to it (a reply
    before the first user turn is left out, as regenerate leaves it)."""
    users = sum(m["role"] == "user" for m in record["messages"])
    system = [m for m in record["messages"][:1] if m["role"] == "system"]
    messages, seen = [], 0
    for m in original:
        if m["role"] == "system" or (m["role"] == "assistant" and not seen):  # what regenerate never asks
            continue
        if m["role"] == "user":
            if seen == users:
                break
            seen += 1
        messages.append({"role": m["role"], "content": m["content"]})
    return {"messages": system + messages, "source": record["source"]}


def original_replies(source: str, regenerated: Path, out: Path) -> int:
    """Write `out`; returns the number of conversations."""
    records = [json.loads(line) for f in sorted(regenerated.glob("*.jsonl")) for line in f.open() if line.strip()]
    wanted = {r["source"] for r in records}
    originals = {c.where: c.messages for c in read_conversations(resolve_sources(source), Tally()) if c.where in wanted}
    missing = wanted - originals.keys()
    if missing:
        raise SystemExit(f"{len(missing)} regenerated records name no record of {source}, e.g. {sorted(missing)[0]}")
    rows = [with_original_replies(r, originals[r["source"]]) for r in records]
    atomic_write_text(out, "".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    count = original_replies(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
    print(f"{count} conversations with their original replies -> {sys.argv[3]}")
