"""The causal part on a sequence shard: queries that are the last Tq of Tk key positions, the keys before the
shard made a block at a time from the gathered step-0 entry (docs/design.md §4, sequence parallelism)."""

from __future__ import annotations

import torch

from eagle31.kernels import causal as kernels
from eagle31.kernels.causal import NOT_A_BAND, CausalMask, accumulation_dtype, segment_starts
from eagle31.kernels.entries import KEYS_VALUES, ChainKeysValues, step0_keys_values


class QueryTail:
    """A causal kernel whose queries q [B, Tq, nh, d] are the last Tq of Tk key positions (a shard). The wrapped kernel
    attends the shard's own keys; the one document per row that began earlier adds its earlier keys, made from the
    step-0 entry a block of `prefix_block` positions at a time (forward and backward), masked by the rule and merged
    by log-sum-exp; with a band rule only the blocks and rows that can see each other are visited."""

    def __init__(self, kernel):
        self.kernel = kernel

    @staticmethod
    def _prefixes(segments: torch.Tensor, Tq: int, window: int | None) -> list[tuple[int, int, int]]:
        """(row, keys before the shard s.., queries ..n) of each row whose first shard run began earlier:
        its queries 0..n-1 attend key positions s..Tk-Tq-1 too (with a window, those within it)."""
        B, Tk = segments.shape
        off = Tk - Tq
        if off == 0:
            return []
        starts = segment_starts(segments)[:, off].tolist()
        same = (segments[:, off:] == segments[:, off : off + 1]).long().cummin(dim=1).values.sum(dim=1).tolist()
        if window is not None:  # query i sees keys from off + i - window + 1 on: only i < window - 1 reach before off
            starts = [max(s, off - window + 1) for s in starts]
            same = [min(n, window - 1) for n in same]
        return [(b, s, n) for b, (s, n) in enumerate(zip(starts, same)) if s < off and n > 0]

    @staticmethod
    def prefix_block(nh: int, d: int) -> int:
        """Key positions of one block before the shard: its fp32 keys and values (nh heads of d) within the budget."""
        return max(1, kernels.BLOCK_BUDGET // (2 * nh * d))

    @classmethod
    def _blocks(cls, q: torch.Tensor, s: int, off: int, n: int, window: int | None):
        """(key block [m0, m1), its queries 0..n1-1, query rows per block) over positions s..off-1 for queries
        0..n-1: a block's scores [rows, nh, m] stay under `kernels.BLOCK_BUDGET` (about its fp32 keys and
        values); with a window, n1 stops at the last query that sees the block's last key."""
        nh, d = q.shape[2:]
        m = cls.prefix_block(nh, d)
        rows = max(1, kernels.BLOCK_BUDGET // (nh * m))
        blocks = [(m0, min(off, m0 + m)) for m0 in range(s, off, m)]
        return [(m0, m1, n if window is None else min(n, m1 - 1 - off + window), rows) for m0, m1 in blocks]

    @staticmethod
    def _masked(sc: torch.Tensor, mask: CausalMask, segments: torch.Tensor, off: int, i0: int, m0: int) -> torch.Tensor:
        """Scores [n, nkv, g, m] of queries off + i0.. over keys m0.. (segments [Tk] the row's runs): those the
        rule hides at -inf. A band rule shows a query every key of its document within the band, and a prefix
        block's keys are of its queries' document (`_prefixes`): a block that lies within every query's band is
        returned as it is, with no mask made."""
        reach = mask.reach(segments.shape[0])
        if reach is None or (reach != NOT_A_BAND and off + i0 + sc.shape[0] - 1 - m0 < reach):
            return sc
        queries = off + i0 + torch.arange(sc.shape[0], device=sc.device)
        keys = m0 + torch.arange(sc.shape[-1], device=sc.device)
        seen = mask.allowed(segments[queries, None], queries[:, None], segments[None, keys], keys[None])
        return sc.masked_fill(~seen[:, None, None], float("-inf"))

    @staticmethod
    def _band(mask: CausalMask, length: int) -> int | None:
        """The rule's band bounds the dense part; a rule that is no band is attended in full, masked."""
        window = mask.reach(length)
        return None if window == NOT_A_BAND else window

    def forward(self, q, keys: StepZeroKeys, segments, scale, mask: CausalMask):
        Tq = q.shape[1]
        off = keys.length - Tq
        window = self._band(mask, keys.length)
        k, v = keys.make(slice(None), slice(off, None))  # the shard's own keys [B, Tq, nkv, d]
        out, lse, ctx = self.kernel.forward(q, k, v, segments[:, off:], scale, mask)
        del k, v
        acc = accumulation_dtype(q)
        for b, s, n in self._prefixes(segments, Tq, window):
            for m0, m1, n1, rows in self._blocks(q, s, off, n, window):
                kb, vb = (x[0].to(acc) for x in keys.make(slice(b, b + 1), slice(m0, m1)))  # [m, nkv, d]
                g = q.shape[2] // kb.shape[1]
                for i0 in range(0, n1, rows):
                    i1 = min(n1, i0 + rows)
                    qb = q[b, i0:i1].to(acc).unflatten(1, (kb.shape[1], g))  # [n, nkv, g, d]
                    sc = self._masked(torch.einsum("nkgd,mkd->nkgm", qb, kb) * scale, mask, segments[b], off, i0, m0)
                    lp = sc.logsumexp(-1)  # [n, nkv, g]; -inf for a query the rule shows none of the block
                    finite = torch.where(lp.isinf(), 0, lp)
                    op = torch.einsum("nkgm,mkd->nkgd", torch.exp(sc - finite[..., None]), vb).flatten(1, 2)
                    lp = lp.flatten(1)
                    merged = torch.logaddexp(lse[b, i0:i1], lp)
                    out[b, i0:i1] = (
                        out[b, i0:i1] * torch.exp(lse[b, i0:i1] - merged)[..., None]
                        + op * torch.exp(lp - merged)[..., None]
                    )
                    lse[b, i0:i1] = merged
        return out, lse, ctx

    def backward(self, dout, q, keys: StepZeroKeys, out, lse, segments, scale, ctx, mask: CausalMask):
        """dq, and the gradients of the step-0 entry and of its parameters (`StepZeroKeys.take_back`)."""
        Tq = q.shape[1]
        off = keys.length - Tq
        window = self._band(mask, keys.length)
        k, v, take_back = keys.make_with_graph(slice(None), slice(off, None))
        dq, dk, dv = self.kernel.backward(dout, q, k, v, out, lse, segments[:, off:], scale, ctx, mask)
        take_back(dk, dv)
        del k, v, dk, dv
        acc = accumulation_dtype(q)
        for b, s, n in self._prefixes(segments, Tq, window):
            for m0, m1, n1, rows in self._blocks(q, s, off, n, window):
                k, v, take_back = keys.make_with_graph(slice(b, b + 1), slice(m0, m1))
                kb, vb = k[0].to(acc), v[0].to(acc)  # [m, nkv, d]
                nkv = kb.shape[1]
                g = q.shape[2] // nkv
                dkb, dvb = torch.zeros_like(kb), torch.zeros_like(vb)
                for i0 in range(0, n1, rows):
                    i1 = min(n1, i0 + rows)
                    qb, do, ob, lb = (
                        x[b, i0:i1].to(acc).unflatten(1, (nkv, g)) for x in (q, dout, out, lse)
                    )  # [n, nkv, g, ...]
                    sc = self._masked(torch.einsum("nkgd,mkd->nkgm", qb, kb) * scale, mask, segments[b], off, i0, m0)
                    p = torch.exp(sc - lb[..., None])  # merged LSE
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
        self._d_entry: list[torch.Tensor | None] = []
        self._d_params: list[torch.Tensor] = []

    def num_kv_heads(self) -> int:
        return self.make(slice(0, 1), slice(0, 1))[0].shape[2]

    def make(self, rows: slice, positions: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of entry rows `rows`, positions `positions`: each [b, t, nkv, d]."""
        block = [t[rows, positions] for t in self.entry]
        return step0_keys_values(block, self.expand, self.params, block[0].shape[:2])

    def make_with_graph(self, rows: slice, positions: slice):
        """(k, v, take_back): `make`'s block, detached, and the function that takes its gradients back."""
        if not self._d_entry:
            self._d_entry = [torch.zeros_like(t) if t.is_floating_point() else None for t in self.entry]
            self._d_params = [
                torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32)) for p in self.params
            ]
        if self.expand is KEYS_VALUES:
            k, v = self.make(rows, positions)

            def add(dk, dv):
                self._d_entry[0][rows, positions] += dk
                self._d_entry[1][rows, positions] += dv

            return k, v, add
        with torch.enable_grad():  # the block's keys and values as a small graph
            inputs = [t[rows, positions].detach().requires_grad_(t.is_floating_point()) for t in self.entry]
            leaves = [p.detach().requires_grad_() for p in self.params]
            k, v = step0_keys_values(inputs, self.expand, leaves, inputs[0].shape[:2])
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
