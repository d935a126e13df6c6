"""The causal part of the TTT attention (docs/design.md §4). A kernel has `forward(q, k, v, segments, scale, mask) ->
(out fp32, lse fp32, ctx)` and `backward(dout, q, k, v, out, lse, segments, scale, ctx, mask) -> dq, dk, dv` (out, lse:
the merged ones); q [B, T, nh, d], k, v [B, T, nkv, d], segments [B, T] document runs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Scores of one query block are kept under this many elements (the blockwise kernel, the chain's
# token blocks, the key blocks before a sequence shard). Read as `causal.BLOCK_BUDGET` so tests can lower it.
BLOCK_BUDGET = 1 << 24
NOT_A_BAND = -1  # `CausalMask.reach` of a rule whose step-0 keys are not the positions just before the query


@dataclass(frozen=True)
class CausalMask:
    """The rule at TTT step `step`: queries (p, step) over step-0 keys (p', 0), positions relative to its first key."""

    rule: Callable[..., torch.Tensor]
    step: int

    def allowed(self, q_seg, q_pos, k_seg, k_pos) -> torch.Tensor:
        """The rule's mask over broadcastable query and key tensors (document runs, positions)."""
        return self.rule(q_seg, q_pos, self.step, k_seg, k_pos, 0)

    @functools.cache  # noqa: B019 - a frozen mask per (rule, step): few, and hashable
    def reach(self, length: int) -> int | None:
        """How many step-0 positions up to its own a query sees in a document of `length` (its last and middle asked):
        None: all, `NOT_A_BAND`: some just before it hidden; a later key or another document's shown is refused."""
        pos, zero = torch.arange(length), torch.zeros((), dtype=torch.long)
        last, middle = self.allowed(zero, pos[-1], zero, pos), self.allowed(zero, pos[length // 2], zero, pos)
        if bool(middle[length // 2 + 1 :].any()) or bool(self.allowed(zero, pos[-1], zero + 1, pos).any()):
            raise ValueError("the visibility rule shows a query a later step-0 key or another document's")
        n = int(last.sum())
        if n == 0:
            raise ValueError(f"the visibility rule leaves a query at TTT step {self.step} no step-0 key")
        band = lambda q: (pos <= q) & (pos > q - n)  # noqa: E731 - the n positions up to q
        if not (torch.equal(last, band(length - 1)) and torch.equal(middle, band(length // 2))):
            return NOT_A_BAND
        return None if n == length else n


def _run_starts(segments: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: where a run starts (the id changes, and at every row's start, whatever the ids)."""
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return starts


def segment_starts(segments: torch.Tensor) -> torch.Tensor:
    """[B, T]: index of the first position of each position's run."""
    idx = torch.arange(segments.shape[1], device=segments.device).expand_as(segments)
    return torch.where(_run_starts(segments), idx, torch.zeros_like(idx)).cummax(dim=1).values


def _runs(segments: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of every run, in order."""
    rows = [torch.unique_consecutive(row, return_counts=True)[1].cumsum(0).tolist() for row in segments.cpu()]
    return [(b, s, e) for b, ends in enumerate(rows) for s, e in zip([0, *ends], ends)]


class BlockwiseCausal:
    """Flash-attention algorithm in plain PyTorch, one query block at a time."""

    @staticmethod
    def _blocks(qg, k, segments, scale, mask: CausalMask):
        """(i0, i1, k0, scores [B, nkv, g, bq, nk], hidden: -inf) per block; qg [B, nkv, g, T, d], k [B, nkv, T, d]."""
        B, T = segments.shape
        block = max(16, min(1024, BLOCK_BUDGET // max(1, B * qg.shape[1] * qg.shape[2] * T)))
        starts = segment_starts(segments)
        pos = torch.arange(T, device=segments.device)
        window = mask.reach(T)
        acc = accumulation_dtype(qg)
        for i0 in range(0, T, block):
            i1 = min(T, i0 + block)
            k0 = int(starts[:, i0].min())
            if window is not None and window != NOT_A_BAND:  # no query of the block sees a key before i0 - window + 1
                k0 = max(k0, i0 - window + 1)
            allowed = mask.allowed(
                segments[:, i0:i1, None], pos[i0:i1, None], segments[:, None, k0:i1], pos[None, k0:i1]
            )
            s = torch.einsum("bhgqd,bhkd->bhgqk", qg[:, :, :, i0:i1].to(acc), k[:, :, k0:i1].to(acc)) * scale
            yield i0, i1, k0, s.masked_fill(~allowed[:, None, None], float("-inf"))

    @classmethod
    def forward(cls, q, k, v, segments, scale, mask: CausalMask):
        acc = accumulation_dtype(q)
        qg, kh, vh = _to_grouped(q, k.shape[2]), k.transpose(1, 2), v.transpose(1, 2)  # [B, nkv, (g,) T, d]
        out = q.new_empty(qg.shape, dtype=acc)
        lse = q.new_empty(qg.shape[:-1], dtype=acc)
        for i0, i1, k0, s in cls._blocks(qg, kh, segments, scale, mask):
            m = s.logsumexp(dim=-1)
            out[:, :, :, i0:i1] = torch.einsum(
                "bhgqk,bhkd->bhgqd", torch.exp(s - m[..., None]), vh[:, :, k0:i1].to(acc)
            )
            lse[:, :, :, i0:i1] = m
        return _from_grouped(out), _from_grouped(lse), None

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, segments, scale, ctx, mask: CausalMask):
        acc, nkv = accumulation_dtype(q), k.shape[2]
        qg, kh, vh = _to_grouped(q, nkv), k.transpose(1, 2), v.transpose(1, 2)  # [B, nkv, (g,) T, d]
        do = _to_grouped(dout.to(acc), nkv)
        lse_g = _to_grouped(lse, nkv)
        D = (do * _to_grouped(out, nkv)).sum(-1)  # [B, nkv, g, T]
        dq = torch.zeros_like(qg, dtype=acc)
        dk = kh.new_zeros(kh.shape, dtype=acc)
        dv = torch.zeros_like(dk)
        for i0, i1, k0, s in cls._blocks(qg, kh, segments, scale, mask):
            p = torch.exp(s - lse_g[:, :, :, i0:i1, None])
            do_b = do[:, :, :, i0:i1]
            dv[:, :, k0:i1] += torch.einsum("bhgqk,bhgqd->bhkd", p, do_b)
            dp = torch.einsum("bhgqd,bhkd->bhgqk", do_b, vh[:, :, k0:i1].to(acc))
            ds = p * (dp - D[:, :, :, i0:i1, None]) * scale
            dq[:, :, :, i0:i1] = torch.einsum("bhgqk,bhkd->bhgqd", ds, kh[:, :, k0:i1].to(acc))
            dk[:, :, k0:i1] += torch.einsum("bhgqk,bhgqd->bhkd", ds, qg[:, :, :, i0:i1].to(acc))
        return _from_grouped(dq).to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)


class FlashCausal:
    """PyTorch's fused flash-attention ops, for a band rule: CUDA's varlen op with its window, CPU's `_cpu_blocks`."""

    @staticmethod
    def forward(q, k, v, segments, scale, mask: CausalMask):
        window = _band(mask, segments.shape[1])
        if q.is_cuda:  # one varlen call: documents never cross rows
            B, T, nh, d = q.shape
            cu, max_len = FlashCausal._cu_seqlens(segments)
            flat = lambda x: x.reshape(B * T, x.shape[2], d)  # noqa: E731
            out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
                flat(q), flat(k), flat(v), cu, cu, max_len, max_len, 0.0, True, False, scale=scale,
                **_cuda_window(window),
            )  # fmt: skip
            lse = _lse_tokens_first(lse, B * T, nh)
            return out.view(B, T, nh, d).float(), lse.view(B, T, nh).float(), (cu, max_len, rng_state, unused)
        acc = accumulation_dtype(q)
        g = q.shape[2] // k.shape[2]
        out = q.new_empty(q.shape, dtype=acc)
        lse = q.new_empty(q.shape[:3], dtype=acc)
        for b, i0, i1, k0, band_mask in _cpu_blocks(segments, mask, window, q.dtype):
            o, o_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                _heads(q, b, i0, i1), _heads(k, b, k0, i1, g), _heads(v, b, k0, i1, g), 0.0, band_mask is None,
                attn_mask=band_mask, scale=scale,
            )  # fmt: skip
            out[b, i0:i1] = o[0].transpose(0, 1)
            lse[b, i0:i1] = o_lse[0].transpose(0, 1)
        return out, lse, None

    @staticmethod
    def backward(dout, q, k, v, out, lse, segments, scale, ctx, mask: CausalMask):
        window = _band(mask, segments.shape[1])
        if q.is_cuda:
            B, T, nh, d = q.shape
            cu, max_len, rng_state, unused = ctx
            flat = lambda x: x.reshape(B * T, x.shape[2], d).to(q.dtype).contiguous()  # noqa: E731
            lse_heads_first = lse.reshape(B * T, nh).t().contiguous()  # the kernel's layout [nh, total]
            dq, dk, dv = torch.ops.aten._flash_attention_backward(
                flat(dout), flat(q), flat(k), flat(v), flat(out), lse_heads_first,
                cu, cu, max_len, max_len, 0.0, True, rng_state, unused, scale=scale, **_cuda_window(window),
            )  # fmt: skip
            return dq.view(B, T, nh, d), dk.view(B, T, -1, d), dv.view(B, T, -1, d)
        acc = accumulation_dtype(q)
        nkv = k.shape[2]
        g = q.shape[2] // nkv
        dq = torch.empty_like(q)  # every position is in exactly one query block: all written below
        # key blocks overlap when a window splits a document: summed in fp32
        dk = torch.zeros_like(k, dtype=acc if window is not None else k.dtype)
        dv = torch.zeros_like(v, dtype=dk.dtype)
        for b, i0, i1, k0, band_mask in _cpu_blocks(segments, mask, window, q.dtype):
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                _heads(dout, b, i0, i1).to(q.dtype).contiguous(), _heads(q, b, i0, i1), _heads(k, b, k0, i1, g),
                _heads(v, b, k0, i1, g), _heads(out, b, i0, i1).to(q.dtype).contiguous(),
                _heads(lse, b, i0, i1).to(acc).contiguous(), 0.0, band_mask is None, attn_mask=band_mask, scale=scale,
            )  # fmt: skip
            dq[b, i0:i1] = gq[0].transpose(0, 1)
            dk[b, k0:i1] += gk[0].unflatten(0, (nkv, g)).sum(1, dtype=acc).transpose(0, 1)
            dv[b, k0:i1] += gv[0].unflatten(0, (nkv, g)).sum(1, dtype=acc).transpose(0, 1)
        return dq, dk.to(k.dtype), dv.to(v.dtype)

    @staticmethod
    def _cu_seqlens(segments):
        """(cu_seqlens int32 [runs + 1], longest run) of the B rows laid end to end (`_run_starts`)."""
        ends = torch.tensor([segments.numel()], device=segments.device)
        cu = torch.cat([_run_starts(segments).flatten().nonzero().flatten(), ends]).to(torch.int32)
        return cu, int((cu[1:] - cu[:-1]).max())


def _cuda_window(window: int | None) -> dict[str, int]:
    """The varlen flash op's window arguments: a query sees the `window - 1` keys before it and none after."""
    return {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}


def _band(mask: CausalMask, length: int) -> int | None:
    """The band a flash kernel attends (`CausalMask.reach`); a rule that is no band is refused in one line."""
    window = mask.reach(length)
    if window == NOT_A_BAND:
        raise ValueError("the flash kernels attend a band of earlier positions; this visibility rule needs blockwise")
    return window


def _cpu_blocks(segments: torch.Tensor, mask: CausalMask, window: int | None, dtype: torch.dtype):
    """(row b, queries i0..i1, first key k0, additive mask) of the CPU flash calls (no window): a document a call (mask
    None) where the band covers it, else blocks of `window` queries over the keys they see, the mask [1, 1, bq, nk]."""
    doc = torch.zeros((), dtype=torch.long)
    for b, s, e in _runs(segments):
        if window is None or e - s <= window:
            yield b, s, e, s, None
            continue
        for i0 in range(s, e, window):
            i1, k0 = min(e, i0 + window), max(s, i0 - window + 1)
            seen = mask.allowed(doc, torch.arange(i0, i1)[:, None], doc, torch.arange(k0, i1)[None])
            yield b, i0, i1, k0, torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, float("-inf"))[None, None]


def _heads(x: torch.Tensor, b: int, lo: int, hi: int, repeat: int = 1) -> torch.Tensor:
    """x [B, T, heads, ...] -> row b's positions lo..hi-1 heads first, each head `repeat` times: [1, heads, n, ...]."""
    x = x[b : b + 1, lo:hi].transpose(1, 2)
    return x.repeat_interleave(repeat, dim=1) if repeat > 1 else x


def accumulation_dtype(q: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 for fp64 inputs (tests)."""
    return torch.promote_types(q.dtype, torch.float32)


def _lse_tokens_first(lse: torch.Tensor, total: int, nh: int) -> torch.Tensor:
    if lse.shape == (nh, total):
        return lse.t()
    if lse.shape == (total, nh):
        return lse
    raise RuntimeError(f"unexpected flash-attention LSE shape {tuple(lse.shape)} for {total} tokens, {nh} heads")


def _to_grouped(x: torch.Tensor, nkv: int) -> torch.Tensor:
    """[B, T, nh, ...] -> [B, nkv, g, T, ...]"""
    return x.unflatten(2, (nkv, -1)).movedim(1, 3)


def _from_grouped(x: torch.Tensor) -> torch.Tensor:
    """[B, nkv, g, T, ...] -> [B, T, nh, ...]"""
    return x.movedim(3, 1).flatten(2, 3)


def resolve_backend(q: torch.Tensor, mask: CausalMask, length: int) -> str:
    """`auto`: flash on CPU, and on CUDA in bf16/fp16 (head_dim <= 256), for a band rule; else blockwise."""
    fused = q.device.type == "cpu" or (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256)
    return "flash" if mask.reach(length) != NOT_A_BAND and fused else "blockwise"
