"""`Eagle31Drafter.unroll` (eagle31/model.py, the spec) in memory linear in T (docs/design.md §4; test_reference.py)."""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

from eagle31.kernels.entries import ChainKeysValues
from eagle31.kernels.ttt_attention import ttt_attention_of_entries
from eagle31.model import TTTOutput, rms_norm, segment_ids, shift_left

# with activation checkpointing, the MLP block is recomputed in token-row chunks of about this many activations
FEED_FORWARD_BUDGET = 1 << 26


def ttt_unroll(
    drafter,
    aux: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    ttt_length: int,
    document_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    attention_kernel: str = "auto",
    activation_checkpointing: bool = False,
    sequence=None,
) -> TTTOutput:
    """`Eagle31Drafter.unroll` in memory linear in T; `attention_kernel`: auto | flash | blockwise | reference (the
    spec's); with `sequence` (a `SequenceShard`) aux holds this rank's T positions, input_ids them and their halo."""
    if attention_kernel == "reference":
        if sequence is not None:
            raise ValueError("the reference attention runs on whole sequences, not on sequence shards")
        return drafter.unroll(
            aux, input_ids, ttt_length=ttt_length, document_ids=document_ids, attention_mask=attention_mask,
            position_ids=position_ids,
        )  # fmt: skip
    if ttt_length < 1:
        raise ValueError(f"ttt_length must be >= 1, got {ttt_length}")
    B, T = aux.shape[:2]
    if sequence is None:
        segments, start = segment_ids(document_ids, attention_mask, (B, T), device=input_ids.device), 0
    else:
        segments, start = sequence.key_segments, sequence.start
    if position_ids is None:
        position_ids = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
    checkpointing = activation_checkpointing and torch.is_grad_enabled()
    run = partial(checkpoint, use_reentrant=False) if checkpointing else lambda fn, *args: fn(*args)
    feature = run(drafter.fuse_aux, aux)  # [B, T, H]; its norms' activations are 3x [B, T, n*Ht]: recomputed too
    expand0, expand = drafter.midlayer.self_attn.step0_keys_values(), chain_keys_values(drafter)
    rule = drafter.visibility

    def step(feature, ids, positions, entry0, *chain):
        # embedding and RoPE made inside the step: recomputed under checkpointing, not kept (docs/performance.md)
        if entry0 is None:  # step 0: its keys are the causal keys of every later step
            q, entry0, residual = step_entry(drafter, feature, ids, positions)
            if sequence is not None:  # every shard's up to this one's end
                entry0 = sequence.gather(entry0)
        else:  # step k >= 1: the query's own key (p, k) joins its chain
            q, entry, residual = step_entry(drafter, feature, ids, positions, chain=True)
            chain = (*chain, entry)
        attn = ttt_attention_of_entries(q, entry0, chain, segments, attention_kernel, expand0, expand, rule)
        if not checkpointing:
            return drafter.step_output(residual, attn), entry0, chain
        return _output_in_token_chunks(drafter, residual + drafter.midlayer.self_attn.output(attn)), entry0, chain

    states, hidden = [], []
    entry0 = None
    chain: tuple[tuple[torch.Tensor, ...], ...] = ()  # entries of steps 1..k-1
    slots = drafter.mask_slots((B, T), input_ids.device) if drafter.config.parallel_drafting else None
    for k in range(ttt_length):
        tokens = shift_left(input_ids, 1 + k)[:, :T]  # x[p+1+k]
        if k and slots is not None:  # parallel drafting: every later step reads the mask slot
            feature, tokens = slots
        out, entry0, chain = run(step, feature, tokens, position_ids + k, entry0, *chain)
        hidden.append(out.hidden)
        states.append(out.state)
        feature = out.feature
    return TTTOutput(states=states, hidden=hidden, segments=segments)


def step_entry(drafter, feature: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, *, chain=False):
    """The step up to its attention: (q, entry, residual); chain=True: the chain's entry (Llama: the step's input)."""
    attn = drafter.midlayer.self_attn
    z, residual = drafter.midlayer.attention_input(drafter.embed(tokens, feature.dtype), feature)
    cos, sin = drafter.rotary_emb(positions, feature.dtype)
    if chain and drafter.config.kind.chain_keeps_input:
        return attn.query(z, cos, sin), (feature, tokens, positions), residual
    return *attn.query_entry(z, cos, sin), residual


def chain_keys_values(drafter) -> ChainKeysValues:
    """How the chain makes keys and values of the entries `step_entry(..., chain=True)` gives."""
    if not drafter.config.kind.chain_keeps_input:
        return drafter.midlayer.self_attn.chain_keys_values()
    layer = drafter.midlayer
    eps = layer.input_layernorm.eps

    def input_keys_values(feature, tokens, positions, input_norm_weight, hidden_norm_weight, k_weight, v_weight):
        # token rows of the step's input: feature [n, H], tokens, positions [n] -> k, v [n, nkv, d]
        emb = drafter.embed(tokens, feature.dtype)
        z = torch.cat([rms_norm(emb, input_norm_weight, eps), rms_norm(feature, hidden_norm_weight, eps)], -1)
        cos, sin = drafter.rotary_emb(positions[None], feature.dtype)
        k, v = layer.self_attn.key_value(z[None], cos, sin, k_weight, v_weight)
        return k[0], v[0]

    attn = layer.self_attn
    weights = (layer.input_layernorm.weight, layer.hidden_norm.weight, attn.k_proj.weight, attn.v_proj.weight)
    return ChainKeysValues(input_keys_values, weights, width=3)


def _output_in_token_chunks(drafter, h: torch.Tensor):
    """h' [B, T, H] -> its `DraftStep`, the MLP block and read-out checkpointed in chunks of token rows."""
    B, T, H = h.shape

    def read_out_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [n, H] -> o, norm(o)
        out = drafter.read_out(drafter.midlayer.feed_forward(rows))
        return out.hidden, out.state

    n = max(1, FEED_FORWARD_BUDGET // drafter.config.intermediate_size)
    parts = [checkpoint(read_out_rows, c, use_reentrant=False) for c in h.reshape(B * T, H).split(n)]
    hidden, state = (torch.cat(p).view(B, T, H) for p in zip(*parts))
    return drafter.read_out(hidden, state)
