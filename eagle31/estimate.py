"""Parameter counts, a step's model FLOPs and a run's per-GPU memory for `dry_run=true` (docs/performance.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle31.config import DrafterConfig
from eagle31.memory_trace import StepMemory
from eagle31.model import Eagle31Drafter

GiB = 1024**3


@dataclass
class ParamCounts:
    trainable: int
    frozen_embedding: int

    @property
    def total(self) -> int:
        return self.trainable + self.frozen_embedding


def count_parameters(cfg: DrafterConfig) -> ParamCounts:
    """The drafter's parameters, built on the meta device."""
    with torch.device("meta"):
        model = Eagle31Drafter(cfg)
    return ParamCounts(sum(p.numel() for p in model.parameters() if p.requires_grad), model.embed_tokens.weight.numel())


def visible_key_pairs(seq_len: int, ttt_length: int, window: int | None) -> list[int]:
    """Per TTT step k, the (query, key) pairs its attention scores over one document of T positions."""
    T, pairs = seq_len, []
    for k in range(ttt_length):
        n = T if window is None else min(T, window - k)  # the most step-0 keys a query sees
        pairs.append(n * (n + 1) // 2 + (T - n) * n + k * T)  # query p sees min(p + 1, n) of them, and k chain keys
    return pairs


def step_flops(cfg: DrafterConfig, seq_len: int, ttt_length: int) -> int:
    """Model FLOPs of a training step on one document of T = `seq_len` tokens (docs/performance.md: matmuls only)."""
    T, K, H = seq_len, ttt_length, cfg.hidden_size
    fc = 2 * 2 * T * cfg.fc_in_features * H  # its input needs no gradient: forward + weight gradient
    projections = cfg.kind.attention_parameters(cfg)  # 2 FLOPs a weight a token (an MLA's two norms too: < 0.1%)
    dense = 2 * T * (projections + 3 * H * cfg.intermediate_size + H * cfg.draft_vocab_size)
    return fc + 3 * K * dense + attention_flops(cfg, seq_len, ttt_length)


def attention_flops(cfg: DrafterConfig, seq_len: int, ttt_length: int) -> int:
    """The FLOPs of a training step's QK^T and PV over the keys each query sees, forward and backward."""
    dqk, dv = head_dims(cfg)
    pairs = visible_key_pairs(seq_len, ttt_length, cfg.sliding_window)
    return 3 * sum(2 * cfg.num_attention_heads * (dqk + dv) * n for n in pairs)


def head_dims(cfg: DrafterConfig) -> tuple[int, int]:
    """(q·k head dim, value head dim) of the drafter's attention kind."""
    return cfg.kind.qk_head_dim(cfg), cfg.kind.o_proj_in_features(cfg) // cfg.num_attention_heads


def attention_flops_share(cfg: DrafterConfig, seq_len: int, ttt_length: int) -> float:
    """The share of `step_flops` spent in the attention's QK^T and PV."""
    return attention_flops(cfg, seq_len, ttt_length) / step_flops(cfg, seq_len, ttt_length)


class RunMemory:
    """GiB per GPU by term (docs/performance.md) at any T (`at`), the longest T that fits (`longest`); device `cuda`
    (FSDP2) or `cpu` (one process); online_target_bytes: the target's on a GPU; step: same-drafter traces to reuse."""

    def __init__(
        self,
        cfg: DrafterConfig,
        ttt_length: int,
        *,
        world_size: int = 1,
        activation_checkpointing: bool = False,
        compute_bytes: int = 2,
        device: str = "cuda",
        sequence_parallel: int = 1,
        attention_kernel: str = "auto",
        online_target_bytes: int = 0,
        anchor: bool = False,
        step: StepMemory | None = None,
    ):
        c, fsdp = compute_bytes, device == "cuda"
        self.step = step or StepMemory(
            cfg,
            ttt_length,
            activation_checkpointing=activation_checkpointing,
            dtype=torch.bfloat16 if c == 2 else torch.float32,
            device=device,
            sequence_parallel=sequence_parallel,
            attention_kernel=attention_kernel,
        )
        p = count_parameters(cfg)
        V, Vd, Ht = cfg.vocab_size, cfg.draft_vocab_size, cfg.target_hidden_size
        fixed = {
            "weights_and_optimizer_states": p.trainable * 12 / world_size,
            "frozen_embedding": p.frozen_embedding * (c if fsdp else 4),
            "gathered_parameters": p.trainable * c if fsdp else 0,
            "target_lm_head": V * Ht * c + (Vd * Ht * c if Vd < V else 0) + V,
        }
        if anchor:
            fixed["anchor_weights"] = p.trainable * 4 / world_size
        if online_target_bytes:
            fixed["online_target"] = online_target_bytes
        self.fixed = {k: v / GiB for k, v in fixed.items()}

    def at(self, seq_len: int) -> dict[str, float]:
        """The terms and their `total` at T = `seq_len` (one packed sequence)."""
        step, features = self.step.at(seq_len)
        parts = {**self.fixed, "target_features": features / GiB, "training_step": step / GiB}
        return {**parts, "total": sum(parts.values())}

    def longest(self, gpu_memory_gib: float) -> int:
        """The longest T (a multiple of 1024) whose estimate fits `gpu_memory_gib`, 0 if none: a bisection."""

        def fits(T: int) -> bool:
            return self.at(T)["total"] <= gpu_memory_gib

        first = -(-self.step.fit_lengths()[0] // 1024)  # in units of 1024 tokens, as the answer
        # fits(lo * 1024) (0: nothing to fit), not fits(hi * 1024); 16M tokens is beyond any plan
        lo, hi = (first, (1 << 14) + 1) if fits(first * 1024) else (0, first)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid * 1024) else (lo, mid)
        return lo * 1024
