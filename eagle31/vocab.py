"""Draft vocabulary: supervised token counts -> d2t / t2d (docs/design.md §5)."""

from __future__ import annotations

import torch


def count_supervised_tokens(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] int64 counts of tokens x[t] with m[t] = 1 (any shape, flattened)."""
    ids = input_ids.reshape(-1)[loss_mask.reshape(-1) > 0].long()
    return torch.bincount(ids, minlength=vocab_size)[:vocab_size]


def draft_token_ids(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """[Vd] target ids of the draft vocabulary, ascending."""
    V = counts.numel()
    if not 0 < draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in 1..{V} (the target vocab size)")
    order = torch.sort(-counts.long(), stable=True).indices  # most frequent first, ties by lower id
    seen = order[counts[order] > 0][:draft_vocab_size]
    if seen.numel() < draft_vocab_size:  # pad with the lowest ids not yet chosen
        unused = torch.ones(V, dtype=torch.bool)
        unused[seen] = False
        pad = unused.nonzero().squeeze(1)[: draft_vocab_size - seen.numel()]
        seen = torch.cat([seen, pad])
    return torch.sort(seen).values


def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [Vd] int64 offsets, t2d [V] bool) for ascending draft ids."""
    draft_ids = draft_ids.long()
    d2t = draft_ids - torch.arange(draft_ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from token counts [V]."""
    return vocab_maps(draft_token_ids(counts, draft_vocab_size), counts.numel())


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    return draft_ids + d2t[draft_ids]
