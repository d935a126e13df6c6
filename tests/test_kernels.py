"""The TTT attention kernels (`eagle31/kernels/`) against the explicit-scores reference.

Every fused path — PyTorch's flash kernel (CPU: per document; CUDA: one varlen call) and the
blockwise kernel — must give the reference's output and the gradients of q, the step-0 keys and
values and every chain key and value, over packed documents, padding, GQA and chain lengths
j = 0..3. On CPU in fp64 (tight); the GPU twin runs the same cases in bf16 at the drafter
shapes of the Kimi K2.6 and Llama 3.1 8B recipes (heads x head_dim 64 x 128 and 32/8 x 128, read
from the recipes).
"""

from __future__ import annotations

import itertools
from functools import partial

import pytest
import torch

import eagle31.kernels.causal
from eagle31.attention.mla import mla_keys_values
from eagle31.kernels.causal import CausalMask, resolve_backend
from eagle31.kernels.entries import ChainKeysValues
from eagle31.kernels.ttt_attention import reference_attention, ttt_attention, ttt_attention_of_entries
from eagle31.model import Visibility, segment_ids
from eagle31.sequence_parallel.query_tail import QueryTail

CUDA = torch.cuda.is_available()

# document ids of one or two rows: one document; three packed; packed then padding (-1)
LAYOUTS = {
    "one_document": [[0] * 24],
    "packed": [[0] * 7 + [1] * 12 + [2] * 5],
    "padded_rows": [[0] * 10 + [1] * 9 + [-1] * 5, [0] * 20 + [-1] * 4],
}


def attention_inputs(
    doc, nh: int, nkv: int, d: int, j: int, dtype, device="cpu", seed: int = 0, d_v: int | None = None
):
    """(q, k0, v0, chain_k, chain_v, segments, dout) of one TTT step with `j` chain keys; values d_v wide (default
    d)."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(doc), len(doc[0])
    d_v = d_v or d

    def rand(heads, dim=d):
        return torch.randn(B, T, heads, dim, generator=g).to(device, dtype)

    q, k0, v0 = rand(nh), rand(nkv), rand(nkv, d_v)
    chain_k, chain_v = [rand(nkv) for _ in range(j)], [rand(nkv, d_v) for _ in range(j)]
    segments = segment_ids(torch.tensor(doc, device=device), None, (B, T), device=device)
    return q, k0, v0, chain_k, chain_v, segments, rand(nh, d_v)


def output_and_grads(backend: str, q, k0, v0, chain_k, chain_v, segments, dout) -> list[torch.Tensor]:
    leaves = [x.detach().clone().requires_grad_() for x in (q, k0, v0, *chain_k, *chain_v)]
    j = len(chain_k)
    q, k0, v0, chain = leaves[0], leaves[1], leaves[2], leaves[3:]
    if backend == "reference":
        out = reference_attention(q, k0, v0, chain[:j], chain[j:], segments)
    else:
        out = ttt_attention(q, k0, v0, list(zip(chain[:j], chain[j:])), segments, backend)
    out.backward(dout.to(out.dtype))
    return [out.detach()] + [x.grad for x in leaves]


def names(j: int) -> list[str]:
    return ["out", "dq", "dk0", "dv0"] + [f"dchain_k{i}" for i in range(j)] + [f"dchain_v{i}" for i in range(j)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("j", [0, 1, 3])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("backend", ["flash", "blockwise"])
@pytest.mark.parametrize("chain_rows", [None, 5], ids=["one-block", "5-row-blocks"])
def test_kernels_match_the_reference_on_cpu(backend, heads, j, layout, chain_rows, monkeypatch):
    if chain_rows:  # the chain attended a few token rows at a time
        monkeypatch.setattr(eagle31.kernels.causal, "BLOCK_BUDGET", chain_rows * max(1, j) * heads[0] * 8)
    inputs = attention_inputs(LAYOUTS[layout], *heads, d=8, j=j, dtype=torch.float64)
    expected = output_and_grads("reference", *inputs)
    got = output_and_grads(backend, *inputs)
    for name, a, b in zip(names(j), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=f"{backend} {name}")


def test_padding_and_other_documents_do_not_leak():
    """Changing a key of another document or of padding leaves a query's output as it was."""
    q, k0, v0, chain_k, chain_v, segments, _ = attention_inputs(LAYOUTS["packed"], 4, 2, 8, 2, torch.float64)
    base = ttt_attention(q, k0, v0, list(zip(chain_k, chain_v)), segments, "flash")
    k0b, v0b = k0.clone(), v0.clone()
    k0b[0, 7:], v0b[0, 7:] = 5.0, -5.0  # documents 1 and 2
    other = ttt_attention(q, k0b, v0b, list(zip(chain_k, chain_v)), segments, "flash")
    torch.testing.assert_close(other[0, :7], base[0, :7], rtol=0, atol=0)  # document 0 sees none of it
    assert not torch.allclose(other[0, 7:], base[0, 7:])


def test_auto_picks_the_fused_kernel_where_it_runs():
    assert resolve_backend(torch.zeros(1, 1, 1, 8), CausalMask(Visibility(), 0), 1) == "flash"  # CPU, any dtype


# ---------------------------------------------------------------------------- the GPU twin


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("recipe", ["kimi_k26", "llama31_8b"])
@pytest.mark.parametrize("backend", ["flash", "blockwise"])
def test_kernels_match_the_reference_on_cuda_in_bf16(backend, recipe, layout):
    from benchmarks.attention_check import attention_dims
    from benchmarks.shapes import recipe_drafter

    nh, nkv, d, d_v = attention_dims(recipe_drafter(recipe))
    j = 3
    doc = [row * 8 for row in LAYOUTS[layout]]  # 192 tokens a row: several flash tiles
    inputs = attention_inputs(doc, nh, nkv, d, j, torch.bfloat16, device="cuda", d_v=d_v)
    q, k0, v0, chain_k, chain_v, segments, dout = inputs
    as_fp32 = [x.float() for x in (q, k0, v0)], [x.float() for x in chain_k], [x.float() for x in chain_v]
    expected = output_and_grads("reference", *as_fp32[0], as_fp32[1], as_fp32[2], segments, dout.float())
    got = output_and_grads(backend, *inputs)
    for name, a, b in zip(names(j), got, expected):
        error = float((a.float() - b).abs().max() / b.abs().max())
        assert error < 5e-2, f"{backend} {name}: max error {error:.3g} of the largest value"


@pytest.mark.parametrize("backend", ["flash", "blockwise", "reference"])
@pytest.mark.parametrize("layout", ["packed", "padded_rows"])
def test_queries_of_a_sequence_shard_attend_every_earlier_key_of_their_document(backend, layout):
    """Sequence parallelism: the queries of shard [a, b) with the keys of 0..b-1 (`QueryTail`; the reference's
    query tail) give the full sequence's rows a..b-1; the key gradients of all shards sum to the full sequence's
    (documents cross shards)."""
    j = 2
    q, k0, v0, chain_k, chain_v, segments, dout = attention_inputs(LAYOUTS[layout], 4, 2, 8, j, torch.float64)
    full = output_and_grads(backend, q, k0, v0, chain_k, chain_v, segments, dout)
    T = q.shape[1]
    dk0, dv0 = torch.zeros_like(k0), torch.zeros_like(v0)
    for a, b in [(0, 5), (5, 13), (13, T)]:  # uneven shards; 13 is inside a document in every layout
        rows = lambda x, a=a, b=b: x[:, a:b]  # noqa: E731
        leaves = [
            x.detach().clone().requires_grad_()
            for x in (rows(q), k0[:, :b], v0[:, :b], *map(rows, chain_k), *map(rows, chain_v))
        ]
        out = ttt_attention(
            leaves[0], leaves[1], leaves[2], list(zip(leaves[3 : 3 + j], leaves[3 + j :])), segments[:, :b], backend
        )
        out.backward(rows(dout))
        torch.testing.assert_close(out, rows(full[0]), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(leaves[0].grad, rows(full[1]), rtol=1e-10, atol=1e-10)
        for i in range(2 * j):
            torch.testing.assert_close(leaves[3 + i].grad, rows(full[4 + i]), rtol=1e-10, atol=1e-10)
        dk0[:, :b] += leaves[1].grad
        dv0[:, :b] += leaves[2].grad
    torch.testing.assert_close(dk0, full[2], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dv0, full[3], rtol=1e-10, atol=1e-10)


def test_the_cuda_kernels_documents_end_at_every_row_whatever_the_run_ids():
    """The CUDA varlen call's `cu_seqlens` (plain tensor code, checked on CPU) cut the runs where the CPU path
    does. A query tail passes a slice of the global run ids, so row 0 may end on run 8 where row 1 starts on
    run 1: offsetting each row's ids by T + 1 made those one document, row 1's queries attending row 0's keys."""
    from eagle31.kernels.causal import FlashCausal, _runs

    cu, max_len = FlashCausal._cu_seqlens(torch.tensor([[7, 8, 8, 8, 8, 8], [1, 1, 1, 1, 1, 1]]))
    assert cu.tolist() == [0, 1, 6, 12] and max_len == 6
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        B, T = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        # each row: non-decreasing run ids from its own start, as segments[:, off:] of a query tail
        segments = torch.randint(0, 2, (B, T), generator=g).cumsum(1) + torch.randint(0, 3 * T, (B, 1), generator=g)
        cu, max_len = FlashCausal._cu_seqlens(segments)
        runs = _runs(segments)
        assert cu.tolist() == [0] + [b * T + e for b, _, e in runs], segments
        assert max_len == max(e - s for _, s, e in runs)


@pytest.mark.parametrize("backend", ["flash", "blockwise"])
def test_a_shards_earlier_keys_are_made_from_their_latents_a_block_at_a_time(backend, monkeypatch):
    """MLA on a sequence shard: the keys before the shard are decompressed from the gathered latents a block
    of positions at a time (here 2, by blocks of 8 query rows), in the forward and the backward, never all at once;
    the output and every gradient (q, the latents of step 0 and of the chain, kv_b_proj's weight) are the full
    sequence's."""
    nh, nope, rope, v_dim, rank, j = 4, 3, 2, 3, 6, 2
    doc = LAYOUTS["padded_rows"]
    B, T = len(doc), len(doc[0])
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    q, latents, dout = (
        rand(B, T, nh, nope + rope),
        [rand(B, T, rank + rope) for _ in range(1 + j)],
        rand(B, T, nh, nope + rope),
    )
    weight = rand(nh * (nope + v_dim), rank)
    segments = segment_ids(torch.tensor(doc), None, (B, T))
    decompress = partial(mla_keys_values, num_heads=nh, nope=nope, v_dim=v_dim)
    made = []  # token rows of each step-0 decompression

    def step0(latent, w):
        made.append(latent.shape[0])
        return decompress(latent, w)

    def run(a: int, b: int):
        leaves = [
            x.detach().clone().requires_grad_()
            for x in (q[:, a:b], latents[0][:, :b], *(c[:, a:b] for c in latents[1:]), weight)
        ]
        expand0, expand = (
            ChainKeysValues(step0, (leaves[-1],), width=1),
            ChainKeysValues(decompress, (leaves[-1],), width=1),
        )
        chain = [(c,) for c in leaves[2:-1]]
        out = ttt_attention_of_entries(leaves[0], (leaves[1],), chain, segments[:, :b], backend, expand0, expand)
        out.backward(dout[:, a:b])
        return out.detach(), [x.grad for x in leaves]

    full_out, full = run(0, T)
    monkeypatch.setattr(QueryTail, "prefix_block", staticmethod(lambda nh, d: 2))
    monkeypatch.setattr(
        eagle31.kernels.causal, "BLOCK_BUDGET", 64
    )  # and 64 // (4 heads x 2 keys) = 8 query rows a block
    d_latent0, d_weight = torch.zeros_like(latents[0]), torch.zeros_like(weight)
    for a, b in [(0, 5), (5, 13), (13, T)]:  # uneven shards; 13 is inside a document in every row
        made.clear()
        out, grads = run(a, b)
        assert max(made) <= B * (b - a) and (a == 0 or 2 in made)  # the shard's own keys, then blocks of 2
        torch.testing.assert_close(out, full_out[:, a:b], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(grads[0], full[0][:, a:b], rtol=1e-10, atol=1e-10)
        for got, want in zip(grads[2:-1], full[2:-1]):
            torch.testing.assert_close(got, want[:, a:b], rtol=1e-10, atol=1e-10)
        d_latent0[:, :b] += grads[1]
        d_weight += grads[-1]
    torch.testing.assert_close(d_latent0, full[1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(d_weight, full[-1], rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------- sliding window


def windowed_output_and_grads(backend: str, window: int, q, k0, v0, chain_k, chain_v, segments, dout):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k0, v0, *chain_k, *chain_v)]
    j = len(chain_k)
    q, k0, v0, chain = leaves[0], leaves[1], leaves[2], leaves[3:]
    if backend == "reference":
        out = reference_attention(q, k0, v0, chain[:j], chain[j:], segments, rule=Visibility(window))
    else:
        out = ttt_attention(q, k0, v0, list(zip(chain[:j], chain[j:])), segments, backend, rule=Visibility(window))
    out.backward(dout.to(out.dtype))
    return [out.detach()] + [x.grad for x in leaves]


def test_the_reference_window_is_over_positions_as_vllm_serves_it():
    """Query (p, j) at position p + j sees the step-0 keys of p + j - W + 1 .. p and its whole chain: the
    probabilities of every other key are 0, and with W beyond the sequence the window changes nothing."""
    W, j = 5, 2
    q, k0, v0, chain_k, chain_v, segments, _ = attention_inputs(LAYOUTS["packed"], 4, 2, 8, j, torch.float64)
    seen = []
    reference_attention(q, k0, v0, chain_k, chain_v, segments, probe=seen.append, rule=Visibility(W))
    probs = seen[0][0, 0]  # [Tq, Tk + j*T], head 0
    T = q.shape[1]
    doc = torch.tensor(LAYOUTS["packed"][0])
    for p in range(T):
        visible = {m for m in range(T) if doc[m] == doc[p] and p + j - W + 1 <= m <= p}
        assert {m for m in range(T) if probs[p, m] > 0} == visible, p
        assert all(probs[p, T + i * T + p] > 0 for i in range(j))  # the chain
    wide = reference_attention(q, k0, v0, chain_k, chain_v, segments, rule=Visibility(T + j))
    torch.testing.assert_close(wide, reference_attention(q, k0, v0, chain_k, chain_v, segments), rtol=0, atol=0)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("j", [0, 1, 3])
@pytest.mark.parametrize("window", [4, 9])
@pytest.mark.parametrize("backend", ["flash", "blockwise"])
def test_windowed_kernels_match_the_reference_on_cpu(backend, window, j, layout, monkeypatch):
    """W = 4 splits every document into several CPU flash blocks (and W - j = 1 at j = 3: the query's own step-0
    key alone); the blockwise kernel runs 16-query blocks whose first key moves with the window."""
    monkeypatch.setattr(eagle31.kernels.causal, "BLOCK_BUDGET", 16 * 4 * 24)  # 16 queries a block
    inputs = attention_inputs(LAYOUTS[layout], 4, 2, d=8, j=j, dtype=torch.float64)
    expected = windowed_output_and_grads("reference", window, *inputs)
    got = windowed_output_and_grads(backend, window, *inputs)
    for name, a, b in zip(names(j), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=f"{backend} W={window} {name}")


def test_the_cpu_flash_window_in_bf16_is_the_reference_in_fp32():
    inputs = attention_inputs(LAYOUTS["packed"], 4, 2, d=8, j=2, dtype=torch.bfloat16)
    q, k0, v0, chain_k, chain_v, segments, dout = inputs
    as_fp32 = [x.float() for x in (q, k0, v0)]
    expected = windowed_output_and_grads(
        "reference", 5, *as_fp32, [c.float() for c in chain_k], [c.float() for c in chain_v], segments, dout.float()
    )
    got = windowed_output_and_grads("flash", 5, *inputs)
    for name, a, b in zip(names(2), got, expected):
        assert float((a.float() - b).abs().max() / b.abs().max()) < 3e-2, name


def test_a_window_that_leaves_a_query_no_step0_key_is_refused():
    q, k0, v0, chain_k, chain_v, segments, _ = attention_inputs(LAYOUTS["packed"], 4, 2, 8, 2, torch.float64)
    with pytest.raises(ValueError, match="leaves a query at TTT step 2 no step-0 key"):
        ttt_attention(q, k0, v0, list(zip(chain_k, chain_v)), segments, "flash", rule=Visibility(2))


@pytest.mark.parametrize("backend", ["flash", "blockwise", "reference"])
@pytest.mark.parametrize("window", [3, 6])
def test_shard_queries_see_only_the_earlier_keys_inside_their_window(backend, window, monkeypatch):
    """Sequence parallelism with a window: the shards' queries and key gradients are the full sequence's; the
    keys before a shard are attended 2 positions a block, and those beyond every query's window are never made."""
    j = 2
    monkeypatch.setattr(QueryTail, "prefix_block", staticmethod(lambda nh, d: 2))
    q, k0, v0, chain_k, chain_v, segments, dout = attention_inputs(LAYOUTS["padded_rows"], 4, 2, 8, j, torch.float64)
    full = windowed_output_and_grads(backend, window, q, k0, v0, chain_k, chain_v, segments, dout)
    T = q.shape[1]
    dk0, dv0 = torch.zeros_like(k0), torch.zeros_like(v0)
    for a, b in [(0, 5), (5, 13), (13, T)]:
        rows = lambda x, a=a, b=b: x[:, a:b]  # noqa: E731
        leaves = [
            x.detach().clone().requires_grad_()
            for x in (rows(q), k0[:, :b], v0[:, :b], *map(rows, chain_k), *map(rows, chain_v))
        ]
        chain = list(zip(leaves[3 : 3 + j], leaves[3 + j :]))
        out = ttt_attention(leaves[0], leaves[1], leaves[2], chain, segments[:, :b], backend, rule=Visibility(window))
        out.backward(rows(dout))
        torch.testing.assert_close(out, rows(full[0]), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(leaves[0].grad, rows(full[1]), rtol=1e-10, atol=1e-10)
        for i in range(2 * j):
            torch.testing.assert_close(leaves[3 + i].grad, rows(full[4 + i]), rtol=1e-10, atol=1e-10)
        # no query of the shard sees a key before a - (window - j) + 1
        first = max(0, a - (window - j) + 1)
        assert not leaves[1].grad[:, :first].any()
        dk0[:, :b] += leaves[1].grad
        dv0[:, :b] += leaves[2].grad
    torch.testing.assert_close(dk0, full[2], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dv0, full[3], rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("backend", ["flash", "blockwise"])
def test_windowed_kernels_match_the_reference_on_cuda_in_bf16(backend, layout):
    """The varlen flash op's window arguments (window_size_left = W - k - 1, right 0) against the reference."""
    doc = [row * 8 for row in LAYOUTS[layout]]  # 192 tokens a row: the window (40) splits every document
    j = 3
    inputs = attention_inputs(doc, 8, 2, 64, j, torch.bfloat16, device="cuda")
    q, k0, v0, chain_k, chain_v, segments, dout = inputs
    as_fp32 = [x.float() for x in (q, k0, v0)]
    expected = windowed_output_and_grads(
        "reference", 40, *as_fp32, [c.float() for c in chain_k], [c.float() for c in chain_v], segments, dout.float()
    )
    got = windowed_output_and_grads(backend, 40, *inputs)
    for name, a, b in zip(names(j), got, expected):
        error = float((a.float() - b).abs().max() / b.abs().max())
        assert error < 5e-2, f"{backend} {name}: max error {error:.3g} of the largest value"


@pytest.mark.parametrize("window", [None, 3, 6, 11])
def test_a_prefix_block_inside_every_querys_band_is_left_unmasked_and_others_are_masked_by_the_rule(window):
    """`QueryTail._masked` makes no mask for a block the band shows whole: its scores are the rule's at every
    query offset, block start and size, at each TTT step."""
    T, off = 40, 20
    segments = torch.zeros(T, dtype=torch.long)  # one document: a prefix block's keys are its queries'
    for step in range(3):
        mask = CausalMask(Visibility(window), step)
        for i0, n, m0, m in itertools.product(range(8), (1, 3, 5), range(off), (1, 2, 4)):
            m = min(m, off - m0)
            scores = torch.zeros(n, 1, 1, m, dtype=torch.float64)
            q, k = off + i0 + torch.arange(n), m0 + torch.arange(m)
            seen = mask.allowed(segments[q, None], q[:, None], segments[None, k], k[None])
            expected = scores.masked_fill(~seen[:, None, None], float("-inf"))
            assert torch.equal(QueryTail._masked(scores, mask, segments, off, i0, m0), expected), (step, i0, n, m0, m)
