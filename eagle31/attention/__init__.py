"""The drafter's attention kinds (`drafter.attention`): `KINDS`, Llama's q/k/v (llama.py), DeepSeek's MLA (mla.py)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from eagle31.attention.kind import AttentionKind
from eagle31.attention.llama import LlamaAttentionKind
from eagle31.attention.mla import MLAAttentionKind
from eagle31.errors import ConfigError


class DrafterAttention(StrEnum):
    """The kinds a recipe spells (`drafter.attention`); `KINDS` holds each one's `AttentionKind`."""

    llama = "llama"
    mla = "mla"

    @property
    def kind(self) -> AttentionKind:
        return KINDS[self]

    @classmethod
    def parse(cls, value: Any) -> str:
        """A kind's name in `KINDS` (built-in: a member); else a one-line ConfigError naming `drafter.attention`."""
        if value not in KINDS:
            raise ConfigError(f"drafter.attention must be one of {list(KINDS)}, got {value!r}")
        return cls(value) if value in cls._value2member_map_ else str(value)

    @staticmethod
    def of_layer(layer: dict[str, Any]) -> str:
        """The kind of a checkpoint's layer config: the first that recognises it, else Llama (vLLM's default layer)."""
        return next((name for name, kind in KINDS.items() if kind.recognises(layer)), DrafterAttention.llama)


# every attention kind by its name; a new kind is its module and its line here (and its member above, for recipes)
KINDS: dict[str, AttentionKind] = {
    DrafterAttention.llama: LlamaAttentionKind(),
    DrafterAttention.mla: MLAAttentionKind(),
}
