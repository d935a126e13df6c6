"""Every fast path against the reference drafter (eagle31/model.py, the spec).

The spec's unroll keeps every step's keys and scores; the memory-lean unroll (eagle31/ttt.py) attends through
the kernels (flash, blockwise), keeps MLA's latents instead of keys, remakes Llama's chain keys from the step
inputs and recomputes steps under activation checkpointing; a sequence shard attends the keys before it through
the query tail. Each must give the spec's logits and gradients in fp64. The drafting decoder is held to the spec
in tests/eval/test_drafting.py, the spec to naive Python loops in tests/test_ttt.py and tests/test_mla.py.
"""

from __future__ import annotations

import pytest
import torch

from eagle31.model import segment_ids
from eagle31.sequence_parallel.query_tail import QueryTail
from eagle31.ttt import step_entry, ttt_unroll
from tests.helpers import random_batch, tiny_drafter
from tests.test_mla import MLAConfig

K = 3
MLA = dict(attention="mla", num_key_value_heads=4, head_dim=10, mla=MLAConfig(8, 8, 6, 4, 5))
DRAFTERS = {
    "llama": {},
    "llama-parallel": dict(parallel_drafting=True, mask_token_id=5),
    "mla": MLA,
    "llama-window": dict(sliding_window=4),
    "mla-norm_output-off": {**MLA, "norm_output": False},
}
DOCS = torch.tensor([[0] * 6 + [1] * 7 + [-1] * 2, [0] * 12 + [-1] * 3])  # packed documents, padding


def logits_and_gradients(drafter, run) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """run(drafter) -> per-step states; the logits [K, B, T, Vd] and the gradients of a fixed weighting of them."""
    drafter.zero_grad()
    logits = torch.stack([drafter.lm_head(s) for s in run(drafter)])
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0), dtype=logits.dtype)
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def assert_same(got, expected, rows=slice(None)):
    (a, ga), (b, gb) = got, expected
    real = (DOCS >= 0)[:, rows]
    torch.testing.assert_close(a[:, real], b[:, real], rtol=1e-9, atol=1e-10)
    assert ga.keys() == gb.keys()
    for name in gb:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-8, atol=1e-10, msg=name)


@pytest.mark.parametrize("kernel", ["flash", "blockwise"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_the_memory_lean_unroll_is_the_reference(name, kernel, checkpointing, monkeypatch):
    """Blocks of 3 chain rows and 4 MLP rows, so the blocked paths run more than once."""
    import eagle31.kernels.causal
    import eagle31.ttt

    drafter = tiny_drafter(seed=3, **DRAFTERS[name])
    c = drafter.config
    monkeypatch.setattr(eagle31.kernels.causal, "BLOCK_BUDGET", 3 * c.num_attention_heads * c.qk_head_dim)
    monkeypatch.setattr(eagle31.ttt, "FEED_FORWARD_BUDGET", 4 * c.intermediate_size)
    aux, _, ids, _ = random_batch(c, 2, 15, seed=4)
    expected = logits_and_gradients(drafter, lambda d: d.unroll(aux, ids, ttt_length=K, document_ids=DOCS).states)
    fast = logits_and_gradients(
        drafter,
        lambda d: (
            ttt_unroll(
                d,
                aux,
                ids,
                ttt_length=K,
                document_ids=DOCS,
                attention_kernel=kernel,
                activation_checkpointing=checkpointing,
            ).states
        ),
    )
    assert_same(fast, expected)


class PrefixShard:
    """A sequence shard in one process (`ttt_unroll`'s `sequence`): positions `start`.. are this shard's, the
    step-0 entries of those before it are made as the rank before it makes them, and gathered in front of its own."""

    def __init__(self, drafter, aux, ids, start: int):
        B, T = ids.shape
        self.start, self.key_segments = start, segment_ids(DOCS, None, (B, T))
        positions = torch.arange(start).expand(B, start)
        _, self.before, _ = step_entry(drafter, drafter.fuse_aux(aux[:, :start]), ids[:, 1 : start + 1], positions)

    def gather(self, entry):
        return tuple(torch.cat([b, e], dim=1) for b, e in zip(self.before, entry, strict=True))


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_a_sequence_shard_is_the_reference_at_its_positions(name, monkeypatch):
    """The query tail's keys before the shard in blocks of 2 positions; documents cross the shard's edge."""
    monkeypatch.setattr(QueryTail, "prefix_block", staticmethod(lambda nh, d: 2))
    drafter = tiny_drafter(seed=5, **DRAFTERS[name])
    aux, _, ids, _ = random_batch(drafter.config, 2, 15, seed=6)
    start, rows = 9, slice(9, None)
    expected = logits_and_gradients(
        drafter, lambda d: d.unroll(aux, ids, ttt_length=K, document_ids=DOCS, first_query=start).states
    )
    shard = logits_and_gradients(
        drafter,
        lambda d: (
            ttt_unroll(
                d,
                aux[:, rows],
                ids[:, rows],
                ttt_length=K,
                attention_kernel="flash",
                sequence=PrefixShard(d, aux, ids, start),
            ).states
        ),
    )
    assert_same(shard, expected, rows)
