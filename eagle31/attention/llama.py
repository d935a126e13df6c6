"""Llama attention (`drafter.attention=llama`): q/k/v of the 2H-wide input, as vLLM's `LlamaForCausalLMEagle3`."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eagle31.attention.kind import AttentionKind, DrafterShape
from eagle31.errors import ConfigError
from eagle31.kernels.entries import KEYS_VALUES, ChainKeysValues
from eagle31.rope import YARN_FIELDS, check_rope, for_llama_drafter, inverse_frequencies, llama_yarn_reading


class LlamaAttention(nn.Module):
    """Projections of the EAGLE 3 (Llama) attention, q/k/v reading the 2H-wide input (attending: `eagle31.kernels`)."""

    def __init__(self, config: DrafterShape):
        super().__init__()
        H, d, nh, nkv = config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, d
        self.q_proj = nn.Linear(2 * H, nh * d, bias=False)
        self.k_proj = nn.Linear(2 * H, nkv * d, bias=False)
        self.v_proj = nn.Linear(2 * H, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, H, bias=False)

    def query(self, z: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """z [B, T, 2H] -> q [B, T, nh, d], RoPE applied."""
        return apply_rope(self.q_proj(z).unflatten(-1, (self.num_heads, self.head_dim)), cos, sin)

    def query_entry(self, z: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """z [B, T, 2H] -> q [B, T, nh, d] and the step's entry, its keys and values (k, v) [B, T, nkv, d], roped."""
        return self.query(z, cos, sin), self.key_value(z, cos, sin, self.k_proj.weight, self.v_proj.weight)

    def key_value(self, z: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_weight, v_weight):
        """z [B, T, 2H] -> k (RoPE applied), v [B, T, nkv, d], with the given k_proj / v_proj weights."""
        k = F.linear(z, k_weight).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return apply_rope(k, cos, sin), F.linear(z, v_weight).unflatten(-1, (self.num_kv_heads, self.head_dim))

    def step0_keys_values(self) -> ChainKeysValues:
        """The causal (step-0) keys and values are the step-0 entry itself."""
        return KEYS_VALUES

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """attn [B, T, nh, d] -> o_proj(attn) [B, T, H]."""
        return self.o_proj(attn.flatten(2))


class RotaryEmbedding(nn.Module):
    """vLLM's RoPE (`eagle31.rope`): position_ids [B, T] -> cos, sin [B, T, d], scaled by `attention_scaling`."""

    interleaved = False  # each frequency on a pair of dims (DeepSeek's), else on both halves (Llama's rotate-half)

    def __init__(self, config: DrafterShape):
        super().__init__()
        with torch.device("cpu"):  # real numbers even when the drafter is built on the meta device
            self.inv_freq, self.attention_scaling = self.frequencies(config)  # float64, no buffer: no bf16 cast

    def frequencies(self, config: DrafterShape) -> tuple[torch.Tensor, float]:
        return inverse_frequencies(config.rope_parameters, config.head_dim, config.max_position_embeddings)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype):
        acc = torch.promote_types(dtype, torch.float32)
        freqs = position_ids[..., None].to(acc) * self.inv_freq.to(position_ids.device, acc)
        emb = freqs.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, d]; cos/sin [B, T, d] (Llama's rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.unsqueeze(2) + torch.cat((-x2, x1), dim=-1) * sin.unsqueeze(2)


# ---------------------------------------------------------------------------- the kind


class LlamaAttentionKind(AttentionKind):
    name = "llama"
    label = "a Llama-attention drafter"
    architecture = "LlamaForCausalLMEagle3"
    model_type = "llama"
    rotary_embedding = RotaryEmbedding
    rope_reading = staticmethod(llama_yarn_reading)
    rope_fields_read = YARN_FIELDS
    rope_quantities = "extrapolation, magnitude"
    chain_keeps_input = True  # its keys and values are wider than the step's input

    def attention(self, config: DrafterShape, rms_norm: type[nn.Module]) -> nn.Module:
        return LlamaAttention(config)

    def validate(self, cfg: DrafterShape) -> None:
        check_rope(cfg.rope_parameters)

    def qk_head_dim(self, cfg: DrafterShape) -> int:
        return cfg.head_dim

    def from_target(self, target: dict[str, Any], rope: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
        """The target's rope without DeepSeek's yarn magnitude fields (`eagle31.rope.for_llama_drafter`)."""
        return {"rope_parameters": for_llama_drafter(rope)}

    def layer_fields(self, cfg: DrafterShape) -> dict[str, Any]:
        return {"model_type": self.model_type, "head_dim": cfg.head_dim}

    def read_layer(self, layer: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """transformers' `LlamaConfig` reading (defaults included), as vLLM reads it."""
        from transformers import LlamaConfig

        if layer.get("model_type", self.model_type) != self.model_type:
            raise ConfigError(f"only Llama-layer drafters are supported, got model_type={layer['model_type']!r}")
        fields = {k: v for k, v in layer.items() if k not in ("architectures", "model_type")}
        parsed = LlamaConfig(**{**fields, "num_hidden_layers": 1})
        return parsed, {"num_key_value_heads": parsed.num_key_value_heads, "head_dim": parsed.head_dim}
