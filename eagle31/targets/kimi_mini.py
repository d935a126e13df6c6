"""A miniature Kimi K2.6: transformers' DeepSeek-V3 at tiny sizes, Kimi's routing and rope (docs/demo_target.md)."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle31.targets.cache import ensure_built
from eagle31.targets.kimi_tokenizer import build_kimi_tokenizer

KIMI_MINI_BUILD_VERSION = "4"  # bump when the config, the tokenizer or the build changes the files

KIMI_YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0, "original_max_position_embeddings": 4096,
             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
# the latent width vLLM 0.32's CPU MLA kernel takes (DeepSeek-V3's 512 + 64; the miniature's is 16 + 8)
VLLM_CPU_MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}


def kimi_k26_mini_config(vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int, **overrides):
    """The miniature's `DeepseekV3Config` (Kimi K2.6's routing and rope, tiny widths); `overrides` change fields."""
    from transformers import DeepseekV3Config

    values = dict(
        vocab_size=vocab_size, hidden_size=64,
        intermediate_size=128, moe_intermediate_size=32,  # the dense layer, each expert
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        norm_topk_prob=True,
        topk_method="noaux_tc", scoring_func="sigmoid",  # not DeepseekV3Config fields: kept for vLLM (docs/export.md)
        routed_scaling_factor=2.827, num_mtp_layers=0, rms_norm_eps=1e-5, max_position_embeddings=262144,
        rope_parameters=dict(KIMI_YARN), initializer_range=0.3, tie_word_embeddings=False,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
    )  # fmt: skip
    return DeepseekV3Config(**{**values, **overrides})


def build_kimi_k26_mini(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Write the miniature Kimi K2.6 (config, weights, tokenizer) into `out_dir`; `overrides` of its config."""
    from transformers import DeepseekV3ForCausalLM

    tokenizer = build_kimi_tokenizer()
    config = kimi_k26_mini_config(
        len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, **overrides
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DeepseekV3ForCausalLM(config).float()
    model.generation_config.do_sample = False
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def ensure_kimi_k26_mini(seed: int = 0) -> Path:
    """The cached miniature Kimi K2.6, built under a lock on first use."""
    key = f"v{KIMI_MINI_BUILD_VERSION}-seed{seed}"
    return ensure_built("kimi_k26_mini", key, lambda d: build_kimi_k26_mini(d, seed=seed))
