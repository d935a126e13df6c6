"""The causal part of the TTT attention: each query over the step-0 keys of its document that the visibility rule
shows it (docs/design.md §4). Each kernel has `forward(q, k, v, segments, scale, mask) -> (out fp32, lse fp32, ctx)`
and `backward(dout, q, k, v, out, lse, segments, scale, ctx, mask) -> dq, dk, dv`, the backward's out and lse the
merged ones; q [B, T, nh, d], k, v [B, T, nkv, d], segments [B, T] document runs."""

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
    """The visibility rule as the causal kernels see it at TTT step `step`: queries (p, step), step-0 keys (p', 0).

    Positions are indices into the keys a kernel is given (a shard's keys start at its first key): the rule
    reads their differences.
    """

    rule: Callable[..., torch.Tensor]
    step: int

    def allowed(self, q_seg, q_pos, k_seg, k_pos) -> torch.Tensor:
        """The rule's mask over broadcastable query and key tensors (document runs, positions)."""
        return self.rule(q_seg, q_pos, self.step, k_seg, k_pos, 0)

    def reach(self, length: int) -> int | None:
        """How many step-0 positions up to its own a query sees in one document of `length` positions: None for all
        of them, `NOT_A_BAND` for a rule that skips some of the positions just before the query (blockwise only).
        Derived from the rule at the document's last and middle queries; a rule that shows a query a later key or
        another document's is refused (the kernels attend each document's keys up to the query)."""
        return _reach(self, length)


@functools.cache
def _reach(mask: CausalMask, length: int) -> int | None:
    pos, zero = torch.arange(length), torch.zeros((), dtype=torch.long)
    last, middle = mask.allowed(zero, pos[-1], zero, pos), mask.allowed(zero, pos[length // 2], zero, pos)
    if bool(middle[length // 2 + 1 :].any()) or bool(mask.allowed(zero, pos[-1], zero + 1, pos).any()):
        raise ValueError("the visibility rule shows a query a later step-0 key or another document's")
    n = int(last.sum())
    if n == 0:
        raise ValueError(f"the visibility rule leaves a query at TTT step {mask.step} no step-0 key")
    band = lambda q: (pos <= q) & (pos > q - n)  # noqa: E731 - the n positions up to q
    if not (torch.equal(last, band(length - 1)) and torch.equal(middle, band(length // 2))):
        return NOT_A_BAND
    return None if n == length else n


def segment_starts(segments: torch.Tensor) -> torch.Tensor:
    """[B, T]: index of the first position of each position's run."""
    T = segments.shape[1]
    idx = torch.arange(T, device=segments.device).expand_as(segments)
    new_run = torch.ones_like(segments, dtype=torch.bool)
    new_run[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return torch.where(new_run, idx, torch.zeros_like(idx)).cummax(dim=1).values


def _runs(segments: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of every run, in order."""
    out = []
    seg = segments.cpu()
    for b in range(seg.shape[0]):
        _, counts = torch.unique_consecutive(seg[b], return_counts=True)
        start = 0
        for n in counts.tolist():
            out.append((b, start, start + n))
            start += n
    return out


# ----------------------------------------------------------------------------
# causal kernels: forward -> (out fp32 [B, T, nh, d], lse fp32 [B, T, nh], ctx)
#                 backward(dout, q, k, v, out, lse, segments, scale, ctx) -> dq, dk, dv in q's dtype
#                 (backward's out and lse are the *merged* ones; out and dout in q's dtype)


class BlockwiseCausal:
    """Flash-attention algorithm in plain PyTorch, one query block at a time."""

    @staticmethod
    def _blocks(segments: torch.Tensor, nh: int, mask: CausalMask):
        B, T = segments.shape
        block = max(16, min(1024, BLOCK_BUDGET // max(1, B * nh * T)))
        starts = segment_starts(segments)
        pos = torch.arange(T, device=segments.device)
        window = mask.reach(T)
        for i0 in range(0, T, block):
            i1 = min(T, i0 + block)
            k0 = int(starts[:, i0].min())
            if window is not None and window != NOT_A_BAND:  # no query of the block sees a key before i0 - window + 1
                k0 = max(k0, i0 - window + 1)
            allowed = mask.allowed(
                segments[:, i0:i1, None], pos[i0:i1, None], segments[:, None, k0:i1], pos[None, k0:i1]
            )
            yield i0, i1, k0, allowed[:, None, None]  # [B, 1, 1, bq, nk]

    @staticmethod
    def _scores(qg, k, i0, i1, k0, allowed, scale):
        # qg [B, nkv, g, T, d], k [B, nkv, T, d] -> [B, nkv, g, bq, nk]
        acc = accumulation_dtype(qg)
        s = torch.einsum("bhgqd,bhkd->bhgqk", qg[:, :, :, i0:i1].to(acc), k[:, :, k0:i1].to(acc)) * scale
        return s.masked_fill(~allowed, float("-inf"))

    @classmethod
    def forward(cls, q, k, v, segments, scale, mask: CausalMask):
        B, T, nh, d = q.shape
        acc = accumulation_dtype(q)
        nkv = k.shape[2]
        qg = q.permute(0, 2, 1, 3).reshape(B, nkv, nh // nkv, T, d)
        kh, vh = k.transpose(1, 2), v.transpose(1, 2)
        out = q.new_empty(qg.shape, dtype=acc)
        lse = q.new_empty(qg.shape[:-1], dtype=acc)
        for i0, i1, k0, allowed in cls._blocks(segments, nh, mask):
            s = cls._scores(qg, kh, i0, i1, k0, allowed, scale)
            m = s.logsumexp(dim=-1)
            out[:, :, :, i0:i1] = torch.einsum(
                "bhgqk,bhkd->bhgqd", torch.exp(s - m[..., None]), vh[:, :, k0:i1].to(acc)
            )
            lse[:, :, :, i0:i1] = m
        return _from_grouped(out), _from_grouped(lse), None

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, segments, scale, ctx, mask: CausalMask):
        B, T, nh, d = q.shape
        acc = accumulation_dtype(q)
        nkv = k.shape[2]
        qg = q.permute(0, 2, 1, 3).reshape(B, nkv, nh // nkv, T, d)
        kh, vh = k.transpose(1, 2), v.transpose(1, 2)
        do = _to_grouped(dout.to(acc), nkv)
        lse_g = _to_grouped(lse, nkv)
        D = (do * _to_grouped(out, nkv)).sum(-1)  # [B, nkv, g, T]
        dq = torch.zeros_like(qg, dtype=acc)
        dk = torch.zeros(B, nkv, T, d, dtype=acc, device=q.device)
        dv = torch.zeros_like(dk)
        for i0, i1, k0, allowed in cls._blocks(segments, nh, mask):
            s = cls._scores(qg, kh, i0, i1, k0, allowed, scale)
            p = torch.exp(s - lse_g[:, :, :, i0:i1, None])
            do_b = do[:, :, :, i0:i1]
            dv[:, :, k0:i1] += torch.einsum("bhgqk,bhgqd->bhkd", p, do_b)
            dp = torch.einsum("bhgqd,bhkd->bhgqk", do_b, vh[:, :, k0:i1].to(acc))
            ds = p * (dp - D[:, :, :, i0:i1, None]) * scale
            dq[:, :, :, i0:i1] = torch.einsum("bhgqk,bhkd->bhgqd", ds, kh[:, :, k0:i1].to(acc))
            dk[:, :, k0:i1] += torch.einsum("bhgqk,bhgqd->bhkd", ds, qg[:, :, :, i0:i1].to(acc))
        return _from_grouped(dq).to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)


class FlashCausal:
    """PyTorch's fused flash-attention ops (CUDA: varlen over documents, its window arguments; CPU: per
    document, and with a band shorter than the document per block of `band` queries, over the keys that
    block can see and the rule's mask: the CPU op has no window arguments). The rule must be a band."""

    @staticmethod
    def forward(q, k, v, segments, scale, mask: CausalMask):
        window = _band(mask, segments.shape[1])
        if q.is_cuda:
            return FlashCausal._cuda_forward(q, k, v, segments, scale, window)
        B, T, nh, d = q.shape
        acc = accumulation_dtype(q)
        g = nh // k.shape[2]
        out = q.new_empty(B, T, nh, d, dtype=acc)
        lse = q.new_empty(B, T, nh, dtype=acc)
        for b, s, e in _runs(segments):
            for i0, i1, k0, band_mask in _cpu_blocks(s, e, mask, window, q.dtype):
                qb = q[b : b + 1, i0:i1].transpose(1, 2)
                kb = k[b : b + 1, k0:i1].transpose(1, 2).repeat_interleave(g, dim=1)
                vb = v[b : b + 1, k0:i1].transpose(1, 2).repeat_interleave(g, dim=1)
                o, o_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    qb, kb, vb, 0.0, band_mask is None, attn_mask=band_mask, scale=scale
                )
                out[b, i0:i1] = o[0].transpose(0, 1).to(acc)
                lse[b, i0:i1] = o_lse[0].transpose(0, 1).to(acc)
        return out, lse, None

    @staticmethod
    def backward(dout, q, k, v, out, lse, segments, scale, ctx, mask: CausalMask):
        window = _band(mask, segments.shape[1])
        if q.is_cuda:
            return FlashCausal._cuda_backward(dout, q, k, v, out, lse, segments, scale, ctx, window)
        B, T, nh, d = q.shape
        acc = accumulation_dtype(q)
        nkv = k.shape[2]
        g = nh // nkv
        dq = torch.empty_like(q)  # every position is in exactly one query block: all written below
        # key blocks overlap when a window splits a document: summed in fp32
        dk = torch.zeros_like(k, dtype=acc) if window is not None else torch.empty_like(k)
        dv = torch.zeros_like(v, dtype=acc) if window is not None else torch.empty_like(v)
        for b, s, e in _runs(segments):
            for i0, i1, k0, band_mask in _cpu_blocks(s, e, mask, window, q.dtype):

                def heads(x, lo=i0, b=b, i1=i1):  # [1, heads, i1 - lo, d]
                    return x[b : b + 1, lo:i1].transpose(1, 2)

                kb, vb = heads(k, k0).repeat_interleave(g, dim=1), heads(v, k0).repeat_interleave(g, dim=1)
                gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    heads(dout).to(q.dtype).contiguous(),
                    heads(q),
                    kb,
                    vb,
                    heads(out).to(q.dtype).contiguous(),
                    lse[b : b + 1, i0:i1].transpose(1, 2).to(acc).contiguous(),
                    0.0,
                    band_mask is None,
                    attn_mask=band_mask,
                    scale=scale,
                )
                dq[b, i0:i1] = gq[0].transpose(0, 1)
                n = i1 - k0
                gk = gk[0].view(nkv, g, n, d).sum(1, dtype=acc).transpose(0, 1)
                gv = gv[0].view(nkv, g, n, d).sum(1, dtype=acc).transpose(0, 1)
                if window is None:
                    dk[b, k0:i1], dv[b, k0:i1] = gk, gv
                else:
                    dk[b, k0:i1] += gk
                    dv[b, k0:i1] += gv
        return dq, dk.to(k.dtype), dv.to(v.dtype)

    # CUDA: one varlen flash-attention call; documents never cross rows.
    @staticmethod
    def _cu_seqlens(segments):
        """(cu_seqlens int32 [runs + 1], longest run) of the B rows laid end to end: a run starts where the id
        changes and at every row's start, whatever the ids (a query tail's are a slice of global ones)."""
        B, T = segments.shape
        starts = torch.ones_like(segments, dtype=torch.bool)
        starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
        cu = torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([B * T], device=segments.device)]).to(
            torch.int32
        )
        return cu, int((cu[1:] - cu[:-1]).max())

    @staticmethod
    def _cuda_forward(q, k, v, segments, scale, window):
        B, T, nh, d = q.shape
        cu, max_len = FlashCausal._cu_seqlens(segments)
        flat = lambda x: x.reshape(B * T, x.shape[2], d)  # noqa: E731
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            flat(q), flat(k), flat(v), cu, cu, max_len, max_len, 0.0, True, False, scale=scale, **_cuda_window(window)
        )
        lse = _lse_tokens_first(lse, B * T, nh)
        return out.view(B, T, nh, d).float(), lse.view(B, T, nh).float(), (cu, max_len, rng_state, unused)

    @staticmethod
    def _cuda_backward(dout, q, k, v, out, lse, segments, scale, ctx, window):
        B, T, nh, d = q.shape
        cu, max_len, rng_state, unused = ctx
        flat = lambda x: x.reshape(B * T, x.shape[2], d).to(q.dtype).contiguous()  # noqa: E731
        lse_heads_first = lse.reshape(B * T, nh).t().contiguous()  # the kernel's layout [nh, total]
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            flat(dout), flat(q), flat(k), flat(v), flat(out), lse_heads_first,
            cu, cu, max_len, max_len, 0.0, True, rng_state, unused, scale=scale, **_cuda_window(window),
        )  # fmt: skip
        return dq.view(B, T, nh, d), dk.view(B, T, -1, d), dv.view(B, T, -1, d)


def _cuda_window(window: int | None) -> dict[str, int]:
    """The varlen flash op's window arguments: a query sees the `window - 1` keys before it and none after."""
    return {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}


def _band(mask: CausalMask, length: int) -> int | None:
    """The band a flash kernel attends (`CausalMask.reach`); a rule that is no band is refused in one line."""
    window = mask.reach(length)
    if window == NOT_A_BAND:
        raise ValueError("the flash kernels attend a band of earlier positions; this visibility rule needs blockwise")
    return window


def _cpu_blocks(s: int, e: int, mask: CausalMask, window: int | None, dtype: torch.dtype):
    """(queries i0..i1, first key k0, additive mask) of the CPU flash calls over document positions s..e-1: one causal
    call (mask None) unless the band is shorter than the document; then blocks of `window` queries, each over the
    keys it can see, k0 = i0 - window + 1.., with the rule's mask [1, 1, bq, nk] in `dtype`."""
    if window is None or e - s <= window:
        yield s, e, s, None
        return
    for i0 in range(s, e, window):
        i1, k0 = min(e, i0 + window), max(s, i0 - window + 1)
        doc = torch.zeros((), dtype=torch.long)
        seen = mask.allowed(doc, torch.arange(i0, i1)[:, None], doc, torch.arange(k0, i1)[None])
        yield i0, i1, k0, torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, float("-inf"))[None, None]


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
    B, T, nh = x.shape[:3]
    x = x.reshape(B, T, nkv, nh // nkv, *x.shape[3:])
    return x.movedim(1, 3)


def _from_grouped(x: torch.Tensor) -> torch.Tensor:
    """[B, nkv, g, T, ...] -> [B, T, nh, ...]"""
    x = x.movedim(3, 1)
    return x.reshape(x.shape[0], x.shape[1], x.shape[2] * x.shape[3], *x.shape[4:])


def resolve_backend(q: torch.Tensor, mask: CausalMask, length: int) -> str:
    """`auto`: the fused flash kernels on CPU and on CUDA in bf16/fp16 (head_dim <= 256) for a rule that is a band
    (`CausalMask.reach`), blockwise otherwise. On CPU the fused kernel is 2-5x faster than the blockwise one (fwd +
    bwd at T = 1024..4096, docs/performance.md)."""
    if mask.reach(length) == NOT_A_BAND:
        return "blockwise"
    if q.device.type == "cpu":
        return "flash"
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256:
        return "flash"
    return "blockwise"
