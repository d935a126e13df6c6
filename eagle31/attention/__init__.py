"""The drafter's attention kinds (`drafter.attention`): what differs between them lives on each kind's class.

`DrafterAttention` is the choice a recipe spells; `DrafterAttention.<name>.kind` is its `AttentionKind`,
which the rest of eagle31 asks instead of comparing names:

    config      its own fields, their checks, what it takes from the target    eagle31.config
    rope        how the supported vLLM releases read its rope block             eagle31.rope (ambiguity)
    estimate    its parameter count and the memory terms that differ            eagle31.estimate
    export      its layer's fields and the architecture vLLM serves it with     eagle31.layouts
    convert     recognising and reading its checkpoints, ours and others'       eagle31.convert

    llama       q/k/v projections: vLLM's Llama EAGLE-3 layer                    attention/llama.py
    mla         DeepSeek's Multi-head Latent Attention: vLLM's Eagle3DeepseekV2ForCausalLM
                (the published Kimi K2.6 drafter)                                attention/mla.py

A new kind is a module here with its `AttentionKind`, a member below, and its own fields on
`DrafterConfig` (docs/architecture.md, "How to add").
"""

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
        """`value` as the name of a kind in `KINDS` (a member for the built-in kinds); anything else is a one-line
        ConfigError naming `drafter.attention`."""
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
