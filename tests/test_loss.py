"""Label and mask alignment (docs/design.md §4) on hand-made examples, the metrics, and every
`train.loss` kind against a naive autograd reference and `speculators`' own eager losses."""

import math

import pytest
import torch

from eagle31 import TargetHead, step_scales, supervision_mask, ttt_loss, ttt_metrics, weighted_loss
from eagle31.loss import Divergence, DraftLoss
from eagle31.model import segment_ids
from tests.peers import peer_module


def supervised_positions(sup):
    return {k: sup[k, 0].nonzero().squeeze(1).tolist() for k in range(sup.shape[0])}


MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 1]])


def test_supervised_queries_one_document_by_hand():
    seg = segment_ids(None, None, MASK.shape)
    # (p, k) is supervised iff p+2+k <= 7 and m[p+2+k] = 1
    assert supervised_positions(supervision_mask(MASK, seg, 3)) == {0: [1, 2, 3, 5], 1: [0, 1, 2, 4], 2: [0, 1, 3]}


def test_supervised_queries_never_cross_a_document_boundary():
    seg = segment_ids(torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]]), None, MASK.shape)
    assert supervised_positions(supervision_mask(MASK, seg, 3)) == {0: [1, 5], 1: [0, 4], 2: []}


def test_out_of_vocab_target_argmax_is_not_supervised():
    seg = segment_ids(None, None, MASK.shape)
    in_vocab = torch.ones_like(MASK, dtype=torch.bool)
    in_vocab[0, 4] = False  # the target state at q=4 labels (p, k) with p+1+k = 4
    assert supervised_positions(supervision_mask(MASK, seg, 3, in_vocab)) == {0: [1, 2, 5], 1: [0, 1, 4], 2: [0, 3]}


def test_query_p_k_is_labelled_by_final_at_p_plus_1_plus_k():
    """If step k's state at p equals final[p+1+k] and lm_head equals the target's draft rows, KL is 0."""
    torch.manual_seed(0)
    B, T, H, V, K = 1, 9, 8, 12, 3
    target_w = torch.randn(V, H, dtype=torch.float64)
    draft_ids = torch.tensor([0, 2, 3, 5, 7, 8, 10, 11])
    head = TargetHead(target_w, draft_ids)
    d2t = draft_ids - torch.arange(len(draft_ids))
    final = torch.randn(B, T, H, dtype=torch.float64) * 3
    mask = torch.ones(B, T, dtype=torch.long)
    sup = supervision_mask(mask, segment_ids(None, None, (B, T)), K)
    argmax = head.argmax(final)
    shifted = [torch.cat([final[:, 1 + k :], final.new_zeros(B, 1 + k, H)], dim=1) for k in range(K)]
    stats = ttt_loss(shifted, head.draft_weight, d2t, final, sup, head, argmax, torch.ones(K))
    assert stats.count.tolist() == [7, 6, 5]
    torch.testing.assert_close(stats.loss_sum, torch.zeros(K, dtype=torch.float64), atol=1e-12, rtol=0)
    # and the draft argmax equals the target's wherever the target's is a draft token
    in_vocab = head.in_draft[argmax]
    expected_correct = [int(in_vocab[0, 1 + k : 1 + k + n].sum()) for k, n in enumerate([7, 6, 5])]
    assert stats.correct.tolist() == expected_correct
    # misaligned by one position: no longer zero
    wrong = [torch.cat([final[:, k:], final.new_zeros(B, k, H)], dim=1) for k in range(K)]
    assert ttt_loss(wrong, head.draft_weight, d2t, final, sup, head, argmax, torch.ones(K)).loss_sum.sum() > 1e-3


def test_metrics_from_counters_by_hand():
    # count, correct, cond_count, cond_correct per step
    counters = torch.tensor([[10.0, 8.0, 6.0], [8.0, 6.0, 3.0], [10.0, 8.0, 6.0], [8.0, 5.0, 2.0]])
    m = ttt_metrics(counters)
    assert m["acc_0"] == 0.8 and m["acc_1"] == 0.75 and m["acc_2"] == 0.5
    assert m["cond_acc_1"] == 5 / 8 and m["cond_acc_2"] == 2 / 6
    assert abs(m["tau_sim"] - (1 + 0.8 + 0.8 * 0.75 + 0.8 * 0.75 * 0.5)) < 1e-12


def test_conditional_accuracy_follows_each_chain():
    """cond_acc_k counts (p, k) only when (p, 0..k-1) were supervised and correct."""
    B, T, H, K = 1, 6, 4, 2
    target_w = torch.eye(H, dtype=torch.float64) * 5  # V = H = 4, target argmax at q = argmax(final[q])
    head = TargetHead(target_w, torch.arange(H))
    d2t = torch.zeros(H, dtype=torch.long)
    labels = torch.tensor([0, 1, 2, 3, 0, 1])
    final = torch.nn.functional.one_hot(labels, H).double()[None]
    mask = torch.ones(B, T, dtype=torch.long)
    sup = supervision_mask(mask, segment_ids(None, None, (B, T)), K)
    argmax = head.argmax(final)
    # step 0 right at p = 0, 1 and wrong at p = 2, 3; step 1 right everywhere
    s0 = torch.nn.functional.one_hot(torch.tensor([1, 2, 0, 1, 0, 0]), H).double()[None]
    s1 = torch.nn.functional.one_hot(torch.tensor([2, 3, 0, 1, 0, 0]), H).double()[None]
    stats = ttt_loss([s0, s1], torch.eye(H, dtype=torch.float64), d2t, final, sup, head, argmax, torch.ones(K))
    assert stats.count.tolist() == [4, 3] and stats.correct.tolist() == [2, 3]
    assert stats.cond_count.tolist() == [4, 2] and stats.cond_correct.tolist() == [2, 2]


def test_target_argmax_in_vocabulary_tiles_equals_argmax_with_ties(monkeypatch):
    import eagle31.loss

    monkeypatch.setattr(eagle31.loss, "_ARGMAX_COLUMNS", 7)  # 100 ids -> 15 tiles
    g = torch.Generator().manual_seed(0)
    w = torch.randn(100, 8, generator=g)
    w[40] = w[5]  # a tie across tiles: the lower id wins, as torch.argmax says
    final = torch.randn(2, 30, 8, generator=g)
    final[0, 0] = w[5] * 10
    needed = torch.rand(2, 30, generator=g) < 0.5
    head = TargetHead(w, torch.arange(10))
    expected = (final @ w.T).argmax(-1)
    assert expected[0, 0] == 5
    assert torch.equal(head.argmax(final), expected)
    got = head.argmax(final, needed)
    assert torch.equal(got[needed], expected[needed]) and bool((got[~needed] == -1).all())


def _explicit_loss_sums(states, W, final, sup, head):
    """Per-step KL sums from full [B, T, Vd] logits, by autograd (the reference for FusedDraftLoss)."""
    K = len(states)
    label = torch.log_softmax(final @ head.draft_weight.to(final.dtype).T, -1)  # [B, T, Vd]
    sums = []
    for k in range(K):
        logq = torch.log_softmax(states[k] @ W.T, -1)
        lp = label[:, 1 + k :]
        n = lp.shape[1]
        kl = (lp.exp() * (lp - logq[:, :n])).sum(-1)
        sums.append((kl * sup[k][:, :n]).sum())
    return torch.stack(sums)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_lm_head_gradient_accumulator_equals_per_step_gradients(dtype, monkeypatch):
    """FusedDraftLoss's single weighted dW (and dh) equal autograd through explicit logits, across several chunks."""
    import eagle31.loss

    monkeypatch.setattr(eagle31.loss, "_LOGITS_BUDGET", 40)  # 4 label rows per chunk, many chunks
    g = torch.Generator().manual_seed(1)
    B, T, H, Ht, V, K = 2, 13, 6, 5, 11, 3
    head = TargetHead(torch.randn(V, Ht, generator=g, dtype=dtype), torch.tensor([0, 1, 3, 4, 6, 7, 8, 10]))
    Vd = head.draft_ids.numel()
    final = torch.randn(B, T, Ht, generator=g, dtype=dtype)
    doc = torch.zeros(B, T, dtype=torch.long)
    doc[0, 6:] = 1
    doc[1, 10:] = -1
    mask = (torch.rand(B, T, generator=g) < 0.8).long()
    sup = supervision_mask(mask, segment_ids(doc, None, (B, T)), K)
    scale = step_scales(sup.sum(dim=(1, 2)), 0.8)

    def grads(explicit):
        W = torch.randn(Vd, H, generator=torch.Generator().manual_seed(2), dtype=dtype, requires_grad=True)
        states = [
            torch.randn(B, T, H, generator=torch.Generator().manual_seed(3 + k), dtype=dtype, requires_grad=True)
            for k in range(K)
        ]
        if explicit:
            sums = _explicit_loss_sums(states, W, final, sup, head)
        else:
            sums = ttt_loss(
                states, W, torch.zeros(Vd, dtype=torch.long), final, sup, head, head.argmax(final), scale
            ).loss_sum
        (3.0 * (scale.to(dtype) * sums).sum()).backward()  # any constant factor (the trainer's world size)
        return sums.detach(), W.grad, [s.grad for s in states]

    sums, gW, gh = grads(False)
    ref_sums, ref_gW, ref_gh = grads(True)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(sums, ref_sums, **tol)
    torch.testing.assert_close(gW, ref_gW, **tol)
    for a, b in zip(gh, ref_gh):
        torch.testing.assert_close(a, b, **tol)


def test_a_gradient_not_of_the_given_step_scale_is_refused():
    g = torch.Generator().manual_seed(4)
    head = TargetHead(torch.randn(9, 4, generator=g), torch.arange(9))
    final = torch.randn(1, 8, 4, generator=g)
    sup = supervision_mask(torch.ones(1, 8, dtype=torch.long), segment_ids(None, None, (1, 8)), 2)
    W = torch.randn(9, 4, generator=g, requires_grad=True)
    states = [torch.randn(1, 8, 4, generator=g) for _ in range(2)]
    stats = ttt_loss(
        states, W, torch.zeros(9, dtype=torch.long), final, sup, head, head.argmax(final), torch.tensor([1.0, 0.5])
    )
    with pytest.raises(RuntimeError, match="not proportional to the step_scale"):
        stats.loss_sum.sum().backward()


# ---------------------------------------------------------------------------- the loss kinds (train.loss)

DECAY = 0.8


def naive_row_loss(kind: DraftLoss, eta: float, logits: torch.Tensor, label_logits: torch.Tensor) -> torch.Tensor:
    """[n]: the loss of each query, written from the definitions, for autograd to differentiate."""
    p, q = label_logits.softmax(-1), logits.softmax(-1)
    kl = (p * (p.log() - q.log())).sum(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    alpha = torch.minimum(p, q).sum(-1)
    if kind == DraftLoss.kl:
        return kl
    if kind == DraftLoss.tv:
        return tv
    if kind == DraftLoss.lk_alpha:
        return -alpha.log()
    if kind == DraftLoss.lk_hybrid:
        lam = torch.exp(-eta * alpha.detach())
        return lam * kl + (1 - lam) * tv
    return torch.nn.functional.cross_entropy(logits, label_logits.argmax(-1), reduction="none")


def speculators_row_loss(kind: DraftLoss, eta: float, logits: torch.Tensor, label_logits: torch.Tensor) -> torch.Tensor:
    """[n]: the same from `speculators.losses.eager` (0.9.0), which takes [1, n, Vd] logits of both sides."""
    eager = peer_module("speculators.losses.eager")
    fn = {
        DraftLoss.kl: eager.kl_div_loss,
        DraftLoss.tv: eager.tv_loss,
        DraftLoss.lk_alpha: eager.neg_log_acceptance_loss,
        DraftLoss.lk_hybrid: lambda x, y: eager.lk_hybrid_loss(x, y, eta=eta),
        DraftLoss.ce: eager.ce_loss,
    }[kind]
    return fn(logits[None], label_logits[None])[0]


def loss_case(seed: int, B=2, T=10, H=6, Ht=5, V=30, Vd=12, K=3):
    """Random states [B, T, H] per step, a draft lm_head, a target head, and the supervised queries."""
    g = torch.Generator().manual_seed(seed)
    draft_ids = torch.randperm(V, generator=g)[:Vd].sort().values
    head = TargetHead(torch.randn(V, Ht, generator=g, dtype=torch.float64) * 1.5, draft_ids)
    final = torch.randn(B, T, Ht, generator=g, dtype=torch.float64)
    states = [torch.randn(B, T, H, generator=g, dtype=torch.float64).requires_grad_() for _ in range(K)]
    W = (torch.randn(Vd, H, generator=g, dtype=torch.float64) * 0.7).requires_grad_()
    mask = (torch.rand(B, T, generator=g) < 0.8).long()
    sup = supervision_mask(mask, segment_ids(None, None, (B, T)), K)
    return states, W, draft_ids, head, final, sup


def reference_loss(row_loss, kind, eta, states, W, head, final, sup):
    """sum_k w^k * mean over step k's supervised queries of row_loss, on explicit logits."""
    T = sup.shape[2]
    total = 0.0
    for k, h in enumerate(states):
        b, p = sup[k].nonzero(as_tuple=True)
        logits = h[b, p] @ W.T  # [n, Vd]
        label_logits = final[b, p + 1 + k] @ head.draft_weight.T
        assert (p + 1 + k < T).all()
        total = total + DECAY**k * row_loss(kind, eta, logits, label_logits).sum() / len(p)
    return total


@pytest.mark.parametrize("kind", list(DraftLoss))
@pytest.mark.parametrize(
    "reference", ["naive", pytest.param("speculators", marks=pytest.mark.slow)]
)  # importing speculators takes ~10 s
def test_each_loss_kind_matches_its_references_in_value_and_gradient(kind, reference, monkeypatch):
    """The fused chunked pass (3 label rows per chunk here) against explicit logits and autograd."""
    import eagle31.loss

    monkeypatch.setattr(eagle31.loss, "_LOGITS_BUDGET", 3 * 12)
    states, W, draft_ids, head, final, sup = loss_case(seed=21)
    eta = 2.5
    argmax = head.argmax(final)
    d2t = draft_ids - torch.arange(len(draft_ids))
    scale = step_scales(sup.sum(dim=(1, 2)), DECAY)
    stats = ttt_loss(states, W, d2t, final, sup, head, argmax, scale, Divergence(kind, eta))
    ours = weighted_loss(stats.loss_sum, stats.count, DECAY)
    ours_grads = torch.autograd.grad(ours, [W, *states])

    row_loss = naive_row_loss if reference == "naive" else speculators_row_loss
    expected = reference_loss(row_loss, kind, eta, states, W, head, final, sup)
    expected_grads = torch.autograd.grad(expected, [W, *states])
    # speculators computes in float32; the naive reference in float64 like the library here
    tol = dict(rtol=1e-10, atol=1e-12) if reference == "naive" else dict(rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(ours, expected.to(ours.dtype), **tol)
    for name, got, want in zip(["lm_head", *[f"state {k}" for k in range(len(states))]], ours_grads, expected_grads):
        torch.testing.assert_close(got, want.to(got.dtype), **tol, msg=lambda m, name=name: f"{kind}, {name}: {m}")
    if kind != DraftLoss.kl:  # the kind reached the loss: it is not KL under another name
        kl = weighted_loss(ttt_loss(states, W, d2t, final, sup, head, argmax, scale).loss_sum, stats.count, DECAY)
        assert abs(float(kl.detach()) - float(ours.detach())) > 1e-3


def test_every_train_loss_choice_has_its_function():
    import eagle31.loss

    assert set(eagle31.loss.LOSSES) == set(DraftLoss)


def test_a_new_loss_is_a_function_and_its_line_in_losses(monkeypatch):
    """docs/architecture.md, "How to add a loss": a loss registered from this module alone (its function and its
    `LOSSES` line; a recipe's `train.loss` also needs its `DraftLoss` member) is what the fused chunked pass
    minimises, in value and gradient: a toy, half the squared distance between p and q."""
    import eagle31.loss

    def squared(label_logp, draft_logq, eta):  # the loss per query: its gradient is autograd's
        return 0.5 * ((draft_logq.exp() - label_logp.exp()) ** 2).sum(-1)

    def naive(kind, eta, logits, label_logits):
        return 0.5 * ((logits.softmax(-1) - label_logits.softmax(-1)) ** 2).sum(-1)

    monkeypatch.setitem(eagle31.loss.LOSSES, "squared", squared)
    monkeypatch.setattr(eagle31.loss, "_LOGITS_BUDGET", 3 * 12)  # several chunks
    states, W, draft_ids, head, final, sup = loss_case(seed=23)
    d2t = draft_ids - torch.arange(len(draft_ids))
    scale = step_scales(sup.sum(dim=(1, 2)), DECAY)
    stats = ttt_loss(states, W, d2t, final, sup, head, head.argmax(final), scale, Divergence("squared"))
    ours = weighted_loss(stats.loss_sum, stats.count, DECAY)
    expected = reference_loss(naive, "squared", 0.0, states, W, head, final, sup)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12)
    for got, want in zip(torch.autograd.grad(ours, [W, *states]), torch.autograd.grad(expected, [W, *states])):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    kl = weighted_loss(
        ttt_loss(states, W, d2t, final, sup, head, head.argmax(final), scale).loss_sum, stats.count, DECAY
    )
    assert abs(float(kl.detach()) - float(ours.detach())) > 1e-3  # it is not KL under another name


def test_loss_kinds_meet_at_their_limits():
    """lk_hybrid is KL at eta = 0; TV = 1 - alpha stays below -log alpha."""
    states, W, draft_ids, head, final, sup = loss_case(seed=22)
    argmax = head.argmax(final)
    d2t = draft_ids - torch.arange(len(draft_ids))

    def sums(kind, eta=3.0, s=states):
        scale = step_scales(sup.sum(dim=(1, 2)), DECAY)
        return ttt_loss(s, W, d2t, final, sup, head, argmax, scale, Divergence(kind, eta)).loss_sum.detach()

    torch.testing.assert_close(sums(DraftLoss.lk_hybrid, eta=0.0), sums(DraftLoss.kl), rtol=1e-12, atol=0)
    assert (sums(DraftLoss.tv) < sums(DraftLoss.lk_alpha)).all()  # 1 - a < -log a


@pytest.mark.slow  # imports speculators
def test_no_overlap_clamps_log_acceptance_as_speculators_does():
    """Disjoint label and draft: -log alpha is clamped at -log 1e-5 and has no gradient, in both."""
    from eagle31.loss import loss_and_gradient

    eager = peer_module("speculators.losses.eager")
    logits = torch.tensor([[40.0, 0.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    label_logits = torch.tensor([[0.0, 0.0, 0.0, 40.0]], dtype=torch.float64)
    rows, dz = loss_and_gradient(Divergence(DraftLoss.lk_alpha), label_logits.log_softmax(-1), logits.detach())
    theirs = eager.neg_log_acceptance_loss(logits[None], label_logits[None])[0]
    (grad,) = torch.autograd.grad(theirs.sum(), logits)
    torch.testing.assert_close(rows, theirs.double(), rtol=1e-6, atol=0)
    assert float(rows) == pytest.approx(-math.log(1e-5))
    assert torch.equal(dz, torch.zeros_like(dz)) and torch.equal(grad, torch.zeros_like(grad))
