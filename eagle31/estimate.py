"""Parameter counts and a per-GPU memory estimate for a training run (used by `dry_run=true`).

Both drafter types are counted: Llama attention and MLA (`eagle31.mla`, whose keys and
zero-padded values are `head_dim = qk_nope_head_dim + qk_rope_head_dim` wide per head).

The estimate counts, per GPU with FSDP over `world_size` ranks:
  * trainable parameters: fp32 master (4 B) + fp32 gradient (4 B) + AdamW moments (8 B), sharded;
  * the frozen target embedding (stored in the compute dtype), sharded;
  * all-gathered bf16 copies of the parameters during forward/backward (unsharded);
  * the target's lm_head rows used for labels (full vocabulary, compute dtype, not sharded);
  * activations of the TTT unroll: the tensors one drafter step saves for backward, per token
    (with activation checkpointing only each step's inputs and its keys/values are kept, plus one
    step recomputed at a time);
  * the chunked lm_head + KL working set: chunk temporaries, each step's gathered states and
    the fp32 lm_head gradient each step forms in its forward.
It is an estimate for planning (±25%), not a guarantee; `benchmarks/benchmark_train_step.py`
measures the real peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle31.config import DrafterConfig
from eagle31.loss import _LOGITS_BUDGET

GiB = 1024**3


@dataclass
class ParamCounts:
    trainable: int
    frozen_embedding: int

    @property
    def total(self) -> int:
        return self.trainable + self.frozen_embedding


def attention_parameters(cfg: DrafterConfig) -> int:
    """Parameters of the layer's attention (its projections read 2H)."""
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    if cfg.attention == "mla":  # eagle31.mla: q_a + norm + q_b, kv_a + norm + kv_b, o
        qr, kvr = cfg.q_lora_rank, cfg.kv_lora_rank
        q = 2 * H * qr + qr + qr * nh * cfg.qk_head_dim
        kv = 2 * H * (kvr + cfg.qk_rope_head_dim) + kvr + kvr * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        return q + kv + nh * cfg.v_head_dim * H
    nkv, d = cfg.num_key_value_heads, cfg.head_dim
    return 2 * H * (nh * d) + 2 * (2 * H * nkv * d) + nh * d * H  # q, k, v read 2H; o


def count_parameters(cfg: DrafterConfig) -> ParamCounts:
    H, Ht, I = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size
    attn = attention_parameters(cfg)
    mlp = 3 * H * I
    norms = 4 * H + (cfg.num_aux * Ht if cfg.fc_norm else 0) + (cfg.fc_in_features if cfg.norm_before_fc else 0)
    trainable = cfg.fc_in_features * H + attn + mlp + norms + cfg.draft_vocab_size * H
    return ParamCounts(trainable=trainable, frozen_embedding=cfg.vocab_size * H)


def activation_bytes_per_token_step(cfg: DrafterConfig, compute_bytes: int) -> int:
    """Bytes one TTT step saves for backward per token (no activation checkpointing)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = 2 * cfg.num_key_value_heads * cfg.head_dim
    elems = 12 * H + 4 * I + 2 * q + kv  # norms, 2H input, projections, SwiGLU, residuals
    if cfg.attention == "mla":  # latents before/after their norms, kv_b's output (v is padded to head_dim)
        rope = cfg.qk_rope_head_dim
        elems += 2 * cfg.q_lora_rank + 2 * (cfg.kv_lora_rank + rope) + cfg.num_attention_heads * (
            cfg.qk_nope_head_dim + cfg.v_head_dim
        )
    fp32 = 4 * (q + cfg.num_attention_heads)  # attention output and log-sum-exp kept in fp32
    return elems * compute_bytes + fp32


def estimate_memory(
    cfg: DrafterConfig,
    seq_len: int,
    ttt_length: int,
    *,
    world_size: int = 1,
    activation_checkpointing: bool = False,
    compute_bytes: int = 2,
) -> dict[str, float]:
    """GiB per GPU, by component, for one packed sequence of `seq_len` tokens."""
    p = count_parameters(cfg)
    states = p.trainable * 16 / world_size
    embed = p.frozen_embedding * compute_bytes / world_size
    gathered = p.total * compute_bytes
    target_head = cfg.vocab_size * cfg.target_hidden_size * compute_bytes
    step = activation_bytes_per_token_step(cfg, compute_bytes) * seq_len
    kv = 2 * cfg.num_key_value_heads * cfg.head_dim * compute_bytes * seq_len
    if activation_checkpointing:  # inputs + chain keys of every step, one step live at a time
        activations = ttt_length * (2 * cfg.hidden_size * compute_bytes * seq_len + kv) + step
    else:
        activations = ttt_length * step
    features = (cfg.fc_in_features + cfg.target_hidden_size) * compute_bytes * seq_len
    # chunk temporaries, the gathered states of every step, and the fp32 lm_head gradient each
    # step's loss forms in its forward and holds until backward (eagle31.loss.DraftKL)
    loss_work = (
        4 * _LOGITS_BUDGET * 4
        + ttt_length * cfg.hidden_size * compute_bytes * seq_len
        + ttt_length * cfg.draft_vocab_size * cfg.hidden_size * 4
    )
    parts = {
        "param_grad_optimizer_states": states,
        "frozen_embedding": embed,
        "gathered_parameters": gathered,
        "target_lm_head": target_head,
        "activations": activations,
        "target_features": features,
        "loss_working_set": loss_work,
    }
    parts = {k: v / GiB for k, v in parts.items()}
    parts["total"] = sum(parts.values())
    return parts
