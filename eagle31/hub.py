"""Publish an exported drafter on the Hub: model card, one-commit upload; the token never shown (docs/export.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCardData, create_repo, get_token, upload_folder

from eagle31.attention import KINDS
from eagle31.config import read_json_config
from eagle31.errors import ConfigError
from eagle31.io import atomic_write_text
from eagle31.layouts import layout_of_config

CARD_NAME = "README.md"
REPORT_NAME = "report.json"
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class HubError(RuntimeError):
    """A Hub operation failed; the message is one line and holds no secret."""


def read_export(out_dir: str | Path) -> dict[str, Any]:
    """The config.json of an eagle31 export folder; refuses anything else."""
    out = Path(out_dir)
    path = out / "config.json"
    if not path.is_file() or not (out / "model.safetensors").is_file():
        raise ConfigError(f"{out} is not an export folder (needs config.json and model.safetensors)")
    config = read_json_config(path, "export config")
    if "eagle31" not in config:
        raise ConfigError(f"{path} was not written by eagle31's export (scripts/export.py)")
    return config


def read_report(run_dir: str | Path | None) -> dict[str, Any] | None:
    """A run's report.json, or None when the run has none."""
    return _first_report([run_dir], "run report")


def read_data_report(run_dir: str | Path | None, run_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The prepared data's report.json (`data.prepared_dir`, else `<run>/data`), or None when neither has one."""
    prepared = ((run_config or {}).get("data") or {}).get("prepared_dir")
    return _first_report([prepared, None if run_dir is None else Path(run_dir) / "data"], "prepared data report")


def _first_report(folders: list[str | Path | None], what: str) -> dict[str, Any] | None:
    """The report.json of the first of `folders` (None and '' skipped) that holds one, else None."""
    paths = [Path(folder) / REPORT_NAME for folder in folders if folder]
    return next((read_json_config(path, what) for path in paths if path.is_file()), None)


def public_name(name: str) -> str:
    """How a published card names a model: a Hub id as it is, a local path by its last component."""
    if _REPO_ID.match(name) and not (name.startswith((".", "~", "/")) or Path(name).expanduser().exists()):
        return name
    return _last_component(name)


def dataset_name(source: str) -> str:
    """How a published card names a data source: `demo:<split>` as it is, a file or folder by its own name."""
    return source if source.startswith("demo:") else _last_component(source)


def _last_component(path: str) -> str:
    return Path(path.rstrip("/")).name or path


def check_repo_id(repo_id: str) -> None:
    if not _REPO_ID.match(repo_id or ""):
        raise ConfigError(f"repo_id must look like <user or org>/<name>, got {repo_id!r}")


def render_model_card(
    config: dict[str, Any], repo_id: str, run_config: dict[str, Any] | None = None,
    report: dict[str, Any] | None = None, data_report: dict[str, Any] | None = None,
) -> str:  # fmt: skip
    """README.md text for an export with `config` (its config.json), published as `repo_id`."""
    run = run_config or {}
    report = report or {}
    layout = layout_of_config(config)
    drafter = layout.read(config)  # its DrafterConfig values
    named = (run.get("target") or {}).get("name") or drafter["target_name_or_path"]
    target = public_name(named) if named else "<target>"
    served = target if _REPO_ID.match(target) else f"<path to {target}>"
    hub = run.get("hub") or {}
    k = layout.num_speculative_tokens(config)  # the export's, where its layout keeps one, else the run's
    k = (run.get("eval") or {}).get("num_speculative_tokens", 3) if k is None else k
    kind = KINDS[drafter["attention"]]  # served as trained from the layout's release, or the kind's for fc_norm
    min_vllm = kind.min_vllm_fc_norm if drafter["fc_norm"] and kind.min_vllm_fc_norm else layout.min_vllm
    metadata = ModelCardData(
        base_model=target if _REPO_ID.match(target) else None,
        library_name=layout.library_name,
        license=hub.get("license", "apache-2.0"),
        tags=list(hub.get("tags") or ["eagle3", "eagle3.1", "speculative-decoding", "vllm"]),
    )
    spec = json.dumps({"method": "eagle3", "model": repo_id, "num_speculative_tokens": k})
    w = drafter["sliding_window"]
    window = [f"* attention: a sliding window of {w} positions (`layer_types`), served as trained"] if w else []
    flags = ", ".join(f"`{f}={str(drafter[f]).lower()}`" for f in ("fc_norm", "norm_output", "norm_before_residual"))
    title = "EAGLE 3.1" if drafter["fc_norm"] and drafter["norm_output"] else "EAGLE 3"
    maps = " (`d2t`/`t2d` included)" if drafter["draft_vocab_size"] < drafter["vocab_size"] else ""
    shape = [
        f"* one decoder layer: hidden size {drafter['hidden_size']}, {drafter['num_attention_heads']} heads "
        f"({drafter['num_key_value_heads']} KV), MLP {drafter['intermediate_size']}",
        f"* draft vocabulary {drafter['draft_vocab_size']} of the target's {drafter['vocab_size']} tokens{maps}",
        f"* target features: hidden states at the input of decoder layers {list(drafter['aux_layer_ids'])} "
        "(vLLM's convention)",
        *window,
    ]
    blocks = [
        f"---\n{metadata.to_yaml()}\n---",
        f"# {title} drafter for {target}",
        f"A speculative-decoding drafter (EAGLE 3 with the EAGLE 3.1 switches {flags}) for `{target}`, "
        f"trained with eagle31 and stored in vLLM's {layout.card_name}.",
        "\n".join(shape),
        "## Serving with vLLM",
        f"Needs vLLM >= {min_vllm}.",
        f"```bash\nvllm serve {served} --speculative-config '{spec}'\n```",
        "## Training",
        "\n".join(_training_lines(run, report, data_report)),
        "## Acceptance",
        "\n".join(_acceptance_lines(report)),
    ]
    return "\n\n".join(blocks) + "\n"


def write_model_card(
    out_dir: str | Path, repo_id: str, run_config: dict[str, Any] | None = None, report: dict[str, Any] | None = None,
    data_report: dict[str, Any] | None = None,
) -> Path:  # fmt: skip
    """Write README.md into the export folder `out_dir`; returns its path."""
    path = Path(out_dir) / CARD_NAME
    atomic_write_text(path, render_model_card(read_export(out_dir), repo_id, run_config, report, data_report))
    return path


def _training_lines(run: dict[str, Any], report: dict[str, Any], data_report: dict[str, Any] | None) -> list[str]:
    data, train = run.get("data") or {}, run.get("train") or {}
    sources = data.get("source") or []
    names = ", ".join(f"`{dataset_name(str(s))}`" for s in ([sources] if isinstance(sources, str) else sources))
    lines = [f"* data: {names or 'not recorded'}"]
    if data_report:
        samples, supervised = data_report.get("samples") or {}, data_report.get("supervised_tokens") or {}
        lines.append(
            f"* samples: {samples.get('train', 0):,} for training, {samples.get('eval', 0):,} held out "
            f"({supervised.get('train', 0):,} supervised training tokens)"
        )
    if data.get("max_len"):
        lines.append(f"* context: up to {data['max_len']} tokens per sequence")
    if train.get("ttt_length"):
        lines.append(f"* training-time test: {train['ttt_length']} steps")
    steps = report.get("steps", train.get("max_steps"))
    if steps is not None:
        lines.append(f"* optimizer steps: {steps}")
    if report.get("tokens_seen") is not None:
        lines.append(f"* tokens seen: {report['tokens_seen']:,}")
    return lines


def _acceptance_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    if report.get("tau_sim") is not None:
        lines.append(
            f"Simulated acceptance length on held-out data (teacher-forced, bonus token counted): "
            f"**{report['tau_sim']:.3f}**"
        )
    if acc := report.get("acc") or []:
        lines += [
            "",
            "| TTT step | " + " | ".join(str(k) for k in range(len(acc))) + " |",
            "|---|" + "---|" * len(acc),
            "| top-1 accuracy | " + " | ".join(_cell(a) for a in acc) + " |",
        ]
    measured = report.get("acceptance")
    if isinstance(measured, dict) and measured:
        lines += ["", *_measured_lines(measured)]
    return lines or ["Not measured yet."]


def _measured_lines(measured: dict[str, Any]) -> list[str]:
    """Real speculative decoding: one summary, or `{"settings", "results": [per drafter and split]}`."""
    settings = measured.get("settings") or {}
    results = measured["results"] if isinstance(measured.get("results"), list) else [measured]
    shown = [key for key in ("mode", "k", "max_new_tokens") if settings.get(key) is not None]
    mode = ", ".join(f"{key} {settings[key]}" for key in shown)
    lines = [
        f"Measured with real speculative decoding{f' ({mode})' if mode else ''}:",
        "",
        "| split | prompts | acceptance length | acceptance rate per position |",
        "|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.get('split', '-')} | {r.get('prompts', '-')} | {_cell(r.get('tau'))} | "
            f"{_cell(r.get('acceptance_rate'))} |"
        )
    return lines


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value)
    return str(value)


def push_folder(
    out_dir: str | Path, repo_id: str, *, private: bool = False, dry_run: bool = False, token: str | None = None,
) -> list[str]:  # fmt: skip
    """Upload the export folder to `repo_id` (made if needed) in one commit; the files sent (`dry_run`: no upload)."""
    check_repo_id(repo_id)
    read_export(out_dir)
    out = Path(out_dir)
    relative = (p.relative_to(out) for p in out.rglob("*") if p.is_file())  # hidden and temporary files stay
    files = sorted(str(p) for p in relative if not any(part.startswith(".") for part in p.parts))
    if dry_run:
        return files
    token = token or get_token()
    if not token:
        raise HubError("no Hugging Face token: set HF_TOKEN or run `hf auth login`")
    try:
        create_repo(repo_id, token=token, private=private, repo_type="model", exist_ok=True)
        upload_folder(repo_id=repo_id, folder_path=str(out_dir), token=token, repo_type="model", allow_patterns=files,
                      commit_message="Upload EAGLE 3.1 drafter (eagle31)")  # fmt: skip
    except Exception as e:  # httpx, OSError and ValueError families from huggingface_hub: all a failed upload
        raise HubError(f"upload to {repo_id} failed (no files were committed): {_one_line(e, token)}") from None
    return files


def _one_line(error: Exception, secret: str) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}".replace(secret, "***")
