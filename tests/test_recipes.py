"""Every recipe composes; the demo and the miniature Kimi recipes run end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle31.config import DrafterConfig
from eagle31.recipe import load_recipe
from eagle31.target import load_target_config

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
NAMES = sorted(p.stem for p in (RECIPES / "recipe").glob("*.yaml"))


def test_the_expected_recipes_exist():
    assert set(SUPPORTED) | {
        "demo",
        "demo_long",
        "demo_parallel",
        "kimi_k26_mini",
        "llama31_8b_parallel",
        "smollm2_135m",
    } == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_recipe_composes_and_names_itself(name):
    cfg = load_recipe(RECIPES, [f"recipe={name}"])
    assert cfg.name == name
    assert cfg.output_dir == f"runs/{name}"
    assert cfg.train.ttt_length >= 1 and cfg.features.mode in ("online", "store")


# the recipes of full-size targets: (Hub id, layers, aux ids), each from its config.json as published
SUPPORTED = {
    "llama31_8b": ("meta-llama/Llama-3.1-8B-Instruct", 32, (2, 16, 29)),
    "llama31_70b": ("meta-llama/Llama-3.1-70B-Instruct", 80, (2, 40, 77)),
    "qwen3_8b": ("Qwen/Qwen3-8B", 36, (2, 18, 33)),
    "qwen3_30b_a3b": ("Qwen/Qwen3-30B-A3B", 48, (2, 24, 45)),
    "gpt_oss_20b": ("openai/gpt-oss-20b", 24, (2, 12, 21)),
    "gpt_oss_120b": ("openai/gpt-oss-120b", 36, (2, 18, 33)),
    "kimi_k26": ("moonshotai/Kimi-K2.6", 61, (2, 30, 58)),
    "kimi_k26_llama": ("moonshotai/Kimi-K2.6", 61, (2, 30, 58)),
    "deepseek_v3": ("deepseek-ai/DeepSeek-V3", 61, (2, 30, 58)),
}


@pytest.mark.parametrize("name", SUPPORTED)
def test_gpu_recipes_ship_their_target_config(name):
    """Each names its Hub id (in its comment too, where its config comes from) and ships that config, read
    with no download; a target spread over a node (`target.device_map`) never trains online."""
    hub_id, layers, aux = SUPPORTED[name]
    cfg = load_recipe(RECIPES, [f"recipe={name}"])
    assert cfg.target.name == hub_id and f"{hub_id}'s config.json" in (RECIPES / "recipe" / f"{name}.yaml").read_text()
    assert Path(cfg.target.config).parent == RECIPES / "targets" and cfg.target.path is None
    assert not (cfg.target.device_map and cfg.features.mode == "online")
    target = load_target_config(cfg.target.config)
    overrides = {
        k: v
        for k, v in dict(cfg.drafter).items()
        if k in {f for f in DrafterConfig.__dataclass_fields__} and v is not None
    }
    if overrides.get("aux_layer_ids"):
        overrides["aux_layer_ids"] = tuple(overrides["aux_layer_ids"])
    drafter = DrafterConfig.from_target_config(target, **overrides)
    assert drafter.target_num_layers == layers and drafter.aux_layer_ids == aux
    assert drafter.fc_norm and drafter.norm_output


def train_main(
    *args: str, timeout: int = 1500
) -> subprocess.CompletedProcess:  # a hang guard: a loaded 2-core machine needs ~10 min
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, str(REPO / "train" / "main.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=timeout,
    )


@pytest.mark.slow
def test_demo_recipe_end_to_end(tmp_path):
    """`python train/main.py` (recipe=demo): prepare -> features -> train -> export -> acceptance, at a
    sixth of the recipe's 300 steps (the drafter passes these bars after 50; the suite's time is bounded)."""
    out = tmp_path / "demo"
    proc = train_main(f"output_dir={out}", "logging.wandb.mode=offline", "train.max_steps=50")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"run directory: {out}" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    print(f"demo: tau_sim {report['tau_sim']:.2f}, acc {report['acc']}, wall {report['wall_time_s']:.0f} s")
    assert report["steps"] == 50
    assert report["tau_sim"] > 1.5  # the drafter learns the target (2.96 measured after the recipe's 300 steps)
    real = {r["split"]: r["tau"] for r in report["acceptance"]["results"]}
    print(f"real acceptance (k=3): {real}")
    assert set(real) == {"heldout", "other_system", "long_prompt"}
    assert real["heldout"] > 1.5
    for fmt in ("eagle3", "speculators"):
        assert (out / "export" / fmt / "model.safetensors").is_file()
    assert (out / "acceptance" / "acceptance.png").is_file()
    assert list((out / "wandb").glob("offline-run-*")), "wandb logs offline by default"


@pytest.mark.slow
def test_kimi_k26_mini_recipe_trains_and_exports(tmp_path):
    out = tmp_path / "kimi"
    proc = train_main("recipe=kimi_k26_mini", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 8
    config = json.loads((out / "export" / "eagle3" / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["rope_scaling"]["rope_type"] == "yarn"
    # the MLA drafter, full vocabulary, in vLLM's DeepSeek EAGLE-3 layout only
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["kv_lora_rank"] == 16
    assert config["draft_vocab_size"] == config["vocab_size"] == 532
    assert not (out / "export" / "speculators").exists()
    assert config["model_type"] == "kimi_k2"  # vLLM would make DeepSeek's MTP drafter of deepseek_v3
    # vLLM 0.22.0's and 0.33.0's own config code accept it; 0.33.0's loader takes exactly its tensors
    from tests.export.test_vllm_peers import assert_vllm_serves

    assert_vllm_serves(out / "export" / "eagle3", tmp_path)
    # reload the export and decode speculatively with the miniature Kimi target
    from eagle31.eval.acceptance import AcceptanceConfig, run_acceptance
    from eagle31.targets.kimi_mini import ensure_kimi_k26_mini

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Write a python function that adds two numbers."}]}) + "\n"
    )
    acceptance = run_acceptance(
        AcceptanceConfig(
            drafter=str(out / "export" / "eagle3"),
            target=str(ensure_kimi_k26_mini()),
            data=str(prompts),
            k=3,
            max_new_tokens=24,
            out=str(tmp_path / "acceptance"),
        ),
        log=lambda _: None,
    )
    (result,) = acceptance["results"]
    print(f"kimi_k26_mini MLA drafter: tau {result['tau']:.2f} after {report['steps']} steps")
    assert result["prompts"] == 1 and 0 < result["generated_tokens"] <= 24 and result["tau"] >= 1.0


def test_smollm2_recipe_trains_on_sharegpt_regenerated_by_its_target():
    cfg = load_recipe(RECIPES, ["recipe=smollm2_135m", "output_dir=/x"])
    assert cfg.target.builtin == "smollm2_135m" and cfg.regenerate.source == "sharegpt:"
    assert list(cfg.data.source) == ["/x/regenerated/conversations"]
    # a regenerated first turn (prompt, reply, the system prompt) is never cut by prepare
    assert cfg.regenerate.max_prompt_tokens + cfg.regenerate.max_new_tokens + 64 <= cfg.data.max_len


@pytest.mark.slow
def test_the_supported_targets_table_is_the_recipes():
    """docs/targets.md's table, built again from each recipe and the config.json shipped beside it: every recipe of
    a Hub target has its row, and each row's architecture, layers, aux ids, drafter, features, layouts and vLLM
    release are the recipe's."""
    from eagle31.attention import KINDS
    from eagle31.layouts import LAYOUTS

    rows = {
        cells[0].strip("`"): cells[1:]
        for line in (REPO / "docs" / "targets.md").read_text().splitlines()
        if line.startswith("| `")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    recipes = {name: load_recipe(RECIPES, [f"recipe={name}"]) for name in NAMES}
    assert sorted(rows) == [name for name, cfg in recipes.items() if not cfg.target.name.startswith("eagle31/")]
    for name, cells in rows.items():
        cfg = recipes[name]
        config = json.loads(Path(cfg.target.config).read_text())
        overrides = {
            k: v
            for k, v in dict(cfg.drafter).items()
            if k in {f for f in DrafterConfig.__dataclass_fields__} and v is not None
        }
        if overrides.get("aux_layer_ids"):
            overrides["aux_layer_ids"] = tuple(overrides["aux_layer_ids"])
        drafter = DrafterConfig.from_target_config(load_target_config(cfg.target.config), **overrides)
        kind = KINDS[str(drafter.attention)]
        formats = [str(f) for f in cfg.export.formats]
        served = max(
            (
                kind.min_vllm_fc_norm if drafter.fc_norm and kind.min_vllm_fc_norm else LAYOUTS[f].min_vllm
                for f in formats
            ),
            key=lambda v: tuple(map(int, v.split("."))),
        )
        spread = "one target per node" if cfg.target.device_map else "a target per GPU"
        expected = [
            cfg.target.name,
            config["architectures"][0],
            str(drafter.target_num_layers),
            ", ".join(map(str, drafter.aux_layer_ids)),
            str(drafter.attention) + (", parallel (P-EAGLE)" if drafter.parallel_drafting else ""),
            f"{cfg.features.mode}, {spread}",
            ", ".join(formats),
            f">= {served}",
        ]
        assert cells == expected, name
