"""The drafter at inference against the reference unroll (eagle31/model.py, docs/design.md §4).

Every proposal of `EagleProposer` must be the argmax (chain) or top-k (tree) of
the training unroll's logits at the same query, with the drafted tokens fed to
the unroll as its teacher-forced tokens.
"""

import pytest
import torch

from benchmarks.drafting_parity import chain_and_unroll_logits, kimi_llama_drafter
from eagle31.eval.drafting import DraftTree, EagleProposer, TreeSpec
from tests.helpers import random_batch, tiny_drafter

T = 12  # context tokens available to the tests


def unroll_log_probs(drafter, aux, ids, n, path):
    """Log-probs [len(path)+1, Vd] of queries (n-1, j), j = 0..len(path), teacher-forced on `path`.

    The context is positions 0..n-1 (aux[:n], tokens ids[:n+1]); the drafted tokens
    `path` are x[n+1], x[n+2], ... Positions >= n carry no step-0 key the query sees.
    """
    d = len(path)
    tokens = torch.cat([ids[: n + 1], torch.tensor(path, dtype=torch.long)])[None]  # [1, n+1+d]
    feats = torch.cat([aux[:n], torch.zeros(1 + d, aux.shape[-1], dtype=aux.dtype)])[None]
    out = drafter.unroll(feats, tokens, ttt_length=d + 1)
    return torch.stack([drafter.lm_head(s[0, n - 1]).log_softmax(-1) for s in out.states])


def context(cfg, seed=0):
    aux, _, ids, _ = random_batch(cfg, 1, T, seed=seed)
    return aux[0], ids[0]


def proposer_at(drafter, aux, ids, n, chunks=(None,)):
    """A proposer that has seen positions 0..n-1, extended in the given chunk sizes."""
    prop = EagleProposer(drafter)
    start = 0
    for size in chunks:
        stop = n if size is None else start + size
        prop.extend(aux[start:stop], ids[start + 1 : stop + 1])
        start = stop
    assert prop.length == n
    return prop


def test_first_draft_is_the_argmax_of_training_step_0():
    m = tiny_drafter()
    aux, ids = context(m.config)
    out = m.unroll(aux[None], ids[None], ttt_length=1)
    step0 = m.draft_to_target(m.lm_head(out.states[0][0]).argmax(-1))  # [T] proposal at every position
    for n in (1, 4, T - 1):
        prop = proposer_at(m, aux, ids, n)
        assert prop.draft_chain(1).tolist() == [step0[n - 1].item()]
        torch.testing.assert_close(m.norm(prop.root[0, 0]), out.states[0][0, n - 1])


def test_extending_in_pieces_equals_one_prefill():
    m = tiny_drafter()
    aux, ids = context(m.config)
    whole = proposer_at(m, aux, ids, 9)
    pieces = proposer_at(m, aux, ids, 9, chunks=(4, 1, 3, 1))
    torch.testing.assert_close(pieces.keys, whole.keys)
    torch.testing.assert_close(pieces.values, whole.values)
    torch.testing.assert_close(pieces.root, whole.root)


@pytest.mark.parametrize("norm_output", [True, False])
def test_chain_follows_the_training_unroll(norm_output):
    m = tiny_drafter(norm_output=norm_output)
    flipped = tiny_drafter(norm_output=not norm_output)  # same weights, other switch
    aux, ids = context(m.config)
    k = 5
    differs = False
    for n in (2, 6):
        drafts = proposer_at(m, aux, ids, n).draft_chain(k).tolist()
        logp = unroll_log_probs(m, aux, ids, n, drafts[:-1])
        assert m.draft_to_target(logp.argmax(-1)).tolist() == drafts
        other = unroll_log_probs(flipped, aux, ids, n, drafts[:-1])
        differs |= flipped.draft_to_target(other.argmax(-1)).tolist() != drafts
    assert differs, "the test must tell norm_output on from off"


@pytest.mark.parametrize(
    "n", [11, pytest.param(4100, marks=pytest.mark.slow)]
)  # 4100: past the 4096 original positions
def test_chain_logits_are_the_training_unrolls_on_kimis_yarn_rope(n):
    """The Llama drafter of the miniature Kimi K2.6 on Kimi's yarn rope (factor 64, at 1.416): drafting and the
    training unroll compute the same function, so in fp64 their logits agree to rounding at every depth.

    In fp32 they differ by rounding alone: the attention sums its keys in another order (SDPA in
    drafting, the fused kernel in training) and each step reads the one before, so the gap grows
    with the depth, and a little with the context (benchmarks/results/drafting_parity.md, worst of 5
    random drafters, logits up to ~35: 2e-5 to 8e-5 at depth 1, 6e-4 to 3e-3 at depth 3; at
    depth 4 7e-4 to 8e-4 for n = 16 and 256, 5e-3 to 1.3e-2 for n = 2048 and 8192; which drafter is
    drawn moves one gap more than a hundredfold). The same comparisons in fp64 stay below 2e-11,
    about 1e-9 times as far, as fp64's epsilon is to fp32's: rounding, not a difference in what is
    computed. The gap repeats bit for bit at every change to either forward since the Llama drafter
    took Kimi's yarn at 1.416, the memory work included. fp32 is held to 1e-3 of the largest logit,
    twice the worst relative gap measured there.
    """
    for dtype, tolerance in ((torch.float64, 1e-10), (torch.float32, 1e-3)):
        drafted, unrolled = chain_and_unroll_logits(kimi_llama_drafter(0, dtype), n, depth=4)
        gap = (drafted - unrolled).abs().amax(dim=-1) / unrolled.abs().max()
        assert (gap < tolerance).all(), f"{dtype}: max |logit difference| / largest logit per depth {gap.tolist()}"


def test_tree_with_top_k_1_is_the_chain():
    m = tiny_drafter()
    aux, ids = context(m.config)
    prop = proposer_at(m, aux, ids, 7)
    chain = prop.draft_chain(4)
    tree = prop.draft_tree(TreeSpec(top_k=1, depth=4, total_tokens=4))
    assert tree.tokens.tolist() == chain.tolist()
    assert tree.is_chain()


def tree_paths(tree: DraftTree):
    parents = tree.parents.tolist()
    tokens = tree.tokens.tolist()

    def path(i):
        return [] if i < 0 else path(parents[i]) + [tokens[i]]

    return [path(i) for i in range(len(tree))]


@pytest.mark.parametrize("norm_output", [True, False])
def test_tree_expands_and_reranks_like_eagle2(norm_output):
    """Full tree: each expanded node's children are the top-k of the unroll at that node;
    a smaller budget keeps the nodes of highest cumulative log-probability."""
    m = tiny_drafter(norm_output=norm_output)
    aux, ids = context(m.config)
    n, top_k, depth = 5, 3, 3
    prop = proposer_at(m, aux, ids, n)
    full = prop.draft_tree(TreeSpec(top_k=top_k, depth=depth, total_tokens=10_000))
    assert len(full) == top_k + (depth - 1) * top_k * top_k
    paths = tree_paths(full)
    parents = full.parents.tolist()
    assert all(p < i for i, p in enumerate(parents))
    scores = []
    for i, path in enumerate(paths):
        logp = unroll_log_probs(m, aux, ids, n, path)  # step j scores the token after path[:j]
        draft_ids = torch.arange(m.config.draft_vocab_size) + m.d2t
        scores.append(sum(logp[j][draft_ids == t].item() for j, t in enumerate(path)))
        children = sorted(full.tokens[c].item() for c, p in enumerate(parents) if p == i)
        if children:  # an expanded node: its children are the top-k after its path
            assert children == sorted(m.draft_to_target(logp[-1].topk(top_k).indices).tolist())
    roots = sorted(full.tokens[c].item() for c, p in enumerate(parents) if p == -1)
    assert roots == sorted(m.draft_to_target(unroll_log_probs(m, aux, ids, n, [])[0].topk(top_k).indices).tolist())
    # each level expands the top_k nodes of that level
    depths = full.depths()
    for level in range(1, depth):
        at_level = [i for i in range(len(full)) if depths[i] == level]
        expanded = {p for p in parents if p >= 0 and depths[p] == level}
        best = sorted(at_level, key=lambda i: -scores[i])[:top_k]
        assert expanded == set(best)
    budget = 7
    small = prop.draft_tree(TreeSpec(top_k=top_k, depth=depth, total_tokens=budget))
    best_paths = sorted(range(len(full)), key=lambda i: -scores[i])[:budget]
    assert sorted(map(tuple, tree_paths(small))) == sorted(tuple(paths[i]) for i in best_paths)
    assert all(p < i for i, p in enumerate(small.parents.tolist()))


def test_tree_masks_and_depths():
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, -1, 0, 2]))
    assert tree.depths().tolist() == [1, 1, 2, 3]
    assert not tree.is_chain()
    mask = tree.ancestor_mask()  # rows/cols: root, nodes 0..3
    assert mask[4].tolist() == [True, True, False, True, True]
    assert mask[2].tolist() == [True, False, True, False, False]
    assert DraftTree.chain(torch.tensor([1, 2, 3])).is_chain()


def test_bad_tree_spec_and_drafting_before_context():
    with pytest.raises(ValueError, match="tree.depth"):
        TreeSpec(top_k=2, depth=0, total_tokens=4)
    m = tiny_drafter()
    with pytest.raises(RuntimeError, match="extend"):
        EagleProposer(m).draft_chain(2)
    aux, ids = context(m.config)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        proposer_at(m, aux, ids, 3).draft_tree(TreeSpec(top_k=1000, depth=2, total_tokens=4))


# ---------------------------------------------------------------------------- sliding window

W = 4  # shorter than most contexts below: the window cuts the cache


def test_a_windowed_chain_follows_the_windowed_training_unroll():
    """The KV cache attended with the window, at every draft depth, equals the training unroll with it."""
    m = tiny_drafter(sliding_window=W)
    full = tiny_drafter()  # same weights, full attention
    aux, ids = context(m.config)
    differs = False
    for n in (2, 6, T - 1):
        prop = proposer_at(m, aux, ids, n, chunks=(None,) if n < 6 else (3, 2, None))
        drafts = prop.draft_chain(W).tolist()
        logp = unroll_log_probs(m, aux, ids, n, drafts[:-1])
        assert m.draft_to_target(logp.argmax(-1)).tolist() == drafts, n
        differs |= full.draft_to_target(unroll_log_probs(full, aux, ids, n, drafts[:-1]).argmax(-1)).tolist() != drafts
    assert differs, "the test must tell the window from full attention"


def test_a_windowed_tree_expands_each_node_as_the_windowed_unroll():
    """Each expanded node's children are the top-k of the windowed unroll after its path (tree attention with
    the window over the nodes' positions); full attention would have chosen other children somewhere."""
    m = tiny_drafter(sliding_window=W)
    full = tiny_drafter()
    aux, ids = context(m.config)
    top_k, depth = 3, 4

    def top(d, n, path):  # the top_k draft tokens after `path` from position n, as target ids, sorted
        return sorted(d.draft_to_target(unroll_log_probs(d, aux, ids, n, path)[-1].topk(top_k).indices).tolist())

    differs = False
    for n in (7, T - 1):
        tree = proposer_at(m, aux, ids, n).draft_tree(TreeSpec(top_k=top_k, depth=depth, total_tokens=10_000))
        parents = tree.parents.tolist()
        for i, path in enumerate(tree_paths(tree)):
            children = sorted(tree.tokens[c].item() for c, p in enumerate(parents) if p == i)
            if children and len(path) > 1:  # a node below the first level: its query sees draft keys too
                assert children == top(m, n, path), (n, path)
                differs |= children != top(full, n, path)
    assert differs, "the test must tell the window from full attention"
