"""Every recipe's export against vLLM's own code, in the oldest and the newest supported release (0.22.0, 0.33.0).

Each recipe's drafter, at tiny widths but with the recipe's rope, context, aux ids, switches and target
family, as a Llama and (for an MLA target) an MLA drafter, with the full and a reduced vocabulary, in every
format the recipe writes. One subprocess per release (`tests/export/vllm_peer.py`, run by that release's
interpreter: `tests/peers.py`) runs vLLM's config pipeline on all of them: `get_config` with
`SpeculativeConfig.hf_config_override`, `EAGLEConfig`, the model registry, `get_rope`, and for the
speculators layout `maybe_override_with_speculators`. The weights are checked against the loader of
vLLM 0.33.0 emulated from its source (`tests/export/vllm_contract.py`), which needs a GPU to run.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle31.config import DrafterConfig
from eagle31.export import export_drafter
from eagle31.plan import drafter_overrides
from eagle31.recipe import load_recipe
from eagle31.target import load_target_config
from eagle31.targets.demo import DemoRecipe
from eagle31.targets.kimi_mini import kimi_k26_mini_config
from tests.export import vllm_contract
from tests.helpers import tiny_drafter
from tests.peers import VLLM_RELEASES, run_peer

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.stem for p in (REPO / "recipes" / "recipe").glob("*.yaml"))
PEER_SCRIPT = (Path(__file__).parent / "vllm_peer.py").read_text()
POSITIONS = [0, 1, 2, 17, 255, 1000, 4095, 4096, 8191, 65535, 262143]
WINDOW = 6  # the extra sliding-window exports' window
PARALLEL_MASK_TOKEN = 7  # the extra parallel exports' mask token
TINY = dict(
    hidden_size=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=4,
    intermediate_size=24,
    vocab_size=40,
    target_hidden_size=16,
)
TINY_MLA = dict(
    num_key_value_heads=4,
    head_dim=10,
    mla=dict(q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5),
)


def recipe_target(name: str, cfg) -> dict:
    """The recipe's target config.json as a dict (the builtin targets' from the code that builds them)."""
    if cfg.target.config:
        return load_target_config(cfg.target.config)
    if name == "kimi_k26_mini":
        return kimi_k26_mini_config(vocab_size=532, bos_token_id=0, eos_token_id=1, pad_token_id=2).to_dict()
    assert name == "demo", f"recipe {name}: no target config to read"
    d = DemoRecipe()
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": d.hidden_size,
        "num_hidden_layers": d.num_hidden_layers,
        "num_attention_heads": d.num_attention_heads,
        "num_key_value_heads": d.num_key_value_heads,
        "intermediate_size": d.intermediate_size,
        "max_position_embeddings": d.max_position_embeddings,
        "vocab_size": d.vocab_size,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }


def recipe_cases(name: str) -> list[dict]:
    """The exports of recipe `name`: (drafter type x vocabulary x format) at tiny widths."""
    cfg = load_recipe(REPO / "recipes", [f"recipe={name}", "output_dir=/unused"])
    target = recipe_target(name, cfg)
    overrides = drafter_overrides(cfg.drafter)
    text = target.get("text_config") or target
    attentions = ["llama", "mla"] if "kv_lora_rank" in text else ["llama"]
    cases = []
    for attention in attentions:
        shape = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "draft_vocab_size")
        o = {k: v for k, v in overrides.items() if k not in shape}
        o["attention"] = attention
        if attention == "mla":  # vLLM's DeepSeek layer serves no window: refused (test_an_mla_window_is_not_served)
            o.pop("sliding_window", None)
        drafter = DrafterConfig.from_target_config(target, **o)
        if int(cfg.data.max_len) > drafter.max_position_embeddings:  # eagle31.plan.plan_run
            drafter = dataclasses.replace(drafter, max_position_embeddings=int(cfg.data.max_len))
        for vocab in ("full", "reduced"):
            shape = {
                **TINY,
                **(TINY_MLA if attention == "mla" else {}),
                "draft_vocab_size": 40 if vocab == "full" else 24,
            }
            config = {**dataclasses.asdict(dataclasses.replace(drafter, **shape))}
            for fmt in cfg.export.formats:
                if attention == "mla" and fmt != "eagle3":
                    # the speculators layout cannot carry an MLA drafter (refused, tests/export/test_mla_export.py)
                    continue
                cases.append(
                    {
                        "id": f"{name}-{attention}-{vocab}-{fmt}",
                        "recipe": name,
                        "config": config,
                        "format": str(fmt),
                        "max_len": int(cfg.data.max_len),
                        "target_max_positions": int(text.get("max_position_embeddings", 4096)),
                        "target_name": cfg.target.name or "org/target",
                    }
                )
    return cases


CASES = [case for name in RECIPES for case in recipe_cases(name)]


def export_case(case: dict, out: Path):
    config = dict(case["config"])
    config["aux_layer_ids"] = tuple(config["aux_layer_ids"])
    drafter = tiny_drafter(seed=3, dtype=torch.float32, **config)
    export_drafter(
        drafter,
        out,
        case["format"],
        dtype="float32",
        trained_context=case["max_len"],
        target_name_or_path=case["target_name"],
    )
    return drafter


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{case id: (case, drafter, export dir)} plus the extra exports the single-purpose tests read."""
    root = tmp_path_factory.mktemp("exports")
    made = {case["id"]: (case, export_case(case, root / case["id"]), root / case["id"]) for case in CASES}
    mla = next(c for c in CASES if c["config"]["attention"] == "mla")
    old = root / "mla-deepseek_v3"  # an MLA export as eagle31 wrote it before: model_type deepseek_v3
    export_case(mla, old)
    config = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({**config, "model_type": "deepseek_v3"}))
    speculators = next(c for c in CASES if c["format"] == "speculators")
    local = root / "speculators-local-verifier"
    with pytest.warns(UserWarning, match="is a local path, which `vllm serve <export>` .vLLM 0.33. refuses"):
        export_case({**speculators, "target_name": str(root)}, local)  # a local target directory as the verifier
    windows = {}
    for fmt in ("eagle3", "speculators"):  # a drafter with a sliding window, in both layouts
        windows[fmt] = root / f"window-{fmt}"
        export_case(
            {**speculators, "config": {**speculators["config"], "sliding_window": WINDOW}, "format": fmt}, windows[fmt]
        )
    mla_window = root / "mla-window"  # what eagle31 refuses to write: an MLA export carrying a window
    export_case(mla, mla_window)
    config = json.loads((mla_window / "config.json").read_text())
    (mla_window / "config.json").write_text(
        json.dumps({**config, "sliding_window": WINDOW, "layer_types": ["sliding_attention"]})
    )
    extra = {"deepseek_v3": old, "local_verifier": local, "mla_window": mla_window}
    for fmt in ("eagle3", "speculators"):  # a parallel (P-EAGLE) drafter, in both layouts
        extra[f"parallel_{fmt}"] = root / f"parallel-{fmt}"
        parallel = {**speculators["config"], "parallel_drafting": True, "mask_token_id": PARALLEL_MASK_TOKEN}
        export_case({**speculators, "config": parallel, "format": fmt}, extra[f"parallel_{fmt}"])
    return made, {**extra, **{f"window_{fmt}": d for fmt, d in windows.items()}}


@pytest.fixture(scope="module", params=VLLM_RELEASES)
def vllm_reads(request, exports, tmp_path_factory):
    """(release, {export dir: what that release's code makes of it}, SpeculativeConfig's declared fields)."""
    made, extra = exports
    ask = tmp_path_factory.mktemp("peer") / "request.json"
    dirs = [str(d) for _, _, d in made.values()] + [str(d) for d in extra.values()]
    ask.write_text(json.dumps({"exports": dirs, "positions": POSITIONS}))
    answer = run_peer(request.param, PEER_SCRIPT, str(ask), timeout=600)
    assert answer["version"] == request.param
    return request.param, answer["exports"], answer["speculative_config_fields"]


def test_the_cases_cover_every_recipe_both_drafter_types_both_vocabularies_and_formats():
    assert {c["recipe"] for c in CASES} == set(RECIPES)
    kinds = {(c["config"]["attention"], c["config"]["draft_vocab_size"] == 40, c["format"]) for c in CASES}
    assert kinds == {
        ("llama", True, "eagle3"),
        ("llama", False, "eagle3"),
        ("llama", True, "speculators"),
        ("llama", False, "speculators"),
        ("mla", True, "eagle3"),
        ("mla", False, "eagle3"),
    }


@pytest.mark.slow  # vLLM's own code: one subprocess per release (~1 min each on 2 cores)
def test_vllm_builds_every_export_as_the_drafter_it_is(vllm_reads, exports):
    release, read, _ = vllm_reads
    made, _ = exports
    for case_id, (case, drafter, out) in made.items():
        got = read[str(out)]
        assert "error" not in got and "crash" not in got, (case_id, got)
        c = drafter.config
        expected = {"mla": ["Eagle3DeepseekV2ForCausalLM"], "llama": ["LlamaForCausalLMEagle3"]}[c.attention]
        if case["format"] == "speculators":  # the peagle type: vLLM's alias of Eagle3LlamaForCausalLM
            expected = ["PeagleLlamaForCausalLM" if c.parallel_drafting else "Eagle3LlamaForCausalLM"]
        assert got["eagle_architectures"] == expected and got["registered"], (case_id, got["eagle_architectures"])
        f = got["fields"]
        # v1/worker/gpu/spec_decode/eagle/eagle3_utils.py::get_eagle3_aux_layers_from_config (0.33.0's default
        # runner) reads the ids at the top level only
        assert f["eagle_aux_hidden_state_layer_ids"] == list(c.aux_layer_ids), case_id
        assert f.get("num_aux_hidden_states") == c.num_aux and not f.get("eagle_config"), case_id
        assert f.get("target_hidden_size", f["hidden_size"]) == c.target_hidden_size, case_id
        assert (f["draft_vocab_size"], f["vocab_size"]) == (c.draft_vocab_size, c.vocab_size), case_id
        for flag in ("fc_norm", "norm_output", "norm_before_residual"):
            assert f.get(flag, False) == getattr(c, flag), (case_id, flag)
        if c.attention == "mla":
            assert got["model_type"] == "kimi_k2" and got["config_class"] == "DeepseekV3Config", case_id
            for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                assert f[name] == getattr(c.mla, name), (case_id, name)
        assert f["max_position_embeddings"] >= case["max_len"], case_id
        assert got["attention_window"] == c.sliding_window, case_id  # the recipes' windows, or none


@pytest.mark.slow  # vLLM's own code: one subprocess per release (~1 min each on 2 cores)
def test_each_release_builds_the_draft_attention_with_the_exported_window(vllm_reads, exports):
    """`llama.py::LlamaAttention.__init__` on the parsed export hands its `Attention` the drafter's window, in both
    layouts; a full-attention export gets none (`test_vllm_builds_every_export_as_the_drafter_it_is`)."""
    release, read, _ = vllm_reads
    _, extra = exports
    for fmt in ("eagle3", "speculators"):
        got = read[str(extra[f"window_{fmt}"])]
        assert got.get("registered") and got["attention_window"] == WINDOW, (release, fmt, got.get("attention_window"))
        assert got["fields"]["layer_types"] == ["sliding_attention"], (release, fmt)


@pytest.mark.slow  # vLLM's own code: one subprocess per release (~1 min each on 2 cores)
def test_each_release_serves_a_parallel_drafter_with_its_mask_token_and_a_chain_drafter_without_one(
    vllm_reads, exports
):
    """vLLM's parallel drafting reads the export's mask token (the EAGLE-3 layout's mask_token_id; the speculators
    layout's peagle type, which vLLM serves as eagle3 with parallel_drafting); a chain export names none."""
    release, read, _ = vllm_reads
    made, extra = exports
    for fmt in ("eagle3", "speculators"):
        got = read[str(extra[f"parallel_{fmt}"])]
        assert got["registered"] and got["parallel_drafting"] == {"token_id": PARALLEL_MASK_TOKEN}, (release, fmt, got)
    serve = read[str(extra["parallel_speculators"])]["serve"]["speculative_config"]
    assert serve["method"] == "eagle3" and serve["parallel_drafting"] is True, (release, serve)
    for case, drafter, path in made.values():  # recipe=demo_parallel's exports are parallel too
        if drafter.config.parallel_drafting:
            token = {"token_id": drafter.config.mask_token_id}
            assert read[str(path)]["parallel_drafting"] == token, (release, case["id"])
        else:
            assert "error" in read[str(path)]["parallel_drafting"], (release, case["id"])


@pytest.mark.slow
def test_an_mla_window_is_not_served(vllm_reads, exports):
    """Why eagle31 refuses an MLA drafter with a window: vLLM's DeepSeek EAGLE-3 layer builds its MLA attention
    without reading one, so the export would be served with full attention."""
    release, read, _ = vllm_reads
    _, extra = exports
    got = read[str(extra["mla_window"])]
    assert got.get("registered") and got["fields"].get("sliding_window") == WINDOW, release  # parsed, then unread
    assert got["attention_window"] is None, release


@pytest.mark.slow  # vLLM's own code: one subprocess per release (~1 min each on 2 cores)
def test_the_emulated_0_33_loader_finds_every_tensor_it_expects_and_nothing_else(vllm_reads, exports):
    """`AutoWeightsLoader` (0.33.0) refuses a tensor no parameter takes, a d2t for a full vocabulary among them."""
    release, read, _ = vllm_reads
    made, _ = exports
    for case_id, (_, drafter, out) in made.items():
        fields = read[str(out)]["fields"]
        view = {**fields, "architectures": read[str(out)]["eagle_architectures"]}
        expected = vllm_contract.expected_params(view, drafter.config.parallel_drafting)
        loaded = vllm_contract.loaded_shapes(load_file(str(out / "model.safetensors")))
        assert set(loaded) <= set(expected), (case_id, set(loaded) - set(expected))
        missing = set(expected) - set(loaded)
        assert missing <= {"model.embed_tokens.weight"}, (case_id, missing)  # the target's is shared
        assert all(loaded[k] == expected[k] for k in loaded), case_id
        assert ("draft_id_to_target_id" in expected) == (drafter.config.draft_vocab_size < drafter.config.vocab_size)


def _ours(drafter, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's cos, sin [P, d/2] as the table rows vLLM builds ([cos | sin] of each frequency once)."""
    cos, sin = drafter.rotary_emb(torch.tensor([positions]), torch.float64)
    cos, sin = cos[0], sin[0]
    if drafter.config.attention == "mla":  # each frequency on a pair
        return cos[:, ::2], sin[:, ::2]
    half = cos.shape[-1] // 2  # neox: both halves alike
    return cos[:, :half], sin[:, :half]


@pytest.mark.slow  # vLLM's own code: one subprocess per release (~1 min each on 2 cores)
def test_every_drafter_trains_with_the_rope_and_scale_each_release_serves(vllm_reads, exports):
    """vLLM's own `get_rope` table, rows at positions up to 262143, against the drafter's rope; and the MLA
    softmax-scale factor its DeepSeek attention applies for that rope type."""
    release, read, _ = vllm_reads
    made, _ = exports
    for case_id, (_, drafter, out) in made.items():
        table = read[str(out)]["rope_table"]
        positions = [p for p in POSITIONS if p < table["table_len"]]
        rows = torch.tensor(table["rows"], dtype=torch.float64)
        half = rows.shape[-1] // 2
        cos, sin = _ours(drafter.double(), positions)
        # vLLM builds its table in float32: at position 262143 an angle carries ~1e-5 of rounding
        torch.testing.assert_close(
            cos, rows[:, :half], rtol=0, atol=1e-4, msg=lambda m, case_id=case_id: f"{case_id}: {m}"
        )
        torch.testing.assert_close(
            sin, rows[:, half:], rtol=0, atol=1e-4, msg=lambda m, case_id=case_id: f"{case_id}: {m}"
        )
        if drafter.config.attention == "mla":
            rope = table["rope"]
            softmax = 1.0
            if rope["rope_type"] == "deepseek_yarn":  # deepseek_v2.py::DeepseekV2MLAAttention.__init__
                softmax = vllm_contract.yarn_get_mscale(rope["factor"], float(rope.get("mscale_all_dim", 0))) ** 2
            assert drafter.midlayer.self_attn.q_scale == pytest.approx(softmax, rel=1e-9), case_id


@pytest.mark.slow  # vLLM's own code: one subprocess per release (~1 min each on 2 cores)
def test_the_served_context_is_not_capped_below_the_targets(vllm_reads, exports):
    """0.33.0 limits max_model_len to a yarn (not cache-only) draft's max_position_embeddings
    (`SpeculativeConfig._maybe_override_draft_max_position_embeddings`, `VllmConfig`)."""
    release, read, _ = vllm_reads
    made, _ = exports
    for case_id, (case, _, out) in made.items():
        got = read[str(out)]
        if got.get("rope_only_sizes_cache") is False:
            assert got["fields"]["max_position_embeddings"] >= case["target_max_positions"], case_id
    if release != "0.22.0":
        assert any(read[str(out)].get("rope_only_sizes_cache") is False for _, _, out in made.values())


@pytest.mark.slow  # vLLM's own code: one subprocess per release (~1 min each on 2 cores)
def test_an_mla_export_of_model_type_deepseek_v3_is_not_served_by_either_release(vllm_reads, exports):
    """Why the MLA export says kimi_k2: hf_config_override turns deepseek_v3 into DeepSeek's MTP drafter."""
    _, read, _ = vllm_reads
    _, extra = exports
    got = read[str(extra["deepseek_v3"])]
    assert got["eagle_architectures"] == ["Eagle3DeepSeekMTPModel"] and not got["registered"]


@pytest.mark.slow  # vLLM's own code: one subprocess per release (~1 min each on 2 cores)
def test_vllm_serve_of_a_speculators_export_resolves_its_verifier(vllm_reads, exports):
    release, read, _ = vllm_reads
    made, extra = exports
    for case_id, (case, _, out) in made.items():
        if case["format"] == "speculators":
            serve = read[str(out)]["serve"]
            assert serve["model"] == case["target_name"], case_id
            assert serve["speculative_config"]["method"] == "eagle3", case_id
            assert serve["speculative_config"]["num_speculative_tokens"] >= 1, case_id
    local = read[str(extra["local_verifier"])]["serve"]
    if release == "0.22.0":
        assert "error" not in local
    else:  # transformers_utils/config.py::maybe_override_with_speculators (0.33.0)
        assert "must name a remote model repository" in local["error"]


# ------------------------------------------------------------------ the documented serving commands

DOC = REPO / "docs" / "export.md"
SERVE = re.compile(r"vllm serve (\S+)[^\n]*? --speculative-config '(\{[^\n]*?\})'")


def documented_commands() -> list[tuple[str, dict]]:
    return [(m.group(1), json.loads(m.group(2))) for m in SERVE.finditer(DOC.read_text())]


def test_docs_give_a_serving_command_per_layout_and_drafter_type():
    commands = documented_commands()
    # runs/<recipe>/export/<format>: recipe=kimi_k26 trains the MLA drafter
    kinds = {
        (spec["method"], "mla" if "/kimi_k26/" in spec["model"] else "llama", spec["model"].endswith("/speculators"))
        for _, spec in commands
    }
    assert {("eagle3", "llama", False), ("eagle3", "mla", False), ("eagle3", "llama", True)} <= kinds, kinds
    for target, spec in commands:  # each serves its recipe's target
        recipe = spec["model"].split("/")[1]
        assert load_recipe(REPO / "recipes", [f"recipe={recipe}"]).target.name == target, (recipe, target)


@pytest.mark.slow  # vLLM's own code: one subprocess per release (~1 min each on 2 cores)
def test_the_documented_speculative_configs_are_fields_vllm_declares(vllm_reads):
    release, _, declared = vllm_reads
    for _, spec in documented_commands():
        assert set(spec) <= set(declared), (release, set(spec) - set(declared))
        assert spec["method"] == "eagle3" and "eagle3" in declared["method"], release
        assert isinstance(spec["num_speculative_tokens"], int) and spec["num_speculative_tokens"] >= 1


def assert_vllm_serves(export_dir: Path, work_dir: Path) -> None:
    """Both releases' config pipeline accepts the export at `export_dir` as the drafter eagle31 reads back from it,
    and 0.33.0's emulated loader takes exactly its tensors (for a finished run's export)."""
    from eagle31.convert import load_drafter

    drafter = load_drafter(export_dir)
    ask = work_dir / "request.json"
    ask.write_text(json.dumps({"exports": [str(export_dir)], "positions": POSITIONS}))
    for release in VLLM_RELEASES:
        got = run_peer(release, PEER_SCRIPT, str(ask), timeout=600)["exports"][str(export_dir)]
        assert got.get("registered"), (release, got)
        f = got["fields"]
        assert f["eagle_aux_hidden_state_layer_ids"] == list(drafter.config.aux_layer_ids), release
        assert (f["fc_norm"], f["norm_output"]) == (drafter.config.fc_norm, drafter.config.norm_output), release
        view = {**f, "architectures": got["eagle_architectures"]}
        expected = vllm_contract.expected_params(view, drafter.config.parallel_drafting)
        loaded = vllm_contract.loaded_shapes(load_file(str(export_dir / "model.safetensors")))
        assert set(loaded) <= set(expected) and set(expected) - set(loaded) <= {"model.embed_tokens.weight"}, release
        assert all(loaded[k] == expected[k] for k in loaded), release
