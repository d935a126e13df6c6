"""vLLM hidden states captured by `speculators` (`hs_{i}.safetensors`) into the shard store (docs/data.md)."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from eagle31.config import default_aux_layer_ids
from eagle31.data.batch import Sample
from eagle31.data.capture import CaptureStats
from eagle31.data.store import StoreHeader, StoreWriter
from eagle31.errors import ConfigError, CorruptDataError
from eagle31.model import rms_norm
from eagle31.target import (
    check_aux_layer_ids,
    load_target_config,
    read_target_tensor,
    target_fingerprint,
    target_shape,
    text_config,
)

_HS_FILE = re.compile(r"hs_(\d+)\.safetensors")


class Split(StrEnum):
    train = "train"
    eval = "eval"  # held out


def hidden_state_files(hs_dir: str | Path) -> dict[int, Path]:
    """{row i: path} of the `hs_{i}.safetensors` files in `hs_dir`."""
    hs_dir = Path(hs_dir)
    if not hs_dir.is_dir():
        raise ConfigError(f"hidden-states directory not found: {hs_dir}")
    files = {int(m.group(1)): p for p in hs_dir.iterdir() if (m := _HS_FILE.fullmatch(p.name))}
    if not files:
        raise ConfigError(f"no hs_<i>.safetensors files in {hs_dir}")
    return dict(sorted(files.items()))


def final_norm_weight(target_dir: str | Path) -> torch.Tensor:
    """The target's final RMSNorm weight `[Ht]` (`model.norm.weight`, also under a multimodal prefix)."""
    weight = read_target_tensor(target_dir, ("model.norm.weight",), required=False)
    if weight is None:
        raise ConfigError(f"target {target_dir}: no final norm weight (model.norm.weight) in its safetensors")
    return weight


def import_speculators(hs_dir: str | Path, store_dir: str | Path, *, target_dir: str | Path,
                       target_name: str | None = None, target_revision: str | None = None,
                       aux_layer_ids: Sequence[int] | None = None, dataset_dir: str | Path | None = None,
                       all_tokens: bool = False, dtype: str = "bfloat16",
                       shard_max_tokens: int = 32768) -> CaptureStats:  # fmt: skip
    """Convert `hs_dir`'s files into the store at `store_dir`, each checked first (resumable, like a capture)."""
    files = hidden_state_files(hs_dir)
    target = load_target_config(target_dir)
    L, Ht = target_shape(target)
    eps = float(text_config(target).get("rms_norm_eps", 1e-6))
    aux_ids = tuple(int(k) for k in aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(L)
    check_aux_layer_ids(aux_ids, L)
    dataset = _load_rows(dataset_dir) if dataset_dir else None
    lengths = np.array([_check(path, i, len(aux_ids) + 1, Ht, dataset, all_tokens) for i, path in files.items()])
    fingerprint = target_fingerprint(target_dir)
    header = StoreHeader(target_name or str(target_dir), target_revision, L, Ht, aux_ids, dtype, fingerprint)
    writer = StoreWriter(store_dir, header, np.array(list(files)), lengths, shard_max_tokens)
    weight = final_norm_weight(target_dir)
    stats, start = CaptureStats(), time.perf_counter()
    for index, ids in writer.pending():
        samples = [_read_sample(files[int(i)], int(i), dataset, weight, eps) for i in ids]
        stats.add(writer.write_shard(index, ids, samples))
    stats.shards_skipped = len(writer.plan) - stats.shards_written
    stats.seconds = time.perf_counter() - start
    writer.finalize()
    return stats


def _check(path: Path, row: int, slots: int, Ht: int, dataset, all_tokens: bool) -> int:
    """The file's token count, after checking its layout and where its loss mask comes from."""
    with _capture_file(path) as f:
        keys = set(f.keys())
        if not {"hidden_states", "token_ids"} <= keys:
            raise ConfigError(f"{path}: expected tensors hidden_states and token_ids, found {sorted(keys)}")
        shape, token_ids = f.get_slice("hidden_states").get_shape(), f.get_tensor("token_ids")
    T = len(token_ids)
    if list(shape) != [T, slots, Ht]:
        raise ConfigError(
            f"{path}: hidden_states has shape {list(shape)}, expected [{T}, {slots}, {Ht}] "
            f"(the aux layers plus the last layer, hidden size {Ht}); check the aux layer ids"
        )
    if "loss_mask" in keys:
        return T
    if dataset is not None:
        if row >= len(dataset):
            raise ConfigError(f"{path}: row {row} is beyond the {len(dataset)} rows of the dataset")
        if dataset[row]["input_ids"] != token_ids.tolist():
            raise ConfigError(f"{path}: token_ids differ from row {row}'s input_ids in the dataset")
    elif not all_tokens:
        raise ConfigError(
            f"{path} holds no loss_mask; give the dataset the files were generated from "
            "(features.import_dataset_dir) or supervise every token (features.import_all_tokens=true)"
        )
    return T


@contextmanager
def _capture_file(path: Path):
    """`safe_open(path)`; a garbled or truncated file is one `CorruptDataError` naming it."""
    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise CorruptDataError(
            f"{path}: not a readable safetensors file ({e}); capture it again or remove it"
        ) from None


def _load_rows(dataset_dir: str | Path):
    from datasets import Dataset, load_from_disk

    ds = load_from_disk(str(dataset_dir))
    if not isinstance(ds, Dataset) or not {"input_ids", "loss_mask"} <= set(ds.column_names):
        raise ConfigError(f"{dataset_dir}: expected one dataset split with columns input_ids and loss_mask")
    return ds


def _read_sample(path: Path, row: int, dataset, weight: torch.Tensor, eps: float) -> Sample:
    with _capture_file(path) as f:
        hs = f.get_tensor("hidden_states")  # [T, n, Ht]
        token_ids = f.get_tensor("token_ids").long()  # [T]
        loss_mask = f.get_tensor("loss_mask").long() if "loss_mask" in f.keys() else None
    if loss_mask is None:  # checked by _check: the dataset's row, or every token
        loss_mask = torch.ones_like(token_ids) if dataset is None else torch.tensor(dataset[row]["loss_mask"]).long()
    if not torch.isfinite(hs).all():
        raise ConfigError(f"{path}: hidden_states hold non-finite values")
    return Sample(
        input_ids=token_ids,
        loss_mask=loss_mask,
        aux=hs[:, :-1].flatten(1),  # [T, (n-1)*Ht], aux ids in increasing order
        final=rms_norm(hs[:, -1], weight.to(hs.dtype), eps),  # [T, Ht], HF's arithmetic: fp32, cast back, scaled
    )
