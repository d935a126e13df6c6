"""Long multi-turn samples from short conversations (`data.merge_turns`, docs/data.md, Prepared samples)."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator

from eagle31.data.sources import Conversation


class TurnMerger:
    """`merge(conversations)` yields the merged conversations; `read` counts the conversations that went in."""

    def __init__(self, max_conversations: int, seed: int):
        self.max_conversations, self.seed, self.read = max_conversations, seed, 0

    def merge(self, conversations: Iterable[Conversation]) -> Iterator[Conversation]:
        rng = random.Random(self.seed)
        group: list[Conversation] = []
        size = 0
        for conv in conversations:
            self.read += 1
            if conv.tools:
                yield conv
                continue
            if group and conv.chat_template_kwargs != group[0].chat_template_kwargs:
                yield merged(group)
                group = []
            if not group:
                size = rng.randint(1, self.max_conversations)
            group.append(conv)
            if len(group) == size:
                yield merged(group)
                group = []
        if group:
            yield merged(group)


def merged(group: list[Conversation]) -> Conversation:
    """One conversation: the first's messages, then the others' less their system messages."""
    messages = group[0].messages + [m for conv in group[1:] for m in conv.messages if m["role"] != "system"]
    where = group[0].where if len(group) == 1 else f"{group[0].where}..{group[-1].where}"
    return Conversation(messages=messages, where=where, chat_template_kwargs=group[0].chat_template_kwargs)
