"""A run never deletes or mixes with the user's files, is refused before any work when it cannot go right,
and leaves nothing that blocks its corrected rerun; one run per output directory."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle31.io import OUTPUT_MARKER, atomic_dir
from eagle31.pipeline import run
from eagle31.trainer import Trainer
from eagle31_cli import recipe_main
from tests.data.chat_helpers import write_jsonl
from tests.helpers import base_args

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def main(args: list[str], capsys) -> tuple[int, str]:
    code = recipe_main(run, RECIPES, args)
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip() and not x.startswith("warning:")]
    return code, err[-1] if err else ""


def one_line(code_and_err, code: int) -> str:
    got, line = code_and_err
    assert got == code, line
    return line


def user_project(tmp_path: Path, chats: Path) -> Path:
    """A user's folder: their conversations under data/, and notes of their own."""
    project = tmp_path / "my project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "chats.jsonl").write_bytes(chats.read_bytes())
    (project / "notes.txt").write_text("mine")
    return project


def prepare_step():
    """data_prep/prepare.py's `prepare(cfg)`, to run in this process."""
    return runpy.run_path(str(RECIPES.parent / "data_prep" / "prepare.py"))["prepare"]


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_output_dir_set_to_the_users_project_keeps_every_file(tiny_target, chats, tmp_path, capsys):
    project = user_project(tmp_path, chats)
    before = tree(project)
    args = base_args(tiny_target, project / "data" / "chats.jsonl", project)
    line = one_line(main(args, capsys), 2)
    assert str(project) in line and "did not write" in line
    assert tree(project) == before


def test_a_prepared_dir_holding_a_source_is_refused(tiny_target, chats, tmp_path, capsys):
    project = user_project(tmp_path, chats)
    before = tree(project)
    args = base_args(
        tiny_target, project / "data" / "chats.jsonl", tmp_path / "run", **{"data.prepared_dir": str(project / "data")}
    )
    line = one_line(main(args, capsys), 2)
    assert "holds data.source" in line and "chats.jsonl" in line
    assert tree(project) == before and not (tmp_path / "run").exists()


def test_a_prepared_dir_made_from_other_sources_is_refused_not_silently_reused(tiny_target, chats, tmp_path, capsys):
    prepared = tmp_path / "prepared"
    with atomic_dir(prepared, content="prepared-data") as tmp:
        (tmp / "train").mkdir()
        (tmp / "report.json").write_text(json.dumps({"sources": [str(tmp_path / "old.jsonl")]}))
    args = base_args(tiny_target, chats, tmp_path / "run", **{"data.prepared_dir": str(prepared)})
    line = one_line(main(args, capsys), 2)
    assert "old.jsonl" in line and str(chats) in line


@pytest.mark.slow
def test_a_prepared_dir_pointing_at_a_folder_of_runs_deletes_nothing(tiny_target, chats, tmp_path, capsys):
    """`data.prepared_dir=runs`: neither the prepare step nor a run replaces the runs, checkpoints and data under it."""
    runs = tmp_path / "runs"
    first = base_args(tiny_target, chats, runs / "first", **{"train.max_steps": "2", "export.formats": "[]"})
    assert main(first, capsys)[0] == 0  # runs/first: checkpoints, data/, drafter/
    before = tree(runs)
    for step in (prepare_step(), run):
        args = base_args(tiny_target, chats, tmp_path / "second", **{"data.prepared_dir": str(runs)})
        code, line = recipe_main(step, RECIPES, args), capsys.readouterr().err.strip().splitlines()[-1]
        assert code == 2, line
        assert line == (
            f"error: {runs} holds 1 run output(s) of eagle31 (first); refusing to write a prepared-data output "
            "there (choose an empty or new directory)"
        )
        assert tree(runs) == before and not (tmp_path / "second").exists()


@pytest.mark.parametrize(
    "field, value, said",
    [
        ("train.lr", "-1e-4", "train.lr must be positive, got -0.0001"),
        ("train.lk_eta", "-1", "train.lk_eta must be >= 0, got -1.0"),
    ],
)
def test_a_bad_number_is_refused_before_any_model(
    field, value, said, tiny_target, chats, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(Trainer, "__init__", lambda *a, **k: pytest.fail("a model was built"))
    line = one_line(main(base_args(tiny_target, chats, tmp_path / "run", **{field: value}), capsys), 2)
    assert line == f"error: {said}"
    assert not (tmp_path / "run").exists()


def test_an_output_dir_below_a_file_is_one_line(tiny_target, chats, tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    line = one_line(main(base_args(tiny_target, chats, tmp_path / "a_file" / "run"), capsys), 2)
    assert "a_file is a file" in line


@pytest.mark.slow
def test_a_run_stopped_by_validation_leaves_no_identity_and_the_fixed_rerun_goes_ahead(
    tiny_target, chats, tmp_path, capsys
):
    out = tmp_path / "run"
    masked = write_jsonl(tmp_path / "only_users.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 4)
    line = one_line(main(base_args(tiny_target, masked, out, **{"data.prepared_dir": str(tmp_path / "p1")}), capsys), 2)
    assert "no sample" in line
    assert not (out / "config.yaml").exists()
    fixed = base_args(
        tiny_target,
        chats,
        out,
        **{"data.prepared_dir": str(tmp_path / "p2"), "train.max_steps": "2", "export.formats": "[]"},
    )
    assert main(fixed, capsys)[0] == 0
    assert (out / "config.yaml").is_file() and (out / OUTPUT_MARKER).is_file()


@pytest.mark.slow
def test_resuming_with_other_template_options_is_refused_as_another_run(tiny_target, chats, tmp_path, capsys):
    out = tmp_path / "run"
    first = base_args(tiny_target, chats, out, **{"train.max_steps": "2", "export.formats": "[]"})
    assert main(first, capsys)[0] == 0
    again = [*first, "resume=auto", "data.chat_template_kwargs.preserve_thinking=false"]
    line = one_line(main(again, capsys), 2)
    assert "holds a different run: data.chat_template_kwargs was" in line and "'preserve_thinking': False" in line


def test_resuming_with_another_optimizer_is_refused_as_another_run_and_an_older_config_ran_adamw(tmp_path):
    """A checkpoint's optimizer state is read by the optimizer that wrote it; a config.yaml from before
    train.optimizer existed ran AdamW."""
    import yaml

    from eagle31.errors import ConfigError
    from eagle31.plan import check_run_dir
    from eagle31.recipe import load_recipe, to_container

    out = tmp_path / "run"
    out.mkdir()
    older = to_container(load_recipe(RECIPES, ["recipe=demo", f"output_dir={out}"]))
    del older["train"]["optimizer"]
    (out / "config.yaml").write_text(yaml.safe_dump(older))

    def plan(optimizer: str) -> SimpleNamespace:
        overrides = ["recipe=demo", f"output_dir={out}", "resume=auto", f"train.optimizer={optimizer}"]
        return SimpleNamespace(cfg=load_recipe(RECIPES, overrides), run_dir=out)

    check_run_dir(plan("adamw"))
    with pytest.raises(ConfigError, match=f"output_dir {out} holds a different run: train.optimizer was 'adamw', now"):
        check_run_dir(plan("muon"))


def test_ctrl_c_says_where_the_run_resumes(tiny_target, chats, tmp_path, capsys, monkeypatch):
    real_step = Trainer.train_step

    def step(self, micro):
        if self.state.step == 3:
            raise KeyboardInterrupt
        return real_step(self, micro)

    monkeypatch.setattr(Trainer, "train_step", step)
    out = tmp_path / "run"
    line = one_line(main(base_args(tiny_target, chats, out), capsys), 130)
    assert (
        "interrupted at step 3" in line and "resume=auto" in line and str(out / "checkpoints" / "step_00000002") in line
    )


def test_ctrl_c_before_training_says_what_is_kept(tiny_target, chats, tmp_path, capsys, monkeypatch):
    import eagle31.pipeline

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(eagle31.pipeline, "build_loaders", interrupted)
    line = one_line(main(base_args(tiny_target, chats, tmp_path / "run"), capsys), 130)
    assert "prepared data" in line and "resume=auto" in line


@pytest.mark.slow
def test_a_second_run_on_a_locked_output_dir_names_the_holder(tiny_target, chats, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from eagle31.io import claim_output_dir, hold_lock; "
            f"d = claim_output_dir({str(out)!r}, 'run')\n"
            "with hold_lock(d):\n    print('held', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        line = one_line(main(base_args(tiny_target, chats, out), capsys), 7)
        assert f"pid {holder.pid}" in line and "in use by another run" in line
    finally:
        holder.kill()  # SIGKILL: no chance to clean up
        holder.wait()
    assert not (out / "config.yaml").exists()
    from eagle31.io import hold_lock

    with hold_lock(out):  # the kernel released the dead holder's lock
        pass


# ---------------------------------------------------------------------------- feature stores


@pytest.fixture(scope="module")
def captured_store(tiny_target, chats, tmp_path_factory) -> Path:
    """A store captured (by a short run) from the tiny target."""
    out = tmp_path_factory.mktemp("store_run") / "run"
    extra = {"features.mode": "store", "train.max_steps": "1", "export.formats": "[]"}
    assert recipe_main(run, RECIPES, base_args(tiny_target, chats, out, **extra)) == 0
    return out / "features"


def test_a_store_captured_from_another_target_of_the_same_shape_is_refused(
    captured_store, tiny_target, chats, tmp_path, capsys
):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    other = tmp_path / "other_target"
    config = LlamaConfig.from_pretrained(tiny_target)
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(other)  # same name in the recipe, same shape, other weights
    for f in tiny_target.glob("tokenizer*"):
        (other / f.name).write_bytes(f.read_bytes())
    extra = {"features.mode": "store", "features.store_dir": str(captured_store), "target.path": str(other)}
    line = one_line(main(base_args(tiny_target, chats, tmp_path / "run", **extra), capsys), 2)
    assert "target_fingerprint" in line and str(captured_store) in line


def copy_store(captured_store: Path, store: Path) -> Path:
    """A copy of the store, to leave the fixture's intact."""
    for split in ("train", "eval"):
        (store / split).mkdir(parents=True)
        for f in (captured_store / split).iterdir():
            (store / split / f.name).write_bytes(f.read_bytes())
    return store


def corrupt_copy(captured_store: Path, store: Path) -> Path:
    """A copy of the store with one flipped byte in a train shard; returns that shard."""
    shard = copy_store(captured_store, store) / "train" / "shard-000000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-50] ^= 0x01
    shard.write_bytes(bytes(data))
    return shard


def test_a_capture_stopped_midway_is_completed_not_trained_on_partly(
    captured_store, tiny_target, chats, tmp_path, capsys
):
    store = copy_store(captured_store, tmp_path / "features")
    manifest = json.loads((store / "train" / "manifest.json").read_text())
    full = {r["file"]: r for r in manifest["shards"]}
    last = sorted(full)[-1]
    head = {k: v for k, v in manifest.items() if k not in ("shards", "num_samples", "num_tokens")}
    (store / "train" / "manifest.json").write_text(json.dumps({**head, "shards": []}))  # as a killed capture leaves it
    (store / "train" / last).unlink()
    (store / "train" / last.replace(".safetensors", ".json")).unlink()
    extra = {"features.mode": "store", "features.store_dir": str(store), "train.max_steps": "1", "export.formats": "[]"}
    assert main(base_args(tiny_target, chats, tmp_path / "run", **extra), capsys)[0] == 0
    done = json.loads((store / "train" / "manifest.json").read_text())
    assert {r["file"]: r["samples"] for r in done["shards"]} == {f: r["samples"] for f, r in full.items()}
    assert done["num_samples"] == manifest["num_samples"]


def test_a_corrupt_shard_stops_the_run_with_one_line(captured_store, tiny_target, chats, tmp_path, capsys):
    shard = corrupt_copy(captured_store, tmp_path / "features")
    extra = {"features.mode": "store", "features.store_dir": str(tmp_path / "features")}
    line = one_line(main(base_args(tiny_target, chats, tmp_path / "run", **extra), capsys), 3)
    assert f"corrupt shard {shard}" in line and "skip_corrupt" in line


def test_skip_corrupt_reports_what_it_skipped(captured_store, tiny_target, chats, tmp_path, capsys):
    store = tmp_path / "features"
    shard = corrupt_copy(captured_store, store)
    out = tmp_path / "run"
    extra = {
        "features.mode": "store",
        "features.store_dir": str(store),
        "features.skip_corrupt": "true",
        "export.formats": "[]",
    }
    assert main(base_args(tiny_target, chats, out, **extra), capsys)[0] == 0
    report = json.loads((out / "report.json").read_text())
    assert report["skipped_corrupt"]["shards"] == [str(shard)] and report["skipped_corrupt"]["samples"] > 0
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(x.get("data/skipped_samples") == report["skipped_corrupt"]["samples"] for x in logged)


# ---------------------------------------------------------------------------- torchrun


@pytest.mark.slow
def test_under_torchrun_the_users_line_is_the_last_thing_said(tiny_target, chats, tmp_path):
    from tests.train.test_main import run_main

    proc = run_main(base_args(tiny_target, chats, tmp_path / "run", **{"train.lr": "-1"}), torchrun=2, timeout=300)
    assert proc.returncode != 0
    said = [x.strip() for x in proc.stderr.strip().splitlines() if x.strip() and not set(x.strip()) <= {"="}]
    assert said[-1] == "traceback : error: train.lr must be positive, got -1.0", proc.stderr[-3000:]


# ---------------------------------------------------------------------------- resume


@pytest.mark.slow
def test_resume_passes_over_a_damaged_checkpoint_and_a_torn_metrics_line(tiny_target, chats, tmp_path, capsys):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    args = base_args(tiny_target, chats, out, **{"train.max_steps": "4", "export.formats": "[]"})
    assert main(args, capsys)[0] == 0
    uninterrupted = load_file(str(out / "drafter" / "model.safetensors"))
    shard = next((out / "checkpoints" / "step_00000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # torn by a kill or a bad copy
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "train/lo')  # a kill in the middle of a write

    assert recipe_main(run, RECIPES, args + ["resume=auto"]) == 0
    captured = capsys.readouterr()
    warnings = [x for x in captured.err.splitlines() if x.startswith("warning: checkpoint")]
    assert len(warnings) == 1 and "step_00000004" in warnings[0] and shard.name in warnings[0]
    assert "resumed from" in captured.out and "step_00000002" in captured.out
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if "train/loss" in x]
    assert steps == [1, 2, 3, 4]
    resumed = load_file(str(out / "drafter" / "model.safetensors"))
    assert all((resumed[k] == uninterrupted[k]).all() for k in uninterrupted)


def test_a_store_dir_holding_the_users_files_is_refused_before_capture(
    tiny_target, chats, tmp_path, capsys, monkeypatch
):
    import eagle31.target

    monkeypatch.setattr(eagle31.target, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    mine = tmp_path / "mine"
    (mine / "train").mkdir(parents=True)
    (mine / "train" / "results.csv").write_text("a,b\n")
    extra = {"features.mode": "store", "features.store_dir": str(mine)}
    line = one_line(main(base_args(tiny_target, chats, tmp_path / "run", **extra), capsys), 2)
    assert str(mine / "train") in line and "did not write" in line
    assert [p.name for p in (mine / "train").iterdir()] == ["results.csv"]


def test_data_prepared_by_the_prepare_step_then_trained_in_the_same_output_dir(tiny_target, chats, tmp_path, capsys):
    out = tmp_path / "run"
    args = base_args(tiny_target, chats, out, **{"train.max_steps": "1", "export.formats": "[]"})
    assert recipe_main(prepare_step(), RECIPES, args) == 0 and (out / "data" / "train").is_dir()
    assert main(args, capsys)[0] == 0
    assert (out / "report.json").is_file()


def test_a_garbled_prepared_report_is_one_line(tiny_target, chats, tmp_path, capsys):
    out = tmp_path / "run"
    args = base_args(tiny_target, chats, out, **{"train.max_steps": "1", "export.formats": "[]"})
    assert recipe_main(prepare_step(), RECIPES, args) == 0
    (out / "data" / "report.json").write_text('{"samples": {"tra')
    line = one_line(main(args, capsys), 3)
    assert "report.json is not valid JSON" in line
