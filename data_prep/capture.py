"""Capture the target's hidden states into the shard store (docs/design.md §2, §6).

    python data_prep/capture.py recipe=demo
    torchrun --nproc-per-node 8 data_prep/capture.py recipe=llama31_8b features.store_dtype=float8
    python data_prep/capture.py recipe=kimi_k26 target.device_map=auto    # one process, the target over all GPUs

Runs the target (`target.path` or `target.builtin`) over the prepared splits
(`data.prepared_dir`/train and /eval, from data_prep/prepare.py) in length-sorted
batches of `features.capture_batch_tokens` padded tokens, and writes one store per
split, `features.store_dir`/<split>. Aux layers: `drafter.aux_layer_ids`, default
(2, L//2, L-3). Each rank writes its own shards; rerunning skips the finished ones.
A store made for another target, aux ids, dtype or data is refused with one line
and exit code 2 before the target is loaded. Train on it with features.mode=store.
"""

import sys
from pathlib import Path

from datasets import load_from_disk

from eagle31.cli import recipe_main
from eagle31.config import ConfigError, DrafterConfig, load_target_config
from eagle31.data.capture import capture_to_store, load_target, target_fingerprint
from eagle31.data.store import StoreWriter
from eagle31.distributed import barrier, close_world, init_world
from eagle31.errors import RunInterrupted
from eagle31.targets import resolve_target_path

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def open_stores(cfg) -> tuple[Path, dict, dict]:
    """(target dir, prepared splits, store writers): everything checked before the target loads."""
    splits = {}
    for name in ("train", "eval"):
        path = Path(cfg.data.prepared_dir) / name
        if name == "train" and not path.is_dir():
            raise ConfigError(f"no prepared split at {path}; run data_prep/prepare.py first")
        if path.is_dir():
            splits[name] = load_from_disk(str(path))
    target_dir = Path(resolve_target_path(cfg.target))
    target_config = load_target_config(target_dir)
    aux_ids = DrafterConfig.from_target_config(target_config, aux_layer_ids=cfg.drafter.aux_layer_ids).aux_layer_ids
    store_dir = Path(cfg.features.store_dir)
    fingerprint = target_fingerprint(target_dir)
    writers = {
        name: StoreWriter.for_dataset(store_dir / name, ds, target_config, aux_ids, cfg.target, cfg.features, fingerprint=fingerprint)
        for name, ds in splits.items()
    }
    return target_dir, splits, writers


def capture(cfg) -> None:
    world = init_world(cfg.train.device)
    try:
        target_dir, splits, writers = open_stores(cfg)  # raises ConfigError before the target loads
        model = load_target(target_dir, cfg.target, world.device)
        for name, ds in splits.items():
            stats = capture_to_store(
                model,
                ds,
                writers[name],
                batch_tokens=cfg.features.capture_batch_tokens,
                rank=world.rank,
                world_size=world.world_size,
            )
            print(f"[rank {world.rank}] {name}: {stats.summary()}")
        barrier()
        if world.is_main:
            for name, writer in writers.items():
                m = writer.finalize()
                print(f"{writer.root}: {m['num_samples']} samples, {m['num_tokens']} tokens, {len(m['shards'])} shards")
    except KeyboardInterrupt:
        raise RunInterrupted(
            f"interrupted; the finished shards under {cfg.features.store_dir} are kept: rerun the same command to capture the rest"
        ) from None
    finally:
        close_world()


if __name__ == "__main__":
    sys.exit(recipe_main(capture, RECIPES, sys.argv[1:], usage=__doc__))
