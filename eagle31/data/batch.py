"""`FeatureBatch`, what the trainer consumes, packed or padded from `Sample`s; `TOKEN_COLUMNS` (architecture.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch
from torch.nn.utils.rnn import pad_sequence


@dataclass(frozen=True)
class TokenColumn:
    """How a per-token column is kept: pyarrow type when prepared, dtype in a store, padding (int64 in batches)."""

    arrow: str
    store: torch.dtype
    pad: int = 0


TOKEN_COLUMNS: dict[str, TokenColumn] = {
    "input_ids": TokenColumn("int32", torch.int32),
    "loss_mask": TokenColumn("int8", torch.uint8),  # 1 = assistant token to learn
}


class Sample(NamedTuple):
    """One tokenised sample with its target features."""

    input_ids: torch.Tensor  # [T] long
    loss_mask: torch.Tensor  # [T] long, 1 = assistant token to learn
    aux: torch.Tensor  # [T, n*Ht]
    final: torch.Tensor  # [T, Ht]


@dataclass
class FeatureBatch:
    input_ids: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] long
    document_ids: torch.Tensor  # [B, T] long, documents numbered per row, -1 = padding
    aux: torch.Tensor  # [B, T, n*Ht]
    final: torch.Tensor  # [B, T, Ht]
    num_tokens: int = -1  # real tokens; computed from document_ids when not given
    num_samples: int = -1  # documents; computed from document_ids when not given

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            self.num_tokens = int((self.document_ids >= 0).sum())
        if self.num_samples < 0:  # rows number their documents 0..n-1, so n = max + 1
            self.num_samples = int((self.document_ids.max(dim=1).values + 1).sum())

    def to(self, device, dtype: torch.dtype | None = None) -> FeatureBatch:
        """Move to `device`; `dtype` (if given) applies to the features `aux` and `final` only."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                moved[f.name] = value.to(device, dtype=dtype if f.name in ("aux", "final") else None, non_blocking=True)
        return replace(self, **moved)


def pack(samples: list[Sample]) -> FeatureBatch:
    """Concatenate `samples` into one row `[1, sum T]`, documents numbered in order."""
    lengths = torch.tensor([s.input_ids.shape[0] for s in samples], device=samples[0].input_ids.device)
    doc = torch.repeat_interleave(torch.arange(len(samples), device=lengths.device), lengths)
    return FeatureBatch(
        **{name: torch.cat([getattr(s, name) for s in samples]).unsqueeze(0) for name in Sample._fields},
        document_ids=doc.unsqueeze(0),
        num_tokens=int(lengths.sum()),
        num_samples=len(samples),
    )


def pad(samples: list[Sample]) -> FeatureBatch:
    """One sample per row, right-padded to the longest (columns with their `pad`, features 0, document id -1)."""
    pads = {name: column.pad for name, column in TOKEN_COLUMNS.items()}
    return FeatureBatch(
        **{
            name: pad_sequence([getattr(s, name) for s in samples], batch_first=True, padding_value=pads.get(name, 0))
            for name in Sample._fields
        },
        document_ids=pad_sequence([torch.zeros_like(s.input_ids) for s in samples], batch_first=True, padding_value=-1),
        num_tokens=sum(s.input_ids.shape[0] for s in samples),
        num_samples=len(samples),
    )


def empty_batch(aux_size: int, hidden_size: int, dtype: torch.dtype) -> FeatureBatch:
    """A one-token, all-padding batch: a step with nothing to learn (keeps ranks in lockstep)."""
    return FeatureBatch(
        **{name: torch.full((1, 1), column.pad, dtype=torch.long) for name, column in TOKEN_COLUMNS.items()},
        document_ids=torch.full((1, 1), -1, dtype=torch.long),
        aux=torch.zeros(1, 1, aux_size, dtype=dtype),
        final=torch.zeros(1, 1, hidden_size, dtype=dtype),
        num_tokens=0,
        num_samples=0,
    )


def bucket_by_length(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices sorted by length (stable), cut greedily into groups of `B * max T` <= `budget`, shortest first."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[i] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def next_fit(lengths: Sequence[int], budget: int) -> list[slice]:
    """Runs of consecutive `lengths` of at most `budget` in all (a longer one alone), in order."""
    runs: list[slice] = []
    start = total = 0
    for i, n in enumerate(lengths):
        if i > start and total + n > budget:
            runs.append(slice(start, i))
            start, total = i, 0
        total += int(n)
    if start < len(lengths):
        runs.append(slice(start, len(lengths)))
    return runs
