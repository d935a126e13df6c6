"""The MLA drafter (eagle31.attention.mla) against naive re-implementations.

* Its rope and softmax scale against DeepSeek YaRN written out from vLLM's source
  (`rotary_embedding/deepseek_scaling_rope.py`, `rotary_embedding/common.py`, and
  `deepseek_v2.py`'s `DeepseekV2MLAAttention`, which `deepseek_eagle3.py` builds with
  `rope_type = "deepseek_yarn"` for any `rope_scaling`): frequencies blended by a ramp
  between the correction dims, cos/sin scaled by `mscale(factor, mscale) /
  mscale(factor, mscale_all_dim) * attn_factor`, interleaved pairs (`is_neox_style=False`),
  softmax scale `qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2`.
* The whole TTT unroll, loss and gradients against the naive loops of tests/test_ttt.py
  with the MLA projections written out per position (fp64, explicit softmax).
"""

import itertools
import math

import pytest
import torch

from eagle31 import ConfigError, DrafterConfig
from eagle31.attention.mla import MLAConfig
from tests.export.vllm_contract import OLDEST, deepseek_rope_numbers
from tests.helpers import random_batch, tiny_drafter
from tests.test_ttt import K, layouts, library_loss, naive_logits, naive_loss, rms

# ----------------------------------------------------------------------------
# DeepSeek YaRN as vLLM 0.22.0 computes it (eagle31.attention.mla reads attn_factor and extrapolation_factor as
# 0.22.0 does; a block that 0.33.0 reads otherwise is refused at export): tests/export/vllm_contract.py's
# `deepseek_rope_numbers`


def rope_pairs(x, pos, inv, magnitude):
    """x [heads, d]: dims (2i, 2i+1) rotated by pos * inv[i], scaled by the magnitude (GPT-J style)."""
    out = x.clone()
    for i in range(x.shape[-1] // 2):
        c, s = math.cos(pos * inv[i]) * magnitude, math.sin(pos * inv[i]) * magnitude
        out[..., 2 * i] = x[..., 2 * i] * c - x[..., 2 * i + 1] * s
        out[..., 2 * i + 1] = x[..., 2 * i + 1] * c + x[..., 2 * i] * s
    return out


KIMI_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
TINY_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 500.0,
    "factor": 8.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 4.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.5,
}


def mla_config(rope=TINY_ROPE, q_lora_rank=12, **overrides):
    values = dict(
        hidden_size=16,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=10,
        intermediate_size=24,
        vocab_size=40,
        draft_vocab_size=24,
        target_num_layers=8,
        aux_layer_ids=(2, 4, 5),
        attention="mla",
        mla=dict(q_lora_rank=q_lora_rank, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5),
        rope_parameters=dict(rope),
        max_position_embeddings=256,
    )
    mla = {k: overrides.pop(k) for k in list(overrides) if k in MLAConfig.__dataclass_fields__}
    values.update(overrides)
    values["mla"] = {**values["mla"], **mla}
    return values


# ----------------------------------------------------------------------------
# rope and softmax scale


ROPES = {
    "kimi": KIMI_ROPE,
    "mscale_differs": {**KIMI_ROPE, "mscale": 0.707, "mscale_all_dim": 1.0},
    "no_mscale_fields": {k: v for k, v in KIMI_ROPE.items() if not k.startswith("mscale")},
    "attn_factor": {**KIMI_ROPE, "attn_factor": 0.9, "factor": 40.0, "beta_fast": 16.0},
    "deepseek_yarn_name": {**KIMI_ROPE, "rope_type": "deepseek_yarn"},
    "default": {"rope_type": "default", "rope_theta": 50000.0},
}


@pytest.mark.parametrize("name", ROPES)
def test_mla_rope_and_softmax_scale_match_vllm_deepseek_yarn(name):
    from eagle31 import Eagle31Drafter

    rope = ROPES[name]
    cfg = DrafterConfig(
        **mla_config(rope, hidden_size=32, qk_nope_head_dim=128, qk_rope_head_dim=64, head_dim=192, v_head_dim=128)
    )
    with torch.device("meta"):
        m = Eagle31Drafter(cfg)
    inv, magnitude, softmax = deepseek_rope_numbers(64, rope, OLDEST)
    positions = torch.tensor([[0, 1, 7, 4095, 4096, 65535, 262143]])
    cos, sin = m.rotary_emb(positions, torch.float64)
    angles = positions[..., None].double() * inv
    torch.testing.assert_close(cos, (angles.cos() * magnitude).repeat_interleave(2, -1), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(sin, (angles.sin() * magnitude).repeat_interleave(2, -1), rtol=1e-9, atol=1e-9)
    assert m.midlayer.self_attn.q_scale == pytest.approx(softmax, rel=1e-12)
    if name == "kimi":  # the published drafter: the scale gains (0.1 ln 64 + 1)^2 ~ 2.005, cos/sin unscaled
        assert softmax == pytest.approx((0.1 * math.log(64) + 1) ** 2) and magnitude == 1.0


def test_mla_rope_rotates_interleaved_pairs():
    from eagle31.attention.mla import apply_interleaved_rope

    x = torch.tensor([[[[1.0, 2.0, 3.0, 4.0]]]], dtype=torch.float64)  # [B, T, heads, d]
    cos = torch.tensor([[[0.0, 0.0, 1.0, 1.0]]], dtype=torch.float64)  # pair 0 by 90 degrees, pair 1 still
    sin = torch.tensor([[[1.0, 1.0, 0.0, 0.0]]], dtype=torch.float64)
    assert apply_interleaved_rope(x, cos, sin).flatten().tolist() == [-2.0, 1.0, 3.0, 4.0]


# ----------------------------------------------------------------------------
# the layer: naive MLA projections in the naive unroll


def mla_project(W, c, z, pos):
    """MLA q [nh, nope+rope], k [nh, nope+rope], v [nh, v] at position pos, and the softmax scale, written out."""
    eps, nh = c.rms_norm_eps, c.num_attention_heads
    nope, rdim, vdim, kvr = c.mla.qk_nope_head_dim, c.mla.qk_rope_head_dim, c.mla.v_head_dim, c.mla.kv_lora_rank
    inv, magnitude, softmax = deepseek_rope_numbers(rdim, c.rope_parameters, OLDEST)
    a = "midlayer.self_attn."
    q = (W[a + "q_b_proj.weight"] @ rms(W[a + "q_a_proj.weight"] @ z, W[a + "q_a_layernorm.weight"], eps)).view(
        nh, nope + rdim
    )
    latent = W[a + "kv_a_proj_with_mqa.weight"] @ z
    kv = (W[a + "kv_b_proj.weight"] @ rms(latent[:kvr], W[a + "kv_a_layernorm.weight"], eps)).view(nh, nope + vdim)
    k_pe = rope_pairs(latent[kvr:], pos, inv, magnitude)
    q = torch.cat([q[:, :nope], rope_pairs(q[:, nope:], pos, inv, magnitude)], dim=1)
    k = torch.cat([kv[:, :nope], k_pe.expand(nh, rdim)], dim=1)
    return q, k, kv[:, nope:], softmax / math.sqrt(nope + rdim)


def mla_drafter(seed=1, **overrides):
    values = mla_config(**overrides)
    return tiny_drafter(seed=seed, **{k: v for k, v in values.items()})


@pytest.mark.parametrize("fc_norm,norm_output", list(itertools.product([True, False], repeat=2)))
@pytest.mark.parametrize("layout", ["padding", "packed"])
def test_mla_unroll_loss_and_gradients_match_naive_loops(fc_norm, norm_output, layout):
    m = mla_drafter(fc_norm=fc_norm, norm_output=norm_output)
    doc = layouts()[layout]
    aux, final, ids, mask = random_batch(m.config, 2, 11, seed=2)
    target_w = torch.randn(40, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    expected_logits = naive_logits(m, aux, ids, doc, project=mla_project)
    expected_loss = naive_loss(m, expected_logits, final, ids, mask, doc, target_w)
    expected_loss.backward()
    expected_grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert {"midlayer.self_attn.q_a_proj.weight", "midlayer.self_attn.kv_b_proj.weight"} <= set(expected_grads)

    for attention in ("blockwise", "flash", "reference"):
        m.zero_grad()
        loss, out, _ = library_loss(m, aux, final, ids, mask, doc, target_w, attention)
        logits = torch.stack([m.lm_head(s) for s in out.states])
        real = doc >= 0
        torch.testing.assert_close(logits[:, real], expected_logits[:, real], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(loss, expected_loss, rtol=1e-9, atol=1e-9)
        loss.backward()
        for name, grad in expected_grads.items():
            got = dict(m.named_parameters())[name].grad
            torch.testing.assert_close(got, grad, rtol=1e-7, atol=1e-9, msg=f"{attention}: {name}")


def test_mla_activation_checkpointing_keeps_loss_and_gradients():
    from eagle31 import ttt_unroll

    m = mla_drafter(seed=3)
    aux, _, ids, _ = random_batch(m.config, 2, 9, seed=4)
    results = []
    for checkpointing in (False, True):
        m.zero_grad()
        out = ttt_unroll(m, aux, ids, ttt_length=K, activation_checkpointing=checkpointing)
        sum(m.lm_head(s).pow(2).mean() for s in out.states).backward()
        results.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    for name, grad in results[0].items():
        torch.testing.assert_close(results[1][name], grad, rtol=1e-10, atol=1e-12, msg=name)


# ----------------------------------------------------------------------------
# config


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(attention="gqa"), "drafter.attention must be"),
        (dict(kv_lora_rank=0), "drafter.mla.kv_lora_rank must be a positive integer"),
        (dict(q_lora_rank=0), "drafter.mla.q_lora_rank must be a positive integer"),
        (dict(num_key_value_heads=2), "num_key_value_heads=2 must equal num_attention_heads=4"),
        (dict(head_dim=8), "head_dim=8 must be mla.qk_nope_head_dim"),
        (dict(v_head_dim=11), "v_head_dim=11 exceeds"),
        (dict(qk_rope_head_dim=3, head_dim=9), "qk_rope_head_dim must be even"),
        (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1.0}), "rope_type='llama3' is not supported"),
        (
            dict(attention="llama", head_dim=10),
            "drafter.mla.q_lora_rank is a field of an MLA drafter: set drafter.attention=mla",
        ),
        (dict(fc_norm=False, norm_before_fc=True), "norm_before_fc is not read by vLLM's DeepSeek"),
    ],
)
def test_mla_config_errors_name_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        DrafterConfig(**mla_config(**overrides))


def test_yarn_without_factor_is_refused_in_one_line():
    from eagle31 import Eagle31Drafter

    with pytest.raises(ConfigError, match="needs factor"):
        Eagle31Drafter(DrafterConfig(**mla_config({"rope_type": "yarn", "rope_theta": 10.0})))


def test_from_target_config_copies_the_targets_mla_shape():
    from pathlib import Path

    from eagle31.target import load_target_config

    target = load_target_config(Path(__file__).parents[1] / "recipes/targets/kimi_k26.json")
    cfg = DrafterConfig.from_target_config(target, attention="mla", draft_vocab_size=163840)
    assert (
        cfg.mla.q_lora_rank,
        cfg.mla.kv_lora_rank,
        cfg.mla.qk_nope_head_dim,
        cfg.mla.qk_rope_head_dim,
        cfg.mla.v_head_dim,
    ) == (
        1536,
        512,
        128,
        64,
        128,
    )
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (
        64,
        64,
        192,
        18432,
    )
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["mscale_all_dim"] == 1.0
    assert cfg.aux_layer_ids == (2, 30, 58) and cfg.draft_vocab_size == cfg.vocab_size == 163840
    llama = DrafterConfig.from_target_config(target)
    assert llama.attention == "llama" and llama.mla.kv_lora_rank == 0 and llama.head_dim == 128


# ----------------------------------------------------------------------------
# drafting at inference


@pytest.mark.parametrize("norm_output", [True, False])
def test_mla_drafting_follows_the_training_unroll_step_by_step(norm_output):
    from eagle31 import ttt_unroll
    from eagle31.eval.drafting import TreeSpec
    from tests.eval.test_drafting import context, proposer_at, unroll_log_probs

    m = mla_drafter(seed=6, norm_output=norm_output)
    aux, ids = context(m.config)
    out = ttt_unroll(m, aux[None], ids[None], ttt_length=1, attention_kernel="reference")
    for n in (2, 6, 11):
        prop = proposer_at(m, aux, ids, n)
        torch.testing.assert_close(m.norm(prop.root[0, 0]), out.states[0][0, n - 1])
        drafts = prop.draft_chain(5).tolist()
        logp = unroll_log_probs(m, aux, ids, n, drafts[:-1])
        assert m.draft_to_target(logp.argmax(-1)).tolist() == drafts
        tree = prop.draft_tree(TreeSpec(top_k=1, depth=5, total_tokens=5))
        assert tree.is_chain() and tree.tokens.tolist() == drafts


@pytest.mark.parametrize("checkpointing", [False, True])
def test_mla_chain_attended_in_token_blocks_matches_naive_loops(checkpointing, monkeypatch):
    """The chain's latents decompressed a few token rows at a time (many blocks), the checkpointed MLP
    in 4-row chunks, packed documents and padding, with and without activation checkpointing: the
    naive fp64 loss and gradients."""
    import eagle31.kernels.causal
    import eagle31.ttt
    from eagle31 import TargetHead, step_scales, supervision_mask, ttt_loss, ttt_unroll
    from tests.test_ttt import DECAY

    monkeypatch.setattr(eagle31.kernels.causal, "BLOCK_BUDGET", 3 * 4 * 16)  # a 3-row block at j = 1, 1 row after
    m = mla_drafter(seed=5)
    monkeypatch.setattr(eagle31.ttt, "FEED_FORWARD_BUDGET", 4 * m.config.intermediate_size)  # MLP in 4-row chunks
    doc = layouts()["packed"]
    aux, final, ids, mask = random_batch(m.config, 2, 11, seed=6)
    target_w = torch.randn(40, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    expected_logits = naive_logits(m, aux, ids, doc, project=mla_project)
    naive_loss(m, expected_logits, final, ids, mask, doc, target_w).backward()
    expected = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    m.zero_grad()
    out = ttt_unroll(
        m, aux, ids, ttt_length=K, document_ids=doc, attention_kernel="flash", activation_checkpointing=checkpointing
    )
    head = TargetHead(target_w, m.draft_token_ids())
    argmax = head.argmax(final)
    sup = supervision_mask(mask, out.segments, K, m.t2d[argmax])
    scale = step_scales(sup.sum(dim=(1, 2)), DECAY)
    stats = ttt_loss(out.states, m.lm_head.weight, m.d2t, final, sup, head, argmax, scale)
    (scale * stats.loss_sum).sum().backward()
    for name, grad in expected.items():
        torch.testing.assert_close(dict(m.named_parameters())[name].grad, grad, rtol=1e-7, atol=1e-9, msg=name)
