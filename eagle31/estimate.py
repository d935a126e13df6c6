"""Parameter counts, the model FLOPs of a training step and a per-GPU memory estimate for a training run
(used by `dry_run=true`).

Every attention kind is counted, what differs between them on the kind's class (`eagle31.attention`:
its parameters, widths, entries and extra saved tensors). The estimate follows
what the code allocates, term by term (`benchmarks/memory_model.py` checks each term against
the bytes the tensors of real training steps hold):

  * `param_grad_optimizer_states`: fp32 master weights, fp32 gradients and AdamW's two moments
    of the trainable parameters (16 B each), sharded over the ranks;
  * `frozen_embedding`: the target's embedding inside the drafter: under FSDP outside the shards,
    whole on every GPU in the compute dtype (`eagle31.trainer.shard_for_training`); fp32 in one
    plain CPU process;
  * `gathered_parameters` (FSDP, on GPUs): the compute-dtype copies of the trainable parameters
    that FSDP2 all-gathers for forward and backward (the drafter is one FSDP unit), and the
    unsharded compute-dtype gradients it holds until the reduce-scatter;
  * `target_lm_head`: the target's lm_head rows that make the labels (compute dtype, full
    vocabulary for the argmax; the draft rows again when the draft vocabulary is smaller);
  * `target_features`: the batch's aux and final hidden states (compute dtype);
  * `activations`: what the TTT unroll keeps, `activation_bytes(...)`: with activation
    checkpointing each step's input state, token ids and positions, step 0's keys and values
    (Llama) or every step's latents (MLA); plus the largest moment of the backward: the loss's
    backward, or the largest over the steps k of step k's (its saved tensors and the largest
    moment of its backward: MLP chunks, causal kernel, chain blocks k entries deep — while every
    step's state gradient waits; on CPU also the layer's gradient buffers made by then,
    `layer_gradient_bytes`: the deepest step, whose backward runs first, has only those of the
    weights after the attention when its attention's backward runs);
  * `loss_working_set`: the chunked lm_head + loss (`eagle31.loss.FusedDraftLoss`): the one fp32 lm_head
    gradient, d loss / d state of every supervised query, chunk temporaries;
  * `sequence_keys` (`train.sequence_parallel` N > 1, `sequence_keys_bytes`): with each sequence split
    N ways every term above that grows with T is taken at a shard's length and its halo
    (ceil(T / N) + K + 1); this one adds the step-0 entries exchanged between the shards, on the last
    shard's rank (its queries see the whole sequence), and one block of the keys made of them.

A sliding window of W positions (`DrafterConfig.sliding_window`) bounds what attention costs per query:
`step_flops` counts each query's visible keys (at most W - k step-0 keys at step k, not p + 1), and
`sequence_keys` holds the step-0 entries of the keys a shard's queries can see (its own positions and the
W - 1 before it, not the whole sequence). The other terms are linear in T with or without it; on CPU
the causal kernel's per-document temporaries (`attention_backward_bytes`) are then those of one block of
W queries and their 2W - 1 keys, so the term taken at the whole document is an upper bound.

The backward's moments are compared as a whole: `activations` carries the largest one, the
loss terms that are alive at it stay in `loss_working_set`. `total` is the peak: the terms' sum,
less the gradients that do not exist yet at that moment (`gradients_after_the_peak`, negative).
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle31.config import DrafterConfig
from eagle31.kernels.causal import BLOCK_BUDGET
from eagle31.loss import _LOGITS_BUDGET
from eagle31.sequence_parallel import shard_length
from eagle31.sequence_parallel.query_tail import QueryTail
from eagle31.ttt import FEED_FORWARD_BUDGET

GiB = 1024**3


@dataclass
class ParamCounts:
    trainable: int
    frozen_embedding: int

    @property
    def total(self) -> int:
        return self.trainable + self.frozen_embedding


def count_parameters(cfg: DrafterConfig) -> ParamCounts:
    H, Ht, I = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size
    attn = cfg.kind.attention_parameters(cfg)
    mlp = 3 * H * I
    norms = 4 * H + (cfg.num_aux * Ht if cfg.fc_norm else 0) + (cfg.fc_in_features if cfg.norm_before_fc else 0)
    trainable = cfg.fc_in_features * (H + cfg.parallel_drafting) + attn + mlp + norms + cfg.draft_vocab_size * H
    return ParamCounts(trainable=trainable, frozen_embedding=cfg.vocab_size * H)


def visible_key_pairs(seq_len: int, ttt_length: int, window: int | None) -> list[int]:
    """Per TTT step k, the (query, key) pairs its attention scores over one document of T positions: the step-0
    keys of positions max(0, p + k - W + 1) .. p for the query at p (all of 0..p without a window), plus its k
    chain keys."""
    T, pairs = seq_len, []
    for k in range(ttt_length):
        n = T if window is None else min(T, window - k)  # the most step-0 keys a query sees
        causal = n * (n + 1) // 2 + (T - n) * n  # query p sees min(p + 1, n)
        pairs.append(causal + k * T)
    return pairs


def step_flops(cfg: DrafterConfig, seq_len: int, ttt_length: int) -> int:
    """Model FLOPs of one training step on one sequence of T = `seq_len` tokens (one document).

    Matrix multiplications only, 2 FLOPs per multiply-add, backward = 2x forward for
    trainable layers whose input also needs a gradient (PaLM's convention, no
    recomputation counted — activation checkpointing and the loss's recomputed logits
    are overhead, not model FLOPs):

        fc (input has no gradient: forward + weight gradient)     2 * 2 T (n Ht) H
        per TTT step, 3x forward of
            the attention's projections (2H wide input), o, SwiGLU MLP, lm_head
                Llama: 2 T (2H (nh + 2 nkv) d + nh d H + 3 H I + H Vd)
                MLA:   2 T (2H (qr + kvr + dr) + qr nh dqk + kvr nh (dn + dv) + nh dv H + 3 H I + H Vd)
            attention: QK^T and PV over the keys each query sees     2 nh (dqk + dv) x `visible_key_pairs`

    The labels (target lm_head rows, the full-vocabulary argmax) are data preparation and
    not counted.
    """
    T, K = seq_len, ttt_length
    H, I, Vd, nh = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size, cfg.num_attention_heads
    fc = 2 * 2 * T * cfg.fc_in_features * H
    dqk, dv = head_dims(cfg)
    projections = cfg.kind.attention_parameters(cfg)  # 2 FLOPs a weight a token (an MLA's two norms too: < 0.1%)
    dense = 2 * T * (projections + 3 * H * I + H * Vd)
    attention = sum(2 * nh * (dqk + dv) * n for n in visible_key_pairs(T, K, cfg.sliding_window))
    return fc + 3 * (K * dense + attention)


def head_dims(cfg: DrafterConfig) -> tuple[int, int]:
    """(q·k head dim, value head dim) of the drafter's attention kind."""
    return cfg.kind.qk_head_dim(cfg), cfg.kind.o_proj_in_features(cfg) // cfg.num_attention_heads


def attention_flops_share(cfg: DrafterConfig, seq_len: int, ttt_length: int) -> float:
    """The share of `step_flops` spent in the attention's QK^T and PV."""
    nh = cfg.num_attention_heads
    dqk, dv = head_dims(cfg)
    attention = 3 * sum(2 * nh * (dqk + dv) * n for n in visible_key_pairs(seq_len, ttt_length, cfg.sliding_window))
    return attention / step_flops(cfg, seq_len, ttt_length)


def _norm(width: int, c: int, input_kept: bool) -> int:
    """Bytes an `RMSNorm` saves per token: its input (unless kept anyway) and its fp32 rsqrt."""
    return (0 if input_kept else c * width) + 4


def kept_bytes(cfg: DrafterConfig, ttt_length: int, c: int) -> int:
    """Bytes per token the unroll keeps from the forward to the backward with checkpointing: every step's
    input state, token ids and positions (int64), and the entries (the kind's `entry_elements`: Llama's step-0
    keys and values, MLA's latents of every step)."""
    step0, later = cfg.kind.entry_elements(cfg)
    return ttt_length * (cfg.hidden_size * c + 16) + (step0 + (ttt_length - 1) * later) * c


def step_saved_bytes(cfg: DrafterConfig, c: int) -> int:
    """Bytes per token a recomputed step (k >= 1) saves for the backward of what runs before its
    attention output, beyond what the unroll keeps anyway: alive while its attention's backward runs."""
    H = cfg.hidden_size
    q, kv, rope = cfg.kind.attention_widths(cfg)
    nh = cfg.num_attention_heads
    b = _norm(H, c, False) + _norm(H, c, True) + 2 * H * c  # input_layernorm(emb), hidden_norm(h), z
    b += 2 * rope * c + 4 * nh  # cos, sin; the merged log-sum-exp (fp32)
    b += 2 * q * c  # q and the attention output
    return b + cfg.kind.step_saved_extra_bytes(cfg, c)  # MLA: its norms' inputs, the recomputed latent


def step_after_attention_bytes(cfg: DrafterConfig, c: int) -> int:
    """Bytes per token a recomputed step saves for what runs after its attention (freed before the
    attention's backward): h', the chunked MLP block's input, and MLA's o_proj input (unpadded columns)."""
    return (cfg.hidden_size + cfg.kind.after_attention_saved_elements(cfg)) * c


def attention_backward_bytes(cfg: DrafterConfig, c: int, device: str, depth: int) -> dict[str, int]:
    """Bytes per token `_TTTAttention.backward` holds at a step of chain depth `depth` (step k: k entries):
    `throughout` the incoming gradient and dq (compute dtype); `causal` while the causal kernel's backward
    runs: dk0, dv0, MLA's re-decompressed k0, v0, and what the kernel allocates besides, per device;
    `chain` while the chain blocks run: the gradients of the `depth` chain entries and of the step-0 entry
    (made by the causal part, returned after the chain: Llama's dk0, dv0; MLA's latent's)."""
    q, kv, _ = cfg.kind.attention_widths(cfg)
    if device == "cuda":  # varlen flash: its fp32 dq accumulator
        kernel = 4 * q
    else:  # per document: keys and values repeated to every head, dout and out made contiguous, dq, dk, dv
        kernel = 2 * q * c + 2 * q * c + 3 * q * c
    causal = 2 * kv * c * (2 if cfg.kind.step0_keys_remade() else 1) + kernel
    entry_grad = cfg.kind.chain_entry_gradient_elements(cfg)  # Llama: d feature
    entry0_grad = cfg.kind.entry_elements(cfg)[0]
    return {"throughout": 2 * q * c, "causal": causal, "chain": (depth * entry_grad + entry0_grad) * c}


def feed_forward_chunk_bytes(cfg: DrafterConfig, c: int, seq_len: int) -> int:
    """Bytes one checkpointed MLP chunk saves during its backward (independent of T once T passes a chunk)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    rows = min(seq_len, max(1, FEED_FORWARD_BUDGET // I))
    return rows * (_norm(H, c, True) + 4 * I * c + _norm(H, c, False) + 2 * H * c)  # norms, SwiGLU, o and norm(o)


def chain_block_bytes(cfg: DrafterConfig, depth: int, c: int, seq_len: int) -> int:
    """Bytes of one chain block in the backward of a step of chain depth `depth` >= 1, at the larger of
    its two moments. Both hold the block's depth x rows remade keys and values, their gradients (compute
    dtype) and fp32 copies (unless fp32 already), the graph that remakes them (MLA: kv_b_proj's output
    gradient; Llama: the rows' embedding, z and its gradient, one key gradient), the fp32 sum of that
    graph's weight gradients over the blocks and MLA's step-0 kv_b_proj gradient (made before the chain,
    returned after it); then either the block's own weight gradients (`autograd.grad` has made them) or,
    earlier in that graph's backward, its intermediate gradients: MLA's keys' gradient made contiguous for
    the unflatten and the values' cut from their zero padding; Llama's rope backward (the key's gradient
    through cos and through sin, the rotated half, their sum)."""
    q, kv, _ = cfg.kind.attention_widths(cfg)
    rows = min(seq_len, max(1, BLOCK_BUDGET // (depth * q)))  # `eagle31.kernels.ttt_attention._chain_rows`
    graph, intermediate, weights, step0_weights = cfg.kind.chain_block_terms(cfg, c)
    per_row = 2 * kv * (2 * c + (4 if c != 4 else 0)) + graph
    held = rows * depth * per_row + weights * 4 + step0_weights
    return held + max(weights * c, rows * depth * intermediate)


def layer_gradient_bytes(cfg: DrafterConfig) -> int:
    """The gradients of the weights every step uses (the decoder layer, the final norm): autograd holds
    each as one buffer from the first step's backward on and adds it to `.grad` after the last. Under
    FSDP2 these are the unsharded gradients (`gathered_parameters`); in one plain CPU process, fp32."""
    p = count_parameters(cfg)
    return (p.trainable - cfg.fc_in_features * cfg.hidden_size - cfg.draft_vocab_size * cfg.hidden_size) * 4


def after_attention_gradient_bytes(cfg: DrafterConfig) -> int:
    """The part of `layer_gradient_bytes` there when the deepest step's attention backward runs: the
    weights after the attention (o_proj, the MLP, post_attention_layernorm, the final norm), whose backward
    comes first; the attention's projections and the norms before them get theirs after it."""
    H = cfg.hidden_size
    o_proj = cfg.kind.o_proj_in_features(cfg) * H
    return (o_proj + 3 * H * cfg.intermediate_size + 2 * H) * 4


def activation_bytes(
    cfg: DrafterConfig, seq_len: int, ttt_length: int, *, checkpointing: bool, c: int, device: str
) -> dict:
    """The unroll's bytes: `kept`, what is alive from the forward to the loss's backward, and `steps`, for
    each TTT step k = 0..K-1 (the backward runs k = K-1 first) what is alive at the largest moment of its
    backward: what is left of `kept`, its recomputed saved tensors (with checkpointing), the larger of the
    moments of its backward (the MLP chunks', the attention's causal kernel, its chain blocks, k entries
    deep), the step-0 entry's gradient the deeper steps made (summed, waiting for step 0's) and, on CPU,
    the layer's gradient buffers made so far (the deepest step's attention runs before its projections
    have theirs, the others' after: `after_attention_gradient_bytes`, `layer_gradient_bytes`).
    The peak is the largest of `steps`; which step's depends on T: a chain block grows with k and, up to
    `BLOCK_BUDGET`, with T; the gradient buffers are fixed."""
    H, I, T, K = cfg.hidden_size, cfg.intermediate_size, seq_len, ttt_length
    saved = step_saved_bytes(cfg, c)
    after = step_after_attention_bytes(cfg, c)
    mlp_block = _norm(H, c, False) + 4 * I * c + _norm(H, c, False)
    per_step = saved + after + mlp_block - H * c  # without checkpointing, what a step saves (h' is the norm's input)
    entries = kept_bytes(cfg, K, c) * T
    kept = entries + (0 if checkpointing else K * per_step * T)
    steps = []
    for k in range(K):
        attn = attention_backward_bytes(cfg, c, device, k)
        chain = attn["chain"] * T + chain_block_bytes(cfg, k, c, T) if k else 0
        attention = attn["throughout"] * T + max(attn["causal"] * T, chain)
        # after the deepest step, the step-0 entry's gradient summed over the deeper steps waits for step 0
        waiting = cfg.kind.entry_elements(cfg)[0] * c * T if k < K - 1 else 0
        grads = 0
        if device == "cpu":
            grads = after_attention_gradient_bytes(cfg) if k == K - 1 else layer_gradient_bytes(cfg)
        if checkpointing:  # the MLP chunks' backward comes before the attention's, h' (and MLA's o_proj input) with it
            mlp = after * T + feed_forward_chunk_bytes(cfg, c, T)
            steps.append(entries + saved * T + max(attention, mlp) + waiting + grads)
        else:  # the steps after k have freed what they saved, k its MLP block's: its attention's backward runs
            steps.append(entries + (k * per_step + saved) * T + attention + waiting + grads)
    return {"kept": kept, "steps": steps}


def loss_moment_bytes(cfg: DrafterConfig, seq_len: int, ttt_length: int, *, c: int, fsdp: bool) -> dict[str, int]:
    """What is alive when `FusedDraftLoss.backward` runs: d loss / d state of every supervised query (saved)
    and the state gradients it makes of them, the one fp32 lm_head gradient (and its cast to the
    gathered weight's dtype under FSDP), one chunk's fp32 temporaries."""
    H, Vd, T = cfg.hidden_size, cfg.draft_vocab_size, seq_len
    state = ttt_length * H * c * T
    return {
        "saved_dh": state,
        "state_gradients": state,
        "lm_head_gradient": Vd * H * 4 + (Vd * H * c if fsdp else 0),
        # one chunk's fp32 [rows, Vd] temporaries: label log-probs and their rows per query, draft
        # log-probs, q = exp(logq), p = exp(label), and the KL's two intermediates (then dz)
        "chunk": min(T, max(1, _LOGITS_BUDGET // Vd)) * Vd * 4 * 7,
    }


def sequence_keys_bytes(cfg: DrafterConfig, seq_len: int, c: int, shard: int | None = None) -> int:
    """Bytes the last rank of a sequence group holds for the keys of the whole sequence
    (`eagle31.sequence_parallel`): the gathered step-0 entry (kept across steps) and, in the step's
    backward, its gradient and the fp32 copy of that which is reduce-scattered back. The keys and values
    of the positions before the shard exist one block at a time (`prefix_block_bytes`), whatever T. With
    a sliding window W only the keys its queries see are gathered: its `shard` positions and W - 1 before."""
    entry, _ = cfg.kind.entry_elements(cfg)  # the step-0 entry is what is gathered
    keys = seq_len
    if cfg.sliding_window is not None and shard is not None:
        keys = min(seq_len, shard + cfg.sliding_window - 1)
    return keys * entry * (2 * c + 4) + prefix_block_bytes(cfg, c)


def prefix_block_bytes(cfg: DrafterConfig, c: int) -> int:
    """Bytes of one block of the keys before a shard in the backward (`eagle31.sequence_parallel.query_tail.QueryTail`):
    its keys and values made again (MLA: decompressed, with kv_b_proj's output and its gradient; Llama:
    views of the entry), their fp32 copies and gradients, the gradients' cast to the compute dtype, and
    one block of query rows' fp32 scores (probabilities, their gradient and one temporary)."""
    q, kv, _ = cfg.kind.attention_widths(cfg)
    nh = cfg.num_attention_heads
    positions = QueryTail.prefix_block(nh, q // nh)
    rows = max(1, BLOCK_BUDGET // (nh * positions))
    per_position = 2 * kv * (4 + (4 + c if c != 4 else 0))  # fp32 gradients; fp32 copies and the casts back
    per_position += cfg.kind.prefix_block_extra_elements(cfg) * c  # MLA: decompressed, kv_b_proj's output and gradient
    return positions * per_position + 3 * rows * nh * positions * 4


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
    c, T, K = compute_bytes, seq_len, ttt_length
    if sequence_parallel > 1:  # a shard and its halo
        T = shard_length(seq_len, sequence_parallel, K) + K + 1
    V, Vd, Ht = cfg.vocab_size, cfg.draft_vocab_size, cfg.target_hidden_size
    fsdp = device == "cuda"
    p = count_parameters(cfg)
    states = p.trainable * 16 / world_size
    embed = p.frozen_embedding * (c if fsdp else 4)
    gathered = 2 * p.trainable * c if fsdp else 0  # parameters, and the gradients before reduce-scatter
    target_head = V * Ht * c + (Vd * Ht * c if Vd < V else 0) + V  # + the in-draft mask
    features = (cfg.fc_in_features + Ht) * c * T
    act = activation_bytes(cfg, T, K, checkpointing=activation_checkpointing, c=c, device=device)
    loss = loss_moment_bytes(cfg, T, K, c=c, fsdp=fsdp)
    state_grads = loss["state_gradients"]
    # the moments of the backward: the loss's, then each step's (`activation_bytes`: the state gradients
    # wait, dW is gone; on CPU the layer's gradient buffers come, under FSDP they are in `gathered_parameters`)
    loss_moment = sum(loss.values())
    step = max(act["steps"])  # the largest step's moment
    at_loss = act["kept"] + loss_moment >= step + state_grads
    if at_loss:
        activations, loss_work = act["kept"], loss_moment
    else:
        activations, loss_work = step, state_grads
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
        parts["sequence_keys"] = sequence_keys_bytes(cfg, seq_len, c, shard_length(seq_len, sequence_parallel, K))
    parts = {k: v / GiB for k, v in parts.items()}
    parts["gradients_after_the_peak"] = -gradients_after_the_peak(cfg, world_size, device, at_loss) / GiB
    parts["total"] = sum(parts.values())
    return parts


def gradients_after_the_peak(cfg: DrafterConfig, world_size: int, device: str, at_loss: bool) -> int:
    """Bytes of `param_grad_optimizer_states`' fp32 gradients that are not in `.grad` yet at the peak (the
    optimizer sets them to None after each step). Under FSDP2 every sharded gradient: the reduce-scatter
    forms them after the backward, from `gathered_parameters`' unsharded ones. In one CPU process, at
    the loss's backward every one (its lm_head gradient is the loss's), at a step's all but the lm_head's
    (the layer's are autograd's buffers, counted in `activations`; fc's comes last). `total` is the peak:
    the sum of the terms, this one included."""
    trainable = count_parameters(cfg).trainable
    if device == "cuda":
        return trainable * 4 // world_size
    return (trainable - (0 if at_loss else cfg.draft_vocab_size * cfg.hidden_size)) * 4


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
