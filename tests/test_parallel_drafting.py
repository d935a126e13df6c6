"""Parallel drafting (P-EAGLE): the mask slots, their training recipe, export and drafting, as vLLM serves them.

The memory-lean unroll and a sequence shard are held to the reference in tests/test_reference.py (its
`llama-parallel` drafter); vLLM's own config code reads the exports in tests/export/test_vllm_peers.py and a real
vLLM serves one in tests/benchmarks/test_vllm_serving.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from eagle31.config import DrafterConfig
from eagle31.convert import load_drafter
from eagle31.errors import ConfigError
from eagle31.eval.acceptance import check_drafting
from eagle31.export import export_drafter
from eagle31.loss import depth_sampling, step_scales, weighted_loss
from tests.eval.test_drafting import context, proposer_at, unroll_log_probs
from tests.helpers import random_batch, tiny_drafter
from tests.test_mla import mla_config

PARALLEL = dict(parallel_drafting=True, mask_token_id=5)


def test_a_later_step_reads_the_mask_slot_not_the_teacher_tokens_or_the_previous_output():
    """Step k >= 1 at p reads the mask token and fuse_aux(mask_hidden) at p + k: what follows position p + 1 in the
    row changes none of p's queries, and the slot's state is learned (mask_hidden gets a gradient)."""
    d = tiny_drafter(seed=1, **PARALLEL)
    aux, _, ids, _ = random_batch(d.config, 1, 12, seed=2)
    p = 5
    changed_ids, changed_aux = ids.clone(), aux.clone()
    changed_ids[:, p + 2 :] = (ids[:, p + 2 :] + 1) % d.config.vocab_size
    changed_aux[:, p + 1 :] += 1.0
    a = d.unroll(aux, ids, ttt_length=4).states
    b = d.unroll(changed_aux, changed_ids, ttt_length=4).states
    for k in range(4):
        torch.testing.assert_close(a[k][:, p], b[k][:, p], rtol=0, atol=0)
    chain = tiny_drafter(seed=1)  # the same weights as a chain drafter: its later steps read the teacher tokens
    assert not torch.allclose(chain.unroll(aux, ids, ttt_length=2).states[1][:, p], a[1][:, p])
    sum(s.sum() for s in a).backward()
    assert d.mask_hidden.grad is not None and d.mask_hidden.grad.abs().sum() > 0


def test_the_drafting_decoder_drafts_a_round_in_one_forward_as_the_reference_unrolls_it():
    d = tiny_drafter(seed=3, **PARALLEL)
    aux, ids = context(d.config, seed=1)
    for n in (1, 4, 11):
        prop = proposer_at(d, aux, ids, n)
        drafts = prop.draft_chain(4).tolist()
        logp = unroll_log_probs(d, aux, ids, n, [0, 0, 0])  # the slots read no teacher token: any path
        assert d.draft_to_target(logp.argmax(-1)).tolist() == drafts, n
    with pytest.raises(ValueError, match="a parallel drafter drafts its k tokens in one forward, not trees"):
        from eagle31.eval.drafting import TreeSpec

        proposer_at(d, aux, ids, 4).draft_tree(TreeSpec(2, 2, 3))


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_an_export_carries_the_mask_token_and_mask_hidden_and_reads_back_exactly(fmt, tmp_path):
    d = tiny_drafter(seed=4, dtype=torch.float32, **PARALLEL)
    out = export_drafter(d, tmp_path / fmt, fmt, dtype="float32", target_name_or_path="org/target")
    config = json.loads((out / "config.json").read_text())
    assert config["mask_token_id"] == config["pard_token"] == 5  # 0.33 reads the first, 0.22 the second
    if fmt == "speculators":
        assert config["speculators_model_type"] == "peagle" and config["architectures"] == ["PEagleSpeculator"]
    back = load_drafter(out)
    back.embed_tokens.weight.data.copy_(d.embed_tokens.weight)
    assert back.config.parallel_drafting and back.config.mask_token_id == 5
    torch.testing.assert_close(back.mask_hidden, d.mask_hidden, rtol=0, atol=0)
    aux, _, ids, _ = random_batch(d.config, 1, 9, seed=5, dtype=torch.float32)
    for a, b in zip(d(aux, ids, ttt_length=3), back(aux, ids, ttt_length=3), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_chain_export_carries_no_mask_slot(tmp_path):
    out = export_drafter(tiny_drafter(seed=4, dtype=torch.float32), tmp_path / "chain", "eagle3", dtype="float32")
    from safetensors.torch import load_file

    assert "mask_hidden" not in load_file(out / "model.safetensors")
    assert not {"mask_token_id", "pard_token"} & set(json.loads((out / "config.json").read_text()))


def test_what_nothing_serves_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="vLLM serves an MLA drafter without parallel drafting"):
        DrafterConfig(**mla_config(parallel_drafting=True, mask_token_id=1))
    with pytest.raises(ConfigError, match="drafter.mask_token_id must be a token id below vocab_size=40, got 40"):
        tiny_drafter(parallel_drafting=True, mask_token_id=40)
    with pytest.raises(ConfigError, match="drafter d is a parallel drafter: it cannot draft with drafting=chain"):
        check_drafting(tiny_drafter(**PARALLEL).config, "chain", "d")
    with pytest.raises(ConfigError, match="drafter d is a chain drafter: it cannot draft with drafting=parallel"):
        check_drafting(tiny_drafter().config, "parallel", "d")


def test_the_mask_token_is_the_targets_pad_token_unless_set():
    target = {"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 16, "num_attention_heads": 4,
              "intermediate_size": 24, "vocab_size": 40, "pad_token_id": 3, "eos_token_id": 2}  # fmt: skip
    assert DrafterConfig.from_target_config(target, parallel_drafting=True).mask_token_id == 3
    assert DrafterConfig.from_target_config({**target, "pad_token_id": None}, parallel_drafting=True).mask_token_id == 2
    assert DrafterConfig.from_target_config(target, parallel_drafting=True, mask_token_id=9).mask_token_id == 9
    assert DrafterConfig.from_target_config(target).mask_token_id is None  # a chain drafter has none


def test_depth_sampling_keeps_p_eagles_share_of_each_depth_nested_and_the_same_on_every_shard():
    K, T = 6, 20000
    supervised = torch.ones(K, 1, T, dtype=torch.bool)
    kept = depth_sampling(supervised, 0.7, 0.2, seed=3)
    shares = kept.float().mean(dim=(1, 2))
    expected = torch.tensor([1.0] + [max(0.7**k, 0.2) for k in range(1, K)])
    torch.testing.assert_close(shares, expected, rtol=0, atol=0.015)
    assert (kept[1:] <= kept[:-1]).all()  # kept at depth k: kept at k - 1 (P-EAGLE's nested draws)
    shard = depth_sampling(supervised[:, :, 7000:12000], 0.7, 0.2, seed=3, start=7000)  # a sequence shard's rows
    assert torch.equal(shard, kept[:, :, 7000:12000])
    assert not torch.equal(depth_sampling(supervised, 0.7, 0.2, seed=4), kept)  # another step draws anew
    assert torch.equal(depth_sampling(supervised & False, 0.7, 0.2, seed=3), supervised & False)  # only supervised


def test_no_decay_is_one_mean_over_every_steps_queries():
    counts, sums = torch.tensor([10.0, 6.0, 4.0]), torch.tensor([5.0, 3.0, 4.0])
    torch.testing.assert_close(step_scales(counts, None), torch.full((3,), 1 / 20, dtype=torch.float64))
    assert float(weighted_loss(sums, counts, None)) == pytest.approx(12 / 20)
