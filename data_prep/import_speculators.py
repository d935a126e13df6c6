r"""Import hidden states captured with vLLM by `speculators` into the shard store.

    python data_prep/import_speculators.py recipe=kimi_k26 target.path=/models/Kimi-K2.6 \
        features.import_hidden_states_dir=/data/kimi/hidden_states/train \
        features.import_dataset_dir=/data/kimi/prepared/train

Capture Kimi-scale targets with vLLM (speculators' launch_vllm.py + generate-offline-data,
run over a prepared split), then convert their `hs_<i>.safetensors` files here into
`features.store_dir`/<features.import_split> and train with features.mode=store. Loss
masks come from row i of `features.import_dataset_dir` (default: the recipe's prepared
split of that name, when it exists); see eagle31/data/speculators_import.py for the
layout. Only the target's config.json and final norm weight are read, from `target.path`. Rerunning
skips finished shards. Bad input: one line, exit code 2.
"""

import sys
from pathlib import Path

from eagle31.data.speculators_import import import_speculators
from eagle31.data.store import target_identity
from eagle31.errors import ConfigError
from eagle31.targets import resolve_target_path
from eagle31_cli import recipe_main

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def import_hidden_states(cfg) -> None:
    f = cfg.features
    split = f.import_split
    dataset_dir = f.import_dataset_dir
    if dataset_dir is None and (Path(cfg.data.prepared_dir) / split).is_dir():
        dataset_dir = Path(cfg.data.prepared_dir) / split
    if not f.import_hidden_states_dir:
        raise ConfigError("set features.import_hidden_states_dir to the directory of hs_<i>.safetensors files")
    stats = import_speculators(
        f.import_hidden_states_dir,
        Path(f.store_dir) / split,
        target_dir=resolve_target_path(cfg.target),
        target_name=target_identity(cfg.target),
        target_revision=cfg.target.revision,
        aux_layer_ids=cfg.drafter.aux_layer_ids,
        dataset_dir=dataset_dir,
        all_tokens=f.import_all_tokens,
        dtype=f.store_dtype,
        shard_max_tokens=f.shard_max_tokens,
    )
    print(f"{Path(f.store_dir) / split}: {stats.summary()}")


if __name__ == "__main__":
    sys.exit(recipe_main(import_hidden_states, RECIPES, sys.argv[1:], usage=__doc__))
