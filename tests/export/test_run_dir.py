"""A finished run directory as the pipeline writes it: its config.yaml keeps every setting, masks every credential,
and goes through export, the model card and resume unchanged."""

import json
import runpy
import types
from pathlib import Path

import pytest
import torch
import yaml

from eagle31 import metrics_log
from eagle31.metrics_log import redact_secrets
from eagle31.plan import check_run_dir
from eagle31.recipe import load_recipe, to_container
from tests.helpers import tiny_drafter

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
NAMES = sorted(p.stem for p in (RECIPES / "recipe").glob("*.yaml"))
HF_TOKEN = "hf_abcdefghijklmnopqrstuvwxyzABCDEFGH"
WANDB_KEY = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize("name", NAMES)
def test_every_recipe_setting_survives_redaction(name):
    config = to_container(load_recipe(RECIPES, [f"recipe={name}"]))
    assert redact_secrets(config) == config  # num_speculative_tokens, tokens_per_batch, max_new_tokens, ...


def test_credentials_are_masked_by_what_they_are(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", WANDB_KEY)
    config = {
        "hub": {"token": "anything", "license": "mit"},
        "logging": {"wandb": {"api_key": "anything", "mode": "offline", "entity": None}},
        "data": {
            "source": ["https://user:pa55word@example.org/chat.jsonl", f"hf://datasets/org/d?token={HF_TOKEN}"],
            "shard_max_tokens": 4096,
        },
        "notes": f"key {WANDB_KEY} and {HF_TOKEN}",
        "eval": {"num_speculative_tokens": 3, "max_new_tokens": 64},
    }
    red = redact_secrets(config)
    text = json.dumps(red)
    for secret in ("anything", "pa55word", HF_TOKEN, WANDB_KEY):
        assert secret not in text
    assert red["hub"]["license"] == "mit" and red["logging"]["wandb"]["entity"] is None
    assert red["data"]["source"][0] == "https://***@example.org/chat.jsonl"
    assert red["data"]["shard_max_tokens"] == 4096 and red["eval"] == {
        "num_speculative_tokens": 3,
        "max_new_tokens": 64,
    }


@pytest.fixture
def finished_run(tmp_path, monkeypatch):
    """runs/demo as `pipeline.train_run` leaves it: config.yaml (redacted as it writes it) and drafter/."""
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    run = tmp_path / "runs" / "demo"
    overrides = [
        "recipe=demo",
        f"output_dir={run}",
        "eval.num_speculative_tokens=4",
        "target.revision=${oc.env:HF_TOKEN}",
    ]  # a credential that reached the config by interpolation
    cfg = load_recipe(RECIPES, overrides)
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(redact_secrets(to_container(cfg)), sort_keys=False))
    tiny_drafter(seed=1, dtype=torch.float32).save(run / "drafter")
    return run, overrides


def test_a_finished_run_goes_through_export_card_and_resume(finished_run, capsys):
    run, overrides = finished_run
    main = runpy.run_path(str(REPO / "scripts" / "export.py"), run_name="under_test")["main"]
    out = run / "export" / "again"
    assert main([f"checkpoint={run}", "format=speculators", f"out={out}"]) == 0, capsys.readouterr().err
    exported = json.loads((out / "config.json").read_text())
    assert exported["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4

    push = runpy.run_path(str(REPO / "scripts" / "push_to_hub.py"), run_name="under_test")["main"]
    assert push([f"out={out}", "repo_id=me/demo", "dry_run=true"]) == 0
    card = (out / "README.md").read_text()
    assert '"num_speculative_tokens": 4' in card and "***" not in card

    resumed = types.SimpleNamespace(run_dir=run, cfg=load_recipe(RECIPES, [*overrides, "resume=auto"]))
    check_run_dir(resumed)  # the same run: accepted
    assert yaml.safe_load((run / "config.yaml").read_text())["target"]["revision"] == "***"
    for path in run.rglob("*"):
        if path.is_file():
            assert HF_TOKEN.encode() not in path.read_bytes(), path


# -------------------------------------------------------------------- wandb


class FakeWandb:
    """wandb 0.31's failure modes: `online` without a server raises CommError ("Timed out while retrying: ...")."""

    errors = types.SimpleNamespace(
        CommError=type("CommError", (Exception,), {}),
        UsageError=type("UsageError", (Exception,), {}),
        AuthenticationError=type("AuthenticationError", (Exception,), {}),
    )

    def __init__(self):
        self.modes = []

    def Settings(self, **kwargs):
        return kwargs

    def init(self, mode, settings, **kwargs):
        self.modes.append((mode, settings.get("init_timeout")))
        if mode == "online":
            raise self.errors.CommError(
                'Timed out while retrying: Post "https://api.wandb.ai/graphql": dial tcp: no such host '
                f"key={WANDB_KEY}\nConsider increasing the init_timeout setting"
            )
        return types.SimpleNamespace(mode=mode)


def test_wandb_online_without_network_falls_back_to_offline_with_one_warning(tmp_path, monkeypatch, capsys):
    fake = FakeWandb()
    monkeypatch.setitem(__import__("sys").modules, "wandb", fake)
    monkeypatch.setenv("WANDB_API_KEY", WANDB_KEY)
    run = metrics_log.start_wandb("online", project="p", dir=str(tmp_path), config={})
    assert run.mode == "offline"
    assert fake.modes == [("online", metrics_log.ONLINE_INIT_TIMEOUT_S), ("offline", None)]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: logging.wandb.mode=online could not start")
    assert "wandb sync" in err and WANDB_KEY not in err
