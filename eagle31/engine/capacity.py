"""How many inference workers keep the trainers busy: measured from an engine run, or estimated from FLOPs."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from eagle31.config import DrafterConfig, text_config
from eagle31.errors import ConfigError
from eagle31.estimate import count_parameters, head_dims
from eagle31.metrics_log import read_metrics
from eagle31.target import attention_shape, decoder_parameters


@dataclass
class Sizing:
    workers: int  # inference workers that keep `trainers` busy
    trainers: int
    worker_rate: float  # one worker, one trainer: samples/s (measured) or tokens per FLOP-second ratio (estimated)
    trainer_rate: float
    measured: bool
    basis: str  # where the rates come from, one sentence

    def describe(self, worker_gpus: float) -> str:
        each = f" of {worker_gpus:g} GPU(s)" if worker_gpus else ""
        how = "measured" if self.measured else "estimated"
        return f"{self.workers} inference worker(s){each} keep {self.trainers} trainer(s) busy ({how}: {self.basis})"


def workers_needed(trainers: int, trainer_rate: float, worker_rate: float) -> int:
    return max(1, math.ceil(trainers * trainer_rate / worker_rate - 1e-9))


def measured_sizing(metrics: Path, trainers: int) -> Sizing | None:
    """From an engine run's metrics.jsonl; None when it has no window after the first with both rates."""
    try:
        lines = read_metrics(metrics)
    except (OSError, ValueError) as e:
        raise ConfigError(f"features.engine.rates_from={metrics}: cannot read it as metrics.jsonl ({e})") from None
    both = ("engine/inference_samples_per_s", "train/capacity_samples_per_s")
    windows = [x for x in lines if all(x.get(k) for k in both)][1:]  # the first window is warm-up
    if not windows:
        return None
    worker = statistics.median(x["engine/inference_samples_per_s"] / x["engine/workers"] for x in windows)
    trainer = statistics.median(x["train/capacity_samples_per_s"] / x["engine/trainers"] for x in windows)
    basis = (
        f"{worker:.3g} samples/s per worker, {trainer:.3g} per trainer, medians of {len(windows)} windows of {metrics}"
    )
    return Sizing(workers_needed(trainers, trainer, worker), trainers, worker, trainer, True, basis)


def estimated_sizing(
    target_config: dict, drafter: DrafterConfig, ttt_length: int, seq_len: int, trainers: int, worker_gpus: float
) -> Sizing:
    """From FLOPs per token, the same FLOP rate per GPU assumed on both sides."""
    target = target_forward_flops(target_config, seq_len)
    trainer = drafter_training_flops(drafter, ttt_length, seq_len)
    gpus = worker_gpus if worker_gpus > 0 else 1.0
    basis = (
        f"FLOPs per token at T={seq_len}: target forward {target / 1e9:.3g} G on {gpus:g} GPU(s) per worker, drafter "
        f"training {trainer / 1e9:.3g} G per trainer, the same FLOP rate per GPU assumed; run an engine run for "
        "measured rates"
    )
    rate, per_trainer = gpus / target, 1 / trainer  # tokens per unit of one GPU's FLOP rate
    return Sizing(workers_needed(trainers, per_trainer, rate), trainers, rate, per_trainer, False, basis)


# ---------------------------------------------------------------------------- FLOPs per token


def target_active_parameters(target_config: dict) -> int:
    """Parameters a token passes through in the decoder layers (attention, the MLP or the experts it is routed to)."""
    return decoder_parameters(target_config, active=True)


def target_forward_flops(target_config: dict, seq_len: int) -> float:
    """One token's share of the target's forward over a causal sequence of `seq_len` tokens."""
    t = text_config(target_config)
    heads, qk, v = attention_shape(t)
    attention = 2 * (seq_len / 2) * heads * (qk + v) * int(t["num_hidden_layers"])  # T/2 keys on average
    return 2 * target_active_parameters(target_config) + attention


def drafter_training_flops(d: DrafterConfig, ttt_length: int, seq_len: int) -> float:
    """One token's share of the drafter's TTT unroll, forward and backward (3x the forward)."""
    fc = d.fc_in_features * d.hidden_size
    per_step = count_parameters(d).trainable - fc  # the layer, its norms and the lm_head
    heads, (qk, v) = d.num_attention_heads, head_dims(d)
    attention = 2 * (seq_len / 2) * heads * (qk + v)
    return 3 * (2 * fc + ttt_length * (2 * per_step + attention))
