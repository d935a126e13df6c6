"""Multi-head Latent Attention (`drafter.attention=mla`): the published Kimi K2.6 drafter, vLLM's DeepSeek EAGLE-3 layer.

DeepSeek-V2/V3's attention on the 2H-wide input (`eagle31.mla` computes it). The TTT chain keeps each
step's latent (kv_lora_rank + rope values per token) and decompresses keys and values where it attends.

Export: vLLM's DeepSeek EAGLE-3 loader (`deepseek_eagle3.py`) reads the EAGLE-3 HF layout with
`architectures: ["Eagle3DeepseekV2ForCausalLM"]`, `model_type: "kimi_k2"` (as TorchSpec and the published
Kimi drafters write it) and the MLA shape. The model type is `kimi_k2` for every MLA drafter, a Kimi or a
DeepSeek-V3 target alike: vLLM maps it to `DeepseekV3Config` (its `transformers_utils/config.py` registry),
and its `SpeculativeConfig.hf_config_override` leaves it alone, whereas it turns `deepseek_v3` into DeepSeek's
MTP drafter (`DeepSeekMTPModel`, whose EAGLE-3 name no registry has), in 0.22 and 0.33 alike.

Reading: a checkpoint with vLLM's DeepSeek EAGLE-3 architecture under either registry name, or with
`kv_lora_rank`, is an MLA drafter; one eagle31 did not write is TorchSpec's (the published Kimi MLA
drafters, e.g. `lightseekorg/kimi-k2.6-eagle3.1-mla`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eagle31.drafter_attention.kind import AttentionKind
from eagle31.errors import ConfigError
from eagle31.rope import DEEPSEEK_YARN_FIELDS_READ, deepseek_yarn_scales

if TYPE_CHECKING:
    from eagle31.config import DrafterConfig

# rope types an MLA drafter trains exactly as vLLM serves it (`eagle31.mla.DeepseekRotaryEmbedding`)
MLA_ROPE_TYPES = ("default", "yarn", "deepseek_yarn")
# vLLM's DeepSeek EAGLE-3 drafter (deepseek_eagle3.py) under both registry names
MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")


class MLAAttentionKind(AttentionKind):
    name = "mla"
    label = "an MLA drafter"
    fields = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    architecture = MLA_ARCHITECTURES[0]
    model_type = "kimi_k2"  # module docstring: vLLM rewrites deepseek_v3 to its MTP drafter
    unmarked_format = "torchspec"
    rope_fields_read = DEEPSEEK_YARN_FIELDS_READ
    rope_quantities = "extrapolation, magnitude, softmax factor"

    def validate(self, cfg: DrafterConfig) -> None:
        for name in self.fields:
            value = getattr(cfg, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"drafter.{name} must be a positive integer for attention=mla, got {value!r}")
        if cfg.qk_rope_head_dim % 2:
            raise ConfigError(f"drafter.qk_rope_head_dim must be even, got {cfg.qk_rope_head_dim}")
        if cfg.num_key_value_heads != cfg.num_attention_heads:
            raise ConfigError(
                f"drafter.num_key_value_heads={cfg.num_key_value_heads} must equal num_attention_heads="
                f"{cfg.num_attention_heads} for attention=mla (every head has its own key and value)"
            )
        qk = self.qk_head_dim(cfg)
        if cfg.head_dim != qk:
            raise ConfigError(
                f"drafter.head_dim={cfg.head_dim} must be qk_nope_head_dim + qk_rope_head_dim = {qk} for attention=mla"
            )
        if cfg.v_head_dim > qk:
            raise ConfigError(f"drafter.v_head_dim={cfg.v_head_dim} exceeds qk_nope_head_dim + qk_rope_head_dim = {qk}")
        if cfg.norm_before_fc:
            raise ConfigError(
                "drafter.norm_before_fc is not read by vLLM's DeepSeek EAGLE-3 layer: an MLA drafter cannot use it"
            )
        rope_type = cfg.rope_parameters["rope_type"]
        if rope_type not in MLA_ROPE_TYPES:
            raise ConfigError(
                f"drafter.rope_parameters.rope_type={rope_type!r} is not supported for attention=mla "
                f"(vLLM's DeepSeek EAGLE-3 layer reads any rope_scaling as DeepSeek YaRN); use one of {list(MLA_ROPE_TYPES)}"
            )

    def qk_head_dim(self, cfg: DrafterConfig) -> int:
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim

    def from_target(self, target: dict[str, Any], rope: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
        """The target's MLA shape (ranks and head dims, unless overridden), every head its own key and value, and its
        DeepSeek YaRN block as it is, mscale fields included (as the published Kimi K2.6 EAGLE 3.1 drafter has)."""
        shape = {name: int(target.get(name) or 0) for name in self.fields}
        shape.update({k: v for k, v in overrides.items() if k in self.fields})
        heads = target["num_attention_heads"]
        head_dim = shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"]
        return {**shape, "num_key_value_heads": heads, "head_dim": head_dim, "rope_parameters": rope}

    def rope_reading(self, rope: dict[str, Any], release: str) -> tuple[float, ...]:
        return deepseek_yarn_scales(rope, release)

    # ------------------------------------------------------------------ estimate

    def attention_parameters(self, cfg: DrafterConfig) -> int:
        """q_a + norm + q_b, kv_a + norm + kv_b, o (`eagle31.mla.MLAAttention`)."""
        H, nh, qr, kvr = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
        q = 2 * H * qr + qr + qr * nh * self.qk_head_dim(cfg)
        kv = 2 * H * (kvr + cfg.qk_rope_head_dim) + kvr + kvr * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        return q + kv + nh * cfg.v_head_dim * H

    def attention_widths(self, cfg: DrafterConfig) -> tuple[int, int, int]:
        qk = cfg.num_attention_heads * self.qk_head_dim(cfg)
        return qk, qk, cfg.qk_rope_head_dim

    def o_proj_in_features(self, cfg: DrafterConfig) -> int:
        return cfg.num_attention_heads * cfg.v_head_dim

    def entry_elements(self, cfg: DrafterConfig) -> tuple[int, int]:
        """Its latents, every step."""
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        return latent, latent

    def chain_entry_gradient_elements(self, cfg: DrafterConfig) -> int:
        return self.entry_elements(cfg)[1]  # the latent's

    def step0_keys_remade(self) -> bool:
        return True  # decompressed again from the latents

    def step_saved_extra_bytes(self, cfg: DrafterConfig, c: int) -> int:
        """q_a_layernorm's input and fp32 rsqrt, kv_a_layernorm's (its input a view of kv_a's output), the
        recomputed latent."""
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        return (cfg.q_lora_rank * c + 4) + (latent * c + 4) + self.entry_elements(cfg)[1] * c

    def after_attention_saved_elements(self, cfg: DrafterConfig) -> int:
        return self.o_proj_in_features(cfg)  # o_proj's input: the attention output's unpadded columns

    def chain_block_terms(self, cfg: DrafterConfig, c: int) -> tuple[int, int, int, int]:
        """kv_b_proj's output gradient per row; the keys' gradient made contiguous for the unflatten and the values'
        cut from their zero padding; kv_b_proj's gradient, and step 0's (made before the chain, returned after it)."""
        _, kv, _ = self.attention_widths(cfg)
        kv_b = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        weights = cfg.kv_lora_rank * kv_b
        return kv_b * c, (kv + self.o_proj_in_features(cfg)) * c, weights, weights * c

    def prefix_block_extra_elements(self, cfg: DrafterConfig) -> int:
        """The keys and values decompressed, with kv_b_proj's output and its gradient."""
        _, kv, _ = self.attention_widths(cfg)
        return 2 * kv + 2 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)

    # ------------------------------------------------------------ export, convert

    def layer_fields(self, cfg: DrafterConfig) -> dict[str, Any]:
        return {"model_type": self.model_type, **{name: getattr(cfg, name) for name in self.fields}}

    def recognises(self, layer: dict[str, Any]) -> bool:
        return bool(set(layer.get("architectures") or ()) & set(MLA_ARCHITECTURES)) or "kv_lora_rank" in layer

    def read_layer(self, layer: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """transformers' `DeepseekV3Config` reading (defaults included), as vLLM reads it; every head its own key
        and value."""
        from transformers import DeepseekV3Config

        if not layer.get("q_lora_rank"):
            raise ConfigError("an MLA drafter without q_lora_rank is not supported (vLLM's DeepSeek EAGLE-3 loader needs it)")
        fields = {k: v for k, v in layer.items() if k not in ("architectures", "model_type")}
        parsed = DeepseekV3Config(**{**fields, "num_hidden_layers": 1})
        shape = {name: getattr(parsed, name) for name in self.fields}
        heads = {"num_key_value_heads": parsed.num_attention_heads, "head_dim": self.qk_head_dim(parsed)}
        return parsed, {**heads, **shape}
