"""Llama attention (`drafter.attention=llama`): q/k/v projections of the 2H-wide input, vLLM's Llama EAGLE-3 layer.

The TTT chain keeps each step's input (feature, token ids, positions), which the unroll keeps anyway, and
makes keys and values of it a block of tokens at a time; step 0's keys and values are its entry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eagle31.drafter_attention.kind import AttentionKind
from eagle31.errors import ConfigError
from eagle31.rope import YARN_FIELDS, check_rope, for_llama_drafter, llama_yarn_reading

if TYPE_CHECKING:
    from eagle31.config import DrafterConfig


class LlamaAttentionKind(AttentionKind):
    name = "llama"
    label = "a Llama-attention drafter"
    architecture = "LlamaForCausalLMEagle3"
    model_type = "llama"
    rope_fields_read = YARN_FIELDS
    rope_quantities = "extrapolation, magnitude"

    def validate(self, cfg: DrafterConfig) -> None:
        check_rope(cfg.rope_parameters)

    def qk_head_dim(self, cfg: DrafterConfig) -> int:
        return cfg.head_dim

    def from_target(self, target: dict[str, Any], rope: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
        """The target's rope without DeepSeek's yarn magnitude fields (`eagle31.rope.for_llama_drafter`)."""
        return {"rope_parameters": for_llama_drafter(rope)}

    def rope_reading(self, rope: dict[str, Any], release: str) -> tuple[float, ...]:
        return llama_yarn_reading(rope, release)

    # ------------------------------------------------------------------ estimate

    def attention_parameters(self, cfg: DrafterConfig) -> int:
        H, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        return 2 * H * (nh * d) + 2 * (2 * H * nkv * d) + nh * d * H  # q, k, v read 2H; o

    def attention_widths(self, cfg: DrafterConfig) -> tuple[int, int, int]:
        return cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.head_dim

    def o_proj_in_features(self, cfg: DrafterConfig) -> int:
        return cfg.num_attention_heads * cfg.head_dim

    def entry_elements(self, cfg: DrafterConfig) -> tuple[int, int]:
        """Step 0 its keys and values, the others nothing (their chain entry is their input)."""
        return 2 * cfg.num_key_value_heads * cfg.head_dim, 0

    def chain_entry_gradient_elements(self, cfg: DrafterConfig) -> int:
        return cfg.hidden_size  # d feature

    def step0_keys_remade(self) -> bool:
        return False  # the entry is k0, v0

    def step_saved_extra_bytes(self, cfg: DrafterConfig, c: int) -> int:
        return 0

    def after_attention_saved_elements(self, cfg: DrafterConfig) -> int:
        return 0  # o_proj's input is the attention output, saved before it

    def chain_block_terms(self, cfg: DrafterConfig, c: int) -> tuple[int, int, int, int]:
        """Stacked feature rows, emb, normed emb (saved), z, its gradient, a key gradient, cos, sin per row; the rope
        backward's intermediates (the key's gradient through cos and through sin, the rotated half, their sum);
        k_proj's and v_proj's gradients. The step-0 keys and values are the entry: no weights remake them."""
        _, kv, rope = self.attention_widths(cfg)
        H = cfg.hidden_size
        per_row = (H + 2 * H + 2 * H * 2 + kv + 2 * rope) * c + 16
        return per_row, 7 * kv * c // 2, 2 * kv * 2 * H, 0

    def prefix_block_extra_elements(self, cfg: DrafterConfig) -> int:
        return 0  # views of the entry

    # ------------------------------------------------------------ export, convert

    def layer_fields(self, cfg: DrafterConfig) -> dict[str, Any]:
        return {"model_type": self.model_type, "head_dim": cfg.head_dim}

    def read_layer(self, layer: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """transformers' `LlamaConfig` reading (defaults included), as vLLM reads it."""
        from transformers import LlamaConfig

        if layer.get("model_type", self.model_type) != self.model_type:
            raise ConfigError(f"only Llama-layer drafters are supported, got model_type={layer['model_type']!r}")
        fields = {k: v for k, v in layer.items() if k not in ("architectures", "model_type")}
        parsed = LlamaConfig(**{**fields, "num_hidden_layers": 1})
        return parsed, {"num_key_value_heads": parsed.num_key_value_heads, "head_dim": parsed.head_dim}
