"""The drafter module: initialisation from the target, native save/load."""

import pytest
import torch

from eagle31 import ConfigError, Eagle31Drafter
from tests.helpers import random_batch, tiny_drafter


def test_init_from_target_copies_embedding_and_draft_rows_of_lm_head():
    m = tiny_drafter(seed=0)
    assert not m.embed_tokens.weight.requires_grad
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert "embed_tokens.weight" not in trainable and "lm_head.weight" in trainable
    embed = torch.randn(40, 16)
    head = torch.randn(40, 16)
    m.float().init_from_target(embed, head, m.d2t.clone(), m.t2d.clone())
    torch.testing.assert_close(m.embed_tokens.weight, embed)
    torch.testing.assert_close(m.lm_head.weight, head[m.draft_token_ids()])
    assert torch.equal(m.t2d.nonzero().squeeze(1), m.draft_token_ids())


def test_init_from_target_rejects_wrong_shapes():
    m = tiny_drafter(seed=0).float()
    with pytest.raises(ConfigError, match="embedding"):
        m.init_from_target(torch.zeros(39, 16), torch.zeros(40, 16), m.d2t, m.t2d)


@pytest.mark.parametrize("include_embed", [True, False])
def test_native_save_load_round_trip_gives_identical_logits(tmp_path, include_embed):
    m = tiny_drafter(seed=1, dtype=torch.float32, fc_norm=False, norm_output=False)
    m.save(tmp_path / "d", include_embed=include_embed)
    loaded = Eagle31Drafter.load(tmp_path / "d")
    assert loaded.config == m.config
    if not include_embed:
        loaded.embed_tokens.weight.data.copy_(m.embed_tokens.weight)
    aux, _, ids, _ = random_batch(m.config, 2, 7, dtype=torch.float32)
    for a, b in zip(m(aux, ids, ttt_length=3), loaded(aux, ids, ttt_length=3)):
        assert torch.equal(a, b)
    assert not list(tmp_path.glob("d/*.tmp-*"))


def test_load_rejects_a_foreign_directory(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match="not an eagle31 native drafter"):
        Eagle31Drafter.load(tmp_path)


@pytest.mark.parametrize("norm_output", [True, False])
def test_a_step_reads_out_norm_o_for_lm_head_and_feeds_back_per_norm_output(norm_output):
    """The one place the EAGLE 3.1 feedback rule lives: training and inference both take the
    next step's feature from `read_out` (docs/design.md §4)."""
    m = tiny_drafter(seed=3, norm_output=norm_output)
    hidden = torch.randn(2, 5, m.config.hidden_size, dtype=torch.float64)
    step = m.read_out(hidden)
    rms = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + m.config.rms_norm_eps)
    torch.testing.assert_close(step.state, m.norm.weight * rms)
    assert not torch.allclose(step.state, hidden)  # the two candidates differ
    assert step.hidden is hidden
    assert step.feature is (step.state if norm_output else hidden)
