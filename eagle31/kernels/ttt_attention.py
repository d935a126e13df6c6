"""Attention of the training-time-test unroll (docs/design.md §4).

Query `(p, k)` — position `p`, TTT step `k` — attends to

* the step-0 keys of positions `0..p` in the same document (causal), and
* its own chain: the keys `(p, j)` for `j = 1..k`.

Nothing else. So every step is "causal attention over the step-0 keys" plus
`k` extra keys per query.

A sliding window of W positions (`DrafterConfig.sliding_window`) is a window over RoPE positions, as
vLLM serves it: the query `(p, k)` sits at position `p + k` and sees the keys of positions
`p + k - W + 1 .. p + k` — the step-0 keys of `p + k - W + 1 .. p` (a causal window of `W - k`
positions at step k) and its whole chain (positions `p + 1 .. p + k`, inside the window while `k < W`).

The efficient path computes the causal part with a kernel that returns its
log-sum-exp (LSE), adds the chain scores, and merges the two by LSE; its backward calls the kernel's backward with the *merged*
output and LSE (the standard flash-attention identity), then adds the chain's
gradients. Memory is O(T) in the sequence length: no `T x T` or `T x (K*T)`
tensor is built.

The causal part is a kernel of `eagle31.kernels.causal` (on a sequence shard wrapped in
`eagle31.sequence_parallel.query_tail.QueryTail`):
  * `flash` — PyTorch's fused flash-attention ops: on CUDA one varlen call
    over the packed documents, on CPU one call per document (the faster CPU path);
  * `blockwise` — pure PyTorch, any device and dtype, query blocks of bounded size.
`reference_attention` builds the explicit scores (for tests and readers).

Layouts: q [B, T, nh, d]; k0, v0 [B, T, nkv, d]; chain: a sequence of j entries,
what steps 1..j keep for the later ones (empty at step 0) — by default (k, v) each
[B, T, nkv, d]; in the drafter's unroll a Llama step's input (feature, token ids, positions)
and MLA's latents (`ChainKeysValues` makes keys and values of them) — a sequence, not one stacked tensor, so the unroll shares each
step's entry between later steps instead of saving a growing copy per step (O(K)
memory, not O(K^2)). The chain is attended a block of token rows at a time, its keys
and values made per block: the chain never adds a [B, T, j, nkv, d] tensor. segments [B, T].
"""

from __future__ import annotations

import math
from enum import StrEnum

import torch

from eagle31.kernels import causal as kernels
from eagle31.kernels.causal import (
    BlockwiseCausal,
    FlashCausal,
    accumulation_dtype,
    resolve_backend,
)
from eagle31.kernels.entries import KEYS_VALUES, ChainKeysValues, step0_keys_values
from eagle31.sequence_parallel.query_tail import QueryTail, StepZeroKeys


class AttentionBackend(StrEnum):
    auto = "auto"
    flash = "flash"
    blockwise = "blockwise"
    reference = "reference"


# ----------------------------------------------------------------------------
# reference: explicit scores


def reference_attention(q, k0, v0, chain_k, chain_v, segments, probe=None, window=None) -> torch.Tensor:
    """Explicit softmax over [step-0 keys | chain keys]; O(Tq * Tk) memory.

    q [B, Tq, nh, d] are the queries of the last Tq of the Tk positions whose step-0 keys k0, v0
    [B, Tk, nkv, d] are (Tq = Tk but for a query tail, as on a sequence shard); the chain's keys
    are the queries' own, [B, Tq, nkv, d] each; segments [B, Tk]. `probe`, when given, is called
    with the probabilities [B, nh, Tq, Tk + j*Tq] (keys step-major: the Tk step-0 keys, then the
    Tq keys of each chain step) before they weight the values. `window`: the sliding window W in positions
    (module docstring), None for full attention.
    """
    B, T, nh, d = q.shape
    Tk, nkv = k0.shape[1], k0.shape[2]
    g = nh // nkv
    j = len(chain_k)

    def per_query_head(x, n):  # [B, n, nkv, d] -> [B, nh, n, d]
        return x.permute(0, 2, 1, 3).repeat_interleave(g, dim=1)

    # keys (p', s) of every query: [B, nh, Tk + j*T, d], step-major
    K = torch.cat([per_query_head(k0, Tk), *[per_query_head(k, T) for k in chain_k]], dim=2)
    V = torch.cat([per_query_head(v0, Tk), *[per_query_head(v, T) for v in chain_v]], dim=2)
    query_pos = torch.arange(Tk - T, Tk, device=q.device)
    key_pos = torch.arange(Tk, device=q.device)
    # query (p, j) sits at position p + j, the step-0 key p' at p', the chain key (p, i) at p + i
    back = query_pos[:, None] + j - key_pos[None, :]  # [T, Tk]
    causal = (back >= j) & (segments[:, -T:, None] == segments[:, None, :])  # [B, T, Tk]
    diag = (query_pos[:, None] == query_pos[None, :]).expand(B, T, T)
    chain = [diag if window is None or j - i < window else torch.zeros_like(diag) for i in range(1, j + 1)]
    if window is not None:
        causal &= back < window
    allowed = torch.cat([causal, *chain], dim=2)  # [B, T, Tk + j*T]
    probs = attention_probabilities(q, K, allowed)
    if probe is not None:
        probe(probs)
    return torch.einsum("bhqk,bhkd->bqhd", probs, V)


def attention_probabilities(q: torch.Tensor, K: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k / sqrt(d)) over the allowed keys: q [B, Q, nh, d], K [B, nh, S, d] (one per query head),
    allowed [B, Q, S] bool or None (all) -> [B, nh, Q, S]."""
    scores = torch.einsum("bqhd,bhkd->bhqk", q, K) / math.sqrt(q.shape[-1])
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return scores.softmax(dim=-1)


# ----------------------------------------------------------------------------
# the merged step: causal part + chain, by log-sum-exp


def _chain_rows(N: int, j: int, nh: int, d: int):
    """Blocks of flattened token rows (b*T + t) for the chain: one block's fp32 chain keys stay under `kernels.BLOCK_BUDGET`."""
    n = max(1, kernels.BLOCK_BUDGET // max(1, j * nh * d))
    return [slice(r, min(N, r + n)) for r in range(0, N, n)]


def _rows(entries, rows: slice):
    """Each entry's tensors [B, T, ...] cut to flattened token rows `rows`: [n, ...]."""
    return [[t.flatten(0, 1)[rows] for t in e] for e in entries]


def _stacked_rows(entry_rows) -> list[torch.Tensor]:
    """The j entries' rows stacked step-major, one tensor per entry part: [j * n, ...]."""
    return [torch.cat(part) for part in zip(*entry_rows)]


def _chain_block(stacked, j: int, expand: ChainKeysValues, params):
    """Keys and values of every chain step from the stacked entry rows (one `expand` call): each [n, j, nkv, d]."""
    k, v = expand.fn(*stacked, *params)  # [j * n, nkv, d]
    return k.unflatten(0, (j, -1)).transpose(0, 1), v.unflatten(0, (j, -1)).transpose(0, 1)


def _causal_backward(kernel, dout, q, entry0, expand0, params0, out, lse, segments, scale, kctx, window):
    """The causal kernel's backward over the whole sequence's step-0 keys: (dq, the step-0 entry's gradients,
    its parameters'). The keys and values are made again (a graph unless they are the entry), and their
    gradients turned into the entry's at once: the decompressed keys go before the chain blocks run."""
    with torch.enable_grad():
        inputs0 = [t.detach().requires_grad_(t.is_floating_point()) for t in entry0]
        leaves0 = [p.detach().requires_grad_() for p in params0]
        k0, v0 = step0_keys_values(inputs0, expand0, leaves0, entry0[0].shape[:2])
    dq, dk0, dv0 = kernel.backward(dout, q, k0.detach(), v0.detach(), out, lse, segments, scale, kctx, window)
    if expand0 is KEYS_VALUES:
        return dq, [dk0, dv0], []
    wanted = [t for t in inputs0 if t.requires_grad] + leaves0
    grads0 = iter(torch.autograd.grad((k0, v0), wanted, (dk0, dv0), allow_unused=True))
    d_entry0 = [next(grads0) if t.requires_grad else None for t in inputs0]
    return dq, d_entry0, [next(grads0) for _ in leaves0]


class _TTTAttention(torch.autograd.Function):
    """Causal kernel + chain keys merged by log-sum-exp.

    Inputs (q, segments, kernel, window, expand0, expand, j, *entry0, *entries, *expand0.params,
    *expand.params): window the causal kernel's (the drafter's sliding window less j, or None);
    entry0 the `expand0.width` tensors of step 0 (its keys and values, made by `expand0` over all rows), entries the `expand.width` tensors of each of the j chain steps, step
    after step. Unless `expand0` is `KEYS_VALUES` (the entry is k0, v0), the step-0 keys and values
    are not saved: backward makes them again for the causal kernel's backward and turns their
    gradients into the entry's (and the parameters') before the chain blocks run. On a sequence
    shard (`QueryTail`) they are made a block of positions at a time (`StepZeroKeys`), in both.
    """

    @staticmethod
    def forward(ctx, q, segments, kernel, window, expand0, expand, j, *rest):
        B, T, nh, d = q.shape
        acc = accumulation_dtype(q)
        w0 = expand0.width
        entry0 = rest[:w0]
        entries = [rest[w0 + i * expand.width : w0 + (i + 1) * expand.width] for i in range(j)]
        params0 = rest[w0 + j * expand.width : w0 + j * expand.width + len(expand0.params)]
        params = rest[w0 + j * expand.width + len(expand0.params) :]
        scale = 1.0 / math.sqrt(d)
        if isinstance(kernel, QueryTail):  # a shard: the keys before it are made a block at a time
            keys0 = StepZeroKeys(entry0, expand0, params0)
            out, lse, kctx = kernel.forward(q, keys0, segments, scale, window)
            nkv = keys0.num_kv_heads()
        else:
            k0, v0 = step0_keys_values(entry0, expand0, params0, entry0[0].shape[:2])  # [B, T, nkv, d]
            out, lse, kctx = kernel.forward(q, k0, v0, segments, scale, window)  # fp32 [B, T, nh, d], [B, T, nh]
            nkv = k0.shape[2]
            del k0, v0
        g = nh // nkv
        out, lse = out.contiguous(), lse.contiguous()  # the chain merges into them in place
        if j:
            qf, of, lf = q.reshape(B * T, nkv, g, d), out.view(B * T, nkv, g, d), lse.view(B * T, nkv, g)
            for r in _chain_rows(B * T, j, nh, d):
                ck, cv = _chain_block(_stacked_rows(_rows(entries, r)), j, expand, params)  # [n, j, nkv, d]
                s = torch.einsum("nkgd,njkd->nkgj", qf[r].to(acc), ck.to(acc)) * scale  # [n, nkv, g, j]
                lse_all = torch.logaddexp(lf[r], s.logsumexp(-1))
                p = torch.exp(s - lse_all[..., None])
                of[r] = of[r] * torch.exp(lf[r] - lse_all)[..., None] + torch.einsum("nkgj,njkd->nkgd", p, cv.to(acc))
                lf[r] = lse_all
        out = out.to(q.dtype)  # saved as returned: the next layer keeps this tensor anyway
        ctx.save_for_backward(q, segments, out, lse, *rest)
        ctx.kernel, ctx.kctx, ctx.scale, ctx.j, ctx.expand0, ctx.expand, ctx.nkv = (
            kernel,
            kctx,
            scale,
            j,
            expand0,
            expand,
            nkv,
        )
        ctx.window = window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, segments, out, lse, *rest = ctx.saved_tensors
        B, T, nh, d = q.shape
        acc = accumulation_dtype(q)
        nkv = ctx.nkv
        g = nh // nkv
        j, expand0, expand = ctx.j, ctx.expand0, ctx.expand
        w0 = expand0.width
        entry0 = rest[:w0]
        entries = [rest[w0 + i * expand.width : w0 + (i + 1) * expand.width] for i in range(j)]
        params0 = rest[w0 + j * expand.width : w0 + j * expand.width + len(expand0.params)]
        params = rest[w0 + j * expand.width + len(expand0.params) :]
        dout = dout.to(q.dtype)  # no copy: the output's dtype; gradients stay in it (fp32 only per chain block)
        if isinstance(ctx.kernel, QueryTail):
            keys0 = StepZeroKeys(entry0, expand0, params0)
            dq, d_entry0, d_params0 = ctx.kernel.backward(
                dout, q, keys0, out, lse, segments, ctx.scale, ctx.kctx, ctx.window
            )
        else:
            causal = (
                ctx.kernel,
                dout,
                q,
                entry0,
                expand0,
                params0,
                out,
                lse,
                segments,
                ctx.scale,
                ctx.kctx,
                ctx.window,
            )
            dq, d_entry0, d_params0 = _causal_backward(*causal)
        # gradients for the floating entry parts (a Llama entry's token ids and positions have none)
        chain_parts = rest[w0 : w0 + j * expand.width]
        d_entries = [torch.zeros_like(t) if t.is_floating_point() else None for t in chain_parts]
        d_params = [torch.zeros_like(p, dtype=torch.promote_types(p.dtype, acc)) for p in params]
        if j:
            dq = dq.reshape(B * T, nkv, g, d)
            qf, dof = q.reshape(B * T, nkv, g, d), dout.reshape(B * T, nkv, g, d)
            of, lf = out.reshape(B * T, nkv, g, d), lse.reshape(B * T, nkv, g)
            for r in _chain_rows(B * T, j, nh, d):
                with torch.enable_grad():  # the block's keys and values, again, as a small graph
                    inputs = [
                        t.detach().requires_grad_(t.is_floating_point()) for t in _stacked_rows(_rows(entries, r))
                    ]
                    leaves = [p.detach().requires_grad_() for p in params]
                    ck, cv = _chain_block(inputs, j, expand, leaves)
                    differentiable = [t for t in inputs if t.requires_grad]
                qb, do = qf[r].to(acc), dof[r].to(acc)
                D = (do * of[r].to(acc)).sum(-1)  # [n, nkv, g]
                s = torch.einsum("nkgd,njkd->nkgj", qb, ck.detach().to(acc)) * ctx.scale
                p = torch.exp(s - lf[r][..., None].to(acc))
                dp = torch.einsum("nkgd,njkd->nkgj", do, cv.detach().to(acc))
                ds = p * (dp - D[..., None]) * ctx.scale
                dq[r] += torch.einsum("nkgj,njkd->nkgd", ds, ck.detach().to(acc)).to(dq.dtype)
                dck = torch.einsum("nkgj,nkgd->njkd", ds, qb).to(ck.dtype)
                dcv = torch.einsum("nkgj,nkgd->njkd", p, do).to(cv.dtype)
                grads = torch.autograd.grad((ck, cv), differentiable + leaves, (dck, dcv), allow_unused=True)
                parts = [part for part, t in enumerate(inputs) if t.requires_grad]
                for part, grad in zip(parts, grads[: len(parts)]):  # [j * n, ...] -> step i's part
                    if grad is not None:
                        for i, g_i in enumerate(grad.chunk(j)):
                            dst = d_entries[i * expand.width + part]
                            dst.view(B * T, *dst.shape[2:])[r] += g_i
                for dst, grad in zip(d_params, grads[len(parts) :]):
                    if grad is not None:
                        dst += grad
            dq = dq.view(B, T, nh, d)
        d_params = [dp.to(p.dtype) for dp, p in zip(d_params, params)]
        return dq, None, None, None, None, None, None, *d_entry0, *d_entries, *d_params0, *d_params


def ttt_attention(
    q, k0, v0, chain, segments, backend: str = "auto", expand: ChainKeysValues = KEYS_VALUES, probe=None,
    window: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Attention of one TTT step (see module docstring); returns [B, T, nh, d].

    chain: sequence of j entries (empty at step 0), each a tuple of `expand.width` tensors
    [B, T, ...] from which `expand` makes that step's keys and values; with the default,
    an entry is (k, v), each [B, T, nkv, d]. k0, v0 and segments may cover Tk > T positions: the
    queries are then the last T of them (a sequence shard, `QueryTail`). `probe` sees the attention probabilities
    (`reference_attention`), so it needs the reference backend. `window`: the sliding window W in positions
    (module docstring; it must exceed the chain's length j), None for full attention.
    """
    return ttt_attention_of_entries(q, (k0, v0), chain, segments, backend, KEYS_VALUES, expand, probe, window)


def ttt_attention_of_entries(
    q, entry0, chain, segments, backend: str = "auto", expand0: ChainKeysValues = KEYS_VALUES,
    expand: ChainKeysValues = KEYS_VALUES, probe=None, window: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """`ttt_attention` with the causal keys and values given as the step-0 entry, `expand0.width` tensors
    [B, Tk, ...] that `expand0` makes them of (Tk > T on a sequence shard): MLA's latents are kept, its keys and values decompressed
    in the forward and again in the backward, never saved between them."""
    if backend == "auto":
        backend = resolve_backend(q)
    if any(len(e) != expand.width for e in chain) or len(entry0) != expand0.width:
        raise ValueError(f"every chain entry must hold {expand.width} tensors, got {[len(e) for e in chain]}")
    if window is not None and window <= len(chain):
        raise ValueError(
            f"a sliding window of {window} positions leaves step {len(chain)}'s query no step-0 key: it must exceed the chain"
        )
    tail = entry0[0].shape[1] != q.shape[1]  # the queries are the last of the keys' positions (sequence parallelism)
    if backend == "reference":
        B, T = q.shape[:2]
        k0, v0 = step0_keys_values(entry0, expand0, expand0.params, entry0[0].shape[:2])
        kv = [expand.fn(*[t.flatten(0, 1) for t in e], *expand.params) for e in chain]
        chain_k = [k.view(B, T, *k.shape[1:]) for k, _ in kv]
        chain_v = [v.view(B, T, *v.shape[1:]) for _, v in kv]
        return reference_attention(q, k0, v0, chain_k, chain_v, segments, probe, window)
    if probe is not None:
        raise ValueError(f"the attention probabilities are explicit only in the reference backend, not {backend!r}")
    kernels = {"flash": FlashCausal, "blockwise": BlockwiseCausal}
    if backend not in kernels:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {[b.value for b in AttentionBackend]}")
    flat = [t for e in chain for t in e]
    kernel = QueryTail(kernels[backend]) if tail else kernels[backend]
    causal_window = None if window is None else window - len(chain)  # step j: the step-0 keys of p + j - W + 1 .. p
    return _TTTAttention.apply(
        q, segments, kernel, causal_window, expand0, expand, len(chain), *entry0, *flat, *expand0.params, *expand.params
    )
