"""The training-time-test (TTT) unroll (docs/design.md §4).

Step 0 at position p reads the fused target feature `fc(fc_norm(aux[p]))` and
token `x[p+1]`; step k >= 1 reads the drafter's own step-(k-1) output at p —
post-norm `norm(o)` when `norm_output` (EAGLE 3.1), pre-norm `o` otherwise —
and token `x[p+1+k]` (teacher forcing). The step itself is the drafter's
(`Eagle31Drafter.step_qkv` / `step_output`), shared with inference
(`eagle31.eval.drafting`); this module adds the TTT attention and the K-step loop. Query (p, k) sits at RoPE position
p + k and attends to the causal step-0 keys of its document plus its own chain
(`eagle31.kernels`) — with `drafter.sliding_window = W`, those of positions p + k - W + 1 .. p + k. The unroll returns every step's output; the loss lives
in `eagle31.loss`.

Memory: with `activation_checkpointing` each step keeps only its inputs (the
previous step's output, token ids, positions) and its chain entry, shared with the
later steps — for Llama attention those inputs themselves (the chain remakes their keys
and values a block of tokens at a time), for MLA its latents; step 0 keeps its keys and
values (Llama) or latents (MLA) for the causal part; its
activations are recomputed in backward, one step at a time (and so are those of
the fused target feature); within a recomputed step, the MLP block and read-out
(per position) are checkpointed again in chunks of token rows, so the step's
backward holds one chunk of MLP activations, not T rows of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from eagle31.kernels.causal import segment_ids
from eagle31.kernels.ttt_attention import ttt_attention_of_entries

# With activation checkpointing, the MLP block is recomputed in chunks of token rows whose
# intermediate activations hold about this many elements.
FEED_FORWARD_BUDGET = 1 << 26


@dataclass
class TTTOutput:
    states: list[torch.Tensor]  # per step k: norm(o_k) [B, T, H] — what lm_head sees
    hidden: list[torch.Tensor]  # per step k: o_k [B, T, H] (pre-norm)
    segments: torch.Tensor  # [B, T] document runs the attention respected ([B, start + T] of the keys for a shard)


def shift_left(x: torch.Tensor, n: int, fill: int = 0) -> torch.Tensor:
    """x[:, t] -> x[:, t + n], padded with `fill` at the end. x [B, T]."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], min(n, x.shape[1])), fill)
    return torch.cat([x[:, n:], pad], dim=1)


def _read_out_rows(drafter, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = drafter.read_out(drafter.midlayer.feed_forward(h))
    return out.hidden, out.state


def _output_in_token_chunks(drafter, h: torch.Tensor):
    """The step after the attention residual (MLP block, read-out), h' [B, T, H] -> its `DraftStep`,
    checkpointed `FEED_FORWARD_BUDGET / I` token rows at a time: the recomputed step keeps only h'
    for it, and its backward holds one chunk's MLP activations at a time."""
    B, T, H = h.shape
    rows = max(1, FEED_FORWARD_BUDGET // drafter.config.intermediate_size)
    parts = [checkpoint(_read_out_rows, drafter, c, use_reentrant=False) for c in h.reshape(B * T, H).split(rows)]
    hidden = torch.cat([p[0] for p in parts]).view(B, T, H)
    state = torch.cat([p[1] for p in parts]).view(B, T, H)
    return drafter.read_out(hidden, state)


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
    attention_probe=None,
    sequence=None,
) -> TTTOutput:
    """Run K = `ttt_length` drafter steps over every position at once.

    aux [B, T, n*Ht] target features; input_ids [B, T]; document_ids [B, T]
    numbers packed documents (-1 = padding); attention_mask [B, T] 1 = real.
    `attention_probe(k, probs)` sees step k's attention probabilities (`eagle31.kernels.
    reference_attention`; needs `attention_kernel="reference"`).

    `sequence` (`eagle31.sequence_parallel.SequenceShard`, or a row's query tail as the drift
    diagnostic unrolls it, `eagle31.eval.drift`): aux holds this rank's shard of T
    positions, input_ids its T positions and the halo after them (their tokens are what the
    steps read); the attention's document runs are the shard's `key_segments` (document_ids
    and attention_mask are not read), positions default to the global ones, and the step-0
    entries of every shard up to this one's end are gathered for the keys.
    """
    if ttt_length < 1:
        raise ValueError(f"ttt_length must be >= 1, got {ttt_length}")
    B, T = aux.shape[:2]
    start = 0
    if sequence is None:
        segments = segment_ids(document_ids, attention_mask, (B, T), device=input_ids.device)
    else:
        segments, start = sequence.key_segments, sequence.start
    if position_ids is None:
        position_ids = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
    checkpointing = activation_checkpointing and torch.is_grad_enabled()
    if checkpointing:  # its norms' activations are 3x [B, T, n*Ht]: recompute them too
        feature = checkpoint(drafter.fuse_aux, aux, use_reentrant=False)  # [B, T, H]
    else:
        feature = drafter.fuse_aux(aux)

    expand0, expand = drafter.step0_keys_values(), drafter.chain_keys_values()
    window = drafter.config.sliding_window  # None: full attention

    def step(feature, ids, positions, entry0, *chain):
        # The embedding and RoPE are made inside the step, so activation checkpointing
        # recomputes them instead of keeping a [B, T, H] embedding per step. The attention makes
        # the step-0 keys and values of the step-0 entry: only entries are kept from step to step.
        if entry0 is None:  # step 0: its keys are the causal keys of every later step
            q, entry0, residual = drafter.step_entry(feature, ids, positions)
            if sequence is not None:  # every shard's up to this one's end
                entry0 = sequence.gather(entry0)
        else:  # step k >= 1: the query's own key (p, k) joins its chain
            q, entry, residual = drafter.step_entry(feature, ids, positions, chain=True)
            chain = (*chain, entry)
        probe = None if attention_probe is None else lambda probs: attention_probe(len(chain), probs)
        attn = ttt_attention_of_entries(q, entry0, chain, segments, attention_kernel, expand0, expand, probe, window)
        if not checkpointing:
            return drafter.step_output(residual, attn), entry0, chain
        return _output_in_token_chunks(drafter, drafter.midlayer.attention_residual(residual, attn)), entry0, chain

    states, hidden = [], []
    entry0 = None
    chain: tuple[tuple[torch.Tensor, ...], ...] = ()  # entries of steps 1..k-1
    for k in range(ttt_length):
        args = (feature, shift_left(input_ids, 1 + k)[:, :T], position_ids + k, entry0, *chain)  # tokens x[p+1+k]
        if checkpointing:
            out, entry0, chain = checkpoint(step, *args, use_reentrant=False)
        else:
            out, entry0, chain = step(*args)
        hidden.append(out.hidden)
        states.append(out.state)
        feature = out.feature
    return TTTOutput(states=states, hidden=hidden, segments=segments)
