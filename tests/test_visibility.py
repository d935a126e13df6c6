"""One rule for which keys a query sees (`eagle31.model.Visibility`), and every attention path derives from it.

A new mask is a rule (a `Visibility` subclass or any function of its form) set on the drafter: the toy rules
below live in this file alone, and the reference, the memory-lean kernels (their masks and block bounds), a
sequence shard's query tail and the drafting decoder all follow them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

from eagle31.kernels.causal import NOT_A_BAND, CausalMask
from eagle31.model import Visibility
from eagle31.ttt import ttt_unroll
from tests.eval.test_drafting import proposer_at, unroll_log_probs
from tests.helpers import random_batch, tiny_drafter
from tests.test_reference import DOCS, DRAFTERS, K, PrefixShard, assert_same, logits_and_gradients


@pytest.mark.parametrize("window", [None, 1, 2, 4])
def test_the_rule_is_the_contracts(window):
    """docs/design.md §4: (p, k) sees the step-0 keys of its document up to p and its own chain (p, 1..k); with a
    window W, only the keys at RoPE positions p + k - W + 1 .. p + k, a key (p', s) sitting at p' + s."""
    rule, doc = Visibility(window), [0, 0, 0, 1, 1, 1]
    for p, k, key, s in itertools.product(range(6), range(3), range(6), range(3)):
        expected = doc[p] == doc[key] and (key <= p if s == 0 else key == p and s <= k)
        if window is not None:
            expected = expected and (p + k) - (key + s) < window
        got = rule(torch.tensor(doc[p]), torch.tensor(p), k, torch.tensor(doc[key]), torch.tensor(key), torch.tensor(s))
        assert bool(got) == expected, (p, k, key, s)


@dataclass(frozen=True)
class EveryOtherKey(Visibility):
    """A toy rule that is no band: the step-0 keys at an even distance from the query only."""

    def __call__(self, q_doc, q_pos, q_step, k_doc, k_pos, k_step):
        return super().__call__(q_doc, q_pos, q_step, k_doc, k_pos, k_step) & (
            (k_step > 0) | ((q_pos - k_pos) % 2 == 0)
        )


@dataclass(frozen=True)
class FixedBand(Visibility):
    """A toy band: the 3 step-0 keys up to the query at every step (the built-in window shrinks with the step)."""

    def __call__(self, q_doc, q_pos, q_step, k_doc, k_pos, k_step):
        seen = Visibility()(q_doc, q_pos, q_step, k_doc, k_pos, k_step)
        return seen & ((k_step > 0) | (q_pos - k_pos < 3))


def test_the_kernels_read_the_rules_band_from_the_rule():
    assert CausalMask(Visibility(), 2).reach(50) is None
    assert [CausalMask(Visibility(6), k).reach(50) for k in range(3)] == [6, 5, 4]
    assert [CausalMask(FixedBand(), k).reach(50) for k in range(3)] == [3, 3, 3]
    assert CausalMask(EveryOtherKey(), 0).reach(50) == NOT_A_BAND
    with pytest.raises(ValueError, match="leaves a query at TTT step 2 no step-0 key"):
        CausalMask(Visibility(2), 2).reach(50)


@pytest.mark.parametrize("rule", [EveryOtherKey(), FixedBand()], ids=["every-other-key", "fixed-band"])
@pytest.mark.parametrize("name", ["llama", "mla"])
def test_a_new_rule_reaches_every_attention_path(rule, name):
    drafter = tiny_drafter(seed=7, **DRAFTERS[name])
    aux, _, ids, _ = random_batch(drafter.config, 2, 15, seed=8)
    default = drafter.unroll(aux, ids, ttt_length=K, document_ids=DOCS).states
    drafter.visibility = rule
    expected = logits_and_gradients(drafter, lambda d: d.unroll(aux, ids, ttt_length=K, document_ids=DOCS).states)
    assert not torch.allclose(expected[0], torch.stack([drafter.lm_head(s) for s in default]).detach())
    # the memory-lean kernels (auto: flash for a band, blockwise otherwise)
    kernels = ["auto", "blockwise"] + (["flash"] if isinstance(rule, FixedBand) else [])
    for kernel in kernels:

        def run(d, kernel=kernel):
            out = ttt_unroll(
                d, aux, ids, ttt_length=K, document_ids=DOCS, attention_kernel=kernel, activation_checkpointing=True
            )
            return out.states

        assert_same(logits_and_gradients(drafter, run), expected)
    # a sequence shard's query tail
    rows = slice(9, None)
    shard = logits_and_gradients(
        drafter,
        lambda d: ttt_unroll(d, aux[:, rows], ids[:, rows], ttt_length=K, sequence=PrefixShard(d, aux, ids, 9)).states,
    )
    tail = logits_and_gradients(
        drafter, lambda d: d.unroll(aux, ids, ttt_length=K, document_ids=DOCS, first_query=9).states
    )
    assert_same(shard, tail, rows)
    # the drafting decoder: each chain step's log-probs are the reference's at the same query
    with torch.no_grad():
        prop = proposer_at(drafter, aux[1], ids[1], 10)
        drafts = prop.draft_chain(K).tolist()
        logp = unroll_log_probs(drafter, aux[1], ids[1], 10, drafts[:-1])
    assert drafter.draft_to_target(logp.argmax(-1)).tolist() == drafts


def test_the_flash_kernels_refuse_a_rule_that_is_no_band():
    drafter = tiny_drafter(seed=9)
    drafter.visibility = EveryOtherKey()
    aux, _, ids, _ = random_batch(drafter.config, 1, 8, seed=10)
    with pytest.raises(ValueError, match="this visibility rule needs blockwise"):
        ttt_unroll(drafter, aux, ids, ttt_length=2, attention_kernel="flash")
