"""`drafter.init_from`: a drafter to fine-tune must mean what the run's drafter means, not only fit its shapes."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle31.errors import ConfigError
from eagle31.pipeline import init_from_checkpoint
from eagle31.plan import check_init_from
from tests.helpers import tiny_config, tiny_drafter

REPO = Path(__file__).resolve().parents[1]


def saved(tmp_path, **overrides) -> str:
    out = tmp_path / "source"
    tiny_drafter(**overrides).save(out)
    return str(out)


def section(path: str, upgrade: bool = False):
    return SimpleNamespace(init_from=path, init_from_format="auto", upgrade_to_eagle31=upgrade)


def test_a_drafter_with_the_same_switches_is_accepted(tmp_path):
    check_init_from(tiny_config(), section(saved(tmp_path)))


@pytest.mark.parametrize(
    "source, message",
    [
        ({"aux_layer_ids": (2, 4, 6)}, "aux_layer_ids is [2, 4, 6] there but [2, 4, 5] in this run"),
        ({"norm_before_residual": True}, "norm_before_residual is True there but False in this run"),
        ({"fc_norm": False, "norm_before_fc": True}, "norm_before_fc is True there but False in this run"),
        ({"norm_output": False}, "norm_output is False there but True in this run"),
        ({"draft_vocab_size": 20}, "draft_vocab_size is 20 there but 24 in this run"),
    ],
)
def test_a_drafter_whose_weights_fit_but_whose_meaning_differs_is_refused(tmp_path, source, message):
    path = saved(tmp_path, **source)
    with pytest.raises(
        ConfigError, match=f"drafter.init_from={path}: " + message.replace("[", r"\[").replace("]", r"\]")
    ):
        check_init_from(tiny_config(), section(path))


def test_the_eagle3_to_31_upgrade_may_change_norm_output_but_not_the_rest(tmp_path):
    eagle3 = saved(tmp_path, fc_norm=False, norm_output=False)
    check_init_from(tiny_config(), section(eagle3, upgrade=True))
    with pytest.raises(ConfigError, match="norm_before_residual is False there but True"):
        check_init_from(tiny_config(norm_before_residual=True), section(eagle3, upgrade=True))


def test_a_shape_that_does_not_fit_is_one_line_naming_the_tensor(tmp_path):
    path = saved(tmp_path, intermediate_size=32)
    drafter = tiny_drafter()
    with pytest.raises(
        ConfigError, match=r"midlayer.mlp.gate_proj.weight is \[32, 16\] there but \[24, 16\] in this run"
    ):
        init_from_checkpoint(drafter, section(path))


def test_the_run_checks_it_before_any_model_is_built(tmp_path):
    from eagle31.distributed import init_world
    from eagle31.plan import plan_run
    from eagle31.recipe import load_recipe

    path = saved(tmp_path)  # aux ids (2, 4, 5); Kimi K2.6's are (2, 30, 58)
    cfg = load_recipe(REPO / "recipes", ["recipe=kimi_k26", "dry_run=true", f"drafter.init_from={path}"])
    with pytest.raises(ConfigError, match=r"aux_layer_ids is \[2, 4, 5\] there but \[2, 30, 58\] in this run"):
        plan_run(cfg, init_world("cpu"))
