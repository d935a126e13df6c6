"""The causal part on a sequence shard (`QueryTail`, `StepZeroKeys`; docs/design.md §4, sequence parallelism)."""

from __future__ import annotations

import collections

import torch

from eagle31.kernels import causal as kernels
from eagle31.kernels.causal import NOT_A_BAND, CausalMask, accumulation_dtype, segment_starts
from eagle31.kernels.entries import KEYS_VALUES, ChainKeysValues, entry_keys_values, keys_values_with_graph


class QueryTail:
    """A causal kernel for queries q [B, Tq, nh, d], the last Tq of Tk key positions (docs/design.md §4)."""

    def __init__(self, kernel):
        self.kernel = kernel

    @staticmethod
    def prefix_block(nh: int, d: int) -> int:
        """Key positions of one block before the shard: its fp32 keys and values (nh heads of d) within the budget."""
        return max(1, kernels.BLOCK_BUDGET // (2 * nh * d))

    @classmethod
    def prefix_blocks(cls, q: torch.Tensor, segments: torch.Tensor, mask: CausalMask):
        """(row b, key block m0..m1-1 before the shard, its query blocks [(i0, i1)]) of each row whose first run began
        earlier; scores [rows, nh, m] within `BLOCK_BUDGET`; under a band of W only queries i < W - 1 reach back."""
        Tk, (Tq, nh, d) = segments.shape[1], q.shape[1:]
        off, window = Tk - Tq, mask.reach(Tk)
        window = None if window == NOT_A_BAND else window
        if off == 0:
            return
        m = cls.prefix_block(nh, d)
        rows = max(1, kernels.BLOCK_BUDGET // (nh * m))
        starts = segment_starts(segments)[:, off].tolist()
        same = (segments[:, off:] == segments[:, off : off + 1]).long().cummin(dim=1).values.sum(dim=1).tolist()
        for b, (s, n) in enumerate(zip(starts, same)):
            if window is not None:  # query i sees keys from off + i - window + 1 on
                s, n = max(s, off - window + 1), min(n, window - 1)
            for m0 in range(s, off, m) if n > 0 else ():
                m1 = min(off, m0 + m)
                n1 = n if window is None else min(n, m1 - 1 - off + window)
                yield b, m0, m1, [(i0, min(n1, i0 + rows)) for i0 in range(0, n1, rows)]

    @classmethod
    def blocks(cls, q: torch.Tensor, segments: torch.Tensor, mask: CausalMask):
        """`prefix_blocks`; on the meta device, every earlier key shown, two of each shape (docs/performance.md)."""
        blocks = cls.prefix_blocks(q, segments, mask)
        if q.device.type != "meta" or mask.reach(segments.shape[1]) is not None:
            return blocks
        thinned = ((b, m0, m1, list(_first_two(queries, lambda q: q[1] - q[0]))) for b, m0, m1, queries in blocks)
        return _first_two(thinned, lambda block: (block[2] - block[1], tuple(i1 - i0 for i0, i1 in block[3])))

    @staticmethod
    def _masked(sc: torch.Tensor, mask: CausalMask, segments: torch.Tensor, off: int, i0: int, m0: int) -> torch.Tensor:
        """Scores [n, nkv, g, m] of queries off + i0.. over keys m0.. (segments [Tk]), hidden ones at -inf; a block
        within every query's band is returned as it is (its keys are of its queries' document)."""
        reach = mask.reach(segments.shape[0])
        if reach is None or (reach != NOT_A_BAND and off + i0 + sc.shape[0] - 1 - m0 < reach):
            return sc
        queries = off + i0 + torch.arange(sc.shape[0], device=sc.device)
        keys = m0 + torch.arange(sc.shape[-1], device=sc.device)
        seen = mask.allowed(segments[queries, None], queries[:, None], segments[None, keys], keys[None])
        return sc.masked_fill(~seen[:, None, None], float("-inf"))

    def forward(self, q, keys: StepZeroKeys, segments, scale, mask: CausalMask):
        off = keys.length - q.shape[1]
        k, v = keys.make(slice(None), slice(off, None))  # the shard's own keys [B, Tq, nkv, d]
        out, lse, ctx = self.kernel.forward(q, k, v, segments[:, off:], scale, mask)
        del k, v
        acc = accumulation_dtype(q)
        for b, m0, m1, queries in self.blocks(q, segments, mask):
            kb, vb = (x[0].to(acc) for x in keys.make(slice(b, b + 1), slice(m0, m1)))  # [m, nkv, d]
            for i0, i1 in queries:
                qb = q[b, i0:i1].to(acc).unflatten(1, (kb.shape[1], -1))  # [n, nkv, g, d]
                sc = self._masked(torch.einsum("nkgd,mkd->nkgm", qb, kb) * scale, mask, segments[b], off, i0, m0)
                merged = torch.logaddexp(lse[b, i0:i1], sc.logsumexp(-1).flatten(1))  # [n, nh]
                p = torch.exp(sc - merged.view(sc.shape[:3])[..., None])  # 0 where the rule hides a key
                out[b, i0:i1] = out[b, i0:i1] * torch.exp(lse[b, i0:i1] - merged)[..., None] + torch.einsum(
                    "nkgm,mkd->nkgd", p, vb
                ).flatten(1, 2)
                lse[b, i0:i1] = merged
        return out, lse, ctx

    def backward(self, dout, q, keys: StepZeroKeys, out, lse, segments, scale, ctx, mask: CausalMask):
        """dq, and the gradients of the step-0 entry and of its parameters (`StepZeroKeys.gradients`)."""
        off = keys.length - q.shape[1]
        k, v, grads = keys.make_with_graph(slice(None), slice(off, None))
        dq, dk, dv = self.kernel.backward(dout, q, k, v, out, lse, segments[:, off:], scale, ctx, mask)
        if off == 0:  # no keys before the queries: their gradients are the entry's
            return (dq, *grads(dk, dv))
        keys.take_back(slice(None), slice(off, None), *grads(dk, dv))
        del k, v, dk, dv
        acc = accumulation_dtype(q)
        for b, m0, m1, queries in self.blocks(q, segments, mask):
            k, v, grads = keys.make_with_graph(slice(b, b + 1), slice(m0, m1))
            kb, vb = k[0].to(acc), v[0].to(acc)  # [m, nkv, d]
            dkb, dvb = torch.zeros_like(kb), torch.zeros_like(vb)
            for i0, i1 in queries:
                qb, do, ob, lb = (x[b, i0:i1].to(acc).unflatten(1, (kb.shape[1], -1)) for x in (q, dout, out, lse))
                sc = self._masked(torch.einsum("nkgd,mkd->nkgm", qb, kb) * scale, mask, segments[b], off, i0, m0)
                p = torch.exp(sc - lb[..., None])  # merged LSE
                D = (do * ob).sum(-1)
                dvb += torch.einsum("nkgm,nkgd->mkd", p, do)
                ds = p * (torch.einsum("nkgd,mkd->nkgm", do, vb) - D[..., None]) * scale
                dq[b, i0:i1] += torch.einsum("nkgm,mkd->nkgd", ds, kb).flatten(1, 2).to(dq.dtype)
                dkb += torch.einsum("nkgm,nkgd->mkd", ds, qb)
            del kb, vb
            keys.take_back(slice(b, b + 1), slice(m0, m1), *grads(dkb[None].to(k.dtype), dvb[None].to(v.dtype)))
        return (dq, *keys.gradients())


def _first_two(items, shape):
    """The first two items of each shape, in their order."""
    seen: collections.Counter = collections.Counter()
    for item in items:
        seen[shape(item)] += 1
        if seen[shape(item)] <= 2:
            yield item


class StepZeroKeys:
    """The causal keys and values of a step-0 entry [B, Tk, ...], made (and differentiated) a block at a time."""

    def __init__(self, entry, expand: ChainKeysValues, params):
        self.entry, self.expand, self.params = entry, expand, params
        self.length = entry[0].shape[1]
        self._d_entry: list[torch.Tensor | None] = []
        self._d_params: list[torch.Tensor] = []

    def num_kv_heads(self) -> int:
        return self.make(slice(0, 1), slice(0, 1))[0].shape[2]

    def make(self, rows: slice, positions: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of entry rows `rows`, positions `positions`: each [b, t, nkv, d]."""
        block = [t[rows, positions] for t in self.entry]
        return entry_keys_values(block, self.expand, self.params)

    def make_with_graph(self, rows: slice, positions: slice):
        """(k, v, grads): `make`'s block, detached, and `grads(dk, dv)` -> (its entry's gradients, its parameters')."""
        if self.expand is KEYS_VALUES:  # the entry is (k, v) itself: its gradients are (dk, dv), no graph to build
            k, v = self.make(rows, positions)
            return k, v, lambda dk, dv: ([dk, dv], [])
        block = [t[rows, positions] for t in self.entry]
        return keys_values_with_graph(
            lambda entry, params: entry_keys_values(entry, self.expand, params), block, self.params
        )

    def take_back(self, rows: slice, positions: slice, d_entry, d_params) -> None:
        """Adds the gradients of block (rows, positions) (`make_with_graph`) to `gradients()`."""
        if not self._d_entry:
            self._d_entry = [torch.zeros_like(t) if t.is_floating_point() else None for t in self.entry]
            self._d_params = [torch.zeros_like(p, dtype=accumulation_dtype(p)) for p in self.params]
        for d, grad in zip(self._d_entry, d_entry):
            if d is not None and grad is not None:
                d[rows, positions] += grad
        for d, grad in zip(self._d_params, d_params):
            if grad is not None:
                d += grad

    def gradients(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
        """(the entry's gradients, the parameters' in their dtypes) of every block taken back."""
        return self._d_entry, [d.to(p.dtype) for d, p in zip(self._d_params, self.params)]
