"""Speculative decoding with a tiny random Llama target.

Lossless (chain and tree, real drafter and oracles, a Llama and an MLA/MoE
target), the oracles' acceptance lengths, EOS, chain == tree at top-k 1, the
drafter's cache after decoding equal to one built from the target's own features
of the final sequence, and replay from a greedy trace equal to live decoding.
"""

import itertools

import pytest
import torch

from eagle31.eval.drafting import DraftTree, EagleProposer, TreeSpec
from eagle31.eval.speculative import accepted_path, greedy_trace, speculative_generate
from tests.helpers import tiny_drafter
from tests.speculative_helpers import AUX, VOCAB, Oracle, naive_greedy
from tests.tiny_targets import VOCAB as DS_VOCAB
from tests.tiny_targets import drafter_sized_llama, tiny_deepseek_v3

NEW = 14  # tokens generated per prompt


@pytest.fixture(scope="module")
def target():
    return drafter_sized_llama()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 11)]


def generate(target, proposer, prompt, mode, k=3):
    tree = TreeSpec(top_k=3, depth=k, total_tokens=8) if mode == "tree" else None
    return speculative_generate(
        target, proposer, prompt, aux_layer_ids=AUX, max_new_tokens=NEW, k=None if tree else k, tree=tree
    )


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_lossless_with_the_drafter(target, prompts, mode):
    drafter = tiny_drafter(vocab_size=VOCAB, dtype=torch.float64)
    for prompt in prompts:
        out = generate(target, EagleProposer(drafter), prompt, mode)
        assert out.tokens == naive_greedy(target, prompt, NEW)[prompt.numel() :].tolist()
        assert out.target_forwards == 1 + len(out.accepted)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_lossless_with_every_acceptance_length(target, prompts, mode):
    k = 3
    for prompt in prompts:
        ref = naive_greedy(target, prompt, NEW + k + 1)
        out = generate(target, Oracle(ref, good=lambda r, k: r % (k + 1)), prompt, mode, k)
        assert out.tokens == ref[prompt.numel() : prompt.numel() + NEW].tolist()
        assert out.accepted[: k + 1] == [0, 1, 2, 3]


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_oracle_acceptance_lengths(target, prompts, mode):
    k = 4
    prompt = prompts[0]
    ref = naive_greedy(target, prompt, NEW + k + 1)
    right = generate(target, Oracle(ref), prompt, mode, k)
    assert right.accepted and all(a == k for a in right.accepted)  # tau = k + 1
    wrong = generate(target, Oracle(ref, good=lambda r, k: 0), prompt, mode, k)
    assert all(a == 0 for a in wrong.accepted)  # tau = 1
    assert len(wrong.accepted) == NEW - 1  # one token per verification, after the prefill's


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_lossless_on_an_mla_moe_target(mode):
    """DeepSeek-V3 / Kimi layout: MLA attention (its own cache shapes) and routed experts."""
    target = tiny_deepseek_v3()
    prompt = torch.randint(0, DS_VOCAB, (7,), generator=torch.Generator().manual_seed(2))
    ref = naive_greedy(target, prompt, NEW + 4)
    tree = TreeSpec(top_k=2, depth=3, total_tokens=6) if mode == "tree" else None
    out = speculative_generate(
        target,
        Oracle(ref, good=lambda r, k: r % (k + 1), vocab=DS_VOCAB),
        prompt,
        aux_layer_ids=(1, 2, 3),
        max_new_tokens=NEW,
        k=None if tree else 3,
        tree=tree,
    )
    assert out.tokens == ref[prompt.numel() : prompt.numel() + NEW].tolist()
    assert out.accepted[:4] == [0, 1, 2, 3]


def test_chain_and_tree_agree_at_top_k_1(target, prompts):
    drafter = tiny_drafter(vocab_size=VOCAB, dtype=torch.float64)
    for prompt in prompts:
        chain = speculative_generate(target, EagleProposer(drafter), prompt, aux_layer_ids=AUX, max_new_tokens=NEW, k=3)
        tree = speculative_generate(
            target,
            EagleProposer(drafter),
            prompt,
            aux_layer_ids=AUX,
            max_new_tokens=NEW,
            tree=TreeSpec(top_k=1, depth=3, total_tokens=3),
        )
        assert (chain.tokens, chain.accepted) == (tree.tokens, tree.accepted)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_drafter_cache_holds_step0_keys_of_the_target_features(target, prompts, mode):
    """After decoding, the cache equals one built from the final sequence's target features:
    keys written while drafting never survive verification."""
    drafter = tiny_drafter(vocab_size=VOCAB, dtype=torch.float64)
    prompt = prompts[1]
    live = EagleProposer(drafter)
    generate(target, live, prompt, mode)
    seq = naive_greedy(target, prompt, NEW + 4)
    n = live.length
    with torch.no_grad():
        hidden = target(seq[None, :n], output_hidden_states=True).hidden_states
    aux = torch.cat([hidden[i][0] for i in AUX], dim=-1)  # independent of eagle31's capture hooks
    fresh = EagleProposer(drafter)
    fresh.extend(aux, seq[1 : n + 1])
    torch.testing.assert_close(live.keys, fresh.keys)
    torch.testing.assert_close(live.values, fresh.values)
    torch.testing.assert_close(live.root, fresh.root)


def test_accepted_path_follows_the_targets_choices():
    tree = DraftTree(torch.tensor([7, 8, 9, 3, 4]), torch.tensor([-1, -1, 1, 1, 3]))
    # greedy[0] after the root, greedy[1 + i] after node i
    assert accepted_path(tree, torch.tensor([8, 0, 3, 0, 4, 5])) == [1, 3, 4]
    assert accepted_path(tree, torch.tensor([8, 0, 9, 0, 4, 5])) == [1, 2]
    assert accepted_path(tree, torch.tensor([5, 0, 0, 0, 0, 0])) == []


def test_needs_exactly_one_drafting_mode(target, prompts):
    with pytest.raises(ValueError, match="exactly one"):
        speculative_generate(target, Oracle(None), prompts[0], aux_layer_ids=AUX, max_new_tokens=4)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_stops_at_eos(target, prompts, mode):
    k, prompt = 3, prompts[0]
    ref = naive_greedy(target, prompt, NEW + k + 1)
    generated = ref[prompt.numel() :].tolist()
    eos = generated[6]
    expected = generated[: generated.index(eos) + 1]
    tree = TreeSpec(top_k=2, depth=k, total_tokens=6) if mode == "tree" else None
    out = speculative_generate(
        target,
        Oracle(ref),
        prompt,
        aux_layer_ids=AUX,
        max_new_tokens=NEW,
        k=None if tree else k,
        tree=tree,
        eos_token_ids=[eos],
    )
    assert out.tokens == expected
    assert 1 + sum(a + 1 for a in out.accepted) - len(expected) <= k  # no round after the one with eos


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_replay_from_a_greedy_trace_equals_live_decoding(target, prompts, mode):
    """Tokens, accepted lengths and target forwards; with an EOS mid-way, and a trace just long enough."""
    drafter = tiny_drafter(vocab_size=VOCAB, dtype=torch.float64)
    k = 3
    tree = TreeSpec(top_k=3, depth=k, total_tokens=8) if mode == "tree" else None
    for prompt in prompts:
        trace = greedy_trace(target, prompt, aux_layer_ids=AUX, length=NEW + k)
        assert trace.tokens.tolist() == naive_greedy(target, prompt, NEW + k + 1).tolist()
        eos = [trace.continuation[9]]
        proposers = (
            lambda: EagleProposer(drafter),
            lambda trace=trace: Oracle(trace.tokens, good=lambda r, k: r % (k + 1)),
        )
        for (name, make), stop in itertools.product(enumerate(proposers), ([], eos)):
            kwargs = dict(max_new_tokens=NEW, k=None if tree else k, tree=tree, eos_token_ids=stop)
            live = speculative_generate(target, make(), prompt, aux_layer_ids=AUX, **kwargs)
            replayed = speculative_generate(trace, make(), prompt, aux_layer_ids=None, **kwargs)
            assert (replayed.tokens, replayed.accepted, replayed.target_forwards) == (
                live.tokens,
                live.accepted,
                live.target_forwards,
            )
            if name == 1 and not stop:
                assert replayed.accepted[:4] == [0, 1, 2, 3]  # the oracle's accepted lengths reach the replay


def test_replay_refuses_another_prompt_and_a_short_trace(target, prompts):
    trace = greedy_trace(target, prompts[0], aux_layer_ids=AUX, length=4)
    with pytest.raises(ValueError, match="another prompt"):
        speculative_generate(trace, Oracle(None), prompts[1], aux_layer_ids=None, max_new_tokens=4, k=2)
    with pytest.raises(ValueError, match="the trace ends"):
        speculative_generate(trace, Oracle(trace.tokens), prompts[0], aux_layer_ids=None, max_new_tokens=NEW, k=3)
