"""Attention of the training-time-test unroll (docs/design.md §4).

Query `(p, k)` — position `p`, TTT step `k` — attends to

* the step-0 keys of positions `0..p` in the same document (causal), and
* its own chain: the keys `(p, j)` for `j = 1..k`.

Nothing else. So every step is "causal attention over the step-0 keys" plus
`k` extra keys per query. The efficient path computes the causal part with a
kernel that returns its log-sum-exp (LSE), adds the chain scores, and merges
the two by LSE; its backward calls the kernel's backward with the *merged*
output and LSE (the standard flash-attention identity), then adds the chain's
gradients. Memory is O(T) in the sequence length: no `T x T` or `T x (K*T)`
tensor is built.

Kernels for the causal part:
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
from dataclasses import dataclass
from typing import Callable

import torch

from eagle31.recipe import AttentionBackend


# Scores of one query block are kept under this many elements (blockwise kernel).
_BLOCK_BUDGET = 1 << 24


# ----------------------------------------------------------------------------
# documents


def segment_ids(
    document_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, shape, device=None
) -> torch.Tensor:
    """Run ids [B, T]: positions attend only within their run of equal document id.

    `document_ids` [B, T] numbers packed documents (any ints; -1 is padding);
    `attention_mask` [B, T] marks real tokens with 1. Padding forms runs of its
    own, so no real token attends padding and no padded query is left empty.
    """
    B, T = shape
    doc = torch.zeros(B, T, dtype=torch.long, device=device) if document_ids is None else document_ids.long()
    if attention_mask is not None:
        doc = doc.to(attention_mask.device).masked_fill(attention_mask == 0, -1)
    new_run = torch.ones_like(doc, dtype=torch.bool)
    new_run[:, 1:] = doc[:, 1:] != doc[:, :-1]
    return new_run.long().cumsum(dim=1)


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
# reference: explicit scores


def reference_attention(q, k0, v0, chain_k, chain_v, segments, probe=None) -> torch.Tensor:
    """Explicit softmax over [step-0 keys | chain keys]; O(Tq * Tk) memory.

    q [B, Tq, nh, d] are the queries of the last Tq of the Tk positions whose step-0 keys k0, v0
    [B, Tk, nkv, d] are (Tq = Tk but for a query tail, as on a sequence shard); the chain's keys
    are the queries' own, [B, Tq, nkv, d] each; segments [B, Tk]. `probe`, when given, is called
    with the probabilities [B, nh, Tq, Tk + j*Tq] (keys step-major: the Tk step-0 keys, then the
    Tq keys of each chain step) before they weight the values.
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
    causal = (query_pos[:, None] >= key_pos[None, :]) & (segments[:, -T:, None] == segments[:, None, :])  # [B, T, Tk]
    diag = (query_pos[:, None] == query_pos[None, :]).expand(B, T, T)
    allowed = torch.cat([causal] + [diag] * j, dim=2)  # [B, T, Tk + j*T]
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
# causal kernels: forward -> (out fp32 [B, T, nh, d], lse fp32 [B, T, nh], ctx)
#                 backward(dout, q, k, v, out, lse, segments, scale, ctx) -> dq, dk, dv in q's dtype
#                 (backward's out and lse are the *merged* ones; out and dout in q's dtype)


class BlockwiseCausal:
    """Flash-attention algorithm in plain PyTorch, one query block at a time."""

    @staticmethod
    def _blocks(segments: torch.Tensor, nh: int):
        B, T = segments.shape
        block = max(16, min(1024, _BLOCK_BUDGET // max(1, B * nh * T)))
        starts = segment_starts(segments)
        pos = torch.arange(T, device=segments.device)
        for i0 in range(0, T, block):
            i1 = min(T, i0 + block)
            k0 = int(starts[:, i0].min())
            allowed = (segments[:, i0:i1, None] == segments[:, None, k0:i1]) & (pos[i0:i1, None] >= pos[None, k0:i1])
            yield i0, i1, k0, allowed[:, None, None]  # [B, 1, 1, bq, nk]

    @staticmethod
    def _scores(qg, k, i0, i1, k0, allowed, scale):
        # qg [B, nkv, g, T, d], k [B, nkv, T, d] -> [B, nkv, g, bq, nk]
        acc = _acc(qg)
        s = torch.einsum("bhgqd,bhkd->bhgqk", qg[:, :, :, i0:i1].to(acc), k[:, :, k0:i1].to(acc)) * scale
        return s.masked_fill(~allowed, float("-inf"))

    @classmethod
    def forward(cls, q, k, v, segments, scale):
        B, T, nh, d = q.shape
        acc = _acc(q)
        nkv = k.shape[2]
        qg = q.permute(0, 2, 1, 3).reshape(B, nkv, nh // nkv, T, d)
        kh, vh = k.transpose(1, 2), v.transpose(1, 2)
        out = q.new_empty(qg.shape, dtype=acc)
        lse = q.new_empty(qg.shape[:-1], dtype=acc)
        for i0, i1, k0, allowed in cls._blocks(segments, nh):
            s = cls._scores(qg, kh, i0, i1, k0, allowed, scale)
            m = s.logsumexp(dim=-1)
            out[:, :, :, i0:i1] = torch.einsum("bhgqk,bhkd->bhgqd", torch.exp(s - m[..., None]), vh[:, :, k0:i1].to(acc))
            lse[:, :, :, i0:i1] = m
        return _from_grouped(out), _from_grouped(lse), None

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, segments, scale, ctx):
        B, T, nh, d = q.shape
        acc = _acc(q)
        nkv = k.shape[2]
        qg = q.permute(0, 2, 1, 3).reshape(B, nkv, nh // nkv, T, d)
        kh, vh = k.transpose(1, 2), v.transpose(1, 2)
        do = _to_grouped(dout.to(acc), nkv)
        lse_g = _to_grouped(lse, nkv)
        D = (do * _to_grouped(out, nkv)).sum(-1)  # [B, nkv, g, T]
        dq = torch.zeros_like(qg, dtype=acc)
        dk = torch.zeros(B, nkv, T, d, dtype=acc, device=q.device)
        dv = torch.zeros_like(dk)
        for i0, i1, k0, allowed in cls._blocks(segments, nh):
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
    """PyTorch's fused flash-attention ops (CUDA: varlen over documents; CPU: per document)."""

    @staticmethod
    def forward(q, k, v, segments, scale):
        if q.is_cuda:
            return FlashCausal._cuda_forward(q, k, v, segments, scale)
        B, T, nh, d = q.shape
        acc = _acc(q)
        g = nh // k.shape[2]
        out = q.new_empty(B, T, nh, d, dtype=acc)
        lse = q.new_empty(B, T, nh, dtype=acc)
        for b, s, e in _runs(segments):
            qb = q[b : b + 1, s:e].transpose(1, 2)
            kb = k[b : b + 1, s:e].transpose(1, 2).repeat_interleave(g, dim=1)
            vb = v[b : b + 1, s:e].transpose(1, 2).repeat_interleave(g, dim=1)
            o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qb, kb, vb, 0.0, True, scale=scale)
            out[b, s:e] = o[0].transpose(0, 1).to(acc)
            lse[b, s:e] = l[0].transpose(0, 1).to(acc)
        return out, lse, None

    @staticmethod
    def backward(dout, q, k, v, out, lse, segments, scale, ctx):
        if q.is_cuda:
            return FlashCausal._cuda_backward(dout, q, k, v, out, lse, segments, scale, ctx)
        B, T, nh, d = q.shape
        acc = _acc(q)
        nkv = k.shape[2]
        g = nh // nkv
        dq = torch.empty_like(q)  # every position is in exactly one run: all written below
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        for b, s, e in _runs(segments):
            def heads(x):
                return x[b : b + 1, s:e].transpose(1, 2)

            qb, kb, vb = heads(q), heads(k).repeat_interleave(g, dim=1), heads(v).repeat_interleave(g, dim=1)
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                heads(dout).to(q.dtype).contiguous(),
                qb,
                kb,
                vb,
                heads(out).to(q.dtype).contiguous(),
                lse[b : b + 1, s:e].transpose(1, 2).to(acc).contiguous(),
                0.0,
                True,
                scale=scale,
            )
            dq[b, s:e] = gq[0].transpose(0, 1)
            dk[b, s:e] = gk[0].view(nkv, g, e - s, d).sum(1, dtype=acc).transpose(0, 1)
            dv[b, s:e] = gv[0].view(nkv, g, e - s, d).sum(1, dtype=acc).transpose(0, 1)
        return dq, dk, dv

    # CUDA: one varlen flash-attention call; documents never cross rows.
    @staticmethod
    def _cu_seqlens(segments):
        B, T = segments.shape
        flat = (segments + torch.arange(B, device=segments.device)[:, None] * (T + 1)).flatten()
        _, counts = torch.unique_consecutive(flat, return_counts=True)
        cu = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=segments.device)
        cu[1:] = counts.cumsum(0)
        return cu, int(counts.max())

    @staticmethod
    def _cuda_forward(q, k, v, segments, scale):
        B, T, nh, d = q.shape
        cu, max_len = FlashCausal._cu_seqlens(segments)
        flat = lambda x: x.reshape(B * T, x.shape[2], d)  # noqa: E731
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            flat(q), flat(k), flat(v), cu, cu, max_len, max_len, 0.0, True, False, scale=scale
        )
        lse = _lse_tokens_first(lse, B * T, nh)
        return out.view(B, T, nh, d).float(), lse.view(B, T, nh).float(), (cu, max_len, rng_state, unused)

    @staticmethod
    def _cuda_backward(dout, q, k, v, out, lse, segments, scale, ctx):
        B, T, nh, d = q.shape
        cu, max_len, rng_state, unused = ctx
        flat = lambda x: x.reshape(B * T, x.shape[2], d).to(q.dtype).contiguous()  # noqa: E731
        lse_heads_first = lse.reshape(B * T, nh).t().contiguous()  # the kernel's layout [nh, total]
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            flat(dout), flat(q), flat(k), flat(v), flat(out), lse_heads_first,
            cu, cu, max_len, max_len, 0.0, True, rng_state, unused, scale=scale,
        )  # fmt: skip
        return dq.view(B, T, nh, d), dk.view(B, T, -1, d), dv.view(B, T, -1, d)


class QueryTail:
    """A causal kernel whose queries are the last Tq of Tk key positions (sequence parallelism).

    q [B, Tq, nh, d] sits at key positions Tk - Tq .. Tk - 1 (this rank's shard; the keys are every
    position up to its end, given as the step-0 entry they are made of, `StepZeroKeys`). The causal
    part is the wrapped kernel on the shard's own keys (a square, as without sharding); a document
    that starts before the shard adds, for its queries, the keys of its earlier positions, attended
    densely (no mask: they all precede every query) a block of `prefix_block` key positions at a
    time, each block by blocks of query rows, and merged by LSE. Only the first run of each row can
    reach before the shard, so the dense part is at most one run of keys per row of the batch. An
    earlier block's keys are made from the entry when it is reached (MLA decompresses its latents),
    in the forward and again in the backward: the keys before the shard never exist whole.
    """

    def __init__(self, kernel):
        self.kernel = kernel

    @staticmethod
    def _prefixes(segments: torch.Tensor, Tq: int) -> list[tuple[int, int, int]]:
        """(row, keys before the shard s.., queries ..n) of each row whose first shard run began earlier:
        its queries 0..n-1 attend key positions s..Tk-Tq-1 too."""
        B, Tk = segments.shape
        off = Tk - Tq
        if off == 0:
            return []
        starts = segment_starts(segments)[:, off].tolist()
        same = (segments[:, off:] == segments[:, off : off + 1]).long().cummin(dim=1).values.sum(dim=1).tolist()
        return [(b, s, n) for b, (s, n) in enumerate(zip(starts, same)) if s < off]

    @staticmethod
    def prefix_block(nh: int, d: int) -> int:
        """Key positions of one block before the shard: its fp32 keys and values, at most nh heads of d, stay under `_BLOCK_BUDGET`."""
        return max(1, _BLOCK_BUDGET // (2 * nh * d))

    @classmethod
    def _blocks(cls, q: torch.Tensor, s: int, off: int):
        """(key block [m0, m1), query rows per block) over positions s..off-1: a block's scores [rows, nh, m]
        stay under `_BLOCK_BUDGET` (about its fp32 keys and values)."""
        nh, d = q.shape[2:]
        m = cls.prefix_block(nh, d)
        rows = max(1, _BLOCK_BUDGET // (nh * m))
        return [(m0, min(off, m0 + m), rows) for m0 in range(s, off, m)]

    def forward(self, q, keys: StepZeroKeys, segments, scale):
        Tq = q.shape[1]
        off = keys.length - Tq
        k, v = keys.make(slice(None), slice(off, None))  # the shard's own keys [B, Tq, nkv, d]
        out, lse, ctx = self.kernel.forward(q, k, v, segments[:, off:], scale)
        del k, v
        acc = _acc(q)
        for b, s, n in self._prefixes(segments, Tq):
            for m0, m1, rows in self._blocks(q, s, off):
                kb, vb = (x[0].to(acc) for x in keys.make(slice(b, b + 1), slice(m0, m1)))  # [m, nkv, d]
                g = q.shape[2] // kb.shape[1]
                for i0 in range(0, n, rows):
                    i1 = min(n, i0 + rows)
                    qb = q[b, i0:i1].to(acc).unflatten(1, (kb.shape[1], g))  # [n, nkv, g, d]
                    sc = torch.einsum("nkgd,mkd->nkgm", qb, kb) * scale
                    lp = sc.logsumexp(-1)  # [n, nkv, g]
                    op = torch.einsum("nkgm,mkd->nkgd", torch.exp(sc - lp[..., None]), vb).flatten(1, 2)
                    lp = lp.flatten(1)
                    merged = torch.logaddexp(lse[b, i0:i1], lp)
                    out[b, i0:i1] = out[b, i0:i1] * torch.exp(lse[b, i0:i1] - merged)[..., None] + op * torch.exp(lp - merged)[..., None]
                    lse[b, i0:i1] = merged
        return out, lse, ctx

    def backward(self, dout, q, keys: StepZeroKeys, out, lse, segments, scale, ctx):
        """dq, and the gradients of the step-0 entry and of its parameters (`StepZeroKeys.take_back`)."""
        Tq = q.shape[1]
        off = keys.length - Tq
        k, v, take_back = keys.make_with_graph(slice(None), slice(off, None))
        dq, dk, dv = self.kernel.backward(dout, q, k, v, out, lse, segments[:, off:], scale, ctx)
        take_back(dk, dv)
        del k, v, dk, dv
        acc = _acc(q)
        for b, s, n in self._prefixes(segments, Tq):
            for m0, m1, rows in self._blocks(q, s, off):
                k, v, take_back = keys.make_with_graph(slice(b, b + 1), slice(m0, m1))
                kb, vb = k[0].to(acc), v[0].to(acc)  # [m, nkv, d]
                nkv = kb.shape[1]
                g = q.shape[2] // nkv
                dkb, dvb = torch.zeros_like(kb), torch.zeros_like(vb)
                for i0 in range(0, n, rows):
                    i1 = min(n, i0 + rows)
                    part = lambda x: x[b, i0:i1].to(acc).unflatten(1, (nkv, g))  # noqa: E731 - [n, nkv, g, ...]
                    qb, do, ob, lb = part(q), part(dout), part(out), lse[b, i0:i1].to(acc).unflatten(1, (nkv, g))
                    p = torch.exp(torch.einsum("nkgd,mkd->nkgm", qb, kb) * scale - lb[..., None])  # merged LSE
                    D = (do * ob).sum(-1)
                    dvb += torch.einsum("nkgm,nkgd->mkd", p, do)
                    ds = p * (torch.einsum("nkgd,mkd->nkgm", do, vb) - D[..., None]) * scale
                    dq[b, i0:i1] += torch.einsum("nkgm,mkd->nkgd", ds, kb).flatten(1, 2).to(dq.dtype)
                    dkb += torch.einsum("nkgm,nkgd->mkd", ds, qb)
                del kb, vb
                take_back(dkb[None].to(k.dtype), dvb[None].to(v.dtype))
        return (dq, *keys.gradients())


class StepZeroKeys:
    """The causal keys and values of a step-0 entry [B, Tk, ...] (`expand.width` tensors), made a block
    of (rows, positions) at a time (`QueryTail`): `make` in the forward; `make_with_graph` in the
    backward, whose `take_back(dk, dv)` adds the block's entry and parameter gradients to `gradients()`."""

    def __init__(self, entry, expand: ChainKeysValues, params):
        self.entry, self.expand, self.params = entry, expand, params
        self.length = entry[0].shape[1]
        self._d_entry = self._d_params = None

    def num_kv_heads(self) -> int:
        return self.make(slice(0, 1), slice(0, 1))[0].shape[2]

    def make(self, rows: slice, positions: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of entry rows `rows`, positions `positions`: each [b, t, nkv, d]."""
        block = [t[rows, positions] for t in self.entry]
        return _step0_keys_values(block, self.expand, self.params, block[0].shape[:2])

    def make_with_graph(self, rows: slice, positions: slice):
        """(k, v, take_back): `make`'s block, detached, and the function that takes its gradients back."""
        if self._d_entry is None:
            self._d_entry = [torch.zeros_like(t) if t.is_floating_point() else None for t in self.entry]
            self._d_params = [torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32)) for p in self.params]
        if self.expand is KEYS_VALUES:
            k, v = self.make(rows, positions)

            def add(dk, dv):
                self._d_entry[0][rows, positions] += dk
                self._d_entry[1][rows, positions] += dv

            return k, v, add
        with torch.enable_grad():  # the block's keys and values as a small graph
            inputs = [t[rows, positions].detach().requires_grad_(t.is_floating_point()) for t in self.entry]
            leaves = [p.detach().requires_grad_() for p in self.params]
            k, v = _step0_keys_values(inputs, self.expand, leaves, inputs[0].shape[:2])
        wanted = [t for t in inputs if t.requires_grad] + leaves

        def take_back(dk, dv):
            grads = iter(torch.autograd.grad((k, v), wanted, (dk, dv), allow_unused=True))
            for d, t in zip(self._d_entry, inputs):
                grad = next(grads) if t.requires_grad else None
                if grad is not None:
                    d[rows, positions] += grad
            for d in self._d_params:
                grad = next(grads)
                if grad is not None:
                    d += grad

        return k.detach(), v.detach(), take_back

    def gradients(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
        """(the entry's gradients, the parameters' in their dtypes) of every block taken back."""
        return self._d_entry, [d.to(p.dtype) for d, p in zip(self._d_params, self.params)]


def _acc(q: torch.Tensor) -> torch.dtype:
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


# ----------------------------------------------------------------------------
# the merged step: causal part + chain, by log-sum-exp


@dataclass(frozen=True)
class ChainKeysValues:
    """How a chain step's keys and values are made from what that step keeps (its `entry`).

    `fn(*entry_rows, *params) -> (k, v)`, each [n, nkv, d], from the `width` tensors of one
    entry, each cut to n token rows [n, ...]; `params` are the other tensors it reads (their
    gradients flow). The chain is attended a block of token rows at a time, so only one
    block's keys and values ever exist: a drafter whose entry is smaller than its keys and
    values (MLA's latents) keeps only the entries from step to step.
    """

    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    params: tuple[torch.Tensor, ...] = ()
    width: int = 2


def _keys_values_as_kept(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return k, v


KEYS_VALUES = ChainKeysValues(_keys_values_as_kept)  # the entry is (k, v) itself (Llama attention)


def _chain_rows(N: int, j: int, nh: int, d: int):
    """Blocks of flattened token rows (b*T + t) for the chain: one block's fp32 chain keys stay under `_BLOCK_BUDGET`."""
    n = max(1, _BLOCK_BUDGET // max(1, j * nh * d))
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


def _step0_keys_values(entry0, expand0: ChainKeysValues, params0, shape):
    """The causal keys and values [B, T, nkv, d] of the step-0 entry (its tensors [B, T, ...])."""
    B, T = shape
    if expand0 is KEYS_VALUES:
        return entry0
    k, v = expand0.fn(*[t.flatten(0, 1) for t in entry0], *params0)  # [B * T, nkv, d]
    return k.view(B, T, *k.shape[1:]), v.view(B, T, *v.shape[1:])


def _causal_backward(kernel, dout, q, entry0, expand0, params0, out, lse, segments, scale, kctx):
    """The causal kernel's backward over the whole sequence's step-0 keys: (dq, the step-0 entry's gradients,
    its parameters'). The keys and values are made again (a graph unless they are the entry), and their
    gradients turned into the entry's at once: the decompressed keys go before the chain blocks run."""
    with torch.enable_grad():
        inputs0 = [t.detach().requires_grad_(t.is_floating_point()) for t in entry0]
        leaves0 = [p.detach().requires_grad_() for p in params0]
        k0, v0 = _step0_keys_values(inputs0, expand0, leaves0, entry0[0].shape[:2])
    dq, dk0, dv0 = kernel.backward(dout, q, k0.detach(), v0.detach(), out, lse, segments, scale, kctx)
    if expand0 is KEYS_VALUES:
        return dq, [dk0, dv0], []
    wanted = [t for t in inputs0 if t.requires_grad] + leaves0
    grads0 = iter(torch.autograd.grad((k0, v0), wanted, (dk0, dv0), allow_unused=True))
    d_entry0 = [next(grads0) if t.requires_grad else None for t in inputs0]
    return dq, d_entry0, [next(grads0) for _ in leaves0]


class _TTTAttention(torch.autograd.Function):
    """Causal kernel + chain keys merged by log-sum-exp.

    Inputs (q, segments, kernel, expand0, expand, j, *entry0, *entries, *expand0.params,
    *expand.params): entry0 the `expand0.width` tensors of step 0 (its keys and values, made by
    `expand0` over all rows), entries the `expand.width` tensors of each of the j chain steps, step
    after step. Unless `expand0` is `KEYS_VALUES` (the entry is k0, v0), the step-0 keys and values
    are not saved: backward makes them again for the causal kernel's backward and turns their
    gradients into the entry's (and the parameters') before the chain blocks run. On a sequence
    shard (`QueryTail`) they are made a block of positions at a time (`StepZeroKeys`), in both.
    """

    @staticmethod
    def forward(ctx, q, segments, kernel, expand0, expand, j, *rest):
        B, T, nh, d = q.shape
        acc = _acc(q)
        w0 = expand0.width
        entry0 = rest[:w0]
        entries = [rest[w0 + i * expand.width : w0 + (i + 1) * expand.width] for i in range(j)]
        params0 = rest[w0 + j * expand.width : w0 + j * expand.width + len(expand0.params)]
        params = rest[w0 + j * expand.width + len(expand0.params) :]
        scale = 1.0 / math.sqrt(d)
        if isinstance(kernel, QueryTail):  # a shard: the keys before it are made a block at a time
            keys0 = StepZeroKeys(entry0, expand0, params0)
            out, lse, kctx = kernel.forward(q, keys0, segments, scale)
            nkv = keys0.num_kv_heads()
        else:
            k0, v0 = _step0_keys_values(entry0, expand0, params0, entry0[0].shape[:2])  # [B, T, nkv, d]
            out, lse, kctx = kernel.forward(q, k0, v0, segments, scale)  # fp32 [B, T, nh, d], [B, T, nh]
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
        ctx.kernel, ctx.kctx, ctx.scale, ctx.j, ctx.expand0, ctx.expand, ctx.nkv = kernel, kctx, scale, j, expand0, expand, nkv
        return out

    @staticmethod
    def backward(ctx, dout):
        q, segments, out, lse, *rest = ctx.saved_tensors
        B, T, nh, d = q.shape
        acc = _acc(q)
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
            dq, d_entry0, d_params0 = ctx.kernel.backward(dout, q, keys0, out, lse, segments, ctx.scale, ctx.kctx)
        else:
            causal = (ctx.kernel, dout, q, entry0, expand0, params0, out, lse, segments, ctx.scale, ctx.kctx)
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
                    inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in _stacked_rows(_rows(entries, r))]
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
        return dq, None, None, None, None, None, *d_entry0, *d_entries, *d_params0, *d_params


def ttt_attention(
    q, k0, v0, chain, segments, backend: str = "auto", expand: ChainKeysValues = KEYS_VALUES, probe=None
) -> torch.Tensor:
    """Attention of one TTT step (see module docstring); returns [B, T, nh, d].

    chain: sequence of j entries (empty at step 0), each a tuple of `expand.width` tensors
    [B, T, ...] from which `expand` makes that step's keys and values; with the default,
    an entry is (k, v), each [B, T, nkv, d]. k0, v0 and segments may cover Tk > T positions: the
    queries are then the last T of them (a sequence shard, `QueryTail`). `probe` sees the attention probabilities
    (`reference_attention`), so it needs the reference backend.
    """
    return ttt_attention_of_entries(q, (k0, v0), chain, segments, backend, KEYS_VALUES, expand, probe)


def ttt_attention_of_entries(
    q, entry0, chain, segments, backend: str = "auto", expand0: ChainKeysValues = KEYS_VALUES,
    expand: ChainKeysValues = KEYS_VALUES, probe=None,
) -> torch.Tensor:  # fmt: skip
    """`ttt_attention` with the causal keys and values given as the step-0 entry, `expand0.width` tensors
    [B, Tk, ...] that `expand0` makes them of (Tk > T on a sequence shard): MLA's latents are kept, its keys and values decompressed
    in the forward and again in the backward, never saved between them."""
    if backend == "auto":
        backend = resolve_backend(q)
    if any(len(e) != expand.width for e in chain) or len(entry0) != expand0.width:
        raise ValueError(f"every chain entry must hold {expand.width} tensors, got {[len(e) for e in chain]}")
    tail = entry0[0].shape[1] != q.shape[1]  # the queries are the last of the keys' positions (sequence parallelism)
    if backend == "reference":
        B, T = q.shape[:2]
        k0, v0 = _step0_keys_values(entry0, expand0, expand0.params, entry0[0].shape[:2])
        kv = [expand.fn(*[t.flatten(0, 1) for t in e], *expand.params) for e in chain]
        chain_k = [k.view(B, T, *k.shape[1:]) for k, _ in kv]
        chain_v = [v.view(B, T, *v.shape[1:]) for _, v in kv]
        return reference_attention(q, k0, v0, chain_k, chain_v, segments, probe)
    if probe is not None:
        raise ValueError(f"the attention probabilities are explicit only in the reference backend, not {backend!r}")
    kernels = {"flash": FlashCausal, "blockwise": BlockwiseCausal}
    if backend not in kernels:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {[b.value for b in AttentionBackend]}")
    flat = [t for e in chain for t in e]
    kernel = QueryTail(kernels[backend]) if tail else kernels[backend]
    return _TTTAttention.apply(q, segments, kernel, expand0, expand, len(chain), *entry0, *flat, *expand0.params, *expand.params)


def resolve_backend(q: torch.Tensor) -> str:
    """`auto`: the fused flash kernels on CPU and on CUDA in bf16/fp16 (head_dim <= 256), blockwise otherwise.

    On CPU the fused kernel is 2-5x faster than the blockwise one (fwd + bwd, measured
    at T = 1024..4096, docs/performance.md).
    """
    if q.device.type == "cpu":
        return "flash"
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256:
        return "flash"
    return "blockwise"
