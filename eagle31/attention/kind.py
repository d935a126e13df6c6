"""`AttentionKind`: what one kind of drafter attention does differently (CONTRIBUTING.md, "An attention kind")."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from eagle31.rope import ambiguity

# a drafter's config as the kinds read it (`eagle31.config.DrafterConfig`): the config is built over the kinds, which
# read its fields by name and never import it
DrafterShape = Any


class AttentionKind(ABC):
    name: str  # `drafter.attention`
    label: str  # in messages: "an MLA drafter", "drafter.mla.kv_lora_rank is a field of an MLA drafter"
    # its own fields: a dataclass, the `DrafterConfig` field that holds it (`drafter.<config_field>.<name>`)
    config_field: str | None = None
    config_type: type | None = None
    # the EAGLE-3 HF layout: the architecture vLLM serves it with, the layer's model_type
    architecture: str
    model_type: str
    # the source format of a checkpoint of this kind that eagle31 did not write (`eagle31.convert.detect_format`)
    unmarked_format: str | None = None
    # the rope module (`eagle31.model`): config -> a module, position_ids [B, T] -> cos, sin [B, T, rope dims]
    rotary_embedding: Callable[[DrafterShape], nn.Module]
    # `eagle31.rope`: (rope, release) -> the numbers (`rope_quantities`) vLLM `release` makes of a yarn block in this
    # kind's layer, and the fields each supported release reads
    rope_reading: Callable[[dict[str, Any], str], tuple[float, ...]]
    rope_quantities: str
    rope_fields_read: Mapping[str, tuple[str, ...]]
    # the TTT chain keeps each step's input and remakes its keys and values from it (`eagle31.model`), or
    # the step's entry (`query_entry`'s, made keys and values by `chain_keys_values`)
    chain_keeps_input: bool
    # vLLM builds this kind's attention with the layer's sliding window (`drafter.sliding_window`)
    serves_window: bool = True
    # vLLM serves this kind's drafter with `parallel_drafting` (its mask slots: `mask_token_id`, `mask_hidden`)
    serves_parallel_drafting: bool = True
    # the first tested vLLM release that applies this kind's fc_norm, where a later one than the layout's
    # (`eagle31.hub`: the release a 3.1 drafter's model card asks for)
    min_vllm_fc_norm: str | None = None

    def own_config(self, values: dict[str, Any]) -> Any:
        """Its fields given as a dict (a config file, a recipe) -> its `config_type`."""
        assert self.config_type is not None, f"{self.name} has no fields of its own"
        return self.config_type(**values)

    def fields(self) -> tuple[str, ...]:
        """The names of its own fields (`config_type`'s)."""
        return tuple(f.name for f in dataclasses.fields(self.config_type)) if self.config_type else ()

    @abstractmethod
    def attention(self, config: DrafterShape, rms_norm: type[nn.Module]) -> nn.Module:
        """The layer's attention projections (module docstring: what the drafter asks of them)."""

    @abstractmethod
    def validate(self, cfg: DrafterShape) -> None:
        """Refuse, naming the field, what this kind cannot train as vLLM serves it."""

    @abstractmethod
    def qk_head_dim(self, cfg: DrafterShape) -> int:
        """Head dim of q and k."""

    @abstractmethod
    def from_target(self, target: dict[str, Any], rope: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
        """The `DrafterShape` values this kind takes from the target's config (its text part) and rope block."""

    def rope_ambiguity(self, rope: dict[str, Any]) -> str | None:
        """None when every supported vLLM release reads `rope` alike in this kind's layer; else why not, in one line."""
        return ambiguity(rope, self.rope_reading, dict(self.rope_fields_read), self.rope_quantities)

    def attention_parameters(self, cfg: DrafterShape) -> int:
        """Parameters of the layer's attention (its projections read 2H), counted on a meta-device copy."""
        return sum(p.numel() for p in self._meta_attention(cfg).parameters())

    def o_proj_in_features(self, cfg: DrafterShape) -> int:
        """Width of o_proj's input."""
        return self._meta_attention(cfg).o_proj.in_features

    def _meta_attention(self, cfg: DrafterShape) -> nn.Module:
        with torch.device("meta"):
            return self.attention(cfg, nn.RMSNorm)

    @abstractmethod
    def layer_fields(self, cfg: DrafterShape) -> dict[str, Any]:
        """The fields of this kind's decoder layer in an HF config, before every kind's."""

    def recognises(self, layer: dict[str, Any]) -> bool:
        """Whether a checkpoint's layer config is of this kind; the default kind takes what no other recognises."""
        return False

    @abstractmethod
    def read_layer(self, layer: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """A checkpoint's layer config -> (its fields as transformers reads them, this kind's `DrafterShape` values)."""

    def __repr__(self) -> str:
        return f"<attention kind {self.name}>"
