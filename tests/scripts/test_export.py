"""scripts/export.py and scripts/push_to_hub.py, run in-process; their key=value parser."""

import json
import runpy
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from eagle31 import ConfigError, hub
from eagle31.convert import load_drafter
from eagle31_cli import parse_key_values

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
TOKEN = "hf_TOKENthatmustneverleak0123456789"


def script(name):
    return runpy.run_path(str(SCRIPTS / name), run_name="under_test")["main"]


# ------------------------------------------------------------------ the parser


@dataclass
class Args:
    out: str
    k: int = 3
    dry_run: bool = False
    target: str | None = "x"


def test_parser_types_and_defaults():
    assert parse_key_values(["out=d", "k=5", "dry_run=true", "target=none"], Args) == Args("d", 5, True, None)
    assert parse_key_values(["out=a=b"], Args) == Args("a=b")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["k=3"], "missing required argument.*out="),
        (["out=d", "kk=3"], "unknown argument 'kk'; valid: out, k, dry_run, target"),
        (["out=d", "k=three"], "k must be an integer"),
        (["out=d", "dry_run=maybe"], "dry_run must be true or false"),
        (["out=d", "out=e"], "given twice"),
        (["out"], "key=value"),
    ],
)
def test_parser_errors_name_the_argument(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_key_values(argv, Args)


# -------------------------------------------------------------------- export


def test_export_from_a_run_uses_its_settings(run_dir, capsys):
    out = run_dir / "export" / "spec"
    assert script("export.py")([f"checkpoint={run_dir}", "format=speculators", f"out={out}", "dtype=float32"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["transformer_layer_config"]["max_position_embeddings"] == 3000  # the run's data.max_len
    assert cfg["transformer_layer_config"]["dtype"] == "float32"  # the argument beats the run's bf16
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "moonshotai/Kimi-K2.6"
    assert load_drafter(out).config.aux_layer_ids == load_drafter(run_dir / "drafter").config.aux_layer_ids
    assert "wrote speculators drafter" in capsys.readouterr().out


def test_export_from_a_drafter_dir_of_another_layout(export_dir, tmp_path, capsys):
    argv = [f"checkpoint={export_dir}", "format=speculators", f"out={tmp_path / 's'}"]
    assert script("export.py")(argv) == 2  # the eagle3 export has no embedding for the speculators layout to carry
    assert "include_embed=false" in capsys.readouterr().err and not (tmp_path / "s").exists()
    assert script("export.py")([*argv, "include_embed=false"]) == 0
    assert "speculators_model_type" in json.loads((tmp_path / "s" / "config.json").read_text())


@pytest.mark.parametrize(
    "extra, message",
    [
        (["format=eagle2"], "format must be one of"),
        (["dtype=fp8"], "dtype must be one of"),
        (["fromat=eagle3"], "unknown argument 'fromat'"),
    ],
)
def test_export_bad_arguments_exit_2_with_one_line(run_dir, tmp_path, capsys, extra, message):
    assert script("export.py")([f"checkpoint={run_dir}", f"out={tmp_path / 'o'}", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("out", ["drafter", ".", "export"])
def test_export_never_writes_over_the_run_or_its_drafter(run_dir, capsys, out):
    (run_dir / "export").mkdir()
    (run_dir / "export" / "notes.txt").write_text("not an export")
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    argv = [f"checkpoint={run_dir}", f"out={run_dir / out}", "overwrite=true"]
    assert script("export.py")(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("is or holds the drafter being exported" in err or "did not write" in err)
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_export_replaces_an_earlier_export_only_with_overwrite(run_dir, export_dir, capsys):
    argv = [f"checkpoint={run_dir}", "format=speculators", f"out={export_dir}"]
    assert script("export.py")(argv) == 2
    assert "overwrite=true" in capsys.readouterr().err
    assert script("export.py")([*argv, "overwrite=true"]) == 0
    assert "speculators_model_type" in json.loads((export_dir / "config.json").read_text())


def test_export_missing_checkpoint(tmp_path, capsys):
    assert script("export.py")([f"checkpoint={tmp_path / 'nope'}", f"out={tmp_path / 'o'}"]) == 2
    assert "is not a directory" in capsys.readouterr().err


# --------------------------------------------------------------- push_to_hub


def test_dry_run_writes_the_card_and_lists_the_upload(export_dir, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert script("push_to_hub.py")([f"out={export_dir}", "repo_id=me/kimi-eagle3", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "README.md" in out and "model.safetensors" in out
    card = (export_dir / "README.md").read_text()
    assert "license: mit" in card and "**3.215**" in card  # found the run two levels up


def test_the_token_never_reaches_a_file_or_the_terminal(run_dir, export_dir, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(hub, "create_repo", lambda *a, **k: None)
    monkeypatch.setattr(hub, "upload_folder", lambda **k: None)
    push = script("push_to_hub.py")
    assert push([f"out={export_dir}", "repo_id=me/d", "dry_run=true"]) == 0
    assert push([f"out={export_dir}", "repo_id=me/d", "private=true"]) == 0
    printed = capsys.readouterr()
    assert "uploaded 3 files" in printed.out
    assert TOKEN not in printed.out + printed.err
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path


def test_network_failure_exits_1_and_claims_nothing(export_dir, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)

    def down(*a, **k):
        raise httpx.ConnectError("Name or service not known")

    monkeypatch.setattr(hub, "create_repo", down)
    assert script("push_to_hub.py")([f"out={export_dir}", "repo_id=me/d"]) == 1
    printed = capsys.readouterr()
    assert printed.err.count("\n") == 1 and "no files were committed" in printed.err
    assert "uploaded" not in printed.out and TOKEN not in printed.err


def test_bad_repo_id_exits_2_before_writing_the_card(export_dir, capsys):
    assert script("push_to_hub.py")([f"out={export_dir}", "repo_id=nope"]) == 2
    assert "repo_id" in capsys.readouterr().err
    assert not (export_dir / "README.md").exists()
