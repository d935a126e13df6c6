"""The TTT loss and metrics (docs/design.md §4): supervision, labels, the `train.loss` losses, `FusedDraftLoss`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import torch


class DraftLoss(StrEnum):
    """What each supervised query minimises (`eagle31.loss`); p = label, q = draft distribution."""

    kl = "kl"  # KL(p || q)
    tv = "tv"  # total variation 1 - sum min(p, q)
    lk_alpha = "lk_alpha"  # negative log-acceptance -log sum min(p, q) (LK losses, arXiv 2602.23881)
    lk_hybrid = "lk_hybrid"  # lambda KL + (1 - lambda) TV, lambda = exp(-lk_eta * sg[alpha]) (same paper)
    ce = "ce"  # cross-entropy against the label's argmax (the target's greedy token)


# Rows per chunk are chosen so one fp32 logits chunk holds at most this many elements.
_LOGITS_BUDGET = 1 << 24
# Vocabulary columns per tile of the target's full-vocabulary argmax.
_ARGMAX_COLUMNS = 1 << 15
# lk_alpha: an acceptance below this counts as this (the loss stays finite; its gradient is 0 there).
_MIN_ACCEPTANCE = 1e-5


class TargetHead:
    """The target's lm_head, which makes the labels: weight [V, Ht] (frozen), draft_ids [Vd] (target ids, ascending)."""

    def __init__(self, weight: torch.Tensor, draft_ids: torch.Tensor):
        self.weight = weight.detach()
        self.draft_ids = draft_ids.to(weight.device)
        # [Vd, Ht]; the weight itself when the draft vocabulary is the whole one (no second copy)
        self.draft_weight = self.weight if self.draft_ids.numel() == weight.shape[0] else self.weight[self.draft_ids]
        self.in_draft = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)
        self.in_draft[self.draft_ids] = True

    @torch.no_grad()
    def argmax(self, final: torch.Tensor, needed: torch.Tensor | None = None) -> torch.Tensor:
        """Target argmax over the full vocabulary of final [B, T, Ht]: [B, T] target ids (-1 where not `needed`)."""
        B, T, _ = final.shape
        out = torch.full((B, T), -1, dtype=torch.long, device=final.device)
        idx = torch.arange(B * T, device=final.device) if needed is None else needed.reshape(-1).nonzero().squeeze(1)
        w = self.weight.to(final.dtype)
        # row x vocabulary tiles, a running max across columns: the [V, Ht] weight read once per row tile
        cols = min(w.shape[0], _ARGMAX_COLUMNS)
        rows = max(1, _LOGITS_BUDGET // cols)
        for i in range(0, idx.numel(), rows):
            sel = idx[i : i + rows]
            x = final.reshape(B * T, -1)[sel]
            best, arg = (x @ w[:cols].T).max(dim=-1)
            for c in range(cols, w.shape[0], cols):
                value, index = (x @ w[c : c + cols].T).max(dim=-1)
                better = value > best  # strict: ties keep the lower id, as argmax does
                best, arg = torch.where(better, value, best), torch.where(better, index + c, arg)
            out.view(-1)[sel] = arg
        return out


def label_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: positions q whose final state labels some supervised query (m[q+1] = 1)."""
    return torch.nn.functional.pad(loss_mask[:, 1:] > 0, (0, 1))


def supervision_mask(
    loss_mask: torch.Tensor, segments: torch.Tensor, ttt_length: int, target_in_vocab: torch.Tensor | None = None
) -> torch.Tensor:
    """[K, B, T] bool: (p, k) supervised (docs/design.md §4, "Labels"); inputs [B, T], target_in_vocab optional."""
    T = loss_mask.shape[1]
    supervised = torch.zeros(ttt_length, *loss_mask.shape, dtype=torch.bool, device=loss_mask.device)
    for k in range(min(ttt_length, T - 2)):
        n = T - (2 + k)  # positions p with p + 2 + k <= T - 1
        supervised[k, :, :n] = (loss_mask[:, 2 + k :] > 0) & (segments[:, 2 + k :] == segments[:, :n])
        if target_in_vocab is not None:
            supervised[k, :, :n] &= target_in_vocab[:, 1 + k : 1 + k + n]
    return supervised


@dataclass
class StepStats:
    """Per-step sums of one micro-batch; all [K]. Sum them across micro-batches and ranks."""

    loss_sum: torch.Tensor  # sum of the per-query loss over supervised queries (carries the gradient)
    count: torch.Tensor  # supervised queries
    correct: torch.Tensor  # draft argmax == target argmax
    cond_count: torch.Tensor  # supervised queries whose steps 0..k-1 were all correct
    cond_correct: torch.Tensor

    def counters(self) -> torch.Tensor:
        """[4, K] float64: count, correct, cond_count, cond_correct (for all-reduce)."""
        return torch.stack([self.count, self.correct, self.cond_count, self.cond_correct]).double()


@dataclass(frozen=True)
class Divergence:
    """The loss of one query: `name` (`train.loss`) and the lk_hybrid blend's eta (`train.lk_eta`)."""

    name: DraftLoss = DraftLoss.kl
    eta: float = 3.0


# ---------------------------------------------------------------------------- the losses
# Each: (label_logp, draft_logq [n, Vd]: log p, the label, and log q, the draft, each normalised over the draft
# vocabulary; eta `train.lk_eta`) -> the loss of each query [n], its gradient autograd's (docs/design.md §4).


def kl_loss(label_logp: torch.Tensor, draft_logq: torch.Tensor, eta: float) -> torch.Tensor:
    return (label_logp.exp() * (label_logp - draft_logq)).sum(-1)


def tv_loss(label_logp: torch.Tensor, draft_logq: torch.Tensor, eta: float) -> torch.Tensor:
    return 1 - _acceptance(label_logp, draft_logq)


def lk_alpha_loss(label_logp: torch.Tensor, draft_logq: torch.Tensor, eta: float) -> torch.Tensor:
    """-log alpha; an alpha below `_MIN_ACCEPTANCE` counts as it (no gradient there)."""
    return -_acceptance(label_logp, draft_logq).clamp(min=_MIN_ACCEPTANCE).log()


def lk_hybrid_loss(label_logp: torch.Tensor, draft_logq: torch.Tensor, eta: float) -> torch.Tensor:
    """lam KL + (1 - lam) TV, lam = exp(-eta alpha) held constant."""
    alpha = _acceptance(label_logp, draft_logq)
    lam = torch.exp(-eta * alpha.detach())
    return lam * kl_loss(label_logp, draft_logq, eta) + (1 - lam) * (1 - alpha)


def ce_loss(label_logp: torch.Tensor, draft_logq: torch.Tensor, eta: float) -> torch.Tensor:
    """-log q[argmax p]: the target's greedy token among the draft ids (why not soft labels: docs/design.md §4)."""
    return -draft_logq.gather(-1, label_logp.argmax(-1, keepdim=True)).squeeze(-1)


def _acceptance(label_logp: torch.Tensor, draft_logq: torch.Tensor) -> torch.Tensor:
    """alpha [n] = sum_v min(p_v, q_v); where q_v = p_v its gradient is q's, as below."""
    p, q = label_logp.exp(), draft_logq.exp()
    return torch.where(q <= p, q, p).sum(-1)


# `train.loss` -> its function; a new loss is a function above, its line here and its `DraftLoss` member
LOSSES: dict[DraftLoss, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    DraftLoss.kl: kl_loss,
    DraftLoss.tv: tv_loss,
    DraftLoss.lk_alpha: lk_alpha_loss,
    DraftLoss.lk_hybrid: lk_hybrid_loss,
    DraftLoss.ce: ce_loss,
}


def loss_and_gradient(loss: Divergence, label_logp: torch.Tensor, logits: torch.Tensor):
    """The loss of each query [n] and its gradient with respect to the draft logits [n, Vd] (autograd)."""
    with torch.enable_grad():
        z = logits.detach().requires_grad_()
        per_query = LOSSES[loss.name](label_logp, z.log_softmax(-1), loss.eta)
        (dz,) = torch.autograd.grad(per_query.sum(), z)
    return per_query.detach(), dz


def ttt_loss(
    states: list[torch.Tensor],
    lm_head_weight: torch.Tensor,
    d2t: torch.Tensor,
    final: torch.Tensor,
    supervised: torch.Tensor,
    target: TargetHead,
    target_argmax: torch.Tensor,
    step_scale: torch.Tensor,
    loss: Divergence = Divergence(),
) -> StepStats:
    """Loss sums and accuracy counts of a micro-batch: states [B, T, H] a step, final [B, Tf, Ht] (Tf > T: the halo),
    supervised [K, B, T], target_argmax [B, Tf]; step_scale [K]: `step_scales` (differentiate `weighted_loss`)."""
    B, T = supervised.shape[1:]
    Tf = final.shape[1]  # T, or T + K + 1 on a sequence shard (its halo)
    # Supervised queries (p, k) as flat rows b*T + p, and their label rows b*Tf + p+1+k (both ascending).
    queries, labels = [], []
    for k, step in enumerate(supervised):
        b, p = step.nonzero(as_tuple=True)
        queries.append(b * T + p)
        labels.append(b * Tf + p + 1 + k)
    loss_sum, draft_argmax = FusedDraftLoss.apply(
        lm_head_weight,
        final.reshape(B * Tf, -1),
        target.draft_weight.to(final.dtype),
        queries,
        labels,
        step_scale.detach().double().cpu(),
        torch.is_grad_enabled(),
        loss,
        *[s.reshape(B * T, -1) for s in states],
    )
    flat_argmax = target_argmax.reshape(-1)
    per_step = []  # [4] per step: count, correct, cond_count, cond_correct
    chain_ok = torch.ones(B * T, dtype=torch.bool, device=final.device)  # steps 0..k-1 all correct
    for q, label, draft in zip(queries, labels, draft_argmax.split([q.numel() for q in queries])):
        hit, prev = (draft + d2t[draft]) == flat_argmax[label], chain_ok[q]
        per_step.append(torch.stack([torch.ones_like(hit), hit, prev, hit & prev]).sum(1))
        chain_ok &= torch.zeros_like(chain_ok).index_put((q,), hit)
    return StepStats(loss_sum, *torch.stack(per_step, 1).float())


def step_scales(global_count: torch.Tensor, ttt_decay: float | None) -> torch.Tensor:
    """[K]: w^k / global_count[k] (1 where none is supervised); ttt_decay None: 1 / the total, one mean (P-EAGLE's)."""
    if ttt_decay is None:
        return torch.full_like(global_count, 1 / max(float(global_count.sum()), 1), dtype=torch.float64)
    w = ttt_decay ** torch.arange(global_count.shape[0], dtype=torch.float64, device=global_count.device)
    return w / global_count.double().clamp(min=1)


def depth_sampling(supervised: torch.Tensor, ratio: float, ratio_min: float, seed: int, start: int = 0):
    """P-EAGLE's COD sampling of supervised [K, B, T]: (p, k >= 1) kept with probability max(ratio^k, ratio_min), nested
    in k; one draw per position from `seed`, its row and `start` (a shard's first position), as the whole draws it."""
    K, B, T = supervised.shape
    rows = [
        torch.rand(start + T, generator=torch.Generator().manual_seed(seed * 1_000_003 + r))[start:] for r in range(B)
    ]
    u = torch.stack(rows).to(supervised.device)  # [B, T]
    keep = [torch.ones_like(u, dtype=torch.bool)] + [u < max(ratio**k, ratio_min) for k in range(1, K)]
    return supervised & torch.stack(keep)


def weighted_loss(loss_sum: torch.Tensor, global_count: torch.Tensor, ttt_decay: float | None) -> torch.Tensor:
    """sum_k w^k * loss_sum[k] / global_count[k] (steps with no supervised query add 0); `step_scales`' decay."""
    return (step_scales(global_count, ttt_decay).to(loss_sum) * loss_sum).sum()


def ttt_metrics(counters: torch.Tensor) -> dict[str, float]:
    """From summed `StepStats.counters()` [4, K]: acc_k, cond_acc_k, tau_sim (docs/design.md §4), supervised count."""
    count, correct, cond_count, cond_correct = counters.double().cpu()
    acc = correct / count.clamp(min=1)
    cond = cond_correct / cond_count.clamp(min=1)
    per_step = {
        f"{name}_{k}": float(x[k]) for k in range(acc.numel()) for name, x in (("acc", acc), ("cond_acc", cond))
    }
    return {**per_step, "tau_sim": float(1 + torch.cumprod(acc, 0).sum()), "supervised": float(count.sum())}


class FusedDraftLoss(torch.autograd.Function):
    """Per step k: over its supervised queries, the sum of D(softmax(f Wt^T), softmax(h W^T)) and the draft argmax, one
    pass over label-row chunks forming dh and dW too. W [Vd, H], f [N, Ht] final, Wt [Vd, Ht] target draft rows, queries
    and labels (per step, ascending rows), scale [K], grads, divergence, *h [N, H]; backward: `_shared_factor`."""

    @staticmethod
    def forward(ctx, W, f, Wt, queries, labels, scale, grads, divergence, *h):
        K = len(h)
        acc = torch.promote_types(h[0].dtype, torch.float32)
        need_dh = grads and any(ctx.needs_input_grad[8:])
        need_dW = grads and ctx.needs_input_grad[0]
        loss = torch.zeros(K, dtype=acc, device=W.device)
        argmax = [torch.empty_like(q) for q in queries]
        dh = [x.new_empty(q.numel(), x.shape[1]) if need_dh else None for x, q in zip(h, queries)]
        dW = torch.zeros(W.shape, dtype=acc, device=W.device) if need_dW else None
        step_scale = scale.tolist()
        rows = torch.unique(torch.cat(labels))  # every label row, ascending
        where = [torch.searchsorted(rows, lab) for lab in labels]  # each query's label, as an index into `rows`
        chunk = max(1, _LOGITS_BUDGET // W.shape[0])
        starts = torch.arange(0, rows.numel() + chunk, chunk, device=W.device).clamp(max=rows.numel())
        # step k's queries of chunk c: bounds[k][c:c+2]
        bounds = [torch.searchsorted(w, starts).tolist() for w in where]
        for c, c0 in enumerate(starts[:-1].tolist()):
            logp = (f[rows[c0 : c0 + chunk]] @ Wt.T).to(acc).log_softmax(-1)  # [c, Vd] label log-probabilities
            for k in range(K):
                i, j = bounds[k][c], bounds[k][c + 1]
                if i == j:
                    continue
                hk = h[k][queries[k][i:j]]  # [n, H]
                logits = (hk @ W.T).to(acc)
                rows_loss, dz = loss_and_gradient(divergence, logp[where[k][i:j] - c0], logits)  # [n], [n, Vd]
                loss[k] += rows_loss.sum()
                argmax[k][i:j] = logits.argmax(-1)
                if need_dh:
                    dh[k][i:j] = (dz.to(W.dtype) @ W).to(hk.dtype)
                if need_dW:
                    _accumulate_dW(dW, dz.to(hk.dtype), hk, step_scale[k])
                del dz  # before the next step's chunk tensors: one [n, Vd] fewer at the peak
        ctx.save_for_backward(dW, *dh)  # intermediates: freed once backward has run
        ctx.queries, ctx.shapes, ctx.w_dtype, ctx.scale = queries, [x.shape for x in h], W.dtype, step_scale
        argmax = torch.cat(argmax)
        ctx.mark_non_differentiable(argmax)
        return loss, argmax

    @staticmethod
    def backward(ctx, grad_loss, _grad_argmax):
        if getattr(ctx, "consumed", False):
            raise RuntimeError(
                "FusedDraftLoss's backward ran twice (retain_graph): its lm_head gradient is scaled in place"
            )
        ctx.consumed = True
        dW, *dh = ctx.saved_tensors
        g = grad_loss.tolist()  # one scalar per step
        # dW scaled in place: no second fp32 copy
        grad_W = None if dW is None else dW.mul_(_shared_factor(g, ctx.scale, ctx.queries)).to(ctx.w_dtype)
        grad_h = [
            None if d is None else d.new_zeros(shape).index_copy_(0, q, d).mul_(gk)
            for d, q, shape, gk in zip(dh, ctx.queries, ctx.shapes, g)
        ]
        return grad_W, None, None, None, None, None, None, None, *grad_h


def _accumulate_dW(dW: torch.Tensor, dz: torch.Tensor, h: torch.Tensor, scale: float) -> None:
    """dW [Vd, H] fp32 += scale * dz^T h (dz [n, Vd], h [n, H]), multiplied in their dtype, `_LOGITS_BUDGET` tiles."""
    if dW.dtype == h.dtype:
        dW.addmm_(dz.T, h, alpha=scale)
        return
    tile = max(1, _LOGITS_BUDGET // h.shape[1])
    for v in range(0, dW.shape[0], tile):
        dW[v : v + tile].add_((dz[:, v : v + tile].T @ h).to(dW.dtype), alpha=scale)


def _shared_factor(grad: list[float], scale: list[float], queries: list[torch.Tensor]) -> float:
    """The one c with grad[k] = c * scale[k] for every step with a supervised query (`FusedDraftLoss`)."""
    steps = [k for k, q in enumerate(queries) if q.numel()]
    if not steps:
        return 0.0
    c = grad[steps[0]] / scale[steps[0]]
    for k in steps[1:]:
        if not math.isclose(grad[k], c * scale[k], rel_tol=1e-6, abs_tol=1e-30):
            raise RuntimeError(
                f"the loss sums' gradient {grad} is not proportional to the step_scale {scale} ttt_loss was given; "
                "differentiate sum_k step_scale[k] * loss_sum[k] (weighted_loss), times any constant"
            )
    return c
