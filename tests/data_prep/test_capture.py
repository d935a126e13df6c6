"""data_prep/capture.py and data_prep/import_speculators.py as users run them: in-process through their
`__main__` (see `run_script`), and under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import load_from_disk

from eagle31.data.store import FeatureStore
from tests.helpers import run_script
from tests.tiny_targets import prepared_split, tiny_llama, write_vllm_captures

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A saved tiny Llama target and a prepared directory with train and eval splits."""
    root = tmp_path_factory.mktemp("cli")
    model = tiny_llama(seed=2)
    model.save_pretrained(root / "target")
    prepared_split(10, seed=1).save_to_disk(str(root / "data" / "train"))
    prepared_split(3, seed=2).save_to_disk(str(root / "data" / "eval"))
    return root, model


def overrides(root: Path, store: str, aux=(1, 3, 4)) -> list[str]:
    return [
        "recipe=demo",
        "target.builtin=null",
        "target.name=null",
        f"target.path={root / 'target'}",
        "target.dtype=float32",
        f"data.prepared_dir={root / 'data'}",
        f"features.store_dir={root / store}",
        "features.store_dtype=float32",
        "features.shard_max_tokens=40",
        "features.capture_batch_tokens=64",
        f"drafter.aux_layer_ids=[{','.join(map(str, aux))}]",
        f"output_dir={root / 'run'}",
        "train.device=cpu",
    ]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_capture_cli_writes_the_stores_and_refuses_another_target(setup, monkeypatch, capsys):
    root, model = setup
    code, (out, err) = (
        run_script(ROOT / "data_prep" / "capture.py", overrides(root, "features"), monkeypatch),
        capsys.readouterr(),
    )
    assert code == 0, err
    assert "tokens/s" in out and "bytes/token" in out
    train, held_out = FeatureStore(root / "features" / "train"), FeatureStore(root / "features" / "eval")
    assert len(train) == 10 and len(held_out) == 3
    assert train.header.aux_layer_ids == (1, 3, 4) and train.header.target_name == str(root / "target")

    code = run_script(ROOT / "data_prep" / "capture.py", overrides(root, "features", aux=(1, 2, 4)), monkeypatch)
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().count("\n") == 0 and "made with aux_layer_ids=[1, 3, 4]" in err


@pytest.mark.slow
def test_capture_under_torchrun_matches_one_process(setup):
    root, _ = setup
    single = run([sys.executable, "data_prep/capture.py", *overrides(root, "single")])
    assert single.returncode == 0, single.stderr
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    two = run([*torchrun, "data_prep/capture.py", *overrides(root, "two")])
    assert two.returncode == 0, two.stderr
    assert "[rank 0]" in two.stdout and "[rank 1]" in two.stdout
    for split in ("train", "eval"):  # the same shards, bit for bit: a shard's batches do not depend on the rank
        a = json.loads((root / "single" / split / "manifest.json").read_text())
        b = json.loads((root / "two" / split / "manifest.json").read_text())
        assert a == b


@pytest.mark.slow
@pytest.mark.deadline(400)  # waits on torchrun
def test_a_target_spread_over_the_node_is_captured_by_one_process_per_node(setup):
    """`target.device_map=auto` (Kimi K2.6): two processes on one node are refused, one line each, before the target
    loads; `--nproc-per-node 1` captures."""
    root, _ = setup
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    args = ["data_prep/capture.py", *overrides(root, "spread"), "target.device_map=auto"]
    two = run([*torchrun, "--nproc-per-node", "2", *args])
    refusal = (
        "error: target.device_map=auto spreads the target over every GPU of the node, so one process per node "
        "loads it, not each of the 2 launched here: launch capture.py with torchrun --nproc-per-node 1"
    )
    assert two.returncode != 0 and refusal in two.stderr, two.stderr  # torchrun may stop the second rank first
    assert not list((root / "spread").rglob("*.safetensors"))
    one = run([*torchrun, "--nproc-per-node", "1", *args])
    assert one.returncode == 0, one.stderr
    assert len(FeatureStore(root / "spread" / "train")) == 10


@pytest.mark.slow
def test_import_cli_takes_loss_masks_from_the_prepared_split(setup, tmp_path, monkeypatch, capsys):
    root, model = setup
    prepared = load_from_disk(str(root / "data" / "train"))
    write_vllm_captures(model, prepared, tmp_path / "hs")
    args = [*overrides(root, "imported"), f"features.import_hidden_states_dir={tmp_path / 'hs'}"]
    script = ROOT / "data_prep" / "import_speculators.py"
    assert run_script(script, args, monkeypatch) == 0, capsys.readouterr().err
    store = FeatureStore(root / "imported" / "train")
    assert store.header.aux_layer_ids == (1, 3, 4)
    assert [s.loss_mask.tolist() for s in store.samples(range(10))] == prepared["loss_mask"]

    args[-1] = "features.import_hidden_states_dir=/nonexistent"
    capsys.readouterr()
    assert run_script(script, args, monkeypatch) == 2
    assert "hidden-states directory not found: /nonexistent" in capsys.readouterr().err


def test_capture_with_vllm_where_none_is_installed_is_one_line_before_the_target_loads(setup, monkeypatch, capsys):
    root, _ = setup
    monkeypatch.setattr("eagle31.engine.vllm_engine.installed_vllm", lambda: None)
    args = [*overrides(root, "vllm_features"), "features.engine.worker=vllm"]
    code, err = run_script(ROOT / "data_prep" / "capture.py", args, monkeypatch), capsys.readouterr().err
    assert (
        code == 2
        and err.strip()
        == "error: features from a vLLM engine need vLLM installed beside eagle31 (pip install 'vllm>=0.22')"
    )
    assert not list((root / "vllm_features").rglob("*.safetensors"))  # no shard was written


class BFloat16Engine:
    """A vLLM worker whose engine was told another dtype (`features.engine.vllm_args={dtype: ...}`): it describes
    itself, and is never asked for features."""

    kind = "vllm"

    def __init__(self, spec):
        self.spec = spec

    def describe(self):
        from eagle31.engine.worker import WorkerInfo
        from eagle31.target import target_fingerprints

        return WorkerInfo(
            self.kind, self.spec.aux_layer_ids, 32, "bfloat16", "cpu", **target_fingerprints(self.spec.target_dir)
        )

    def features(self, token_rows):
        raise AssertionError("a refused engine captures nothing")


def test_capture_with_an_engine_that_differs_from_the_recipe_is_one_line_before_any_shard(setup, monkeypatch, capsys):
    """The engine is checked as the training pool checks its workers (`eagle31.engine.worker.worker_mismatch`)."""
    root, _ = setup
    monkeypatch.setattr("eagle31.engine.worker.VLLMInferenceWorker", BFloat16Engine)
    args = [*overrides(root, "vllm_bf16"), "features.engine.worker=vllm"]
    code, err = run_script(ROOT / "data_prep" / "capture.py", args, monkeypatch), capsys.readouterr().err
    assert (
        code == 2
        and err.strip() == "error: the inference worker (vllm) computes dtype bfloat16, the recipe asks for float32"
    ), err
    assert not list((root / "vllm_bf16").rglob("*.safetensors"))
