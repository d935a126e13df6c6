"""What is checked before a vLLM engine starts (`eagle31.engine.vllm_engine.check_vllm`), the final norm applied to
vLLM's last-layer state, an engine whose aux ids are not the store's, and our connector against the connector
interface of the oldest and newest supported vLLM; the engine itself runs in tests/benchmarks/test_vllm_features.py."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from eagle31.data.capture import capture_to_store
from eagle31.engine import vllm_engine
from eagle31.engine.worker import WorkerInfo
from eagle31.errors import ConfigError
from tests.peers import VLLM_RELEASES, run_peer
from tests.tiny_targets import tiny_llama

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "installed, modules, expected",
    [
        (None, (), "features from a vLLM engine need vLLM installed beside eagle31 (pip install 'vllm>=0.22')"),
        ("0.21.1", (), "vLLM 0.21.1 is too old for extract_hidden_states: eagle31 needs vLLM >= 0.22"),
        ("0.24.0", (), "vLLM 0.24.0 has no extract_hidden_states speculative method "
         "(vllm.v1.spec_decode.extract_hidden_states)"),
        # vLLM is not in this venv, so eagle31's connector (which subclasses vLLM's base) does not import
        ("0.32.0", ("vllm.v1.spec_decode.extract_hidden_states",),
         "the hidden-states connector module eagle31.engine.vllm_connector does not import: No module named 'vllm'"),
    ],
)  # fmt: skip
def test_an_engine_that_cannot_capture_is_refused_in_one_line(monkeypatch, installed, modules, expected):
    monkeypatch.setattr(vllm_engine, "installed_vllm", lambda: installed)
    monkeypatch.setattr(vllm_engine, "has_module", lambda name: name in modules)
    with pytest.raises(ConfigError) as e:
        vllm_engine.check_vllm()
    assert str(e.value) == expected


def test_a_connector_missing_from_its_module_is_named(monkeypatch):
    monkeypatch.setattr(vllm_engine, "installed_vllm", lambda: "0.32.0")
    monkeypatch.setattr(vllm_engine, "has_module", lambda name: True)
    with pytest.raises(ConfigError, match=r"^the hidden-states connector Missing is not in eagle31.engine.worker$"):
        vllm_engine.check_vllm(("eagle31.engine.worker", "Missing"))


def test_the_final_norm_of_the_last_layer_state_is_the_targets_lm_head_input(tmp_path):
    """vLLM hands out layer L's output before the final norm; `final_norm` (read from the checkpoint) makes it the
    state transformers feeds lm_head, to the bit in the target's dtype."""
    model = tiny_llama(seed=3, rms_norm_eps=1e-2)  # neither the default eps
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)  # nor the initial weight
    model.save_pretrained(tmp_path)
    out = model(input_ids=torch.tensor([[3, 5, 7, 11]]), output_hidden_states=True)
    pre_norm = out.hidden_states[-1]  # transformers' last entry is already normed: recompute it from the layers
    h = out.hidden_states[0]
    with torch.no_grad():
        for layer in model.model.layers:
            h = layer(h, position_embeddings=model.model.rotary_emb(h, torch.arange(4)[None]))
            h = h[0] if isinstance(h, tuple) else h
        assert torch.equal(vllm_engine.final_norm(tmp_path, torch.float32)(h), pre_norm)


class OtherIdsEngine:
    def describe(self) -> WorkerInfo:
        return WorkerInfo("vllm", (1, 2, 3), 32, "float32", "cpu", "target", "tokenizer")

    def features(self, token_rows):
        raise AssertionError("never asked")


def test_an_engine_computing_other_aux_ids_than_the_stores_is_refused(tmp_path):
    from tests.data.test_capture import writer_for
    from tests.tiny_targets import prepared_split

    data = prepared_split(4, seed=1)
    writer = writer_for(tmp_path / "store", tiny_llama(), data)  # aux ids (1, 3, 4)
    with pytest.raises(
        ConfigError, match=r"^the vllm engine computes aux ids \[1, 2, 3\], the store holds \[1, 3, 4\]$"
    ):
        capture_to_store(OtherIdsEngine(), data, writer, batch_tokens=64)


CONNECTOR_CHECK = """
import inspect, json, sys
sys.path.insert(0, sys.argv[1])
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from eagle31.engine.vllm_connector import HiddenStatesToFiles

# every method vLLM calls on a connector: does ours take the arguments its base class declares?
calls = ["get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
         "request_finished_all_groups", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
         "get_finished", "register_kv_caches", "get_finished_count", "get_required_kvcache_layout"]
refused = {}
for name in calls:
    if not hasattr(KVConnectorBase_V1, name):
        continue
    theirs = inspect.signature(getattr(KVConnectorBase_V1, name)).parameters.values()
    positional = [p.name for p in theirs if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = {p.name: None for p in theirs if p.kind == p.KEYWORD_ONLY}
    try:
        inspect.signature(getattr(HiddenStatesToFiles, name)).bind(*positional, **keywords)
    except TypeError as e:
        refused[name] = f"{positional} {list(keywords)}: {e}"
print(json.dumps({"abstract": sorted(getattr(HiddenStatesToFiles, "__abstractmethods__", ())), "refused": refused}))
"""


@pytest.mark.deadline(400)  # a vLLM process (run_peer's own limit is 300 s)
@pytest.mark.parametrize("version", VLLM_RELEASES)
@pytest.mark.slow
def test_the_connector_implements_the_connector_interface_of_each_supported_vllm(version):
    """What vLLM 0.22 and 0.33 (their own base class) call on a connector, ours takes, with their arguments;
    the engine runs it on 0.32 (tests/benchmarks/test_vllm_features.py)."""
    r = run_peer(version, CONNECTOR_CHECK, str(ROOT))
    assert r == {"abstract": [], "refused": {}}


def test_engine_arguments_that_make_the_capture_are_not_the_users_to_set(tmp_path, monkeypatch):
    tiny_llama(seed=1).save_pretrained(tmp_path)
    monkeypatch.setattr(vllm_engine, "installed_vllm", lambda: "0.32.0")
    monkeypatch.setattr(vllm_engine, "has_module", lambda name: True)
    present = ("eagle31.engine.worker", "WorkerInfo")  # a connector that imports here (vLLM's does not)
    with pytest.raises(
        ConfigError, match=r"^vLLM engine arguments \['enable_prefix_caching', 'speculative_config'\] are eagle31's"
    ):
        engine_args = {"speculative_config": {}, "enable_prefix_caching": True, "gpu_memory_utilization": 0.5}
        vllm_engine.VLLMFeatures(
            tmp_path, (1, 3, 4), dtype="float32", max_prompt_len=64, connector=present, engine_args=engine_args
        )


class FakeLLM:
    """vLLM's `LLM` as `VLLMFeatures` drives it, without vLLM: each prompt's hidden states written where, and as,
    the connector writes them, naming the layers this engine "resolved": those asked, `shift` above them."""

    shift = 0
    batches: list[int] = []  # prompts per generate call

    def __init__(self, **args):
        self.directory = Path(args["kv_transfer_config"]["kv_connector_extra_config"]["hidden_states_dir"])
        asked = args["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
        self.layer_ids, self.dtype = [i + self.shift for i in asked], getattr(torch, args["dtype"])

    def generate(self, prompts, params, use_tqdm):
        from safetensors.torch import save_file

        FakeLLM.batches.append(len(prompts))
        outputs = []
        for prompt in prompts:
            request = f"r{len(list(self.directory.iterdir()))}-{len(outputs)}"
            states = torch.zeros(len(prompt["prompt_token_ids"]), len(self.layer_ids), 32, dtype=self.dtype)
            path = str(self.directory / f"{request}.safetensors")
            save_file({"hidden_states": states}, path, metadata={"layer_ids": json.dumps(self.layer_ids)})
            outputs.append(SimpleNamespace(request_id=request, kv_transfer_params={"hidden_states_path": path}))
        return outputs


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    """A target directory, and `vllm` standing for the engine that would run on it."""
    tiny_llama(seed=1).save_pretrained(tmp_path / "target")
    vllm = ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams, vllm.TokensPrompt = FakeLLM, dict, dict
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setattr(vllm_engine, "check_vllm", lambda connector: "0.32.0")
    monkeypatch.setattr(FakeLLM, "batches", [])
    return tmp_path / "target"


@pytest.mark.parametrize("shift", [0, 1])
def test_a_vllm_worker_describes_the_layers_the_engine_resolved_and_other_ones_are_refused(
    fake_vllm, monkeypatch, shift
):
    """The aux ids a vLLM worker describes are those its engine's configuration names in each answer, not the spec's:
    an engine that resolved other layers is refused before training, and each answer of other layers is an error."""
    from eagle31.engine.worker import VLLMInferenceWorker, WorkerSpec, expected_info, worker_mismatch

    monkeypatch.setattr(FakeLLM, "shift", shift)
    worker = VLLMInferenceWorker(WorkerSpec(str(fake_vllm), "float32", None, False, (1, 3, 4), 64, threads=1, gpus=0))
    info = worker.describe()
    mismatch = worker_mismatch(info, expected_info(fake_vllm, (1, 3, 4), 32, "float32"), fake_vllm)
    if shift == 0:
        assert info.aux_layer_ids == (1, 3, 4) and mismatch is None
        assert [(a.shape, f.shape) for a, f in worker.features([[5, 6, 7]])] == [((3, 96), (3, 32))]
    else:
        assert mismatch == "computes aux_layer_ids (2, 4, 5, 7), the recipe asks for (1, 3, 4)"
        with pytest.raises(
            RuntimeError, match=r"of layers \[2, 4, 5, 7\] for a 3-token prompt; expected .* of layers \[1, 3, 4, 6\]"
        ):
            worker.features([[5, 6, 7]])
    assert not list(Path(worker.engine.directory).iterdir())  # every file read is deleted


def test_rows_go_to_the_engine_in_parts_whose_states_fit_the_shared_memory(fake_vllm, monkeypatch):
    """The states of the rows sent together are files in /dev/shm at once: rows are sent in parts that fit what is
    free there (here room for 100 tokens' states); an engine whose longest row cannot fit is refused as it starts."""
    row_bytes = 4 * 32 * 4  # 3 aux ids and the last layer, Ht = 32, float32: per token
    free = 100 * row_bytes / vllm_engine.SHM_SHARE
    monkeypatch.setattr(vllm_engine.shutil, "disk_usage", lambda path: SimpleNamespace(free=int(free) + 1))
    engine = vllm_engine.VLLMFeatures(fake_vllm, (1, 3, 4), dtype="float32", max_prompt_len=100)
    rows = [[1] * n for n in (60, 30, 20, 70, 100, 5)]
    assert [a.shape[0] for a, _ in engine.features(rows)] == [60, 30, 20, 70, 100, 5]  # all, in order
    assert FakeLLM.batches == [2, 2, 1, 1]  # 60 + 30 | 20 + 70 | 100 | 5
    with pytest.raises(ConfigError) as e:
        vllm_engine.VLLMFeatures(fake_vllm, (1, 3, 4), dtype="float32", max_prompt_len=4096)
    assert re.fullmatch(
        r"the hidden states of a 4096-token row \(data.max_len\) take 2.0 MiB in .*eagle31-hidden-states-\w+, which "
        r"has 0.1 MiB free: give the engine's machine more shared memory \(docker --shm-size, a memory-backed volume "
        r"on /dev/shm\) or lower data.max_len",
        str(e.value),
    ), str(e.value)


def test_the_dtype_of_the_features_is_the_targets_not_the_engine_arguments(fake_vllm):
    with pytest.raises(ConfigError, match=r"^vLLM engine arguments \['dtype'\] are eagle31's to set for the capture"):
        vllm_engine.VLLMFeatures(
            fake_vllm, (1, 3, 4), dtype="float32", max_prompt_len=64, engine_args={"dtype": "bfloat16"}
        )
