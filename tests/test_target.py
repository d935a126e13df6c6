"""eagle31.target: one reading of a target's config, shape and aux ids for every caller."""

import json
from pathlib import Path

import pytest
import torch

from eagle31.config import DrafterConfig
from eagle31.errors import ConfigError
from eagle31.eval.acceptance import check_drafter_fits
from eagle31.target import check_aux_layer_ids, inference_device_and_dtype, target_shape, target_vocab_size, text_config

RECIPES = Path(__file__).resolve().parents[1] / "recipes"

LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 8,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 300,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
}
WRAPPED = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": LLAMA}


def test_a_multimodal_wrapper_is_read_as_its_language_model(tmp_path):
    assert text_config(WRAPPED) is LLAMA and text_config(LLAMA) is LLAMA
    assert target_shape(WRAPPED) == target_shape(LLAMA) == (8, 64)
    (tmp_path / "config.json").write_text(__import__("json").dumps(WRAPPED))
    assert target_vocab_size(tmp_path) == 300
    assert target_vocab_size(tmp_path / "missing") is None
    drafter = DrafterConfig.from_target_config(WRAPPED)
    assert drafter.target_num_layers == 8 and drafter.target_architectures == ("KimiK25ForConditionalGeneration",)


def test_one_aux_id_check_for_capture_and_evaluation():
    check_aux_layer_ids((2, 3, 5), 6)
    with pytest.raises(ConfigError, match=r"^aux_layer_ids \[6\] out of range for a 6-layer target$"):
        check_aux_layer_ids((2, 6), 6)
    with pytest.raises(ConfigError, match="distinct and increasing"):
        check_aux_layer_ids((3, 2), 6)
    drafter = DrafterConfig.from_target_config(LLAMA, aux_layer_ids=(1, 2, 5))
    check_drafter_fits(drafter, LLAMA, "d")
    with pytest.raises(ConfigError, match=r"^drafter d: aux_layer_ids \[5\] out of range for a 4-layer target$"):
        check_drafter_fits(drafter, {**LLAMA, "num_hidden_layers": 4}, "d")


def test_inference_device_and_dtype_choices():
    assert inference_device_and_dtype("cpu", "auto") == (torch.device("cpu"), torch.float32)
    assert inference_device_and_dtype("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ConfigError, match="dtype must be auto"):
        inference_device_and_dtype("cpu", "int8")


def test_the_tokenizer_fingerprint_follows_the_tokenizer_files_not_the_folder(tmp_path, llama_tok):
    """Two copies of one tokenizer agree wherever they are; a changed vocabulary, a missing file or a folder
    without a tokenizer are told apart; the weights do not enter it."""
    import json
    import shutil

    from eagle31.target import tokenizer_fingerprint

    llama_tok.save_pretrained(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    (tmp_path / "copy" / "model.safetensors").write_bytes(b"not a tokenizer file")
    assert tokenizer_fingerprint(tmp_path / "copy") == tokenizer_fingerprint(tmp_path / "a")
    swapped = json.loads((tmp_path / "a" / "tokenizer.json").read_text())
    vocab = swapped["model"]["vocab"]
    vocab["A"], vocab["B"] = vocab["B"], vocab["A"]
    (tmp_path / "copy" / "tokenizer.json").write_text(json.dumps(swapped))
    (tmp_path / "empty").mkdir()
    shutil.copytree(tmp_path / "a", tmp_path / "no_template")
    (tmp_path / "no_template" / "chat_template.jinja").unlink()
    prints = {tokenizer_fingerprint(tmp_path / name) for name in ("a", "copy", "empty", "no_template")}
    assert len(prints) == 4


def test_the_target_fingerprint_sees_every_tensor_not_how_the_files_split_them(tmp_path):
    """A checkpoint whose one layer's q_proj differs (everything else the same) gets another fingerprint, and an
    inference worker reading it is refused; the same weights in three files get the same one."""
    from eagle31.engine.worker import WorkerInfo, expected_info, worker_mismatch
    from eagle31.target import target_fingerprint, target_fingerprints
    from tests.tiny_targets import tiny_llama

    model = tiny_llama(seed=0)
    model.save_pretrained(tmp_path / "recipe")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    with torch.no_grad():
        model.model.layers[3].self_attn.q_proj.weight.mul_(1.01)  # a fine-tune of one tensor of one layer
    model.save_pretrained(tmp_path / "one_layer_differs")
    recipe = target_fingerprint(tmp_path / "recipe")
    assert target_fingerprint(tmp_path / "sharded") == recipe
    assert target_fingerprint(tmp_path / "one_layer_differs") != recipe

    expected = expected_info(tmp_path / "recipe", [1, 3, 4], 32, "float32")
    worker = WorkerInfo("hf", (1, 3, 4), 32, "float32", "cpu", **target_fingerprints(tmp_path / "one_layer_differs"))
    assert worker_mismatch(worker, expected, tmp_path / "recipe").startswith(
        f"runs a target whose weights or config differ from the recipe's target {tmp_path / 'recipe'} (fingerprint "
    )


KIMI_TOKENIZER_CONFIG = {
    "tokenizer_class": "TikTokenTokenizer",
    "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
}


def kimi_like_target(root: Path) -> Path:
    """Kimi K2.6's published config.json and a tokenizer_config.json whose tokenizer is code of its own."""
    root.mkdir()
    (root / "config.json").write_text((RECIPES / "targets" / "kimi_k26.json").read_text())
    (root / "tokenizer_config.json").write_text(json.dumps(KIMI_TOKENIZER_CONFIG))
    return root


def test_a_target_that_needs_its_own_code_is_named_before_anything_loads(tmp_path):
    """Kimi's tiktoken tokenizer; a model_type transformers lacks; not DeepSeek-V3, whose auto_map transformers
    replaces with its own deepseek_v3."""
    from eagle31.data.prepare import prepare_with_target_tokenizer
    from eagle31.target import check_remote_code, remote_code

    kimi = kimi_like_target(tmp_path / "kimi")
    assert remote_code(kimi) == "tokenizer (TikTokenTokenizer)"
    with pytest.raises(
        ConfigError, match=r"tokenizer \(TikTokenTokenizer\) is code shipped .* target.trust_remote_code=true"
    ):
        prepare_with_target_tokenizer(None, kimi, trust_remote_code=False, draft_vocab_size=8, vocab_size=None)
    check_remote_code(kimi, True)
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"model_type": "my_arch", "auto_map": {"AutoConfig": "configuration_my.MyConfig"}}))
    assert remote_code(unknown) == "model (model_type my_arch)"
    assert remote_code(RECIPES / "targets" / "deepseek_v3.json") is None


@pytest.mark.slow
def test_kimi_recipes_trust_the_tokenizers_code_and_a_dry_run_without_it_says_so(tmp_path, capsys):
    from eagle31.pipeline import run
    from eagle31.recipe import load_recipe
    from eagle31_cli import recipe_main

    assert all(load_recipe(RECIPES, [f"recipe={r}"]).target.trust_remote_code for r in ("kimi_k26", "kimi_k26_llama"))
    argv = ["recipe=kimi_k26", "dry_run=true", f"target.path={kimi_like_target(tmp_path / 'kimi')}"]
    assert recipe_main(run, RECIPES, [*argv, "target.trust_remote_code=false"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("set target.trust_remote_code=true to run it\n"), err
    assert recipe_main(run, RECIPES, argv) == 0
