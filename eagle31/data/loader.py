"""Micro-batches of target features for the trainer: planned, shuffled, split across ranks, resumable (docs/data.md)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from enum import StrEnum
from typing import Any, Protocol

import numpy as np
import torch

from eagle31.data.batch import FeatureBatch, Sample, bucket_by_length, empty_batch, next_fit, pack, pad
from eagle31.errors import ConfigError, choose


class FeatureMode(StrEnum):
    online = "online"  # the target runs in the trainer
    store = "store"  # features read from a shard store (data_prep/capture.py first)
    engine = "engine"  # inference workers on Ray compute them and stream them to the trainers (eagle31.engine)


class Batching(StrEnum):
    pack = "pack"  # one row of whole documents, with document ids
    bucket = "bucket"  # similar lengths together, padded


class FeatureSource(Protocol):
    sample_ids: np.ndarray  # [S] ascending row ids of the split
    lengths: np.ndarray  # [S] tokens per sample
    aux_size: int  # n*Ht
    hidden_size: int  # Ht
    dtype: torch.dtype  # of the features it returns

    def samples(self, ids: Sequence[int]) -> Sequence[Sample | None]:
        """The samples with these ids, in order; None for one that cannot be read (skipped)."""
        ...


def plan_epoch(lengths: np.ndarray, *, batching: str, tokens_per_batch: int, seed: int, epoch: int) -> list[np.ndarray]:
    """Global micro-batches of one epoch, as arrays of positions into `lengths`."""
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(len(lengths))
    if batching == "bucket":
        groups = bucket_by_length(lengths[perm].tolist(), tokens_per_batch)
        return [perm[groups[i]] for i in rng.permutation(len(groups))]
    return [perm[run] for run in next_fit(lengths[perm], tokens_per_batch)]


class FeatureLoader:
    """This rank's micro-batches (`FeatureBatch`, on the source's device), epoch after epoch; resumable."""

    def __init__(self, source: FeatureSource, *, batching: str = "pack", tokens_per_batch: int = 4096, seed: int = 0,
                 rank: int = 0, world_size: int = 1):  # fmt: skip
        batching = choose(Batching, batching, "features.batching")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside world_size {world_size}")
        if len(source.lengths) == 0:
            raise ConfigError("the feature source has no samples")
        longest = int(np.argmax(source.lengths))
        if source.lengths[longest] > tokens_per_batch:
            raise ConfigError(
                f"sample {int(source.sample_ids[longest])} has {int(source.lengths[longest])} tokens, more than "
                f"features.tokens_per_batch={tokens_per_batch}; raise it or lower data.max_len"
            )
        self.source = source
        self.batching, self.tokens_per_batch, self.seed = batching, tokens_per_batch, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.position = 0, 0
        self.consumed: dict[str, Any] = {"samples": 0, "sha256": hashlib.sha256().hexdigest()}
        self._plan: tuple[int, list[np.ndarray | None]] | None = None

    def _rank_plan(self) -> list[np.ndarray | None]:
        """This rank's micro-batches of the current epoch (positions into the source; None = empty batch)."""
        if self._plan is None or self._plan[0] != self.epoch:
            batches = plan_epoch(self.source.lengths, batching=self.batching, tokens_per_batch=self.tokens_per_batch,
                                 seed=self.seed, epoch=self.epoch)  # fmt: skip
            rounds = -(-len(batches) // self.world_size)
            mine = range(self.rank, rounds * self.world_size, self.world_size)
            self._plan = (self.epoch, [batches[i] if i < len(batches) else None for i in mine])
        return self._plan[1]

    def __len__(self) -> int:
        """Micro-batches per rank in the current epoch (equal on every rank)."""
        return len(self._rank_plan())

    def __iter__(self) -> Iterator[FeatureBatch]:
        plan = self._rank_plan()
        while self.position < len(plan):
            positions = plan[self.position]
            self.position += 1
            yield self._batch(positions)
        self.epoch, self.position = self.epoch + 1, 0

    def rewind(self) -> None:
        """Back to epoch 0: every evaluation reads the held-out batches in the same order, resumed or not."""
        self.epoch, self.position = 0, 0

    def _batch(self, positions: np.ndarray | None) -> FeatureBatch:
        src = self.source
        ids = [] if positions is None else src.sample_ids[positions].tolist()
        # a skipped corrupt shard drops its samples
        kept = {i: s for i, s in zip(ids, src.samples(ids) if ids else [], strict=False) if s is not None}
        chain = hashlib.sha256(bytes.fromhex(self.consumed["sha256"]) + np.asarray(list(kept), np.int64).tobytes())
        self.consumed = {"samples": self.consumed["samples"] + len(kept), "sha256": chain.hexdigest()}
        samples = list(kept.values())
        if not samples:
            return empty_batch(src.aux_size, src.hidden_size, src.dtype)
        return pack(samples) if self.batching == "pack" else pad(samples)

    def state_dict(self) -> dict:
        keys = ("epoch", "position", "world_size", "seed", "batching", "tokens_per_batch")
        state = {k: getattr(self, k) for k in keys}
        return {**state, "num_samples": len(self.source.sample_ids), "consumed": dict(self.consumed)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved position (on another world size: the same global batch if it divides, a new record)."""
        for key in ("seed", "batching", "tokens_per_batch", "num_samples"):
            mine = self.state_dict()[key]
            if state[key] != mine:
                raise ConfigError(f"the data position was saved with {key}={state[key]!r}, this run has {mine!r}")
        done = state["position"] * state["world_size"]  # global batches consumed this epoch
        if done % self.world_size:
            raise ConfigError(
                f"cannot resume {done} consumed batches (saved with world_size={state['world_size']}) "
                f"on world_size={self.world_size}"
            )
        self.epoch, self.position = state["epoch"], done // self.world_size
        if state["world_size"] == self.world_size and "consumed" in state:
            self.consumed = dict(state["consumed"])
