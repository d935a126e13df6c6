"""The TTT unroll and its loss against a deliberately naive re-implementation.

The naive version below shares no code with the library: Python loops over
rows, steps and positions, explicit softmax, hand-written RMSNorm and RoPE. It
follows docs/design.md §3–§4 literally.
"""

import itertools
import math

import pytest
import torch

from eagle31 import TargetHead, step_scales, supervision_mask, ttt_loss, ttt_unroll, weighted_loss
from eagle31.model import segment_ids
from tests.helpers import random_batch, tiny_drafter

K = 3
DECAY = 0.8


# ----------------------------------------------------------------------------
# the naive reference


def rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean() + eps))


def rope(x, pos, theta):
    """x [heads, d] at integer position pos (Llama rotate-half)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.cat([pos * inv, pos * inv]).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * torch.cos(ang) + torch.cat([-x2, x1], -1) * torch.sin(ang)


def llama_project(W, c, z, pos):
    """The Llama attention's q [nh, d], k, v [nkv, d] at RoPE position pos, and the softmax scale."""
    nh, nkv, d, theta = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rope_parameters["rope_theta"]
    q = (W["midlayer.self_attn.q_proj.weight"] @ z).view(nh, d)
    kk = (W["midlayer.self_attn.k_proj.weight"] @ z).view(nkv, d)
    vv = (W["midlayer.self_attn.v_proj.weight"] @ z).view(nkv, d)
    return rope(q, pos, theta), rope(kk, pos, theta), vv, 1 / math.sqrt(d)


def naive_logits(m, aux, input_ids, doc, project=llama_project):
    """Per step k: logits [B, T, Vd] of query (p, k); doc [B, T] (-1 padding).

    project(W, config, z, position) -> q [nh, dq], k [nkv, dq], v [nkv, dv], scale: the attention's projections.
    """
    c = m.config
    W = dict(m.named_parameters())
    eps = c.rms_norm_eps
    g = c.num_attention_heads // c.num_key_value_heads
    B, T = input_ids.shape
    out = torch.zeros(K, B, T, c.draft_vocab_size, dtype=aux.dtype)
    for b in range(B):
        keys = {}  # (p, k) -> (key [nkv, dq], value [nkv, dv])
        feature = {}
        for p in range(T):
            chunks = aux[b, p].chunk(c.num_aux)
            if c.fc_norm:
                x = torch.cat([rms(ch, W[f"fc_norm.{i}.weight"], eps) for i, ch in enumerate(chunks)])
            elif c.norm_before_fc:
                x = rms(aux[b, p], W["input_norm.weight"], eps)
            else:
                x = aux[b, p]
            feature[p] = W["fc.weight"] @ x
        for k in range(K):
            queries, residuals = {}, {}
            for p in range(T):
                tok = input_ids[b, p + 1 + k] if p + 1 + k < T else 0
                h = feature[p]
                hn = rms(h, W["midlayer.hidden_norm.weight"], eps)
                z = torch.cat([rms(m.embed_tokens.weight[tok], W["midlayer.input_layernorm.weight"], eps), hn])
                queries[p], kk, vv, scale = project(W, c, z, p + k)
                keys[(p, k)] = (kk, vv)
                residuals[p] = hn if c.norm_before_residual else h
            for p in range(T):
                # step-0 keys of the same document, causal; then the query's own chain; with a sliding
                # window W those at positions p + k - W + 1 .. p + k (the key (p, j) sits at p + j)
                window = c.sliding_window or T + K
                visible = [(j, 0) for j in range(p + 1) if doc[b, j] == doc[b, p] and p + k - j < window]
                visible += [(p, j) for j in range(1, k + 1) if k - j < window]
                heads = []
                for h_ in range(c.num_attention_heads):
                    q = queries[p][h_]
                    s = torch.stack([q @ keys[key][0][h_ // g] for key in visible]) * scale
                    w = torch.exp(s - s.max())
                    w = w / w.sum()
                    heads.append(sum(w[i] * keys[key][1][h_ // g] for i, key in enumerate(visible)))
                attn = torch.cat(heads)
                h1 = residuals[p] + W["midlayer.self_attn.o_proj.weight"] @ attn
                x = rms(h1, W["midlayer.post_attention_layernorm.weight"], eps)
                mlp = W["midlayer.mlp.down_proj.weight"] @ (
                    torch.nn.functional.silu(W["midlayer.mlp.gate_proj.weight"] @ x)
                    * (W["midlayer.mlp.up_proj.weight"] @ x)
                )
                o = h1 + mlp
                normed = rms(o, W["norm.weight"], eps)
                out[k, b, p] = W["lm_head.weight"] @ normed
                feature[p] = normed if c.norm_output else o
    return out


def naive_loss(m, logits, final, input_ids, loss_mask, doc, target_w, mask_oov=True):
    """sum_k w^k * mean over supervised (p, k) of KL(label || draft), written out."""
    B, T = input_ids.shape
    draft_ids = torch.arange(m.config.draft_vocab_size) + m.d2t
    total = 0.0
    for k in range(K):
        kls = []
        for b in range(B):
            for p in range(T):
                q = p + 1 + k  # the target state that predicts x[p+2+k]
                if p + 2 + k > T - 1 or loss_mask[b, p + 2 + k] == 0 or doc[b, p + 2 + k] != doc[b, p]:
                    continue
                full = target_w @ final[b, q]
                if mask_oov and not bool(m.t2d[full.argmax()]):
                    continue
                label = torch.softmax(full[draft_ids], -1)
                logq = torch.log_softmax(logits[k][b, p], -1)
                kls.append((label * (label.log() - logq)).sum())
        if kls:
            total = total + DECAY**k * torch.stack(kls).mean()
    return total


# ----------------------------------------------------------------------------
# library side


def library_loss(m, aux, final, input_ids, loss_mask, doc, target_w, attention, mask_oov=True):
    out = ttt_unroll(m, aux, input_ids, ttt_length=K, document_ids=doc, attention_kernel=attention)
    head = TargetHead(target_w, m.draft_token_ids())
    argmax = head.argmax(final)
    sup = supervision_mask(loss_mask, out.segments, K, m.t2d[argmax] if mask_oov else None)
    stats = ttt_loss(out.states, m.lm_head.weight, m.d2t, final, sup, head, argmax, own_scale(sup))
    return weighted_loss(stats.loss_sum, stats.count, DECAY), out, stats


def own_scale(sup):
    """step_scales of one micro-batch that is the whole batch."""
    return step_scales(sup.sum(dim=(1, 2)), DECAY)


def layouts():
    """(name, document_ids [2, 11]): right padding in row 1, and two packed documents in row 0."""
    padded = torch.zeros(2, 11, dtype=torch.long)
    padded[1, 8:] = -1
    packed = torch.zeros(2, 11, dtype=torch.long)
    packed[0, 5:] = 1
    packed[1, 9:] = -1
    return {"padding": padded, "packed": packed}


SWITCHES = [
    dict(fc_norm=a, norm_output=b, norm_before_residual=c) for a, b, c in itertools.product([True, False], repeat=3)
] + [dict(fc_norm=False, norm_before_fc=True, norm_output=True, norm_before_residual=False)]


@pytest.mark.parametrize("switches", SWITCHES, ids=lambda s: "-".join(k for k, v in s.items() if v) or "eagle3")
@pytest.mark.parametrize("layout", ["padding", "packed"])
def test_unroll_and_loss_match_naive_loops(switches, layout):
    m = tiny_drafter(seed=1, **switches)
    doc = layouts()[layout]
    aux, final, ids, mask = random_batch(m.config, 2, 11, seed=2)
    target_w = torch.randn(
        m.config.vocab_size,
        m.config.target_hidden_size,
        dtype=torch.float64,
        generator=torch.Generator().manual_seed(3),
    )

    expected_logits = naive_logits(m, aux, ids, doc)
    expected_loss = naive_loss(m, expected_logits, final, ids, mask, doc, target_w)
    expected_loss.backward()
    expected_grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert expected_grads, "the naive loss must reach the parameters"

    for attention in ("blockwise", "flash", "reference"):
        m.zero_grad()
        loss, out, stats = library_loss(m, aux, final, ids, mask, doc, target_w, attention)
        logits = torch.stack([m.lm_head(s) for s in out.states])
        real = doc >= 0  # padded queries are not part of the contract
        torch.testing.assert_close(logits[:, real], expected_logits[:, real], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(loss, expected_loss, rtol=1e-9, atol=1e-9)
        loss.backward()
        for name, grad in expected_grads.items():
            torch.testing.assert_close(
                dict(m.named_parameters())[name].grad, grad, rtol=1e-7, atol=1e-9, msg=f"{attention}: {name}"
            )


@pytest.mark.parametrize("window", [3, 5])
def test_windowed_unroll_and_loss_match_naive_loops(window):
    """`drafter.sliding_window`: every backend, logits, loss and gradients, against the naive loops (W = 3 = K:
    the deepest step sees its own step-0 key alone)."""
    m = tiny_drafter(seed=1, sliding_window=window)
    doc = layouts()["packed"]
    aux, final, ids, mask = random_batch(m.config, 2, 11, seed=2)
    target_w = torch.randn(
        m.config.vocab_size,
        m.config.target_hidden_size,
        dtype=torch.float64,
        generator=torch.Generator().manual_seed(3),
    )
    expected_logits = naive_logits(m, aux, ids, doc)
    full = tiny_drafter(seed=1)
    assert not torch.allclose(expected_logits, naive_logits(full, aux, ids, doc))  # the window matters here
    expected_loss = naive_loss(m, expected_logits, final, ids, mask, doc, target_w)
    expected_loss.backward()
    expected_grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    for attention in ("blockwise", "flash", "reference"):
        m.zero_grad()
        loss, out, _ = library_loss(m, aux, final, ids, mask, doc, target_w, attention)
        logits = torch.stack([m.lm_head(s) for s in out.states])
        real = doc >= 0
        torch.testing.assert_close(logits[:, real], expected_logits[:, real], rtol=1e-9, atol=1e-9, msg=attention)
        loss.backward()
        for name, grad in expected_grads.items():
            torch.testing.assert_close(
                dict(m.named_parameters())[name].grad, grad, rtol=1e-7, atol=1e-9, msg=f"{attention}: {name}"
            )


def test_drafter_forward_returns_the_unroll_logits():
    m = tiny_drafter(seed=4)
    aux, _, ids, _ = random_batch(m.config, 2, 9, seed=5)
    doc = torch.zeros(2, 9, dtype=torch.long)
    logits = m(aux, ids, ttt_length=K, document_ids=doc)
    assert len(logits) == K and logits[0].shape == (2, 9, m.config.draft_vocab_size)
    torch.testing.assert_close(torch.stack(logits), naive_logits(m, aux, ids, doc), rtol=1e-9, atol=1e-9)


def test_attention_mask_equals_document_ids_for_padding():
    m = tiny_drafter(seed=6)
    aux, _, ids, _ = random_batch(m.config, 2, 9, seed=7)
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[0, 6:] = 0
    doc = torch.zeros(2, 9, dtype=torch.long)
    doc[0, 6:] = -1
    a = torch.stack(m(aux, ids, ttt_length=K, attention_mask=attention_mask))
    b = torch.stack(m(aux, ids, ttt_length=K, document_ids=doc))
    torch.testing.assert_close(a[:, 0, :6], b[:, 0, :6])
    torch.testing.assert_close(a[:, 1], b[:, 1])


@pytest.mark.parametrize("norm_output", [True, False])
def test_next_step_receives_post_norm_output_only_with_norm_output(norm_output):
    """SpecForge once changed only what lm_head saw; the fed-back state must change too."""
    m = tiny_drafter(seed=8, norm_output=norm_output)
    aux, _, ids, _ = random_batch(m.config, 1, 7, seed=9)
    received = []
    attention_input = m.midlayer.attention_input

    def spy(emb, h):
        received.append(h.detach().clone())
        return attention_input(emb, h)

    m.midlayer.attention_input = spy
    out = ttt_unroll(m, aux, ids, ttt_length=K)
    assert len(received) == K
    for k in range(K - 1):
        assert not torch.allclose(out.states[k], out.hidden[k])  # the two candidates differ
        expected = out.states[k] if norm_output else out.hidden[k]
        torch.testing.assert_close(received[k + 1], expected, rtol=0, atol=0)


def test_fc_norm_normalises_each_aux_chunk_separately():
    cfg = dict(seed=10)
    aux, *_ = random_batch(tiny_drafter(**cfg).config, 1, 5, seed=11)
    scaled = aux.clone()
    Ht = aux.shape[-1] // 3
    scaled[..., Ht : 2 * Ht] *= 1000.0  # one chunk only

    with_fc_norm = tiny_drafter(**cfg, fc_norm=True)
    torch.testing.assert_close(with_fc_norm.fuse_aux(scaled), with_fc_norm.fuse_aux(aux), rtol=1e-6, atol=1e-6)

    with_one_norm = tiny_drafter(**cfg, fc_norm=False, norm_before_fc=True)
    assert not torch.allclose(with_one_norm.fuse_aux(scaled), with_one_norm.fuse_aux(aux), rtol=1e-2)


def test_loss_is_invariant_to_micro_batching():
    """Loss and gradients of a batch == two micro-batches, summed, divided by the global count."""
    m = tiny_drafter(seed=12)
    aux, final, ids, mask = random_batch(m.config, 4, 10, seed=13)
    doc = torch.zeros(4, 10, dtype=torch.long)
    doc[2, 4:] = 1
    target_w = torch.randn(m.config.vocab_size, m.config.target_hidden_size, dtype=torch.float64)
    head = TargetHead(target_w, m.draft_token_ids())

    def stats_of(sl):
        out = ttt_unroll(m, aux[sl], ids[sl], ttt_length=K, document_ids=doc[sl])
        argmax = head.argmax(final[sl])
        sup = supervision_mask(mask[sl], out.segments, K, m.t2d[argmax])
        return ttt_loss(out.states, m.lm_head.weight, m.d2t, final[sl], sup, head, argmax, step_scales(count, DECAY))

    count = torch.zeros(K)  # the global count, set before each forward as the trainer does
    count[:] = supervision_mask(mask, segment_ids(doc, None, doc.shape), K, m.t2d[head.argmax(final)]).sum(dim=(1, 2))
    full = stats_of(slice(0, 4))
    whole = weighted_loss(full.loss_sum, full.count, DECAY)
    whole.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    m.zero_grad()
    parts = [stats_of(slice(0, 2)), stats_of(slice(2, 4))]
    global_count = parts[0].count + parts[1].count
    torch.testing.assert_close(global_count, full.count)
    split = sum(weighted_loss(s.loss_sum, global_count, DECAY) for s in parts)
    split.backward()
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-12)
    for n, g in grads.items():
        torch.testing.assert_close(dict(m.named_parameters())[n].grad, g, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(parts[0].counters() + parts[1].counters(), full.counters())


def test_segments_split_padding_from_documents():
    doc = torch.tensor([[0, 0, 1, 1, -1, -1]])
    seg = segment_ids(doc, None, doc.shape)
    assert seg.tolist() == [[1, 1, 2, 2, 3, 3]]


@pytest.mark.parametrize("attention", ["flash", "blockwise"])
def test_activation_checkpointing_changes_neither_loss_nor_gradients(attention, monkeypatch):
    import eagle31.ttt

    m = tiny_drafter(seed=14)
    monkeypatch.setattr(eagle31.ttt, "FEED_FORWARD_BUDGET", 3 * m.config.intermediate_size)  # MLP in 3-row chunks
    doc = layouts()["packed"]
    aux, final, ids, mask = random_batch(m.config, 2, 11, seed=15)
    target_w = torch.randn(m.config.vocab_size, m.config.target_hidden_size, dtype=torch.float64)
    head = TargetHead(target_w, m.draft_token_ids())

    def loss_and_grads(checkpointing):
        m.zero_grad()
        out = ttt_unroll(
            m,
            aux,
            ids,
            ttt_length=K,
            document_ids=doc,
            attention_kernel=attention,
            activation_checkpointing=checkpointing,
        )
        argmax = head.argmax(final)
        sup = supervision_mask(mask, out.segments, K, m.t2d[argmax])
        stats = ttt_loss(out.states, m.lm_head.weight, m.d2t, final, sup, head, argmax, own_scale(sup))
        loss = weighted_loss(stats.loss_sum, stats.count, DECAY)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    plain, plain_grads = loss_and_grads(False)
    ckpt, ckpt_grads = loss_and_grads(True)
    torch.testing.assert_close(ckpt, plain, rtol=1e-12, atol=1e-12)
    assert ckpt_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_llama_chain_remade_from_step_inputs_in_token_blocks_matches_naive_loops(checkpointing, monkeypatch):
    """A Llama step's chain entry is its input (feature, token ids, positions): no keys or values are kept
    for later steps; the chain remakes them a few token rows at a time (many blocks), the checkpointed MLP in
    4-row chunks, packed documents and padding, with and without activation checkpointing: the naive fp64
    loss and gradients."""
    import eagle31.kernels.causal
    import eagle31.ttt

    m = tiny_drafter(seed=21)
    c = m.config
    aux, final, ids, mask = random_batch(c, 2, 11, seed=22)
    positions = torch.arange(11).expand(2, 11) + 1
    feature = m.fuse_aux(aux)
    _, entry, _ = eagle31.ttt.step_entry(m, feature, ids, positions, chain=True)
    assert entry[0] is feature and entry[1] is ids and entry[2] is positions

    monkeypatch.setattr(
        eagle31.kernels.causal, "BLOCK_BUDGET", 3 * c.num_attention_heads * c.head_dim
    )  # 3 rows at j = 1
    monkeypatch.setattr(eagle31.ttt, "FEED_FORWARD_BUDGET", 4 * c.intermediate_size)
    doc = layouts()["packed"]
    target_w = torch.randn(
        c.vocab_size, c.target_hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(23)
    )
    expected_logits = naive_logits(m, aux, ids, doc)
    naive_loss(m, expected_logits, final, ids, mask, doc, target_w).backward()
    expected = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    m.zero_grad()
    out = ttt_unroll(
        m, aux, ids, ttt_length=K, document_ids=doc, attention_kernel="flash", activation_checkpointing=checkpointing
    )
    real = doc >= 0
    torch.testing.assert_close(
        torch.stack([m.lm_head(s) for s in out.states])[:, real], expected_logits[:, real], rtol=1e-9, atol=1e-9
    )
    head = TargetHead(target_w, m.draft_token_ids())
    argmax = head.argmax(final)
    sup = supervision_mask(mask, out.segments, K, m.t2d[argmax])
    stats = ttt_loss(out.states, m.lm_head.weight, m.d2t, final, sup, head, argmax, own_scale(sup))
    weighted_loss(stats.loss_sum, stats.count, DECAY).backward()
    assert expected.keys() == {n for n, p in m.named_parameters() if p.grad is not None}
    for name, grad in expected.items():
        torch.testing.assert_close(dict(m.named_parameters())[name].grad, grad, rtol=1e-7, atol=1e-9, msg=name)
