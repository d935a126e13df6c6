"""The training levers of eagle31.optim: Muon's parameters and step, the schedules, the anchor (L2-SP) and its
refusal without drafter.init_from."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from eagle31.errors import ConfigError
from eagle31.optim import Anchor, Schedule, build_optimizer, lr_lambda, muon_split
from eagle31.trainer import TrainConfig
from tests.helpers import feature_batch, tiny_drafter
from tests.test_trainer import make_trainer

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
MATRICES = {
    "fc.weight",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
}


def trained(trainer) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainer's trained parameters under the drafter's names."""
    return [(n.removeprefix("drafter."), p) for n, p in trainer.model.named_parameters() if p.requires_grad]


def test_muon_takes_the_2d_matrices_and_adamw_the_norms_mask_hidden_and_lm_head():
    drafter = tiny_drafter(parallel_drafting=True, mask_token_id=0)  # with mask_hidden, [1, 3 Ht]
    muon, adamw = muon_split(drafter.named_parameters())
    assert {n for n, _ in muon} == MATRICES
    assert {n for n, _ in adamw} == {
        *(f"fc_norm.{i}.weight" for i in range(3)),
        *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
        "norm.weight",
        "lm_head.weight",
        "mask_hidden",
    }  # the frozen embedding in neither
    optimizers = build_optimizer(drafter.named_parameters(), TrainConfig(optimizer="muon"), torch.device("cpu"))
    stepped = {name: {id(p) for g in o.param_groups for p in g["params"]} for name, o in optimizers.by_name.items()}
    assert stepped == {"adamw": {id(p) for _, p in adamw}, "muon": {id(p) for _, p in muon}}
    assert list(build_optimizer(drafter.named_parameters(), TrainConfig(), torch.device("cpu")).by_name) == ["adamw"]


def test_one_muon_step_orthogonalises_the_matrices_and_leaves_adamws_parameters_as_adamw_does(tmp_path):
    """The first step of both runs sees the same gradients: the parameters AdamW steps come out identical, while
    Muon's matrices take an update whose singular values are near 1 at the scale match_rms_adamw gives
    (lr x 0.2 sqrt(max(A, B))), unlike AdamW's."""
    batch = feature_batch(tiny_drafter(dtype=torch.float32).config, 48, seed=1)
    lr, moved = 1e-3, {}
    for optimizer in ("adamw", "muon"):
        trainer = make_trainer(tmp_path / optimizer, [batch], optimizer=optimizer, lr=lr, muon_weight_decay=0.0)
        before = {n: p.detach().clone() for n, p in trained(trainer)}
        assert trainer.train_step([batch])["finite"]
        moved[optimizer] = {n: p.detach() - before[n] for n, p in trained(trainer)}
    for name, delta in moved["muon"].items():
        if name in MATRICES:
            scale = -lr * 0.2 * math.sqrt(max(delta.shape))
            singular = torch.linalg.svdvals(delta / scale)
            assert 0.3 < singular.min() and singular.max() < 1.3, name
            assert torch.linalg.svdvals(moved["adamw"][name] / scale).max() > 3, name  # AdamW's is no rotation
        else:
            assert torch.equal(delta, moved["adamw"][name]), name


def test_the_schedules_after_warm_up():
    cosine, linear, constant = (lr_lambda(10, 110, s) for s in (Schedule.cosine, Schedule.linear, Schedule.constant))
    for f in (cosine, linear, constant):  # the same warm-up
        assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0) and f(10) == pytest.approx(1.0)
    assert [linear(s) for s in (60, 100, 109, 110, 200)] == pytest.approx([0.5, 0.1, 0.01, 0.0, 0.0])
    assert [constant(s) for s in (60, 109, 110)] == [1.0, 1.0, 1.0]
    assert cosine(60) == pytest.approx(0.55) and cosine(110) == pytest.approx(0.1)


def test_linear_is_transformers_schedule_after_its_warm_up():
    """speculators' linear schedule is transformers' `get_linear_schedule_with_warmup`; past the warm-up, ours."""
    from transformers import get_linear_schedule_with_warmup

    param = torch.nn.Parameter(torch.zeros(1))
    theirs = get_linear_schedule_with_warmup(torch.optim.SGD([param], lr=1.0), 10, 110)
    ours = lr_lambda(10, 110, Schedule.linear)
    assert [theirs.lr_lambdas[0](s) for s in range(10, 111)] == pytest.approx([ours(s) for s in range(10, 111)])


def test_muon_and_adamw_both_follow_the_schedule():
    drafter = tiny_drafter()
    train = TrainConfig(optimizer="muon", schedule="linear", lr=1e-3, muon_lr=2e-2, warmup_steps=2, max_steps=6)
    optimizers = build_optimizer(drafter.named_parameters(), train, torch.device("cpu"))
    seen = []
    for _ in range(6):
        seen.append(optimizers.lrs())
        optimizers.advance()
    factors = [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    assert [s["lr"] for s in seen] == pytest.approx([1e-3 * f for f in factors])
    assert [s["muon_lr"] for s in seen] == pytest.approx([2e-2 * f for f in factors])


def test_the_anchor_adds_its_gradient_and_returns_its_term():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    anchor = Anchor([w], weight=0.5)
    with torch.no_grad():
        w.add_(torch.tensor([0.5, -1.0]))
    w.grad = torch.tensor([1.0, 1.0])
    assert anchor.add_gradient() == pytest.approx(0.5 * (0.25 + 1.0))
    assert torch.equal(w.grad, torch.tensor([1.5, 0.0]))  # + 2 x 0.5 x (w - w0)


def test_the_trainer_logs_the_anchor_and_it_pulls_the_weights_back(tmp_path):
    """With a large weight the weights end nearer where they started than without (the run's own test on an
    exported drafter: tests/train/test_main.py)."""
    batch = feature_batch(tiny_drafter(dtype=torch.float32).config, 24, seed=1)
    distance = {}
    for weight in (0.0, 100.0):
        trainer = make_trainer(tmp_path / str(weight), [batch], lr=1e-2, anchor_weight=weight)
        start = {n: p.detach().clone() for n, p in trained(trainer)}
        results = [trainer.train_step([batch]) for _ in range(4)]
        assert ("anchor" in results[0]) == (weight > 0)
        if weight:
            assert results[0]["anchor"] == 0 and results[-1]["anchor"] > 0  # w = w0 at the first step
        distance[weight] = sum((p.detach() - start[n]).pow(2).sum() for n, p in trained(trainer))
    assert distance[100.0] < 0.5 * distance[0.0]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["train.anchor_weight=0.1"],
            "train.anchor_weight=0.1 anchors the weights to drafter.init_from's, and drafter.init_from is not set",
        ),
        (["train.anchor_weight=-1"], "train.anchor_weight must be >= 0, got -1"),
        (["train.muon_ns_steps=0"], "train.muon_ns_steps must be in 1..99, got 0"),
        (["train.muon_lr=0"], "train.muon_lr must be positive or null, got 0"),
    ],
)
def test_a_bad_lever_is_refused_by_the_plan_in_one_line(overrides, message):
    from eagle31.distributed import init_world
    from eagle31.plan import plan_run
    from eagle31.recipe import load_recipe

    cfg = load_recipe(RECIPES, ["recipe=kimi_k26", "dry_run=true", *overrides])
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")) as e:
        plan_run(cfg, init_world("cpu"))
    assert "\n" not in str(e.value)
