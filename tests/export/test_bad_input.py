"""Damaged or hand-edited inputs of export and evaluation: one line naming the file and the field, exit 2, never a
traceback."""

import json
import runpy
import types
from pathlib import Path

import pytest

from eagle31 import ConfigError
from eagle31.convert import load_drafter, read_drafter_config
from eagle31.eval.acceptance import load_prompts
from eagle31.export import export_drafter
from eagle31.plan import check_run_dir
from tests.helpers import tiny_drafter

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def export_script(argv, capsys):
    """Run scripts/export.py in-process; returns (exit code, stderr)."""
    code = runpy.run_path(str(SCRIPTS / "export.py"), run_name="under_test")["main"](argv)
    return code, capsys.readouterr().err


def edit_drafter_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["drafter"].update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(hidden_size=32, head_dim=8),
            r"embed_tokens.weight has shape \(40, 16\).*\(vocab_size, hidden_size\) makes it \(40, 32\)",
        ),
        (dict(aux_layer_ids=[1, 2, 4, 5]), r"fc.weight has shape \(16, 48\).*aux_layer_ids\) makes it \(16, 64\)"),
        (dict(draft_vocab_size=30), r"d2t has shape \(24,\).*\(draft_vocab_size\) makes it \(30,\)"),
    ],
)
def test_a_hand_edited_drafter_config_names_the_tensor_and_the_fields(tmp_path, capsys, changes, message):
    tiny_drafter(seed=1).save(tmp_path / "d")
    edit_drafter_config(tmp_path / "d", **changes)
    with pytest.raises(ConfigError, match=message):
        load_drafter(tmp_path / "d")
    code, err = export_script([f"checkpoint={tmp_path / 'd'}", f"out={tmp_path / 'o'}"], capsys)
    assert code == 2 and err.count("\n") == 1 and "model.safetensors" in err
    assert not (tmp_path / "o").exists()


def test_a_hand_edited_export_config_names_the_tensor(tmp_path):
    out = export_drafter(tiny_drafter(seed=1), tmp_path / "e")
    config = json.loads((out / "config.json").read_text())
    config["intermediate_size"] = 30
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"midlayer.mlp.\w+_proj.weight has shape .*intermediate_size"):
        load_drafter(out)


def test_a_config_without_its_drafter_block(tmp_path, capsys):
    tiny_drafter(seed=1).save(tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    del config["drafter"]
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    code, err = export_script([f"checkpoint={tmp_path / 'd'}", f"out={tmp_path / 'o'}"], capsys)
    assert code == 2 and err.count("\n") == 1 and "config.json has no 'drafter' block" in err


@pytest.mark.parametrize("layout", ["native", "eagle3"])
def test_a_truncated_weights_file(tmp_path, capsys, layout):
    m = tiny_drafter(seed=1, target_name_or_path="org/t")
    folder = tmp_path / "d"
    m.save(folder) if layout == "native" else export_drafter(m, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code, err = export_script([f"checkpoint={folder}", f"out={tmp_path / 'o'}"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"{weights} is not a readable safetensors file (truncated or corrupt?)" in err


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", "cannot read the run config"),
        (b"target: [unclosed\n  data: {", "cannot read the run config"),
        (b"- just\n- a list\n", "is not a mapping of sections"),
        (b"target: moonshotai/Kimi-K2.6\n", "target is not a section"),
    ],
)
def test_a_garbled_run_config(run_dir, tmp_path, capsys, content, message):
    (run_dir / "config.yaml").write_bytes(content)
    code, err = export_script([f"checkpoint={run_dir}", f"out={tmp_path / 'o'}"], capsys)
    assert code == 2 and err.count("\n") == 1 and message in err and str(run_dir / "config.yaml") in err
    resumed = types.SimpleNamespace(run_dir=run_dir, cfg=types.SimpleNamespace(resume="auto"))
    with pytest.raises(ConfigError, match=message):
        check_run_dir(resumed)  # train/main.py ... resume=auto on the same directory


def test_a_binary_prompt_file_names_the_line(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"prompt": "fine"}\n\x00\x9f\x92\x96 binary\n')
    with pytest.raises(ConfigError, match=r"prompts.jsonl:2: not UTF-8 text \(byte 0x9f\)"):
        load_prompts(prompts, tokenizer=lambda text: {"input_ids": [1, 2]})


def test_a_config_that_is_not_a_json_object(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="is not a JSON object"):
        load_drafter(tmp_path / "d")


def test_a_drafter_block_missing_a_field_is_one_line_for_the_weights_and_the_config_alone(tmp_path):
    tiny_drafter(seed=1).save(tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    del config["drafter"]["hidden_size"]
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    for read in (load_drafter, read_drafter_config):
        with pytest.raises(ConfigError, match=r"config.json: the drafter block is not a drafter config .*hidden_size"):
            read(tmp_path / "d")
