"""Capture the target's hidden states into the shard store (docs/design.md §2, §6).

    python data_prep/capture.py recipe=demo
    torchrun --nproc-per-node 8 data_prep/capture.py recipe=llama31_8b target.path=/models/Llama-3.1-8B-Instruct \
        features.store_dtype=float8
    python data_prep/capture.py recipe=llama31_70b target.path=/models/Llama-3.1-70B-Instruct   # one process, all GPUs
    python data_prep/capture.py recipe=kimi_k26 target.path=/models/Kimi-K2.6 features.engine.worker=vllm \
        features.engine.worker_gpus=8   # vLLM, TP 8

Runs the target (`target.path` or `target.builtin`) over the prepared splits
(`data.prepared_dir`/train and /eval, from data_prep/prepare.py) in length-sorted
batches of `features.capture_batch_tokens` padded tokens, and writes one store per
split, `features.store_dir`/<split>. Aux layers: `drafter.aux_layer_ids`, default
(2, L//2, L-3). Each rank writes its own shards; rerunning skips the finished ones. A target
spread over the node's GPUs (`target.device_map=auto`, as recipe=llama31_70b sets) is captured by one
process per node: under torchrun, `--nproc-per-node 1` (more are refused in one line).
A store made for another target, aux ids, dtype or data is refused with one line
and exit code 2 before the target is loaded. Train on it with features.mode=store.

`features.engine.worker=vllm` captures with a vLLM engine instead (vLLM >= 0.22 installed beside
eagle31; one process, tensor parallel over `features.engine.worker_gpus`, engine arguments in
`features.engine.vllm_args`): vLLM's `extract_hidden_states` and eagle31's connector
(docs/engine.md), the same store within floating-point tolerance of the HF capture. The engine is checked
as the training pool checks its workers (aux ids, hidden size, dtype, the target's and its tokenizer's
fingerprints) before it captures anything.
"""

import sys
from pathlib import Path

from eagle31.config import DrafterConfig
from eagle31.data.capture import capture_splits, check_one_process_per_node, open_store_writers
from eagle31.data.prepare import load_prepared_splits
from eagle31.distributed import close_world, init_world
from eagle31.engine.worker import EngineWorker, VLLMInferenceWorker, WorkerSpec, expected_info, worker_mismatch
from eagle31.errors import ConfigError, RunInterrupted
from eagle31.target import load_recipe_target, load_target_config, target_shape
from eagle31.targets import resolve_target_path
from eagle31_cli import recipe_main

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def capture(cfg) -> None:
    world = init_world(cfg.train.device)
    try:
        splits = load_prepared_splits(Path(cfg.data.prepared_dir))
        target_dir = Path(resolve_target_path(cfg.target))
        target_config = load_target_config(target_dir)
        aux_ids = DrafterConfig.from_target_config(target_config, aux_layer_ids=cfg.drafter.aux_layer_ids).aux_layer_ids
        # raises ConfigError before the target loads
        writers = open_store_writers(
            Path(cfg.features.store_dir), splits, target_dir, target_config, aux_ids, cfg.target, cfg.features
        )
        if cfg.features.engine.worker == EngineWorker.vllm:
            if world.world_size > 1:
                raise ConfigError(
                    "features.engine.worker=vllm captures in one process (vLLM spreads the target over "
                    "features.engine.worker_gpus); run it without torchrun"
                )
            target = VLLMInferenceWorker(WorkerSpec.from_recipe(cfg, target_dir, aux_ids))
            expected = expected_info(target_dir, aux_ids, target_shape(target_config)[1], str(cfg.target.dtype))
            mismatch = worker_mismatch(target.describe(), expected, target_dir)  # as the pool checks its workers
            if mismatch:
                raise ConfigError(f"the inference worker ({target.kind}) {mismatch}")
        else:
            check_one_process_per_node(world, cfg.target, "launch capture.py with torchrun --nproc-per-node 1")
            target = load_recipe_target(target_dir, cfg.target, world.device)
        capture_splits(target, splits, writers, batch_tokens=cfg.features.capture_batch_tokens, world=world)
    except KeyboardInterrupt:
        raise RunInterrupted(
            f"interrupted; the finished shards under {cfg.features.store_dir} are kept: rerun the same command to "
            "capture the rest"
        ) from None
    finally:
        close_world()


if __name__ == "__main__":
    sys.exit(recipe_main(capture, RECIPES, sys.argv[1:], usage=__doc__))
