"""Our parallel (P-EAGLE) drafter in speculators 0.9.0's own P-EAGLE (`speculators/models/peagle`), on one batch.

Our drafter's weights go into their `PEagleDraftModel` through our speculators-layout export; both read one packed
batch (theirs through their collate and `shift_batch`). On one set of sampled queries their per-depth logits and
their loss are ours, and so are the gradients but the embedding's. What differs, each shown here (docs/training.md):
their trainer's loss mask (one token early, as for the chain: `eagle31_loss_mask` aligns it), their draw of the
sampled queries (same shares per depth, drawn otherwise; a query also needs every earlier depth of its rollout
supervised), their trained embedding, and their RoPE positions (the packed row's, one lower: a shift that attention
does not see).
"""

from __future__ import annotations

import pytest
import torch

from tests.experiments.test_side_by_side import packed_batch
from tests.helpers import tiny_drafter

pytestmark = pytest.mark.slow  # importing speculators takes ~10-40 s: in the tests, not at collection

K, RATIO, RATIO_MIN = 4, 0.7, 0.2
PARALLEL = dict(parallel_drafting=True, mask_token_id=5)


@pytest.fixture(scope="module")
def peagle():
    """Their P-EAGLE module (`PEagleDraftModel`, and the COD sampler its forward calls)."""
    from tests.peers import peer_module

    peer_module("loguru")  # speculators' loading module imports it (speculators itself goes in with --no-deps)
    return peer_module("speculators.models.peagle.core")


def their_model(ours, target_lm_head: torch.Tensor):
    """Their `PEagleDraftModel` of our drafter's shape holding our export's tensors, the verifier head ours."""
    from benchmarks.peer import speculators_drafter
    from eagle31.export import export_tensors

    model = speculators_drafter(ours.config, ours.d2t, ours.t2d, attention="sdpa", ttt_length=K)
    missing, unexpected = model.load_state_dict(export_tensors(ours, "speculators", dtype="float32"), strict=False)
    assert sorted(missing) == ["verifier_lm_head.weight", "verifier_norm.weight"] and not unexpected
    draft_ids = torch.arange(ours.config.draft_vocab_size) + ours.d2t
    with torch.no_grad():  # what load_verifier_weights reads from the target: its lm_head's draft rows, its norm
        model.verifier_lm_head.weight.copy_(target_lm_head[draft_ids])
        model.verifier_norm.weight.fill_(1.0)
    return model, draft_ids


def our_positions(lengths: list[int]) -> torch.Tensor:
    """Our position of each of their row's positions: `shift_batch` drops each document's first token, so their
    position i of document d is our p = i + d (a document's last position of ours has none of theirs)."""
    return torch.cat([torch.arange(n - 1) + sum(lengths[:d]) for d, n in enumerate(lengths)])


def cod_sample(keep: torch.Tensor, at: torch.Tensor, length: int):
    """Their (anchor_pos, depth) lists of the queries `keep` [K, 1, T] holds: depth 0 at every position of their row
    (as their sampler gives it), depth k >= 1 at their positions whose query of ours is kept."""
    anchors, depths = [torch.arange(length)], [torch.zeros(length, dtype=torch.long)]
    for k in range(1, keep.shape[0]):
        i = keep[k, 0, at].nonzero().squeeze(1)
        i = i[i + k < length]
        anchors.append(i)
        depths.append(torch.full_like(i, k))
    return torch.cat(anchors), torch.cat(depths)


def test_their_loader_reads_our_export_and_we_read_their_checkpoint(peagle, tmp_path):
    """`PEagleDraftModel.from_pretrained` reads every tensor of our speculators-layout export (mask_hidden in their
    [1, 1, n·Ht]) and the mask token; our reader takes their `save_pretrained` back to the same drafter."""
    from safetensors.torch import load_file

    from eagle31.convert import load_drafter
    from eagle31.export import export_drafter
    from tests.tiny_targets import drafter_sized_llama

    drafter_sized_llama(dtype=torch.float32).save_pretrained(tmp_path / "verifier")
    ours = tiny_drafter(seed=1, dtype=torch.float32, **PARALLEL)
    out = export_drafter(
        ours, tmp_path / "s", "speculators", dtype="float32", target_name_or_path=str(tmp_path / "verifier")
    )
    theirs = peagle.PEagleDraftModel.from_pretrained(str(out))
    state = theirs.state_dict()
    for key, tensor in load_file(str(out / "model.safetensors")).items():
        assert torch.equal(state[key], tensor), key
    assert theirs.mask_hidden.shape == (1, 1, ours.config.fc_in_features) and theirs.mask_token_id == 5
    theirs.save_pretrained(tmp_path / "theirs")
    back = load_drafter(tmp_path / "theirs", source_format="speculators")
    assert back.config.parallel_drafting and back.config.mask_token_id == 5
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


def test_on_one_sample_their_logits_per_depth_loss_and_gradients_are_ours(peagle, monkeypatch):
    """One packed batch of three chats, our COD draw of the sampled queries given to their forward (their sampler
    replaced by it): each depth's logits at every sampled query, the loss (one mean over every depth's supervised
    queries) and the gradients of every weight both train equal ours; their own loss mask gives another loss."""
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    from eagle31.loss import TargetHead, depth_sampling, label_positions, step_scales, supervision_mask, weighted_loss
    from eagle31.model import segment_ids
    from eagle31.trainer import DrafterObjective, TrainConfig
    from experiments.side_by_side.peer_training import eagle31_loss_mask, speculators_samples

    ours = tiny_drafter(seed=2, dtype=torch.float32, **PARALLEL)
    cfg = ours.config
    target_lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=torch.Generator().manual_seed(3))
    theirs, draft_ids = their_model(ours, target_lm_head)
    head = TargetHead(target_lm_head, draft_ids)
    lengths = [40, 56, 32]
    batch, T = packed_batch(lengths, prompt=8, vocab=cfg.vocab_size, hidden=cfg.target_hidden_size), sum(lengths)
    at = our_positions(lengths)

    # ours: the trainer's supervision, COD-sampled, one mean over all of it (train.ttt_decay=null)
    segments = segment_ids(batch.document_ids, None, batch.input_ids.shape)
    argmax = head.argmax(batch.final, label_positions(batch.loss_mask))
    in_vocab = head.in_draft[argmax.clamp(min=0)] & (argmax >= 0)
    supervised = depth_sampling(supervision_mask(batch.loss_mask, segments, K, in_vocab), RATIO, RATIO_MIN, seed=7)
    count = supervised.sum(dim=(1, 2)).double()
    assert 0 < count[-1] < count[1] < count[0]  # the draw thins the later depths
    stats = DrafterObjective(ours, TrainConfig(ttt_length=K, ttt_decay=None))(
        batch.aux, batch.input_ids, batch.document_ids, batch.final, supervised, argmax, step_scales(count, None), head
    )
    our_loss = weighted_loss(stats.loss_sum, count, None)
    our_loss.backward()
    with torch.no_grad():
        our_logits = [ours.lm_head(s) for s in ours.unroll(batch.aux, batch.input_ids, ttt_length=K,
                                                          document_ids=batch.document_ids).states]  # fmt: skip

    # theirs: the same queries (every query our draw keeps, supervised or not: a rollout sees its earlier depths)
    keep = depth_sampling(torch.ones_like(supervised), RATIO, RATIO_MIN, seed=7)
    anchor, depth = cod_sample(keep, at, T)
    monkeypatch.setattr(peagle, "generate_cod_sample_indices", lambda *a, **kw: (anchor, depth))
    logits = []
    theirs.lm_head.register_forward_hook(lambda module, args, out: logits.append(out.detach()))
    collate = CollateFn(T, cfg.target_hidden_size, cfg.num_aux, dtype=torch.float32, preprocess=shift_batch)
    call = dict(num_depths=K, down_sample_ratio=RATIO, down_sample_ratio_min=RATIO_MIN,
                loss_config=resolve_loss_config("kl_div", "eager"))  # fmt: skip

    def their_loss(loss_mask):
        inputs = collate(speculators_samples(batch, torch.ones(cfg.target_hidden_size), loss_mask))
        theirs.zero_grad(set_to_none=True)
        _, loss, _ = theirs(**{k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}, **call)
        return loss

    assert abs(their_loss(None).item() - our_loss.item()) > 1e-3  # their trainer's mask: one token early
    loss = their_loss(eagle31_loss_mask(batch, head))
    loss.backward()
    torch.testing.assert_close(loss.double(), our_loss.double(), rtol=1e-5, atol=1e-6)
    for k in range(K):
        rows = (depth == k) & (anchor < at.numel())  # not their row's padding
        torch.testing.assert_close(
            logits[-1][0, rows], our_logits[k][0, at[anchor[rows]]], rtol=1e-4, atol=1e-5, msg=f"depth {k}"
        )
    grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        if p.requires_grad and name != "lm_head.weight":  # both freeze lm_head
            their_name = name.replace("midlayer.", "layers.0.")
            torch.testing.assert_close(grads[their_name].grad.view_as(p), p.grad, rtol=1e-4, atol=1e-6, msg=name)
    # the one weight only they train: the embedding (PEagleSpeculatorConfig.embed_requires_grad); ours stays the
    # target's, so the mask token's row is the target's embedding of it
    assert theirs.config.embed_requires_grad and grads["embed_tokens.weight"].grad[cfg.mask_token_id].abs().sum() > 0
    assert not ours.embed_tokens.weight.requires_grad


def test_their_draw_keeps_our_share_per_depth_and_needs_the_whole_rollout_supervised(peagle):
    """Their COD sampler against `depth_sampling` on one long row: both keep a share max(0.7^k, 0.2) of depth k
    (theirs an exact count, a random subset of depth k - 1's; ours one uniform per position); theirs keeps a depth-k
    query only where the labels of depths 1..k are all supervised, ours wherever its own label is."""
    from eagle31.loss import depth_sampling, supervision_mask

    n, depths = 20000, 6
    mask = torch.ones(1, n)
    mask[0, 0] = 0  # a row opens with its prompt (a supervised position 0 would give depth 1 an anchor of -1)
    torch.manual_seed(0)
    anchor, depth = peagle.generate_cod_sample_indices(n, mask, num_depths=depths)
    ours = depth_sampling(torch.ones(depths, 1, n, dtype=torch.bool), RATIO, RATIO_MIN, seed=0)
    for k in range(1, depths):
        share = max(RATIO**k, RATIO_MIN)
        assert abs((depth == k).sum().item() / n - share) < 2e-3, k  # an exact count: int((n - k) * share)
        assert abs(ours[k].float().mean().item() - share) < 0.01, k
        kept = set(anchor[depth == k].tolist())
        assert kept <= set(anchor[depth == k - 1].tolist())  # nested: a rollout's depths 1..k-1 are sampled too
    # one unsupervised label in the middle of the row: theirs keeps no query of a rollout through it at a later depth
    gap = n // 2
    mask[0, gap] = 0
    anchor, depth = peagle.generate_cod_sample_indices(n, mask, num_depths=depths)
    label = anchor + depth  # the position whose label a query (anchor, depth) is trained on
    assert not ((depth >= 1) & (anchor < gap) & (label >= gap)).any()
    # ours supervises (p, k) by its own label m[p+2+k] alone: depth 2 at p = gap - 3 trains, depth 1 there does not
    supervised = supervision_mask(mask.long(), torch.zeros(1, n, dtype=torch.long), 3, None)
    assert supervised[2, 0, gap - 3] and not supervised[1, 0, gap - 3]
