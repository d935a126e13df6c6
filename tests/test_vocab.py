"""Draft vocabulary: frequency order, tie-break, padding, offsets, round trip."""

import torch

from eagle31.vocab import build_draft_vocab, count_supervised_tokens, draft_to_target


def test_counts_only_supervised_positions():
    ids = torch.tensor([[1, 2, 2, 3], [3, 3, 0, 1]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 0, 0, 1]])
    assert count_supervised_tokens(ids, mask, 5).tolist() == [0, 1, 2, 2, 0]


def test_most_frequent_kept_ties_to_lower_id_sorted_ascending():
    counts = torch.tensor([0, 5, 3, 5, 1, 3, 0, 9])
    d2t, t2d = build_draft_vocab(counts, 4)
    kept = torch.arange(4) + d2t
    # 7 (9), then 1 and 3 (5 each), then the tie 2 vs 5 (3 each) goes to the lower id 2
    assert kept.tolist() == [1, 2, 3, 7]
    assert d2t.tolist() == [1, 1, 1, 4] and d2t.dtype == torch.int64
    assert t2d.tolist() == [False, True, True, True, False, False, False, True]


def test_pads_with_lowest_unused_ids_when_fewer_were_seen():
    counts = torch.tensor([0, 0, 4, 0, 7, 0])
    d2t, t2d = build_draft_vocab(counts, 4)
    assert (torch.arange(4) + d2t).tolist() == [0, 1, 2, 4]
    assert t2d.sum() == 4


def test_draft_ids_map_onto_exactly_the_target_ids_t2d_marks():
    counts = torch.randint(0, 50, (100,), generator=torch.Generator().manual_seed(0))
    d2t, t2d = build_draft_vocab(counts, 30)
    target = draft_to_target(torch.arange(30), d2t)
    assert torch.equal(target, t2d.nonzero().squeeze(1))
