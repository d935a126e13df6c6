"""What a TTT step keeps for the later ones (its entry), and how keys and values are made of it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChainKeysValues:
    """How a step's keys and values are made of its entry (docs/design.md §4): `fn(*entry_rows, *params) -> (k, v)`,
    [n, nkv, d], of the `width` entry tensors cut to n token rows; `params`: other tensors read (gradients flow)."""

    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    params: tuple[torch.Tensor, ...] = ()
    width: int = 2


KEYS_VALUES = ChainKeysValues(lambda k, v: (k, v))  # the entry is (k, v) itself (Llama attention)


def entry_keys_values(entry, expand: ChainKeysValues, params):
    """The keys and values [B, T, nkv, d] that `expand.fn` makes of an entry (tensors [B, T, ...]) with `params`."""
    if expand is KEYS_VALUES:
        return entry
    k, v = expand.fn(*[t.flatten(0, 1) for t in entry], *params)  # [B * T, nkv, d]
    shape = entry[0].shape[:2]
    return k.unflatten(0, shape), v.unflatten(0, shape)


def keys_values_with_graph(make: Callable, entry, params):
    """(k, v, grads) of `make(entry, params)` rerun detached; `grads(dk, dv)` -> (entry's, None: not float; params')."""
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in entry]
        leaves = [p.detach().requires_grad_() for p in params]
        k, v = make(inputs, leaves)
    wanted = [t for t in inputs if t.requires_grad] + leaves

    def grads(dk: torch.Tensor, dv: torch.Tensor):
        found = iter(torch.autograd.grad((k, v), wanted, (dk, dv), allow_unused=True))
        return [next(found) if t.requires_grad else None for t in inputs], [next(found) for _ in leaves]

    return k.detach(), v.detach(), grads
