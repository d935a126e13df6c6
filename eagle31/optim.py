"""The optimizer, its learning-rate schedule and the anchor to the starting weights (docs/training.md)."""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterable
from enum import StrEnum

import torch
from torch import nn

# 2-D weights that stay with AdamW under Muon: the vocabulary's rows (speculators 0.9.0's rule, Muon's authors')
_VOCABULARY_WEIGHTS = ("embed_tokens", "lm_head")
Named = list[tuple[str, nn.Parameter]]  # (name, parameter) pairs


class Optimizer(StrEnum):
    """What steps the trained parameters (`eagle31.optim`)."""

    adamw = "adamw"  # AdamW on every trained parameter
    muon = "muon"  # torch.optim.Muon on the 2-D weight matrices, AdamW on the rest (speculators 0.9.0's default)


class Schedule(StrEnum):
    """The learning rate after `train.warmup_steps` of linear warm-up (`eagle31.optim.lr_lambda`)."""

    cosine = "cosine"  # cosine decay to a tenth of the peak at max_steps
    linear = "linear"  # linear decay to 0 at max_steps (speculators 0.9.0's default)
    constant = "constant"  # the peak until max_steps


class MuonAdjustLR(StrEnum):
    """How Muon scales its learning rate to a matrix's shape [A, B] (torch.optim.Muon's `adjust_lr_fn`)."""

    original = "original"  # lr x sqrt(max(1, A / B)) (Keller Jordan's Muon)
    match_rms_adamw = "match_rms_adamw"  # lr x 0.2 sqrt(max(A, B)): AdamW's update RMS, so AdamW's lr carries over


def lr_lambda(warmup_steps: int, max_steps: int, schedule: Schedule = Schedule.cosine, min_ratio: float = 0.1):
    """The peak's factor at a step: linear warm-up, then `schedule` to `max_steps` (docs/training.md)."""

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        if schedule == Schedule.linear:
            return 1.0 - progress
        if schedule == Schedule.constant:
            return 1.0
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def muon_split(named_params: Iterable[tuple[str, nn.Parameter]]) -> tuple[Named, Named]:
    """(Muon's, AdamW's) trained parameters: Muon the 2-D matrices (both sides > 1) but the vocabulary weights."""
    muon: Named = []
    adamw: Named = []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        matrix = p.ndim == 2 and min(p.shape) > 1 and not any(w in name for w in _VOCABULARY_WEIGHTS)
        (muon if matrix else adamw).append((name, p))
    return muon, adamw


class Optimizers:
    """The optimizers of a run (AdamW, or Muon and AdamW), stepped together, each with the run's schedule."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer], schedule):
        self.by_name = optimizers  # {"adamw": ..., "muon": ...}: the lr each logs is `lr` or `muon_lr`
        self.optimizers = list(optimizers.values())  # in a fixed order: what checkpoints save and restore
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in self.optimizers]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)

    def advance(self) -> None:
        """The schedule's step (after every training step, a skipped one included)."""
        with warnings.catch_warnings():  # torch warns when the schedule moves before any optimizer step
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            for s in self.schedulers:
                s.step()

    def lrs(self) -> dict[str, float]:
        """The learning rates of this step: `lr` (AdamW's) and, with Muon, `muon_lr` (before its shape scaling)."""
        names = {"adamw": "lr", "muon": "muon_lr"}
        return {names[n]: s.get_last_lr()[0] for n, s in zip(self.by_name, self.schedulers)}

    def state_dict(self) -> list[dict]:
        return [s.state_dict() for s in self.schedulers]

    def load_state_dict(self, states: list[dict] | dict) -> None:
        """The schedules' positions (a checkpoint from before Muon holds one dict)."""
        for s, state in zip(self.schedulers, states if isinstance(states, list) else [states], strict=True):
            s.load_state_dict(state)


def build_optimizer(named_params: Iterable[tuple[str, nn.Parameter]], train, device: torch.device) -> Optimizers:
    """The optimizers and schedule `train` (a `TrainConfig`) asks for, over the trained ones of `named_params`."""
    named = [(n, p) for n, p in named_params if p.requires_grad]
    muon, adamw = muon_split(named) if train.optimizer == Optimizer.muon else ([], named)
    optimizers: dict[str, torch.optim.Optimizer] = {}
    if adamw:
        optimizers["adamw"] = torch.optim.AdamW(
            [p for _, p in adamw],
            lr=train.lr,
            betas=tuple(train.betas),
            weight_decay=train.weight_decay,
            fused=device.type == "cuda",
        )
    if muon:
        optimizers["muon"] = torch.optim.Muon(
            [p for _, p in muon],
            lr=train.lr if train.muon_lr is None else train.muon_lr,
            momentum=train.muon_momentum,
            weight_decay=train.muon_weight_decay,
            ns_steps=train.muon_ns_steps,
            adjust_lr_fn=str(train.muon_adjust_lr),
        )
    return Optimizers(optimizers, lr_lambda(train.warmup_steps, train.max_steps, Schedule(train.schedule)))


class Anchor:
    """L2-SP (`train.anchor_weight`, docs/training.md): w0 a copy of each trained parameter (sharded) when made."""

    def __init__(self, params: list[nn.Parameter], weight: float):
        self.params, self.weight = params, weight
        self.start = [p.detach().clone() for p in params]

    @torch.no_grad()
    def add_gradient(self) -> float:
        """Add the term's gradient `2 weight (w - w0)` to each parameter's (after the backward, before clipping; each
        FSDP shard its own) and return the term, summed over the shards."""
        norms = []
        for p, start in zip(self.params, self.start, strict=True):
            delta = p - start
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.add_(delta, alpha=2 * self.weight)
            norms.append(torch.linalg.vector_norm(delta))
        total = torch.linalg.vector_norm(torch.stack(norms))
        total = total.full_tensor() if hasattr(total, "full_tensor") else total
        return self.weight * float(total) ** 2
