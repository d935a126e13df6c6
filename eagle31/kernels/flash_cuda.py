"""The bytes `FlashCausal`'s CUDA path holds in a call, for memory traces that cannot run it (docs/performance.md)."""

from __future__ import annotations

import torch


def flash_cuda_call_bytes(backward: bool, q: torch.Tensor, k: torch.Tensor, *others: torch.Tensor) -> int:
    """Peak bytes of one `FlashCausal.forward` (backward=False) or `.backward` call on CUDA above its arguments:
    q [B, T, nh, d], k [B, T, nkv, d]; `others`, the call's other arguments of q's shape (v; backward: dout, out)."""
    B, T, nh, d = q.shape
    nkv = k.shape[2]
    c = q.element_size()
    n = B * T * nh * -(-d // 32) * 32  # elements of q, d rounded up to 32 as the ops pad it
    lse = 4 * B * T * nh  # the log-sum-exp (backward: made heads-first)
    # the copies the call makes of an argument that is not contiguous in q's dtype
    copies = sum(x.numel() * c for x in (q, k, *others) if x.dtype != q.dtype or not x.is_contiguous())
    if not backward:
        return c * n + 4 * n + lse + copies  # the op's output and its fp32 copy
    gradients = c * B * T * (nh + 2 * nkv) * d  # dq, dk, dv
    # inside the op: the fp32 dq accumulator, softmax_d, and with fewer key heads than query heads the key and value
    # gradients of every query head before they are summed
    inside = 4 * n + lse + (2 * c * n if nkv < nh else 0)
    return lse + gradients + inside + copies
