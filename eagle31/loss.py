"""TTT loss and metrics (DESIGN §4).

Label of query (p, k): the target's distribution for token x[p+2+k], i.e.
`softmax(target_lm_head(final[p+1+k]))` restricted to the draft vocabulary
and renormalised. (p, k) is supervised iff p+2+k <= T-1, m[p+2+k] = 1, x[p+2+k]
is in p's document, and — with `mask_out_of_vocab` — the target's argmax over
its full vocabulary at p+1+k is a draft token.

Loss: sum_k w^k * mean over the supervised (p, k) of the *global* batch of
KL(label || softmax(draft logits)). A micro-batch returns per-step sums and
counts (`StepStats`); the trainer all-reduces the counts and divides.

lm_head + KL run in chunks of positions inside one autograd function that
recomputes the logits in backward, so no fp32 [T, Vd] tensor is kept per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Rows per chunk are chosen so one fp32 logits chunk holds at most this many elements.
_LOGITS_BUDGET = 1 << 24


class TargetHead:
    """The target's lm_head, which makes the labels.

    weight [V, Ht] (the target's `lm_head.weight`, frozen); draft_ids [Vd] the
    target ids of the draft vocabulary (ascending).
    """

    def __init__(self, weight: torch.Tensor, draft_ids: torch.Tensor):
        self.weight = weight.detach()
        self.draft_ids = draft_ids.to(weight.device)
        self.draft_weight = self.weight[self.draft_ids]  # [Vd, Ht]
        self.in_draft = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)
        self.in_draft[self.draft_ids] = True

    @torch.no_grad()
    def argmax(self, final: torch.Tensor, needed: torch.Tensor | None = None) -> torch.Tensor:
        """Target argmax over the full vocabulary, [B, T] target ids (-1 where not `needed`).

        final [B, T, Ht] — the input of the target's lm_head.
        """
        B, T, _ = final.shape
        out = torch.full((B, T), -1, dtype=torch.long, device=final.device)
        flat = final.reshape(B * T, -1)
        idx = torch.arange(B * T, device=final.device) if needed is None else needed.reshape(-1).nonzero().squeeze(1)
        rows = max(1, _LOGITS_BUDGET // self.weight.shape[0])
        w = self.weight.to(final.dtype)
        for i in range(0, idx.numel(), rows):
            sel = idx[i : i + rows]
            out.view(-1)[sel] = (flat[sel] @ w.T).argmax(dim=-1)
        return out


def label_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: positions q whose final state labels some supervised query (m[q+1] = 1)."""
    needed = torch.zeros_like(loss_mask, dtype=torch.bool)
    needed[:, :-1] = loss_mask[:, 1:] > 0
    return needed


def supervision_mask(
    loss_mask: torch.Tensor,
    segments: torch.Tensor,
    ttt_length: int,
    target_in_vocab: torch.Tensor | None = None,
) -> torch.Tensor:
    """[K, B, T] bool: is query (p, k) supervised (see module docstring).

    loss_mask [B, T]; segments [B, T] document runs; target_in_vocab [B, T]
    (is the target argmax at q a draft token), or None to supervise regardless.
    """
    B, T = loss_mask.shape
    masks = []
    for k in range(ttt_length):
        sup = torch.zeros(B, T, dtype=torch.bool, device=loss_mask.device)
        n = T - (2 + k)  # positions p with p + 2 + k <= T - 1
        if n > 0:
            sup[:, :n] = (loss_mask[:, 2 + k :] > 0) & (segments[:, 2 + k :] == segments[:, :n])
            if target_in_vocab is not None:
                sup[:, :n] &= target_in_vocab[:, 1 + k : 1 + k + n]
        masks.append(sup)
    return torch.stack(masks)


@dataclass
class StepStats:
    """Per-step sums of one micro-batch; all [K]. Sum them across micro-batches and ranks."""

    loss_sum: torch.Tensor  # sum of KL over supervised queries (carries the gradient)
    count: torch.Tensor  # supervised queries
    correct: torch.Tensor  # draft argmax == target argmax
    cond_count: torch.Tensor  # supervised queries whose steps 0..k-1 were all correct
    cond_correct: torch.Tensor

    def counters(self) -> torch.Tensor:
        """[4, K] float64: count, correct, cond_count, cond_correct (for all-reduce)."""
        return torch.stack([self.count, self.correct, self.cond_count, self.cond_correct]).double()


def ttt_loss(
    states: list[torch.Tensor],
    lm_head_weight: torch.Tensor,
    d2t: torch.Tensor,
    final: torch.Tensor,
    supervised: torch.Tensor,
    target: TargetHead,
    target_argmax: torch.Tensor,
) -> StepStats:
    """KL sums and accuracy counts of one micro-batch.

    states: per step norm(o_k) [B, T, H]; lm_head_weight [Vd, H];
    final [B, T, Ht]; supervised [K, B, T]; target_argmax [B, T] full-vocab ids.
    """
    K = len(states)
    B, T = supervised.shape[1:]
    device = final.device
    loss_sums, counts, correct, cond_counts, cond_correct = [], [], [], [], []
    chain_ok = torch.ones(B, T, dtype=torch.bool, device=device)  # steps 0..k-1 all correct
    for k in range(K):
        b, p = supervised[k].nonzero(as_tuple=True)
        h = states[k][b, p]  # [P, H]
        f = final[b, p + 1 + k]  # [P, Ht]
        loss_k, draft_argmax = DraftKL.apply(h, lm_head_weight, f, target.draft_weight.to(f.dtype))
        hit = (draft_argmax + d2t[draft_argmax]) == target_argmax[b, p + 1 + k]
        prev = chain_ok[b, p]
        loss_sums.append(loss_k)
        counts.append(b.numel())
        correct.append(hit.sum())
        cond_counts.append(prev.sum())
        cond_correct.append((hit & prev).sum())
        step_ok = torch.zeros_like(chain_ok)
        step_ok[b, p] = hit
        chain_ok &= step_ok
    as_tensor = lambda xs: torch.stack([torch.as_tensor(x, device=device) for x in xs]).float()  # noqa: E731
    return StepStats(
        loss_sum=torch.stack(loss_sums),
        count=as_tensor(counts),
        correct=as_tensor(correct),
        cond_count=as_tensor(cond_counts),
        cond_correct=as_tensor(cond_correct),
    )


def step_weights(ttt_length: int, ttt_decay: float, dtype=torch.float32, device=None) -> torch.Tensor:
    """[K]: w^k."""
    return ttt_decay ** torch.arange(ttt_length, dtype=torch.float64, device=device).to(dtype)


def weighted_loss(loss_sum: torch.Tensor, global_count: torch.Tensor, ttt_decay: float) -> torch.Tensor:
    """sum_k w^k * loss_sum[k] / global_count[k] (steps with no supervised query add 0)."""
    w = step_weights(loss_sum.shape[0], ttt_decay, loss_sum.dtype, loss_sum.device)
    return (w * loss_sum / global_count.to(loss_sum).clamp(min=1)).sum()


def ttt_metrics(counters: torch.Tensor) -> dict[str, float]:
    """From summed `StepStats.counters()` [4, K]: acc_k, cond_acc_k, tau_sim.

    tau_sim = 1 + sum_k prod_{j<=k} acc_j (the 1 is the bonus token, as in vLLM).
    """
    count, correct, cond_count, cond_correct = counters.double().cpu()
    acc = correct / count.clamp(min=1)
    cond = cond_correct / cond_count.clamp(min=1)
    metrics: dict[str, float] = {}
    for k in range(acc.numel()):
        metrics[f"acc_{k}"] = float(acc[k])
        metrics[f"cond_acc_{k}"] = float(cond[k])
    metrics["tau_sim"] = float(1 + torch.cumprod(acc, 0).sum())
    metrics["supervised"] = float(count.sum())
    return metrics


class DraftKL(torch.autograd.Function):
    """sum over rows of KL(softmax(f Wt^T) || softmax(h W^T)), in chunks of rows.

    h [P, H], W [Vd, H], f [P, Ht], Wt [Vd, Ht] (frozen). Returns (loss sum,
    draft argmax [P]). Backward recomputes each chunk's logits: memory stays
    O(chunk * Vd) whatever P is.
    """

    @staticmethod
    def _chunks(P: int, Vd: int):
        rows = max(1, _LOGITS_BUDGET // Vd)
        return [(i, min(P, i + rows)) for i in range(0, P, rows)]

    @staticmethod
    def forward(ctx, h, W, f, Wt):
        acc = torch.promote_types(h.dtype, torch.float32)
        loss = torch.zeros((), dtype=acc, device=h.device)
        argmax = torch.empty(h.shape[0], dtype=torch.long, device=h.device)
        for i, j in DraftKL._chunks(h.shape[0], W.shape[0]):
            logq = (h[i:j] @ W.T).to(acc).log_softmax(-1)
            logp = (f[i:j] @ Wt.T).to(acc).log_softmax(-1)
            loss += (logp.exp() * (logp - logq)).sum()
            argmax[i:j] = logq.argmax(-1)
        ctx.save_for_backward(h, W, f, Wt)
        ctx.mark_non_differentiable(argmax)
        return loss, argmax

    @staticmethod
    def backward(ctx, grad_loss, _grad_argmax):
        h, W, f, Wt = ctx.saved_tensors
        acc = torch.promote_types(h.dtype, torch.float32)
        dh = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        dW = torch.zeros(W.shape, dtype=acc, device=W.device) if ctx.needs_input_grad[1] else None
        for i, j in DraftKL._chunks(h.shape[0], W.shape[0]):
            q = (h[i:j] @ W.T).to(acc).softmax(-1)
            p = (f[i:j] @ Wt.T).to(acc).softmax(-1)
            dz = (q - p) * grad_loss  # d KL / d logits
            if dh is not None:
                dh[i:j] = (dz.to(W.dtype) @ W).to(h.dtype)
            if dW is not None:
                dW += (dz.to(h.dtype).T @ h[i:j]).to(acc)
        return dh, (dW.to(W.dtype) if dW is not None else None), None, None
