"""What an inference worker must describe (`eagle31.engine.worker.expected_info`) and the one line naming what
differs (`worker_mismatch`), which the pool and data_prep/capture.py both use (the pool's run:
tests/engine/test_pool.py)."""

from __future__ import annotations

from eagle31.engine.worker import WorkerInfo, expected_info, worker_mismatch
from tests.tiny_targets import tiny_llama


def test_a_worker_is_compared_with_the_recipe_field_by_field_and_its_target_by_fingerprint(tmp_path, llama_tok):
    tiny_llama(seed=0).save_pretrained(tmp_path / "recipe")
    llama_tok.save_pretrained(tmp_path / "recipe")
    expected = expected_info(tmp_path / "recipe", [1, 3, 4], 32, "float32")
    assert (
        expected["aux_layer_ids"] == (1, 3, 4)
        and len(expected["target_fingerprint"]) == len(expected["tokenizer_fingerprint"]) == 64
    )
    same = WorkerInfo(
        "vllm", (1, 3, 4), 32, "float32", "cpu", expected["target_fingerprint"], expected["tokenizer_fingerprint"]
    )
    assert worker_mismatch(same, expected, tmp_path / "recipe") is None
    other = same._replace(dtype="bfloat16", tokenizer_fingerprint="f" * 64)
    t = expected["tokenizer_fingerprint"]
    assert worker_mismatch(other, expected, tmp_path / "recipe") == (
        "computes dtype bfloat16, the recipe asks for float32; "
        "runs a target whose tokenizer differs from the recipe's "
        f"target {tmp_path / 'recipe'} (fingerprint ffffffffffff..., expected {t[:12]}...)"
    )


def test_an_hf_worker_describes_the_layers_its_hooks_keep_not_those_it_was_told(tmp_path):
    """The aux ids a worker describes are read off a forward through its installed hooks: hooks one layer above
    the spec's ids describe themselves so, and are refused."""
    from eagle31.engine.worker import HFInferenceWorker, WorkerSpec
    from tests.engine.workers import ShiftedHooksWorker

    tiny_llama(seed=0).save_pretrained(tmp_path)
    spec = WorkerSpec(str(tmp_path), "float32", None, False, (1, 3, 4), 64, threads=1, gpus=0)
    assert HFInferenceWorker(spec).describe().aux_layer_ids == (1, 3, 4)
    shifted = ShiftedHooksWorker(spec).describe()
    assert worker_mismatch(shifted, {"aux_layer_ids": (1, 3, 4)}, tmp_path) == (
        "computes aux_layer_ids (2, 4, 5), the recipe asks for (1, 3, 4)"
    )
