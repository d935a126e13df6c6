"""Target features of prepared rows (docs/design.md §2), from the HF target or an engine, captured into the store."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from eagle31.data.batch import TOKEN_COLUMNS, Sample, bucket_by_length
from eagle31.data.store import StoreWriter
from eagle31.distributed import World, barrier
from eagle31.errors import ConfigError
from eagle31.io import write_errors
from eagle31.target import TargetFeatures, target_fingerprint


def prepared_rows(dataset, ids: Iterable[int]) -> list[tuple[list[int], ...]]:
    """The token columns of rows `ids`, in `TOKEN_COLUMNS`' order (input_ids, loss_mask, ...)."""
    rows = dataset[[int(i) for i in ids]]
    return list(zip(*(rows[name] for name in TOKEN_COLUMNS), strict=False))


def target_forward(
    feats: TargetFeatures, token_rows: Sequence[Sequence[int]], batch_tokens: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(aux [T, n*Ht], final [T, Ht]) of each row: views of length-sorted padded forwards of <= `batch_tokens`."""
    device = feats.model.get_input_embeddings().weight.device
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(token_rows)
    for group in bucket_by_length([len(ids) for ids in token_rows], batch_tokens):
        ids = [torch.tensor(token_rows[i], dtype=torch.long) for i in group]
        input_ids = pad_sequence(ids, batch_first=True)  # [B, T]
        attention_mask = pad_sequence([torch.ones_like(row) for row in ids], batch_first=True)  # [B, T]
        aux, final = feats.capture(input_ids.to(device), attention_mask.to(device))
        for b, i in enumerate(group):
            n = len(token_rows[i])
            out[i] = (aux[b, :n], final[b, :n])
    return out  # type: ignore[return-value]  # every row is in a group


def as_samples(
    rows: Sequence[tuple[list[int], ...]], features: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> list[Sample]:
    """One `Sample` per prepared row (its `TOKEN_COLUMNS`) and its (aux, final), on the device of the features."""
    return [
        Sample._make([*(torch.tensor(values, dtype=torch.long, device=final.device) for values in row), aux, final])
        for row, (aux, final) in zip(rows, features, strict=True)
    ]


def run_target(feats: TargetFeatures, rows: Sequence[tuple[list[int], ...]], batch_tokens: int) -> list[Sample]:
    """`target_forward` of each row (its `TOKEN_COLUMNS`, input ids first), as one `Sample` per row."""
    return as_samples(rows, target_forward(feats, [row[0] for row in rows], batch_tokens))


@dataclass
class CaptureStats:
    """What one rank's capture (or import) did; `summary()`: throughput and bytes per token."""

    shards_written: int = 0
    shards_skipped: int = 0  # this rank's shards finished by an earlier run
    samples: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, record: dict) -> None:
        """Count a shard just written (its record from `StoreWriter.write_shard`)."""
        self.shards_written += 1
        self.samples += record["samples"]
        self.tokens += record["tokens"]
        self.bytes += record["bytes"]

    def summary(self) -> str:
        rate = self.tokens / self.seconds if self.seconds else 0.0
        per_token = self.bytes / self.tokens if self.tokens else 0.0
        return (
            f"{self.tokens} tokens ({self.samples} samples) in {self.shards_written} shards, "
            f"{self.shards_skipped} already done; {rate:,.0f} tokens/s, {per_token:,.0f} bytes/token"
        )


@contextmanager
def features_of(target, aux_layer_ids: Sequence[int], batch_tokens: int):
    """token rows -> [(aux, final)]: the HF target's `target_forward`, or an inference worker's `features` (checked)."""
    if isinstance(target, nn.Module):
        with TargetFeatures(target, aux_layer_ids) as feats:
            yield lambda token_rows: target_forward(feats, token_rows, batch_tokens)
        return
    info = target.describe()
    if tuple(info.aux_layer_ids) != tuple(aux_layer_ids):
        raise ConfigError(
            f"the {info.kind} engine computes aux ids {list(info.aux_layer_ids)}, the store holds {list(aux_layer_ids)}"
        )
    yield target.features


def capture_to_store(
    target, dataset, writer: StoreWriter, *, batch_tokens: int, rank: int = 0, world_size: int = 1
) -> CaptureStats:
    """Capture this rank's unfinished shards of `writer`'s plan (rows of `dataset`); a write error is one line."""
    stats, start = CaptureStats(), time.perf_counter()
    mine = range(rank, len(writer.plan), world_size)
    kept = "the finished shards are kept and the one being written was removed; a rerun captures the rest"
    with (
        write_errors(f"the feature store {writer.root}", kept),
        features_of(target, writer.header.aux_layer_ids, batch_tokens) as features,
    ):
        for index, ids in writer.pending(rank, world_size):
            rows = prepared_rows(dataset, ids)
            stats.add(writer.write_shard(index, ids, as_samples(rows, features([row[0] for row in rows]))))
    stats.shards_skipped = len(mine) - stats.shards_written
    stats.seconds = time.perf_counter() - start
    return stats


def open_store_writers(
    store_dir: Path, splits: dict, target_dir, target_config: dict, aux_layer_ids, target, features
) -> dict[str, StoreWriter]:
    """One writer per prepared split under `store_dir`; each refuses a store made otherwise, before the target loads."""
    fingerprint = target_fingerprint(target_dir)
    return {
        name: StoreWriter.for_dataset(
            store_dir / name, ds, target_config, aux_layer_ids, target, features, fingerprint=fingerprint
        )
        for name, ds in splits.items()
    }


def check_one_process_per_node(world: World, target_section, instead: str) -> None:
    """A target spread over the node's GPUs (`target.device_map`) is loaded by one process per node, never by each."""
    if target_section.device_map and world.local_world_size > 1:
        raise ConfigError(
            f"target.device_map={target_section.device_map} spreads the target over every GPU of the node, so one "
            f"process per node loads it, not each of the {world.local_world_size} launched here: {instead}"
        )


def capture_splits(target, splits: dict, writers: dict[str, StoreWriter], *, batch_tokens: int, world: World) -> None:
    """Capture every split into its writer (each rank its shards); rank 0 finalizes a split once all ranks are done."""
    for name, ds in splits.items():
        writer = writers[name]
        stats = capture_to_store(
            target, ds, writer, batch_tokens=batch_tokens, rank=world.rank, world_size=world.world_size
        )
        print(f"[rank {world.rank}] {name}: {stats.summary()}")
        barrier()
        if world.is_main:
            m = writer.finalize()
            print(f"{writer.root}: {m['num_samples']} samples, {m['num_tokens']} tokens, {len(m['shards'])} shards")
        barrier()
