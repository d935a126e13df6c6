"""Multi-head Latent Attention (`drafter.attention=mla`), as vLLM computes it (docs/design.md §3, "The MLA drafter")."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eagle31.attention.kind import AttentionKind, DrafterShape
from eagle31.attention.llama import RotaryEmbedding
from eagle31.errors import ConfigError
from eagle31.kernels.entries import ChainKeysValues
from eagle31.rope import DEEPSEEK_YARN_FIELDS_READ, deepseek_yarn_scales, yarn_frequencies, yarn_mscale


@dataclass
class MLAConfig:
    """The MLA drafter's own fields, `drafter.mla.<field>`: the target's MLA shape where 0 (or unset in a recipe)."""

    q_lora_rank: int = 0  # the queries' latent width (q_a_proj's output)
    kv_lora_rank: int = 0  # the keys' and values' shared latent width (kv_a_proj_with_mqa's, less the rope part)
    qk_nope_head_dim: int = 0  # per head, the query/key dims without rope
    qk_rope_head_dim: int = 0  # per head, the query/key dims with rope (one rope key shared by the heads)
    v_head_dim: int = 0  # per head, the values' dims


class DeepseekRotaryEmbedding(RotaryEmbedding):
    """The MLA drafter's rope on `qk_rope_head_dim` interleaved pairs: default or DeepSeek YaRN (docs/design.md §3)."""

    interleaved = True

    def frequencies(self, config: DrafterShape) -> tuple[torch.Tensor, float]:
        return deepseek_rope_frequencies(config.rope_parameters, config.mla.qk_rope_head_dim)[:2]


def deepseek_rope_frequencies(rope: dict, d: int) -> tuple[torch.Tensor, float, float]:
    """(inv_freq [d/2] float64, cos/sin magnitude, softmax-scale factor) of `DeepseekRotaryEmbedding`."""
    base = 1.0 / float(rope["rope_theta"]) ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    if rope["rope_type"] == "default":
        return base, 1.0, 1.0
    missing = [k for k in ("factor", "original_max_position_embeddings") if k not in rope]
    if missing:
        raise ConfigError(f"drafter.rope_parameters needs {missing[0]} for rope_type={rope['rope_type']!r}")
    factor, original = float(rope["factor"]), int(rope["original_max_position_embeddings"])
    inv_freq = yarn_frequencies(base, rope, original, float(rope.get("extrapolation_factor", 1)))
    all_dim = yarn_mscale(factor, float(rope.get("mscale_all_dim", 0)))
    magnitude = yarn_mscale(factor, float(rope.get("mscale", 1))) / all_dim * float(rope.get("attn_factor", 1))
    return inv_freq, magnitude, all_dim**2


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, d]; cos/sin [B, T, d] with each frequency on a pair of dims, (x0, x1, ..) -> (-x1, x0, ..)."""
    rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return x * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)


def mla_keys_values(latent: torch.Tensor, kv_b_weight: torch.Tensor, num_heads: int, nope: int, v_dim: int):
    """K, V of latent [*, r + rope] by kv_b_proj's weight [nh * (nope + v_dim), r]: k_pe shared, v zero-padded."""
    rank = kv_b_weight.shape[1]
    c_kv, k_pe = latent.split([rank, latent.shape[-1] - rank], dim=-1)
    k_nope, v = F.linear(c_kv, kv_b_weight).unflatten(-1, (num_heads, nope + v_dim)).split([nope, v_dim], dim=-1)
    k = torch.cat([k_nope, k_pe.unsqueeze(-2).expand(*k_pe.shape[:-1], num_heads, k_pe.shape[-1])], dim=-1)
    return k, F.pad(v, (0, k.shape[-1] - v_dim))


class MLAAttention(nn.Module):
    """Projections of the MLA drafter attention (module docstring); the attention itself is `eagle31.kernels`."""

    def __init__(self, config: DrafterShape, rms_norm: type[nn.Module]):
        super().__init__()
        H, nh, eps, mla = config.hidden_size, config.num_attention_heads, config.rms_norm_eps, config.mla
        self.num_heads, self.kv_lora_rank = nh, mla.kv_lora_rank
        self.nope, self.rope, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.qk_dim = self.nope + self.rope
        # query compression is required: vLLM's DeepSeek EAGLE-3 loader fuses q_a_proj with kv_a_proj_with_mqa
        self.q_a_proj = nn.Linear(2 * H, mla.q_lora_rank, bias=False)
        self.q_a_layernorm = rms_norm(mla.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(mla.q_lora_rank, nh * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * H, mla.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = rms_norm(mla.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, nh * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(nh * self.v_dim, H, bias=False)
        with torch.device("cpu"):  # a number even when the drafter is built on the meta device
            self.q_scale = deepseek_rope_frequencies(config.rope_parameters, self.rope)[2]

    def query_entry(self, z: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """z [B, T, 2H] -> q [B, T, nh, nope + rope] (roped, softmax-scale correction folded in) and the entry: the
        latent [B, T, kv_lora_rank + rope], kv_a_layernorm(c_kv) beside the roped k_pe (`mla_keys_values`' input)."""
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(z))).unflatten(-1, (self.num_heads, self.qk_dim))
        c_kv, k_pe = self.kv_a_proj_with_mqa(z).split([self.kv_lora_rank, self.rope], dim=-1)
        q_pe = apply_interleaved_rope(q[..., self.nope :], cos, sin)
        k_pe = apply_interleaved_rope(k_pe.unsqueeze(2), cos, sin).squeeze(2)  # one rope key for every head
        q = torch.cat([q[..., : self.nope], q_pe], dim=-1) * self.q_scale
        return q, (torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1),)

    def chain_keys_values(self) -> ChainKeysValues:
        """The TTT chain decompresses each step's latents a block of tokens at a time (`eagle31.kernels`)."""
        fn = partial(mla_keys_values, num_heads=self.num_heads, nope=self.nope, v_dim=self.v_dim)
        return ChainKeysValues(fn, (self.kv_b_proj.weight,), width=1)

    def step0_keys_values(self) -> ChainKeysValues:
        """The causal (step-0) keys and values, decompressed inside the attention (so they are not saved)."""
        return self.chain_keys_values()

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """attn [B, T, nh, nope + rope] (v padded) -> o_proj of its first v_head_dim columns, [B, T, H]."""
        return self.o_proj(attn[..., : self.v_dim].flatten(2))


# ---------------------------------------------------------------------------- the kind

# rope types an MLA drafter trains exactly as vLLM serves it (`DeepseekRotaryEmbedding`)
MLA_ROPE_TYPES = ("default", "yarn", "deepseek_yarn")
# vLLM's DeepSeek EAGLE-3 drafter (deepseek_eagle3.py) under both registry names
MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")


class MLAAttentionKind(AttentionKind):
    name = "mla"
    label = "an MLA drafter"
    serves_window = False  # vLLM's DeepSeek EAGLE-3 layer builds its MLA attention without a window
    serves_parallel_drafting = False  # ... and has no parallel-drafting path (no mask_hidden)
    config_field, config_type = "mla", MLAConfig  # `DrafterConfig.mla`
    architecture = MLA_ARCHITECTURES[0]
    model_type = "kimi_k2"  # module docstring: vLLM rewrites deepseek_v3 to its MTP drafter
    unmarked_format = "torchspec"
    rotary_embedding = DeepseekRotaryEmbedding
    rope_reading = staticmethod(deepseek_yarn_scales)
    rope_fields_read = DEEPSEEK_YARN_FIELDS_READ
    rope_quantities = "extrapolation, magnitude, softmax factor"
    chain_keeps_input = False  # its latents are what the chain keeps
    min_vllm_fc_norm = "0.33"  # vLLM 0.22's DeepSeek EAGLE-3 class builds fc_norm and never applies it (docs/export.md)

    def attention(self, config: DrafterShape, rms_norm: type[nn.Module]) -> nn.Module:
        return MLAAttention(config, rms_norm)

    def validate(self, cfg: DrafterShape) -> None:
        for name in self.fields():
            value = getattr(cfg.mla, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"drafter.mla.{name} must be a positive integer for attention=mla, got {value!r}")
        if cfg.mla.qk_rope_head_dim % 2:
            raise ConfigError(f"drafter.mla.qk_rope_head_dim must be even, got {cfg.mla.qk_rope_head_dim}")
        if cfg.num_key_value_heads != cfg.num_attention_heads:
            raise ConfigError(
                f"drafter.num_key_value_heads={cfg.num_key_value_heads} must equal num_attention_heads="
                f"{cfg.num_attention_heads} for attention=mla (every head has its own key and value)"
            )
        qk = self.qk_head_dim(cfg)
        if cfg.head_dim != qk:
            raise ConfigError(
                f"drafter.head_dim={cfg.head_dim} must be mla.qk_nope_head_dim + mla.qk_rope_head_dim = {qk} for "
                "attention=mla"
            )
        if cfg.mla.v_head_dim > qk:
            raise ConfigError(
                f"drafter.mla.v_head_dim={cfg.mla.v_head_dim} exceeds qk_nope_head_dim + qk_rope_head_dim = {qk}"
            )
        if cfg.norm_before_fc:
            raise ConfigError(
                "drafter.norm_before_fc is not read by vLLM's DeepSeek EAGLE-3 layer: an MLA drafter cannot use it"
            )
        rope_type = cfg.rope_parameters["rope_type"]
        if rope_type not in MLA_ROPE_TYPES:
            raise ConfigError(
                f"drafter.rope_parameters.rope_type={rope_type!r} is not supported for attention=mla "
                "(vLLM's DeepSeek EAGLE-3 layer reads any rope_scaling as DeepSeek YaRN); "
                f"use one of {list(MLA_ROPE_TYPES)}"
            )

    def qk_head_dim(self, cfg: DrafterShape) -> int:
        return cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim

    def from_target(self, target: dict[str, Any], rope: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
        """The target's MLA shape (unless overridden), a key and value per head, and its DeepSeek YaRN block as is."""
        shape = {name: int(target.get(name) or 0) for name in self.fields()}
        given = overrides.get(self.config_field) or {}
        given = given if isinstance(given, dict) else asdict(given)
        shape.update({k: v for k, v in given.items() if v})
        heads = target["num_attention_heads"]
        head_dim = shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"]
        return {"mla": MLAConfig(**shape), "num_key_value_heads": heads, "head_dim": head_dim, "rope_parameters": rope}

    def layer_fields(self, cfg: DrafterShape) -> dict[str, Any]:
        return {"model_type": self.model_type, **asdict(cfg.mla)}

    def recognises(self, layer: dict[str, Any]) -> bool:
        return bool(set(layer.get("architectures") or ()) & set(MLA_ARCHITECTURES)) or "kv_lora_rank" in layer

    def read_layer(self, layer: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """transformers' `DeepseekV3Config` reading (defaults included), as vLLM reads it; a key and value per head."""
        from transformers import DeepseekV3Config

        if not layer.get("q_lora_rank"):
            raise ConfigError(
                "an MLA drafter without q_lora_rank is not supported (vLLM's DeepSeek EAGLE-3 loader needs it)"
            )
        fields = {k: v for k, v in layer.items() if k not in ("architectures", "model_type")}
        parsed = DeepseekV3Config(**{**fields, "num_hidden_layers": 1})
        head_dim = parsed.qk_nope_head_dim + parsed.qk_rope_head_dim
        mla = MLAConfig(**{name: getattr(parsed, name) for name in self.fields()})
        return parsed, {"num_key_value_heads": parsed.num_attention_heads, "head_dim": head_dim, "mla": mla}
