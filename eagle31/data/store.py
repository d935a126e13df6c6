"""The shard store of target features: writer, reader and checks, one on-disk format (docs/design.md §6)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle31.data.batch import TOKEN_COLUMNS, Sample, next_fit
from eagle31.errors import ConfigError, CorruptDataError
from eagle31.io import atomic_save_safetensors, atomic_write_json, claim_output_dir, sha256_file
from eagle31.target import target_shape

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STORE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "float8": torch.float8_e4m3fn}  # fmt: skip
_FP8_MAX = 448.0  # largest finite float8 e4m3fn
_OPEN_SHARDS = 64  # memory-mapped shards kept open per reader
_SHARD_FILE = re.compile(r"shard-\d{6}\.safetensors")


class StoreDtype(StrEnum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"
    float8 = "float8"  # e4m3 with per-row scales


class StoreMismatchError(ConfigError):
    """An existing store was made for another target, aux ids, dtype or source data."""


class CorruptShardError(CorruptDataError):
    """A shard is missing, unreadable or does not match its recorded sha256."""


@dataclass(frozen=True)
class StoreHeader:
    """What a store was made for; appending to a store requires an equal header."""

    target_name: str
    target_revision: str | None
    num_layers: int  # L
    hidden_size: int  # Ht
    aux_layer_ids: tuple[int, ...]  # vLLM convention: input of decoder layer k
    dtype: str  # a key of STORE_DTYPES
    target_fingerprint: str | None = None  # eagle31.target.target_fingerprint

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if self.dtype not in STORE_DTYPES:
            raise ConfigError(f"features.store_dtype must be one of {sorted(STORE_DTYPES)}, got {self.dtype!r}")

    @property
    def aux_size(self) -> int:
        return len(self.aux_layer_ids) * self.hidden_size

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "aux_layer_ids": list(self.aux_layer_ids)}


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.safetensors"


def prepared_lengths(dataset) -> np.ndarray:
    """[S] token counts of a prepared split (a `datasets.Dataset` with `input_ids`)."""
    column = dataset.with_format("arrow")[:]["input_ids"]
    return pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)


def target_identity(target: Any) -> str:
    """The name a store records for the recipe's target: `target.name` (which survives a move), `builtin` or `path`."""
    return str(target.name or target.builtin or target.path)


def check_store_compatible(store_dir: str | Path, target_config: dict, aux_layer_ids: Sequence[int], *,
                           target_name: str, target_revision: str | None,
                           target_fingerprint: str) -> None:  # fmt: skip
    """Refuse the stores under `store_dir` (one per split) made for another target (identity or shape) or aux ids."""
    L, Ht = target_shape(target_config)
    header = StoreHeader(target_name, target_revision, L, Ht, tuple(aux_layer_ids), "float32", target_fingerprint)
    want = {k: v for k, v in header.to_dict().items() if k != "dtype"}  # a store of any dtype
    for path in sorted(Path(store_dir).glob(f"*/{MANIFEST}")):
        _check_fields(path, want)


def store_state(root: str | Path) -> str:
    """ "missing" (no manifest), "unfinished" (a capture or import whose shards are not merged) or "finished"."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        return "missing"
    return "finished" if "num_samples" in _read_json(path) else "unfinished"


class StoreWriter:
    """One rank's shards of a store, planned from the split's ids and lengths; a store made otherwise is refused."""

    def __init__(
        self, root: str | Path, header: StoreHeader, sample_ids: np.ndarray, lengths: np.ndarray, shard_max_tokens: int
    ):
        if shard_max_tokens <= 0:
            raise ConfigError(f"features.shard_max_tokens must be positive, got {shard_max_tokens}")
        self.root, self.header = Path(root), header
        sample_ids = np.asarray(sample_ids, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        order = np.lexsort((sample_ids, lengths))  # the plan: sorted by (length, id), cut at shard_max_tokens
        self.plan = [sample_ids[order[run]] for run in next_fit(lengths[order], shard_max_tokens)]
        digest = hashlib.sha256(np.stack([sample_ids, lengths]).tobytes()).hexdigest()
        self.manifest_head = {
            "format_version": FORMAT_VERSION,
            **header.to_dict(),
            "plan": {
                "shard_max_tokens": shard_max_tokens,
                "num_samples": len(sample_ids),
                "num_tokens": int(lengths.sum()),
                "samples_sha256": digest,  # of the sample ids and lengths
            },
        }
        claim_output_dir(self.root, "feature-store")
        if (self.root / MANIFEST).exists():
            _check_fields(self.root / MANIFEST, self.manifest_head)
        else:
            atomic_write_json(self.root / MANIFEST, {**self.manifest_head, "shards": []})

    @classmethod
    def for_dataset(cls, root: str | Path, dataset, target_config: dict, aux_layer_ids: Sequence[int], target: Any,
                    features: Any, *, fingerprint: str) -> StoreWriter:  # fmt: skip
        """The writer for capturing a prepared split; `target` / `features` are the recipe's sections."""
        L, Ht = target_shape(target_config)
        header = StoreHeader(
            target_identity(target), target.revision, L, Ht, tuple(aux_layer_ids), features.store_dtype, fingerprint
        )
        lengths = prepared_lengths(dataset)
        return cls(root, header, np.arange(len(lengths)), lengths, features.shard_max_tokens)

    def pending(self, rank: int = 0, world_size: int = 1) -> Iterator[tuple[int, np.ndarray]]:
        """(shard index, sample ids) of this rank's shards that are not finished yet."""
        for index in range(rank, len(self.plan), world_size):
            if not self.is_finished(index):
                yield index, self.plan[index]

    def is_finished(self, index: int) -> bool:
        record, data = self.root / _record_name(shard_name(index)), self.root / shard_name(index)
        return record.exists() and data.exists() and data.stat().st_size == _read_json(record)["bytes"]

    def write_shard(self, index: int, sample_ids: Sequence[int] | np.ndarray, samples: Sequence[Sample]) -> dict:
        """Write shard `index` atomically, then its record; returns the record."""
        if list(sample_ids) != [int(i) for i in self.plan[index]]:
            raise ValueError(f"shard {index}: samples {list(sample_ids)}, planned {self.plan[index].tolist()}")
        tensors = self._pack(sample_ids, samples)
        name = shard_name(index)
        path = self.root / name
        atomic_save_safetensors(tensors, path, save_file, metadata={"format_version": str(FORMAT_VERSION)})
        record = {
            "file": name,
            "samples": len(samples),
            "tokens": int(tensors["input_ids"].shape[0]),
            "bytes": path.stat().st_size,
            "sha256": sha256_file(path),
        }
        atomic_write_json(self.root / _record_name(name), record)
        return record

    def _pack(self, sample_ids: Sequence[int] | np.ndarray, samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
        h = self.header
        aux = torch.cat([s.aux for s in samples]).cpu()  # [N, n*Ht]
        final = torch.cat([s.final for s in samples]).cpu()  # [N, Ht]
        if aux.shape[1] != h.aux_size or final.shape[1] != h.hidden_size:
            raise ValueError(
                f"features of shape aux {tuple(aux.shape)}, final {tuple(final.shape)} do not fit a store of "
                f"{len(h.aux_layer_ids)} aux layers x hidden size {h.hidden_size}"
            )
        lengths = torch.tensor([s.input_ids.shape[0] for s in samples])
        tensors = {
            **{
                name: torch.cat([getattr(s, name) for s in samples]).cpu().to(column.store)
                for name, column in TOKEN_COLUMNS.items()
            },
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
            "sample_ids": torch.tensor([int(i) for i in sample_ids], dtype=torch.long),
        }
        if h.dtype == "float8":
            tensors["aux"], tensors["aux_scale"] = quantize_rows(aux, len(h.aux_layer_ids))
            tensors["final"], tensors["final_scale"] = quantize_rows(final, 1)
        else:
            tensors["aux"] = aux.to(STORE_DTYPES[h.dtype])
            tensors["final"] = final.to(STORE_DTYPES[h.dtype])
        return tensors

    def finalize(self) -> dict:
        """Merge the shard records into `manifest.json` (call once, after every rank has finished)."""
        manifest = {**self.manifest_head, "shards": _records(self.root)}
        manifest["num_samples"] = sum(r["samples"] for r in manifest["shards"])
        manifest["num_tokens"] = sum(r["tokens"] for r in manifest["shards"])
        atomic_write_json(self.root / MANIFEST, manifest)
        return manifest


def quantize_rows(x: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, c*H] -> float8 e4m3 [N, c*H] and float32 scales [N, c], one per row and chunk."""
    v = x.float().view(x.shape[0], chunks, -1)
    scale = v.abs().amax(dim=-1).clamp(min=1e-30) / _FP8_MAX  # [N, c]
    q = (v / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return q.view(x.shape), scale


def store_bytes_per_token(hidden_size: int, num_aux: int, dtype: str) -> int:
    """Bytes a token takes in a store: its aux and final features (float8: and their scales), its token columns."""
    scales = 4 * (num_aux + 1) if dtype == "float8" else 0
    columns = sum(column.store.itemsize for column in TOKEN_COLUMNS.values())
    return (num_aux + 1) * hidden_size * STORE_DTYPES[dtype].itemsize + scales + columns


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_rows`: q [N, c*H], scale [N, c] -> [N, c*H] in `dtype`."""
    v = q.float().view(q.shape[0], scale.shape[1], -1) * scale.unsqueeze(-1)
    return v.view(q.shape).to(dtype)


class FeatureStore:
    """A store's samples, memory-mapped, features in `dtype`; None for those of a skipped corrupt shard."""

    def __init__(self, root: str | Path, *, dtype: torch.dtype | None = None, skip_corrupt: bool = False):
        self.root = Path(root)
        path = self.root / MANIFEST
        if not path.is_file():
            raise ConfigError(f"no feature store at {self.root} ({MANIFEST} missing); run data_prep/capture.py first")
        manifest = _read_json(path)
        if (version := manifest.get("format_version")) != FORMAT_VERSION:
            raise ConfigError(f"{path}: format_version {version!r}, this reader knows {FORMAT_VERSION}")
        fields_ = {f.name for f in dataclasses.fields(StoreHeader)}
        self.header = StoreHeader(**{k: v for k, v in manifest.items() if k in fields_})
        self.dtype = dtype or (torch.bfloat16 if self.header.dtype == "float8" else STORE_DTYPES[self.header.dtype])
        self.aux_size, self.hidden_size = self.header.aux_size, self.header.hidden_size
        self.skip_corrupt = skip_corrupt
        self.corrupt_shards: list[str] = []
        self.skipped_samples = 0
        self._records = _merge_records(manifest["shards"], _records(self.root), path)
        for name in (r.get("file") for r in self._records):
            if not _SHARD_FILE.fullmatch(str(name)):  # a plain name, so never a path out of the store
                raise CorruptShardError(
                    f"{path}: a shard record names {name!r}, not a shard of this store; refusing to read it"
                )
        self._verified: set[str] = set()
        self._open: OrderedDict[str, object] = OrderedDict()
        self._index()

    def _index(self) -> None:
        """Read every shard's `sample_ids` and `offsets` (small) to map sample id -> (shard, rows)."""
        parts: list[tuple[np.ndarray, ...]] = [(np.zeros(0, np.int64),) * 4]  # (ids, starts, ends, shard) per shard
        for s, record in enumerate(self._records):
            try:
                with safe_open(self.root / record["file"], framework="pt") as f:
                    sample_ids, offsets = f.get_tensor("sample_ids"), f.get_tensor("offsets")
                if len(sample_ids) != record["samples"] or int(offsets[-1]) != record["tokens"]:
                    raise ValueError("sample_ids/offsets disagree with the record")
            except Exception as e:  # a missing, truncated or garbled file
                self._corrupt(record, f"cannot be read ({e})")
                continue
            parts.append((sample_ids.numpy(), offsets[:-1].numpy(), offsets[1:].numpy(), np.full(len(sample_ids), s)))
        ids, starts, ends, shards = (np.concatenate(x) for x in zip(*parts, strict=True))
        order = np.argsort(ids, kind="stable")
        self.sample_ids = ids[order]
        if len(np.unique(self.sample_ids)) != len(self.sample_ids):
            raise CorruptShardError(f"{self.root}: a sample id appears in two shards")
        self._start, self._end, self._shard = starts[order], ends[order], shards[order]
        self.lengths = self._end - self._start

    def __len__(self) -> int:
        return len(self.sample_ids)

    def skipped(self) -> dict[str, int]:
        """{shard file: samples} of the corrupt shards skipped so far (`skip_corrupt`)."""
        samples = {r["file"]: r["samples"] for r in self._records}
        return {name: samples[name] for name in self.corrupt_shards}

    def samples(self, ids: Sequence[int]) -> list[Sample | None]:
        return [self.sample(i) for i in ids]

    def sample(self, sample_id: int) -> Sample | None:
        pos = int(np.searchsorted(self.sample_ids, sample_id))
        if pos >= len(self.sample_ids) or self.sample_ids[pos] != sample_id:
            raise KeyError(f"sample {sample_id} is not in the store {self.root}")
        f = self._handle(self._records[self._shard[pos]])
        if f is None:
            return None
        a, b = int(self._start[pos]), int(self._end[pos])
        aux, final = f.get_slice("aux")[a:b], f.get_slice("final")[a:b]
        if self.header.dtype == "float8":
            aux = dequantize_rows(aux, f.get_slice("aux_scale")[a:b], self.dtype)
            final = dequantize_rows(final, f.get_slice("final_scale")[a:b], self.dtype)
        return Sample(
            **{name: f.get_slice(name)[a:b].long() for name in TOKEN_COLUMNS},
            aux=aux.to(self.dtype),
            final=final.to(self.dtype),
        )

    def _handle(self, record: dict):
        """The open shard, its checksum verified on first use; None if corrupt and skipped."""
        name = record["file"]
        if name in self.corrupt_shards:
            return None
        if name not in self._verified:
            path = self.root / name
            actual = sha256_file(path) if path.exists() else "missing"
            if actual != record["sha256"]:
                return self._corrupt(record, f"sha256 {actual} != recorded {record['sha256']}")
            self._verified.add(name)
        if name not in self._open:
            self._open[name] = safe_open(self.root / name, framework="pt")
        self._open.move_to_end(name)
        if len(self._open) > _OPEN_SHARDS:
            self._open.popitem(last=False)
        return self._open[name]

    def _corrupt(self, record: dict, reason: str) -> None:
        where = self.root / record["file"]
        if not self.skip_corrupt:
            raise CorruptShardError(
                f"corrupt shard {where}: {reason}; "
                "recapture it (delete the shard and its .json, rerun capture) or set features.skip_corrupt=true"
            )
        self.corrupt_shards.append(record["file"])
        self.skipped_samples += record["samples"]
        print(f"warning: skipping corrupt shard {where} ({reason}): {record['samples']} samples", file=sys.stderr)


def _check_fields(manifest_path: Path, want: dict) -> None:
    """Raise `StoreMismatchError` naming the first field of the manifest that differs from `want`."""
    manifest = _read_json(manifest_path)
    for key, value in want.items():
        if manifest.get(key) != value:
            raise StoreMismatchError(
                f"{manifest_path}: the store was made with {key}={manifest.get(key)!r}, this run has {key}={value!r}; "
                "use another features.store_dir or delete this one"
            )


def _record_name(shard_file: str) -> str:
    return shard_file.removesuffix(".safetensors") + ".json"


def _records(root: Path) -> list[dict]:
    return [_read_json(p) for p in sorted(root.glob("shard-*.json"))]


def _merge_records(listed: list[dict], found: list[dict], manifest_path: Path) -> list[dict]:
    """Union of the manifest's shard list and the records on disk, by file name."""
    merged = {r.get("file"): r for r in listed}
    for r in found:
        if merged.setdefault(r.get("file"), r) != r:
            raise CorruptShardError(f"{manifest_path} and {r['file']}'s record disagree: {merged[r['file']]} vs {r}")
    return [merged[name] for name in sorted(merged, key=str)]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CorruptShardError(f"{path} is not valid JSON: {e}") from None
