"""One TTT step's attention in memory O(T): a causal kernel over the step-0 keys, plus each query's chain, merged
by log-sum-exp (docs/design.md §4). q [B, T, nh, d]; the step-0 entry over Tk >= T positions (Tk > T on a sequence
shard: the queries are the last T); chain: the entries of steps 1..j, each what that step keeps."""

from __future__ import annotations

import math
from enum import StrEnum

import torch

from eagle31.kernels import causal as kernels
from eagle31.kernels.causal import BlockwiseCausal, CausalMask, FlashCausal, accumulation_dtype, resolve_backend
from eagle31.kernels.entries import KEYS_VALUES, ChainKeysValues, step0_keys_values
from eagle31.model import Visibility, explicit_attention
from eagle31.sequence_parallel.query_tail import QueryTail, StepZeroKeys


class AttentionBackend(StrEnum):
    auto = "auto"
    flash = "flash"
    blockwise = "blockwise"
    reference = "reference"  # explicit scores (O(T^2) memory): the spec's attention


def reference_attention(q, k0, v0, chain_k, chain_v, segments, rule=Visibility(), probe=None) -> torch.Tensor:
    """The explicit attention of one TTT step: q [B, T, nh, d] the queries of the last T of the Tk positions of
    the step-0 keys k0, v0 [B, Tk, nkv, d]; chain_k, chain_v the j chain steps' keys [B, T, nkv, d]; segments [B, Tk].
    `probe(probs)` sees the probabilities [B, nh, T, Tk + j*T], keys step-major."""
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


def _causal_backward(kernel, dout, q, entry0, expand0, params0, out, lse, segments, scale, kctx, mask):
    """(dq, the step-0 entry's gradients, its parameters'): the causal kernel's backward over keys made again from
    the entry, their gradients turned into the entry's before the chain blocks run."""
    with torch.enable_grad():
        inputs0 = [t.detach().requires_grad_(t.is_floating_point()) for t in entry0]
        leaves0 = [p.detach().requires_grad_() for p in params0]
        k0, v0 = step0_keys_values(inputs0, expand0, leaves0, entry0[0].shape[:2])
    dq, dk0, dv0 = kernel.backward(dout, q, k0.detach(), v0.detach(), out, lse, segments, scale, kctx, mask)
    if expand0 is KEYS_VALUES:
        return dq, [dk0, dv0], []
    wanted = [t for t in inputs0 if t.requires_grad] + leaves0
    grads0 = iter(torch.autograd.grad((k0, v0), wanted, (dk0, dv0), allow_unused=True))
    d_entry0 = [next(grads0) if t.requires_grad else None for t in inputs0]
    return dq, d_entry0, [next(grads0) for _ in leaves0]


def _split(rest, expand0: ChainKeysValues, expand: ChainKeysValues, j: int):
    """`_TTTAttention`'s flat inputs -> (step-0 entry, the j chain entries, step 0's parameters, the chain's)."""
    w0, w, n0 = expand0.width, expand.width, len(expand0.params)
    entries = [rest[w0 + i * w : w0 + (i + 1) * w] for i in range(j)]
    return rest[:w0], entries, rest[w0 + j * w : w0 + j * w + n0], rest[w0 + j * w + n0 :]


class _TTTAttention(torch.autograd.Function):
    """Causal kernel + chain keys merged by log-sum-exp; inputs (q, segments, kernel, mask, expand0, expand, j,
    *entry0, *entries, *expand0.params, *expand.params). Keys and values made of entries are never saved: the
    backward makes them again (on a shard a block of positions at a time, `StepZeroKeys`)."""

    @staticmethod
    def forward(ctx, q, segments, kernel, mask, expand0, expand, j, *rest):
        B, T, nh, d = q.shape
        acc = accumulation_dtype(q)
        entry0, entries, params0, params = _split(rest, expand0, expand, j)
        scale = 1.0 / math.sqrt(d)
        if isinstance(kernel, QueryTail):  # a shard: the keys before it are made a block at a time
            keys0 = StepZeroKeys(entry0, expand0, params0)
            out, lse, kctx = kernel.forward(q, keys0, segments, scale, mask)
            nkv = keys0.num_kv_heads()
        else:
            k0, v0 = step0_keys_values(entry0, expand0, params0, entry0[0].shape[:2])  # [B, T, nkv, d]
            out, lse, kctx = kernel.forward(q, k0, v0, segments, scale, mask)  # fp32 [B, T, nh, d], [B, T, nh]
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
        ctx.kernel, ctx.kctx, ctx.scale, ctx.j, ctx.nkv, ctx.mask = kernel, kctx, scale, j, nkv, mask
        ctx.expand0, ctx.expand = expand0, expand
        return out

    @staticmethod
    def backward(ctx, dout):
        q, segments, out, lse, *rest = ctx.saved_tensors
        B, T, nh, d = q.shape
        acc = accumulation_dtype(q)
        nkv = ctx.nkv
        g = nh // nkv
        j, expand0, expand = ctx.j, ctx.expand0, ctx.expand
        entry0, entries, params0, params = _split(rest, expand0, expand, j)
        dout = dout.to(q.dtype)  # no copy: the output's dtype; gradients stay in it (fp32 only per chain block)
        if isinstance(ctx.kernel, QueryTail):
            keys0 = StepZeroKeys(entry0, expand0, params0)
            dq, d_entry0, d_params0 = ctx.kernel.backward(
                dout, q, keys0, out, lse, segments, ctx.scale, ctx.kctx, ctx.mask
            )
        else:
            kernel_args = (out, lse, segments, ctx.scale, ctx.kctx, ctx.mask)
            dq, d_entry0, d_params0 = _causal_backward(ctx.kernel, dout, q, entry0, expand0, params0, *kernel_args)
        # gradients for the floating entry parts (a Llama entry's token ids and positions have none)
        d_entries = [torch.zeros_like(t) if t.is_floating_point() else None for e in entries for t in e]
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
    q, k0, v0, chain, segments, backend: str = "auto", expand: ChainKeysValues = KEYS_VALUES, rule=Visibility()
) -> torch.Tensor:
    """Attention of one TTT step (module docstring) -> [B, T, nh, d]; the chain's entries are (k, v) by default."""
    return ttt_attention_of_entries(q, (k0, v0), chain, segments, backend, KEYS_VALUES, expand, rule)


def ttt_attention_of_entries(
    q, entry0, chain, segments, backend: str = "auto", expand0: ChainKeysValues = KEYS_VALUES,
    expand: ChainKeysValues = KEYS_VALUES, rule=Visibility(),
) -> torch.Tensor:  # fmt: skip
    """`ttt_attention` with the causal keys given as the step-0 entry, `expand0.width` tensors [B, Tk, ...] that
    `expand0` makes them of: MLA's latents are kept, decompressed in the forward and again in the backward."""
    if any(len(e) != expand.width for e in chain) or len(entry0) != expand0.width:
        raise ValueError(f"every chain entry must hold {expand.width} tensors, got {[len(e) for e in chain]}")
    mask = CausalMask(rule, len(chain))
    Tk = entry0[0].shape[1]
    if backend == "auto":
        backend = resolve_backend(q, mask, Tk)
    if backend == "reference":
        B, T = q.shape[:2]
        k0, v0 = step0_keys_values(entry0, expand0, expand0.params, entry0[0].shape[:2])
        kv = [expand.fn(*[t.flatten(0, 1) for t in e], *expand.params) for e in chain]
        chain_k = [k.view(B, T, *k.shape[1:]) for k, _ in kv]
        chain_v = [v.view(B, T, *v.shape[1:]) for _, v in kv]
        return reference_attention(q, k0, v0, chain_k, chain_v, segments, rule)
    causal = {"flash": FlashCausal, "blockwise": BlockwiseCausal}
    if backend not in causal:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {[b.value for b in AttentionBackend]}")
    mask.reach(Tk)  # refuses, in one line, a rule that leaves a query no key
    kernel = QueryTail(causal[backend]) if Tk != q.shape[1] else causal[backend]  # a shard: the last Tk positions
    flat = [t for e in chain for t in e]
    return _TTTAttention.apply(
        q, segments, kernel, mask, expand0, expand, len(chain), *entry0, *flat, *expand0.params, *expand.params
    )
