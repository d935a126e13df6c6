"""Parameter counts and a per-GPU memory estimate for a training run (used by `dry_run=true`).

Both drafter types are counted: Llama attention and MLA (`eagle31.mla`). The estimate follows
what the code allocates, term by term (`benchmarks/memory_model.py` checks each term against
the bytes the tensors of real training steps hold):

  * `param_grad_optimizer_states`: fp32 master weights, fp32 gradients and AdamW's two moments
    of the trainable parameters (16 B each), sharded over the ranks;
  * `frozen_embedding`: the target's embedding inside the drafter (fp32, sharded with the rest);
  * `gathered_parameters` (FSDP, on GPUs): the compute-dtype copies of every parameter that
    FSDP2 all-gathers for forward and backward (the drafter is one FSDP unit), and the
    unsharded compute-dtype gradients it holds until the reduce-scatter;
  * `target_lm_head`: the target's lm_head rows that make the labels (compute dtype, full
    vocabulary for the argmax; the draft rows again when the draft vocabulary is smaller);
  * `target_features`: the batch's aux and final hidden states (compute dtype);
  * `activations`: what the TTT unroll keeps, `activation_bytes(...)`: with activation
    checkpointing each step's input state, entry (Llama keys/values or MLA latents) and token
    ids; plus the larger of the two moments of the backward (the loss's backward, or one
    recomputed step — its saved tensors, the attention backward's temporaries — while every
    step's state gradient waits);
  * `loss_working_set`: the chunked lm_head + KL (`eagle31.loss.DraftKL`): the one fp32 lm_head
    gradient, d loss / d state of every supervised query, chunk temporaries;
  * `sequence_keys` (`train.sequence_parallel` N > 1, `sequence_keys_bytes`): with each sequence split
    N ways every term above that grows with T is taken at a shard's length and its halo
    (ceil(T / N) + K + 1); this one adds the step-0 keys exchanged between the shards, on the last
    shard's rank (its queries see the whole sequence).

The two backward moments are compared as a whole: `activations` carries the larger one, the
loss terms that are alive at it stay in `loss_working_set`.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle31.attention import _BLOCK_BUDGET
from eagle31.config import DrafterConfig
from eagle31.loss import _LOGITS_BUDGET
from eagle31.sequence_parallel import shard_length
from eagle31.ttt import FEED_FORWARD_BUDGET

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


def _norm(width: int, c: int, input_kept: bool) -> int:
    """Bytes an `RMSNorm` saves per token: its input (unless kept anyway) and its fp32 rsqrt."""
    return (0 if input_kept else c * width) + 4


def entry_elements(cfg: DrafterConfig) -> int:
    """Elements per token of what a step keeps for the later ones: Llama keys + values, MLA latents."""
    if cfg.attention == "mla":
        return cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return 2 * cfg.num_key_value_heads * cfg.head_dim


def _attention_widths(cfg: DrafterConfig) -> tuple[int, int, int]:
    """(q width nh*d, key/value width nkv*d as the kernel sees them, rope/cos width)."""
    if cfg.attention == "mla":
        return cfg.num_attention_heads * cfg.qk_head_dim, cfg.num_attention_heads * cfg.qk_head_dim, cfg.qk_rope_head_dim
    return cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.head_dim


def step_saved_bytes(cfg: DrafterConfig, c: int) -> int:
    """Bytes per token the tensors one recomputed step saves for its backward hold (MLP block chunked,
    `eagle31.ttt`), beyond what the unroll keeps anyway."""
    H = cfg.hidden_size
    q, kv, rope = _attention_widths(cfg)
    nh = cfg.num_attention_heads
    b = _norm(H, c, False) + _norm(H, c, True) + 2 * H * c  # input_layernorm(emb), hidden_norm(h), z
    b += 2 * rope * c + 4 * nh  # cos, sin; the merged log-sum-exp (fp32)
    b += 2 * q * c  # q and the attention output
    if cfg.attention == "mla":
        qr, r = cfg.q_lora_rank, cfg.kv_lora_rank
        b += _norm(qr, c, False)  # q_a_layernorm
        b += _norm(r + cfg.qk_rope_head_dim, c, False)  # kv_a_layernorm: its input is a view of kv_a's output
        b += entry_elements(cfg) * c  # the recomputed latent
        b += 2 * kv * c  # the step-0 keys and (padded) values, decompressed in the step
        b += nh * cfg.v_head_dim * c  # o_proj's input: the unpadded columns, copied
    else:
        b += entry_elements(cfg) * c  # the recomputed keys and values (the step-0 ones are kept)
    b += H * c  # h', the chunked MLP block's input
    return b


def attention_backward_bytes(cfg: DrafterConfig, c: int, device: str) -> tuple[int, int]:
    """Bytes per token `_TTTAttention.backward` holds: (throughout: the incoming gradient and the
    gradients of q, k0, v0 in the compute dtype; while the causal kernel runs: what it allocates
    besides, per device)."""
    q, kv, _ = _attention_widths(cfg)
    grads = q * c + (q + 2 * kv) * c
    if device == "cuda":  # varlen flash: its fp32 dq accumulator
        kernel = 4 * q
    else:  # per document: keys and values repeated to every head, dout and out made contiguous, dq, dk, dv
        kernel = 2 * q * c + 2 * q * c + 3 * q * c
    return grads, kernel


def feed_forward_chunk_bytes(cfg: DrafterConfig, c: int, seq_len: int) -> int:
    """Bytes one checkpointed MLP chunk saves during its backward (independent of T once T passes a chunk)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    rows = min(seq_len, max(1, FEED_FORWARD_BUDGET // I))
    return rows * (_norm(H, c, True) + 4 * I * c + _norm(H, c, False) + 2 * H * c)  # norms, SwiGLU, o and norm(o)


def chain_block_bytes(cfg: DrafterConfig, ttt_length: int, c: int, seq_len: int) -> int:
    """Bytes of one chain block in the backward at the deepest step: its recomputed keys and values and
    their gradients (compute dtype), fp32 copies (unless fp32 already), MLA's kv_b_proj output gradient."""
    q, kv, _ = _attention_widths(cfg)
    j = max(1, ttt_length - 1)
    rows = min(seq_len, max(1, _BLOCK_BUDGET // (j * q)))
    per_row = 2 * kv * (2 * c + (4 if c != 4 else 0))
    fixed = 0
    if cfg.attention == "mla":  # and kv_b_proj's weight gradient: the fp32 sum over blocks and one block's
        per_row += cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * c
        fixed = 2 * 4 * cfg.kv_lora_rank * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return rows * j * per_row + fixed


def activation_bytes(cfg: DrafterConfig, seq_len: int, ttt_length: int, *, checkpointing: bool, c: int, device: str) -> dict[str, int]:
    """The unroll's terms in bytes: `kept` (from the forward to the backward), `step` (the one step
    whose backward is running: its recomputed saved tensors, with checkpointing, and the attention
    backward's temporaries)."""
    H, I, T, K = cfg.hidden_size, cfg.intermediate_size, seq_len, ttt_length
    kept_per_step = H * c + entry_elements(cfg) * c + 16  # input state, entry, token ids and positions (int64)
    grads, kernel = attention_backward_bytes(cfg, c, device)
    # the attention's backward: the causal kernel, then the chain blocks, one after the other
    backward = grads * T + max(kernel * T, chain_block_bytes(cfg, K, c, T))
    if not checkpointing:  # every step keeps what it saves (its entry is the kept one), the whole MLP block's too
        mlp_block = _norm(H, c, False) + 4 * I * c + _norm(H, c, False) - H * c  # h' is the norm's input
        saved = step_saved_bytes(cfg, c) - entry_elements(cfg) * c
        return {"kept": K * (kept_per_step + saved + mlp_block) * T, "step": backward}
    # the MLP chunks' backward comes before the attention's
    later = max(backward, feed_forward_chunk_bytes(cfg, c, T))
    return {"kept": K * kept_per_step * T, "step": step_saved_bytes(cfg, c) * T + later}


def largest_layer_weight(cfg: DrafterConfig) -> int:
    """Elements of the decoder layer's largest weight (its gradient is one temporary of a step's backward)."""
    H, I, nh = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    if cfg.attention == "mla":
        attention = [2 * H * cfg.q_lora_rank, cfg.q_lora_rank * nh * cfg.qk_head_dim,
                     cfg.kv_lora_rank * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), nh * cfg.v_head_dim * H]  # fmt: skip
    else:
        attention = [2 * H * nh * cfg.head_dim, 2 * H * cfg.num_key_value_heads * cfg.head_dim, nh * cfg.head_dim * H]
    return max(H * I, *attention)


def loss_moment_bytes(cfg: DrafterConfig, seq_len: int, ttt_length: int, *, c: int, fsdp: bool) -> dict[str, int]:
    """What is alive when `DraftKL.backward` runs: d loss / d state of every supervised query (saved)
    and the state gradients it makes of them, the one fp32 lm_head gradient (and its cast to the
    gathered weight's dtype under FSDP), one chunk's fp32 temporaries."""
    H, Vd, T = cfg.hidden_size, cfg.draft_vocab_size, seq_len
    state = ttt_length * H * c * T
    return {
        "saved_dh": state,
        "state_gradients": state,
        "lm_head_gradient": Vd * H * 4 + (Vd * H * c if fsdp else 0),
        # one chunk's fp32 [rows, Vd] temporaries: label log-probs and their rows per query, draft
        # log-probs, p = exp(label), and the KL's two intermediates (then exp(logq) and dz)
        "chunk": min(T, max(1, _LOGITS_BUDGET // Vd)) * Vd * 4 * 6,
    }


def sequence_keys_bytes(cfg: DrafterConfig, seq_len: int, c: int) -> int:
    """Bytes the last rank of a sequence group holds for the keys of the whole sequence
    (`eagle31.sequence_parallel`): the gathered step-0 entry (kept across steps), in the step's backward
    MLA's decompressed step-0 keys and values, their gradients, and the fp32 gradient of the gathered
    entry that is reduce-scattered back."""
    _, kv, _ = _attention_widths(cfg)
    entry = entry_elements(cfg)
    decompressed = 2 * kv * c if cfg.attention == "mla" else 0  # Llama: the entry is the keys and values
    return seq_len * (entry * c + decompressed + 2 * kv * c + entry * 4)


def estimate_memory(
    cfg: DrafterConfig,
    seq_len: int,
    ttt_length: int,
    *,
    world_size: int = 1,
    activation_checkpointing: bool = False,
    compute_bytes: int = 2,
    device: str = "cuda",
    sequence_parallel: int = 1,
) -> dict[str, float]:
    """GiB per GPU, by component, for one packed sequence of `seq_len` tokens.

    device: `cuda` (FSDP2 on GPUs, as trained) or `cpu` (one plain process, as the CPU memory
    benchmark runs: no gathered copies, one dtype throughout). sequence_parallel: the ranks each
    sequence is split over (module docstring).
    """
    c, T, K, H = compute_bytes, seq_len, ttt_length, cfg.hidden_size
    if sequence_parallel > 1:  # a shard and its halo
        T = shard_length(seq_len, sequence_parallel, K) + K + 1
    V, Vd, Ht = cfg.vocab_size, cfg.draft_vocab_size, cfg.target_hidden_size
    fsdp = device == "cuda"
    p = count_parameters(cfg)
    states = p.trainable * 16 / world_size
    embed = p.frozen_embedding * 4 / (world_size if fsdp else 1)
    gathered = (p.total + p.trainable) * c if fsdp else 0  # parameters, and the gradients before reduce-scatter
    target_head = V * Ht * c + (Vd * Ht * c if Vd < V else 0) + V  # + the in-draft mask
    features = (cfg.fc_in_features + Ht) * c * T
    act = activation_bytes(cfg, T, K, checkpointing=activation_checkpointing, c=c, device=device)
    loss = loss_moment_bytes(cfg, T, K, c=c, fsdp=fsdp)
    state_grads = loss["state_gradients"]
    # the two moments of the backward: the loss's and one step's (the state gradients wait; dW is gone)
    loss_moment = sum(loss.values())
    # and, from the second step's backward on, a layer weight's gradient before it is added to .grad
    step = act["step"] + largest_layer_weight(cfg) * (c if fsdp else 4)
    if loss_moment >= state_grads + step:
        activations, loss_work = act["kept"], loss_moment
    else:
        activations, loss_work = act["kept"] + step, state_grads
    parts = {
        "param_grad_optimizer_states": states,
        "frozen_embedding": embed,
        "gathered_parameters": gathered,
        "target_lm_head": target_head,
        "activations": activations,
        "target_features": features,
        "loss_working_set": loss_work,
    }
    if sequence_parallel > 1:
        parts["sequence_keys"] = sequence_keys_bytes(cfg, seq_len, c)
    parts = {k: v / GiB for k, v in parts.items()}
    parts["total"] = sum(parts.values())
    return parts


def longest_fitting_length(cfg: DrafterConfig, ttt_length: int, gpu_memory_gib: float, **kwargs) -> int:
    """The longest T (a multiple of 1024) whose estimate fits `gpu_memory_gib`; 0 if none does."""
    fits = lambda T: estimate_memory(cfg, T, ttt_length, **kwargs)["total"] <= gpu_memory_gib  # noqa: E731
    if not fits(1024):
        return 0
    lo, hi = 1, 2
    while fits(hi * 1024):
        lo, hi = hi, hi * 2
        if hi > 1 << 14:  # 16M tokens: beyond any plan
            return lo * 1024
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * 1024) else (lo, mid)
    return lo * 1024

