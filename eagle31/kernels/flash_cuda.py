"""The bytes `FlashCausal`'s CUDA path holds during one call, beyond its arguments (`flash_cuda_call_bytes`).

A memory trace on a CPU-only torch build cannot run this path, not even on fake tensors (autograd on a fake
CUDA tensor aborts the process there), so `eagle31.memory_trace` takes the call's bytes from here: what the
path allocates (`FlashCausal._cuda_forward` / `_cuda_backward`) and what the varlen flash ops allocate inside
them, which no tensor shows. Per call, with n = B * T * nh * d elements of q (d rounded up to 32, as the
ops pad it), nkv the key heads, c the bytes of q's dtype:

  forward   the op's output (c n) and its fp32 copy, the call's output (4 n); the log-sum-exp (4 B T nh)
  backward  the log-sum-exp made heads-first (4 B T nh); dq, dk, dv (c B T (nh + 2 nkv) d); inside the op, the
            fp32 dq accumulator (4 n) and softmax_d (4 B T nh), and with fewer key heads than query heads
            the key and value gradients of every query head before they are summed (2 c n)
  both      the copies the call makes of an argument that is not contiguous in q's dtype
"""

from __future__ import annotations

import torch


def flash_cuda_call_bytes(backward: bool, q: torch.Tensor, k: torch.Tensor, *others: torch.Tensor) -> int:
    """Peak bytes of one `FlashCausal.forward` (backward=False) or `.backward` call on CUDA above its arguments:
    q [B, T, nh, d], k [B, T, nkv, d]; `others`, the call's other arguments of q's shape (v; backward: dout, out)."""
    B, T, nh, d = q.shape
    nkv = k.shape[2]
    c = q.element_size()
    n = B * T * nh * -(-d // 32) * 32
    lse = 4 * B * T * nh
    copies = sum(x.numel() * c for x in (q, k, *others) if x.dtype != q.dtype or not x.is_contiguous())
    if not backward:
        return c * n + 4 * n + lse + copies
    gradients = c * B * T * (nh + 2 * nkv) * d
    inside = 4 * n + lse + (2 * c * n if nkv < nh else 0)
    return lse + gradients + inside + copies
