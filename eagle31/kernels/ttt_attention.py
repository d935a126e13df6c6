"""One TTT step's attention in O(T) memory: causal kernel + chain, merged by log-sum-exp (docs/design.md §4).
q [B, T, nh, d]; step-0 entry over Tk >= T positions (a shard's queries: the last T); chain: steps 1..j's entries."""

from __future__ import annotations

import math
from enum import StrEnum

import torch

from eagle31.kernels import causal as kernels
from eagle31.kernels.causal import BlockwiseCausal, CausalMask, FlashCausal, accumulation_dtype, resolve_backend
from eagle31.kernels.entries import KEYS_VALUES, ChainKeysValues, entry_keys_values, keys_values_with_graph
from eagle31.model import Visibility, explicit_attention
from eagle31.sequence_parallel.query_tail import QueryTail, StepZeroKeys


class AttentionBackend(StrEnum):
    auto = "auto"
    flash = "flash"
    blockwise = "blockwise"
    reference = "reference"  # explicit scores (O(T^2) memory): the spec's attention


def reference_attention(q, k0, v0, chain_k, chain_v, segments, rule=Visibility(), probe=None) -> torch.Tensor:
    """Explicit attention of one TTT step: q [B, T, nh, d], the last T of the Tk positions of k0, v0 [B, Tk, nkv, d];
    chain_k, chain_v [B, T, nkv, d] each; segments [B, Tk]; `probe`: probs [B, nh, T, Tk + j*T], keys step-major."""
    B, T = q.shape[:2]
    Tk, j = k0.shape[1], len(chain_k)
    index = torch.arange(Tk, device=q.device)
    k_pos = torch.cat([index, *[index[Tk - T :]] * j])
    k_step = torch.cat([torch.zeros_like(index), *[torch.full((T,), s, device=q.device) for s in range(1, j + 1)]])
    k_doc = torch.cat([segments, *[segments[:, Tk - T :]] * j], dim=1)
    allowed = rule(segments[:, Tk - T :, None], index[Tk - T :, None], j, k_doc[:, None], k_pos, k_step)
    return explicit_attention(q, torch.cat([k0, *chain_k], 1), torch.cat([v0, *chain_v], 1), allowed, probe)


# ----------------------------------------------------------------------------
# the merged step: causal part + chain, by log-sum-exp


def _chain_rows(N: int, j: int, nh: int, d: int):
    """Blocks of flattened token rows (b*T + t) for the chain: one block's fp32 chain keys within the budget."""
    n = max(1, kernels.BLOCK_BUDGET // max(1, j * nh * d))
    return [slice(r, min(N, r + n)) for r in range(0, N, n)]


def _stacked_rows(entries, rows: slice) -> list[torch.Tensor]:
    """The j entries' tensors [B, T, ...] cut to flattened token rows `rows`, stacked step-major: [j * n, ...] each."""
    return [torch.cat([t.flatten(0, 1)[rows] for t in part]) for part in zip(*entries)]


def _chain_block(stacked, params, j: int, expand: ChainKeysValues):
    """Keys and values of every chain step from the stacked entry rows (one `expand` call): each [n, j, nkv, d]."""
    k, v = expand.fn(*stacked, *params)  # [j * n, nkv, d]
    return k.unflatten(0, (j, -1)).transpose(0, 1), v.unflatten(0, (j, -1)).transpose(0, 1)


def _split(rest, expand0: ChainKeysValues, expand: ChainKeysValues, j: int):
    """`_TTTAttention`'s flat inputs -> (step-0 entry, the j chain entries, step 0's parameters, the chain's)."""
    w0, w, n0 = expand0.width, expand.width, len(expand0.params)
    entries = [rest[w0 + i * w : w0 + (i + 1) * w] for i in range(j)]
    return rest[:w0], entries, rest[w0 + j * w : w0 + j * w + n0], rest[w0 + j * w + n0 :]


class _TTTAttention(torch.autograd.Function):
    """Causal kernel + chain keys merged by log-sum-exp; inputs (q, segments, kernel, mask, expand0, expand, j, *entry0,
    *entries, *expand0.params, *expand.params); keys and values made of entries are remade in the backward."""

    @staticmethod
    def forward(ctx, q, segments, kernel, mask, expand0, expand, j, *rest):
        B, T, nh, d = q.shape
        acc = accumulation_dtype(q)
        entry0, entries, params0, params = _split(rest, expand0, expand, j)
        scale = 1.0 / math.sqrt(d)
        keys0 = StepZeroKeys(entry0, expand0, params0)
        out, lse, kctx = kernel.forward(q, keys0, segments, scale, mask)  # fp32 [B, T, nh, d], [B, T, nh]
        nkv = keys0.num_kv_heads()
        g = nh // nkv
        out, lse = out.contiguous(), lse.contiguous()  # the chain merges into them in place
        if j:
            qf, of, lf = q.reshape(B * T, nkv, g, d), out.view(B * T, nkv, g, d), lse.view(B * T, nkv, g)
            for r in _chain_rows(B * T, j, nh, d):
                ck, cv = _chain_block(_stacked_rows(entries, r), params, j, expand)  # [n, j, nkv, d]
                s = torch.einsum("nkgd,njkd->nkgj", qf[r].to(acc), ck.to(acc)) * scale  # [n, nkv, g, j]
                lse_all = torch.logaddexp(lf[r], s.logsumexp(-1))
                p = torch.exp(s - lse_all[..., None])
                of[r] = of[r] * torch.exp(lf[r] - lse_all)[..., None] + torch.einsum("nkgj,njkd->nkgd", p, cv.to(acc))
                lf[r] = lse_all
        out = out.to(q.dtype)  # saved as returned: the next layer keeps this tensor anyway
        ctx.save_for_backward(q, segments, out, lse, *rest)
        ctx.kernel, ctx.kctx, ctx.scale, ctx.j, ctx.nkv, ctx.mask = kernel, kctx, scale, j, nkv, mask
        ctx.expand0, ctx.expand = expand0, expand
        return out

    @staticmethod
    def backward(ctx, dout):
        q, segments, out, lse, *rest = ctx.saved_tensors
        B, T, nh, d = q.shape
        acc = accumulation_dtype(q)
        j, nkv, expand = ctx.j, ctx.nkv, ctx.expand
        g = nh // nkv
        entry0, entries, params0, params = _split(rest, ctx.expand0, expand, j)
        dout = dout.to(q.dtype)  # no copy: the output's dtype; gradients stay in it (fp32 only per chain block)
        keys0 = StepZeroKeys(entry0, ctx.expand0, params0)
        dq, d_entry0, d_params0 = ctx.kernel.backward(dout, q, keys0, out, lse, segments, ctx.scale, ctx.kctx, ctx.mask)
        # gradients for the floating entry parts (a Llama entry's token ids and positions have none)
        d_entries = [torch.zeros_like(t) if t.is_floating_point() else None for e in entries for t in e]
        d_params = [torch.zeros_like(p, dtype=torch.promote_types(p.dtype, acc)) for p in params]
        if j:
            dq, qf, dof, of = (x.reshape(B * T, nkv, g, d) for x in (dq, q, dout, out))
            lf = lse.reshape(B * T, nkv, g)
            for r in _chain_rows(B * T, j, nh, d):
                # the block's keys and values, again, as a small graph
                ck, cv, grads = keys_values_with_graph(
                    lambda e, p: _chain_block(e, p, j, expand), _stacked_rows(entries, r), params
                )
                qb, do = qf[r].to(acc), dof[r].to(acc)
                D = (do * of[r].to(acc)).sum(-1)  # [n, nkv, g]
                s = torch.einsum("nkgd,njkd->nkgj", qb, ck.to(acc)) * ctx.scale
                p = torch.exp(s - lf[r][..., None].to(acc))
                dp = torch.einsum("nkgd,njkd->nkgj", do, cv.to(acc))
                ds = p * (dp - D[..., None]) * ctx.scale
                dq[r] += torch.einsum("nkgj,njkd->nkgd", ds, ck.to(acc)).to(dq.dtype)
                d_rows, d_leaves = grads(
                    torch.einsum("nkgj,nkgd->njkd", ds, qb).to(ck.dtype),
                    torch.einsum("nkgj,nkgd->njkd", p, do).to(cv.dtype),
                )
                for part, grad in enumerate(d_rows):  # [j * n, ...] -> step i's part
                    for i, g_i in enumerate(grad.chunk(j) if grad is not None else ()):
                        dst = d_entries[i * expand.width + part]
                        dst.view(B * T, *dst.shape[2:])[r] += g_i
                for dst, grad in zip(d_params, d_leaves):
                    if grad is not None:
                        dst += grad
            dq = dq.view(B, T, nh, d)
        d_params = [dp.to(p.dtype) for dp, p in zip(d_params, params)]
        return dq, None, None, None, None, None, None, *d_entry0, *d_entries, *d_params0, *d_params


def ttt_attention(
    q, k0, v0, chain, segments, backend: str = "auto", expand: ChainKeysValues = KEYS_VALUES, rule=Visibility()
) -> torch.Tensor:
    """Attention of one TTT step (module docstring) -> [B, T, nh, d]; the chain's entries are (k, v) by default."""
    return ttt_attention_of_entries(q, (k0, v0), chain, segments, backend, KEYS_VALUES, expand, rule)


def ttt_attention_of_entries(
    q, entry0, chain, segments, backend: str = "auto", expand0: ChainKeysValues = KEYS_VALUES,
    expand: ChainKeysValues = KEYS_VALUES, rule=Visibility(),
) -> torch.Tensor:  # fmt: skip
    """`ttt_attention` of the step-0 entry, `expand0.width` tensors [B, Tk, ...] that `expand0` expands (MLA)."""
    if any(len(e) != expand.width for e in chain) or len(entry0) != expand0.width:
        raise ValueError(f"every chain entry must hold {expand.width} tensors, got {[len(e) for e in chain]}")
    mask = CausalMask(rule, len(chain))
    Tk = entry0[0].shape[1]
    if backend == "auto":
        backend = resolve_backend(q, mask, Tk)
    if backend == "reference":
        k0, v0 = entry_keys_values(entry0, expand0, expand0.params)
        kv = [entry_keys_values(e, expand, expand.params) for e in chain]
        return reference_attention(q, k0, v0, [k for k, _ in kv], [v for _, v in kv], segments, rule)
    causal = {"flash": FlashCausal, "blockwise": BlockwiseCausal}
    if backend not in causal:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {[b.value for b in AttentionBackend]}")
    mask.reach(Tk)  # refuses, in one line, a rule that leaves a query no key
    kernel = QueryTail(causal[backend])  # the queries are the last T of the Tk positions (Tk > T on a shard)
    flat = [t for e in chain for t in e]
    return _TTTAttention.apply(
        q, segments, kernel, mask, expand0, expand, len(chain), *entry0, *flat, *expand0.params, *expand.params
    )
