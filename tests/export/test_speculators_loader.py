"""The speculators layout read by the `speculators` library itself (0.9.0's `Eagle3DraftModel.from_pretrained`).

Its loader builds the drafter, loads our file, then reads the verifier named in
`speculators_config.verifier.name_or_path` (its config, and its embedding and lm_head for
whatever the file lacks). A tiny Llama target saved with transformers stands in for the
verifier, so nothing is downloaded.
"""

import pytest
import torch
from safetensors.torch import load_file

from eagle31.export import export_drafter
from tests.helpers import tiny_drafter
from tests.peers import peer_module
from tests.tiny_targets import drafter_sized_llama

pytestmark = pytest.mark.slow  # importing speculators takes ~10 s: in the test, not at collection


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    """A Llama target of the tiny drafter's shape (vocabulary 40, hidden 16, 8 layers), saved as a local checkpoint."""
    path = tmp_path_factory.mktemp("verifier")
    drafter_sized_llama(dtype=torch.float32).save_pretrained(path)
    return path


def test_speculators_loads_every_exported_tensor_including_the_embedding(tmp_path, verifier):
    peer_module("loguru")  # speculators' loading module imports it (speculators itself goes in with --no-deps)
    eagle3 = peer_module("speculators.models.eagle3")
    m = tiny_drafter(seed=1, dtype=torch.float32)
    out = export_drafter(m, tmp_path / "s", "speculators", dtype="float32", target_name_or_path=str(verifier))
    loaded = eagle3.Eagle3DraftModel.from_pretrained(str(out))
    state = loaded.state_dict()
    for key, tensor in load_file(str(out / "model.safetensors")).items():
        assert torch.equal(state[key], tensor), key
    assert torch.equal(loaded.embed_tokens.weight, m.embed_tokens.weight)  # ours, not left to chance
    assert (loaded.config.fc_norm, loaded.config.norm_output) == (True, True)
