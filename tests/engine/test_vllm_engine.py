"""What is checked before a vLLM engine starts (`eagle31.engine.vllm_engine.check_vllm`), the final norm applied to
vLLM's last-layer state, an engine whose aux ids are not the store's, and our connector against the connector
interface of the oldest and newest supported vLLM; the engine itself runs in tests/benchmarks/test_vllm_features.py."""

from __future__ import annotations

from pathlib import Path

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
        ("0.24.0", (), "vLLM 0.24.0 has no extract_hidden_states speculative method (vllm.v1.spec_decode.extract_hidden_states)"),
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


@pytest.mark.parametrize("version", VLLM_RELEASES)
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
        vllm_engine.VLLMFeatures(tmp_path, (1, 3, 4), dtype="float32", max_prompt_len=64, connector=present,
                                 engine_args={"speculative_config": {}, "enable_prefix_caching": True, "gpu_memory_utilization": 0.5})  # fmt: skip
