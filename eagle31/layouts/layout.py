"""`Layout`: one checkpoint format of an exported drafter, and the parts layouts share (docs/export.md)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from eagle31.attention import KINDS, DrafterAttention
from eagle31.config import SWITCHES, DrafterConfig, rope_parameters_from
from eagle31.errors import ConfigError

EXPORT_FORMAT_VERSION = 1
NATIVE_PREFIX = "midlayer."  # eagle31's (= the EAGLE-3 HF layout's) name of the decoder layer
VLLM_PREFIX = "layers.0."  # vLLM's own name of it
# the decoder layer's names that vLLM's EAGLE-3 loaders read (they rename midlayer.* to layers.0.*)
DECODER_LAYER_PREFIXES = (NATIVE_PREFIX, VLLM_PREFIX)
# where vLLM's parallel drafting finds a drafter's mask token (llm_base_proposer.py, the order it reads them in)
MASK_TOKEN_FIELDS = ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")
# rope types whose frequencies read max_position_embeddings when original_max_position_embeddings is absent
_ROPE_TYPES_READING_MAX_POSITIONS = ("llama3", "yarn", "dynamic", "longrope")


class Layout(ABC):
    name: str  # `export.formats`, `source_format`
    library_name: str  # the model card's `library_name`: the library that loads an export of this layout
    card_name: str  # the layout as the model card names it ("stored in vLLM's <card_name>")
    min_vllm: str  # the first vLLM release that serves this layout with the 3.1 flags (docs/export.md)
    layer_prefix: str = NATIVE_PREFIX  # the decoder layer's key prefix in this layout's weights
    embeds_by_default: bool = False  # writes the (target's) embedding unless told not to
    # the source formats of other trainers' checkpoints in this layout, read with their own conventions
    # (`eagle31.convert`: which one wrote a checkpoint, and how its fields read)
    dialects: tuple[str, ...] = ()

    def recognises(self, meta: dict[str, Any]) -> bool:
        """Whether a `config.json` is in this layout by a mark of its own (an unmarked one: `layout_of_config`)."""
        return False

    def check(self, config: DrafterConfig, target: str | None) -> None:
        """Refuse, before any work, a drafter this layout cannot carry or a target it cannot name (by default: none)."""
        return None

    @abstractmethod
    def config(
        self, config: DrafterConfig, *, dtype: str, trained_context: int | None, num_speculative_tokens: int,
        target: str | None,
    ) -> dict[str, Any]:  # fmt: skip
        """The export's `config.json` (after `check`)."""  # fmt: skip

    def key(self, name: str) -> str:
        """eagle31 parameter name -> its name in this layout (the whole rename table)."""
        if name.startswith(NATIVE_PREFIX):
            return self.layer_prefix + name[len(NATIVE_PREFIX) :]
        return name

    def stored(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """An eagle31 tensor as this layout stores it (by default as it is)."""
        return tensor

    def native_key(self, key: str) -> str:
        """A weight's name in a checkpoint of this layout -> the eagle31 parameter name."""
        for prefix in DECODER_LAYER_PREFIXES:
            if key.startswith(prefix):
                return NATIVE_PREFIX + key[len(prefix) :]
        return key

    @abstractmethod
    def read(self, meta: dict[str, Any]) -> dict[str, Any]:
        """`config.json` -> the `DrafterConfig` values it states, as stated (`eagle31.convert` adds conventions)."""

    def num_speculative_tokens(self, meta: dict[str, Any]) -> int | None:
        """The k (`num_speculative_tokens`) a `config.json` of this layout states, None if it keeps none."""
        return None

    def __repr__(self) -> str:
        return f"<layout {self.name}>"


def layer_fields(config: DrafterConfig, dtype: str, trained_context: int | None) -> dict[str, Any]:
    """The decoder layer as an HF config (its kind's and common fields), max positions raised to the trained context."""
    rope, max_positions = dict(config.rope_parameters), config.max_position_embeddings
    if trained_context is not None:
        if isinstance(trained_context, bool) or not isinstance(trained_context, int) or trained_context < 1:
            raise ConfigError(f"trained_context must be a positive integer, got {trained_context!r}")
        if trained_context > max_positions and rope["rope_type"] in _ROPE_TYPES_READING_MAX_POSITIONS:
            rope.setdefault("original_max_position_embeddings", max_positions)
        max_positions = max(max_positions, trained_context)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    window = config.sliding_window
    return {
        **config.kind.layer_fields(config),
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "hidden_act": config.hidden_act, "rms_norm_eps": config.rms_norm_eps, "max_position_embeddings": max_positions,
        # the same rope as transformers 4 (rope_theta, rope_scaling) and 5 (rope_parameters) read it
        "rope_theta": float(rope["rope_theta"]),
        "rope_scaling": None if scaling == {"rope_type": "default"} else scaling, "rope_parameters": rope,
        # the window as vLLM's Llama attention reads it (docs/export.md); nothing for full attention
        **({} if window is None else {"sliding_window": window, "layer_types": ["sliding_attention"]}),
        "vocab_size": config.vocab_size, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "dtype": dtype, "torch_dtype": dtype,  # transformers >= 5; transformers 4 and older vLLM
        "num_aux_hidden_states": config.num_aux,  # vLLM sizes fc and fc_norm from it (else 3)
    }  # fmt: skip


def eagle_fields(config: DrafterConfig) -> dict[str, Any]:
    """The draft vocabulary, the aux ids (vLLM's convention), every switch, and `target_hidden_size` when it differs."""
    eagle: dict[str, Any] = {
        "draft_vocab_size": config.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        **{name: getattr(config, name) for name in SWITCHES},
    }
    if config.target_hidden_size != config.hidden_size:
        eagle["target_hidden_size"] = config.target_hidden_size
    if config.parallel_drafting:  # vLLM's parallel drafting reads its mask token here (its mask_hidden: a weight):
        # 0.33 (and speculators) as mask_token_id, 0.22 only as pard_token
        eagle["mask_token_id"] = eagle["pard_token"] = config.mask_token_id
    return eagle


def provenance(config: DrafterConfig, target: str | None) -> dict[str, Any]:
    """The `eagle31` block that `read` uses to read an export back exactly."""
    return {
        "eagle31": {
            "format_version": EXPORT_FORMAT_VERSION,
            "target_num_layers": config.target_num_layers,
            "target_name_or_path": target,
            "target_architectures": list(config.target_architectures),
        }
    }


def read_layer(layer: dict[str, Any]) -> dict[str, Any]:
    """A decoder layer's HF config -> its `DrafterConfig` values as transformers (so vLLM) reads them, defaults too."""
    if layer.get("num_hidden_layers", 1) != 1:
        raise ConfigError(f"drafters with {layer['num_hidden_layers']} decoder layers are not supported (only 1)")
    attention = DrafterAttention.of_layer(layer)
    parsed, values = KINDS[attention].read_layer(layer)
    sliding = (layer.get("layer_types") or [None])[0] == "sliding_attention"  # vLLM serves the window only then
    return dict(
        attention=attention, **values, hidden_size=parsed.hidden_size, num_attention_heads=parsed.num_attention_heads,
        intermediate_size=parsed.intermediate_size, rms_norm_eps=float(parsed.rms_norm_eps),
        hidden_act=parsed.hidden_act,
        rope_parameters=rope_parameters_from(layer),  # transformers keeps a legacy `type` key
        max_position_embeddings=parsed.max_position_embeddings, vocab_size=parsed.vocab_size,
        sliding_window=layer.get("sliding_window") if sliding else None,
    )  # fmt: skip


def read_eagle(meta: dict[str, Any], layer: dict[str, Any], switch_defaults: dict[str, bool]) -> dict[str, Any]:
    """What `eagle_fields` and `provenance` wrote, read back with vLLM's defaults (switches: `switch_defaults`)."""
    nested = meta.get("eagle_config") or {}
    ours = meta.get("eagle31") or {}
    ids = meta.get("eagle_aux_hidden_state_layer_ids") or nested.get("eagle_aux_hidden_state_layer_ids") or ()
    switches = {name: bool(meta.get(name, switch_defaults.get(name, False))) for name in SWITCHES}
    if "norm_before_fc" in nested:
        switches["norm_before_fc"] = bool(nested["norm_before_fc"])
    mask = next((meta[k] for k in MASK_TOKEN_FIELDS if meta.get(k) is not None), None)
    return dict(
        parallel_drafting=mask is not None,
        mask_token_id=mask,
        draft_vocab_size=meta.get("draft_vocab_size") or layer["vocab_size"],  # vLLM's default
        target_hidden_size=meta.get("target_hidden_size") or layer["hidden_size"],
        aux_layer_ids=tuple(int(i) for i in ids),
        target_num_layers=ours.get("target_num_layers"),
        target_name_or_path=ours.get("target_name_or_path"),
        target_architectures=tuple(ours.get("target_architectures") or ()),
        **switches,
    )
