"""The model card, the upload (huggingface_hub faked: nothing leaves the machine) and the token's secrecy."""

import json

import httpx
import pytest
import yaml

from eagle31 import ConfigError, hub
from eagle31.export import export_drafter, read_run_config
from eagle31.hub import HubError, push_folder, read_report, render_model_card, write_model_card
from tests.helpers import tiny_drafter

TOKEN = "hf_TOKENthatmustneverleak0123456789"


def front_matter(card):
    head, _, body = card.partition("\n---\n")
    return yaml.safe_load(head.removeprefix("---\n")), body


def test_model_card_metadata_and_serving_command(run_dir, export_dir):
    card = write_model_card(export_dir, "me/kimi-eagle3", read_run_config(run_dir), read_report(run_dir)).read_text()
    meta, body = front_matter(card)
    assert meta["base_model"] == "moonshotai/Kimi-K2.6"
    assert meta["library_name"] == "vllm" and meta["license"] == "mit"
    assert {"eagle3", "speculative-decoding"} <= set(meta["tags"])
    assert (
        "vllm serve moonshotai/Kimi-K2.6 --speculative-config "
        """'{"method": "eagle3", "model": "me/kimi-eagle3", "num_speculative_tokens": 4}'"""
    ) in body
    assert "* data: `chat.jsonl`, `dataset`\n" in body  # names, not where they lie
    assert "optimizer steps: 1000" in body and "tokens seen: 1,234,567" in body
    assert "**3.215**" in body and "| top-1 accuracy | 0.810 | 0.720 | 0.600 |" in body
    assert "(mode chain, k 3, max_new_tokens 64)" in body
    assert "| eval | 16 | 2.910 | 0.800, 0.600, 0.450 |" in body
    assert "# EAGLE 3.1 drafter" in body and "vLLM >= 0.22" in body


def test_speculators_card_and_a_run_without_report(tmp_path):
    m = tiny_drafter(seed=1, fc_norm=False, norm_output=False)
    out = export_drafter(
        m, tmp_path / "s", "speculators", num_speculative_tokens=5, target_name_or_path="/local/target"
    )
    meta, body = front_matter(render_model_card(hub.read_export(out), "me/d"))
    assert meta["library_name"] == "speculators" and "base_model" not in meta  # a local path is no Hub id
    assert "/local" not in body and "vllm serve <path to target> " in body
    assert '"num_speculative_tokens": 5' in body and "vLLM >= 0.22" in body
    assert "# EAGLE 3 drafter" in body and "Not measured yet." in body
    partial = render_model_card(hub.read_export(out), "me/d", report={"acc": [0.5, None], "acceptance": {"tau": 2.5}})
    assert "| top-1 accuracy | 0.500 | - |" in partial and "| - | - | 2.500 | - |" in partial


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_the_card_of_a_windowed_drafter_says_its_window(tmp_path, fmt):
    out = export_drafter(tiny_drafter(sliding_window=64), tmp_path / fmt, fmt, target_name_or_path="org/t")
    _, body = front_matter(render_model_card(hub.read_export(out), "me/d"))
    assert "* attention: a sliding window of 64 positions" in body
    full = export_drafter(tiny_drafter(), tmp_path / "full", fmt, target_name_or_path="org/t")
    assert "sliding window" not in render_model_card(hub.read_export(full), "me/d")


@pytest.fixture
def fake_hub(monkeypatch):
    calls = []
    monkeypatch.setattr(hub, "create_repo", lambda *a, **k: calls.append(("create_repo", a, k)))
    monkeypatch.setattr(hub, "upload_folder", lambda **k: calls.append(("upload_folder", (), k)))
    return calls


def test_push_uploads_the_folder_in_one_commit(export_dir, fake_hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    write_model_card(export_dir, "me/d")
    files = push_folder(export_dir, "me/d", private=True)
    assert files == ["README.md", "config.json", "model.safetensors"]
    (_, args, create), (_, _, upload) = fake_hub
    assert args == ("me/d",) and create["private"] and create["token"] == TOKEN and create["exist_ok"]
    assert upload["repo_id"] == "me/d" and upload["allow_patterns"] == files and upload["token"] == TOKEN


def test_dry_run_touches_nothing_remote(export_dir, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("dry run reached the Hub")

    monkeypatch.setattr(hub, "create_repo", refuse)
    monkeypatch.setattr(hub, "upload_folder", refuse)
    assert push_folder(export_dir, "me/d", dry_run=True) == ["config.json", "model.safetensors"]


def test_network_failure_is_one_line_without_the_token(export_dir, monkeypatch):
    def down(**k):
        raise httpx.ConnectError(f"connection reset\nwhile sending Authorization: Bearer {k['token']}")

    monkeypatch.setattr(hub, "create_repo", lambda *a, **k: None)
    monkeypatch.setattr(hub, "upload_folder", down)
    with pytest.raises(HubError) as e:
        push_folder(export_dir, "me/d", token=TOKEN)
    assert "\n" not in str(e.value) and TOKEN not in str(e.value) and "no files were committed" in str(e.value)
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_no_token_is_a_clear_error(export_dir, fake_hub, monkeypatch):
    monkeypatch.setattr(hub, "get_token", lambda: None)
    with pytest.raises(HubError, match="HF_TOKEN"):
        push_folder(export_dir, "me/d")
    assert not fake_hub


@pytest.mark.parametrize("repo_id", ["no-slash", "a/b/c", "me/bad name", ""])
def test_bad_repo_ids_are_refused(export_dir, repo_id):
    with pytest.raises(ConfigError, match="repo_id"):
        push_folder(export_dir, repo_id, dry_run=True)


def test_only_eagle31_exports_are_pushed(tmp_path):
    m = tiny_drafter(seed=1)
    m.save(tmp_path / "native")
    with pytest.raises(ConfigError, match="not written by eagle31's export"):
        push_folder(tmp_path / "native", "me/d", dry_run=True)
    with pytest.raises(ConfigError, match="not an export folder"):
        push_folder(tmp_path, "me/d", dry_run=True)


def test_the_card_publishes_names_and_counts_never_a_local_path(tmp_path):
    """The paths of this test's own folders (data, target, run) must not reach the published card."""
    private = tmp_path / "home" / "me" / "private"
    run = private / "runs" / "demo"
    (private / "corpus").mkdir(parents=True)
    sources = [str(private / "chats.jsonl"), str(private / "corpus") + "/", "demo:train"]
    target = private / "models" / "Kimi-K2.6"
    run_config = {
        "target": {"name": None, "path": str(target)},
        "data": {"source": sources, "prepared_dir": str(run / "data"), "max_len": 2048},
    }
    (run / "data").mkdir(parents=True)
    (run / "data" / "report.json").write_text(
        json.dumps(
            {
                "prepared_dir": str(run / "data"),
                "sources": sources,
                "samples": {"train": 1200, "eval": 64},
                "supervised_tokens": {"train": 345678, "eval": 9000},
            }
        )
    )
    out = export_drafter(tiny_drafter(seed=1), run / "export" / "s", "speculators", target_name_or_path=str(target))
    card = write_model_card(
        out, "me/d", run_config, read_report(run), hub.read_data_report(run, run_config)
    ).read_text()
    assert str(tmp_path) not in card and "home/me" not in card
    assert "* data: `chats.jsonl`, `corpus`, `demo:train`" in card
    assert "* samples: 1,200 for training, 64 held out (345,678 supervised training tokens)" in card
    assert "drafter for Kimi-K2.6" in card and "vllm serve <path to Kimi-K2.6> " in card


def test_the_card_of_a_full_vocabulary_mla_drafter_names_the_vllm_it_needs(tmp_path):
    """vLLM 0.22's DeepSeek EAGLE-3 class never applies fc_norm; a full vocabulary carries no d2t/t2d."""
    from tests.test_mla import mla_drafter

    out = export_drafter(
        mla_drafter(seed=3, draft_vocab_size=40).float(), tmp_path / "mla", "eagle3", target_name_or_path="org/target"
    )
    _, body = front_matter(render_model_card(hub.read_export(out), "me/mla"))
    assert "Needs vLLM >= 0.33." in body and "d2t" not in body
    reduced = export_drafter(tiny_drafter(seed=3), tmp_path / "llama", "eagle3", target_name_or_path="org/target")
    _, body = front_matter(render_model_card(hub.read_export(reduced), "me/llama"))
    assert "Needs vLLM >= 0.22." in body and "(`d2t`/`t2d` included)" in body
