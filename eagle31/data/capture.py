"""Target features from a HF causal LM, with hooks (docs/design.md §2), and their capture into the store.

`aux` concatenates the hidden states at the *input* of the decoder layers
`aux_layer_ids` (vLLM convention: id k = HF `output_hidden_states[k]`), in id
order; `final` is the input of `lm_head` (post final norm). Forward pre-hooks
keep just these tensors, so the `L+1` hidden states are never materialised:

    with TargetFeatures(model, aux_layer_ids) as feats:
        out = model(input_ids=..., attention_mask=...)  # any forward, KV cache allowed
        aux, final = feats.pop()  # [B, T, n*Ht], [B, T, Ht] for that forward's positions

(`final` covers the positions lm_head sees: HF's `logits_to_keep`, which
`generate` sets to 1 at prefill, narrows it.) `feats.capture(input_ids, mask)`
runs a forward that stops at lm_head's input, so no `[B, T, V]` logits are built.

`capture_to_store` runs the target over a prepared split (columns `input_ids`,
`loss_mask`) shard by shard into a `StoreWriter`, in length-sorted batches;
`open_store_writers` and `capture_splits` are that step for a recipe's splits, as
both `data_prep/capture.py` and a training run with `features.mode=store` take it.

`target_fingerprint` identifies the target whose features a store holds, beyond its
name: two checkpoints of one shape (a base model and its fine-tune, two random demo
targets) get different fingerprints, so a store is never trained on with another target.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from eagle31.config import ConfigError, load_target_config
from eagle31.data.batch import Sample, bucket_by_length
from eagle31.data.store import StoreWriter
from eagle31.distributed import World, barrier
from eagle31.target_weights import EMBED_NAMES, read_target_tensor

# Where decoder layers live: Llama / Qwen / DeepSeek-V3 (`model.layers`), multimodal wrappers.
_LAYER_PATHS = ("model.layers", "model.language_model.layers", "language_model.model.layers")
_FINGERPRINT_ROWS = 64  # embedding rows hashed: enough to tell checkpoints apart, cheap for any V
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version")  # change when a checkpoint is copied or re-saved


def target_fingerprint(target_dir) -> str:
    """sha256 of the target's config.json (less path and version keys), first embedding rows and final norm weight."""
    config = {k: v for k, v in load_target_config(target_dir).items() if k not in _VOLATILE_CONFIG_KEYS}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for names in (EMBED_NAMES, ("model.norm.weight",)):
        weight = read_target_tensor(target_dir, names, required=False, rows=_FINGERPRINT_ROWS)
        if weight is not None:
            digest.update(weight.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class _StopForward(Exception):
    """Raised by the lm_head pre-hook to end a capture-only forward."""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The target's decoder layers, found at one of the usual attribute paths."""
    for path in _LAYER_PATHS:
        obj = model
        for name in path.split("."):
            obj = getattr(obj, name, None)
        if isinstance(obj, nn.ModuleList):
            return obj
    raise ConfigError(
        f"cannot find the decoder layers of {type(model).__name__}: looked for {', '.join(_LAYER_PATHS)}"
    )


def check_aux_layer_ids(ids: Sequence[int], num_layers: int) -> None:
    """Aux ids are distinct, increasing decoder-layer inputs `0 <= k < L` (vLLM convention)."""
    if not ids or list(ids) != sorted(set(ids)):
        raise ConfigError(f"aux_layer_ids must be distinct and increasing, got {list(ids)}")
    bad = [k for k in ids if not 0 <= k < num_layers]
    if bad:
        raise ConfigError(f"aux_layer_ids {bad} out of range for a target with {num_layers} decoder layers")


class TargetFeatures:
    """Hooks that capture `aux` and `final` from the forwards of `model`; see the module docstring."""

    def __init__(self, model: nn.Module, aux_layer_ids: Sequence[int]):
        self.model = model
        self.aux_layer_ids = tuple(int(i) for i in aux_layer_ids)
        layers = decoder_layers(model)
        check_aux_layer_ids(self.aux_layer_ids, len(layers))
        self._layers = [layers[k] for k in self.aux_layer_ids]
        self._head = model.get_output_embeddings()
        if self._head is None:
            raise ConfigError(f"{type(model).__name__} has no output embeddings (lm_head)")
        self._handles: list = []
        self._stop = False
        self._reset()

    def _reset(self) -> None:
        self._aux: list[torch.Tensor | None] = [None] * len(self._layers)
        self._final: torch.Tensor | None = None

    def __enter__(self) -> "TargetFeatures":
        for slot, layer in enumerate(self._layers):
            hook = partial(self._on_layer_input, slot)
            self._handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
        self._handles.append(self._head.register_forward_pre_hook(self._on_head_input, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._reset()

    def _on_layer_input(self, slot: int, module, args, kwargs) -> None:
        self._aux[slot] = (args[0] if args else kwargs["hidden_states"]).detach()  # [B, T, Ht]

    def _on_head_input(self, module, args, kwargs) -> None:
        self._final = (args[0] if args else kwargs["input"]).detach()  # [B, T, Ht]
        if self._stop:
            raise _StopForward

    def pop(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [B, T, n*Ht], final [B, T, Ht]) of the last forward; clears them."""
        if not self._handles:
            raise RuntimeError("TargetFeatures.pop() outside its `with` block")
        if self._final is None or any(a is None for a in self._aux):
            raise RuntimeError("no complete forward was captured since the last pop()")
        final = self._final
        aux = torch.cat([a.to(final.device) for a in self._aux], dim=-1)
        self._reset()
        return aux, final

    @torch.no_grad()  # not inference_mode: the trainer's autograd must be able to save these tensors
    def capture(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A forward that stops at lm_head's input; returns `pop()`'s (aux, final)."""
        self._stop = True
        try:
            self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        finally:
            self._stop = False
        return self.pop()


# ---------------------------------------------------------------- the target and prepared data


def load_target(path, target, device: torch.device) -> nn.Module:
    """The recipe's target (`target`: its section) in eval mode without gradients.

    On `device`, or spread over devices by `target.device_map` (e.g. "auto") when set.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=getattr(torch, target.dtype),
        device_map=target.device_map or None,
        trust_remote_code=target.trust_remote_code,
    )
    if not target.device_map:
        model.to(device)
    return model.eval().requires_grad_(False)


def prepared_rows(dataset, ids: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of rows `ids`."""
    rows = dataset[[int(i) for i in ids]]
    return list(zip(rows["input_ids"], rows["loss_mask"]))


def run_target(feats: TargetFeatures, rows: Sequence[tuple[list[int], list[int]]], batch_tokens: int) -> list[Sample]:
    """Features of each row, computed in length-sorted, right-padded batches of <= `batch_tokens` tokens.

    Returns one `Sample` per row, in the order of `rows`, on the device of the target's output.
    """
    device = feats.model.get_input_embeddings().weight.device
    out: list[Sample | None] = [None] * len(rows)
    for group in bucket_by_length([len(ids) for ids, _ in rows], batch_tokens):
        T = max(len(rows[i][0]) for i in group)
        input_ids = torch.zeros(len(group), T, dtype=torch.long)
        attention_mask = torch.zeros(len(group), T, dtype=torch.long)
        for b, i in enumerate(group):
            input_ids[b, : len(rows[i][0])] = torch.tensor(rows[i][0])
            attention_mask[b, : len(rows[i][0])] = 1
        aux, final = feats.capture(input_ids.to(device), attention_mask.to(device))
        for b, i in enumerate(group):
            n = len(rows[i][0])
            out[i] = Sample(
                input_ids=input_ids[b, :n].to(final.device),
                loss_mask=torch.tensor(rows[i][1], dtype=torch.long, device=final.device),
                aux=aux[b, :n],
                final=final[b, :n],
            )
    return out


# ---------------------------------------------------------------- capture into the store


@dataclass
class CaptureStats:
    """What one rank's capture (or import) did; `summary()` prints throughput and bytes per token."""

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


def capture_to_store(
    model: nn.Module,
    dataset,
    writer: StoreWriter,
    *,
    batch_tokens: int,
    rank: int = 0,
    world_size: int = 1,
) -> CaptureStats:
    """Capture this rank's unfinished shards of `writer`'s plan; the writer's sample ids are rows of `dataset`."""
    stats = CaptureStats()
    mine = range(rank, len(writer.plan), world_size)
    start = time.perf_counter()
    with TargetFeatures(model, writer.header.aux_layer_ids) as feats:
        for index, ids in writer.pending(rank, world_size):
            samples = run_target(feats, prepared_rows(dataset, ids), batch_tokens)
            stats.add(writer.write_shard(index, ids, samples))
    stats.shards_skipped = len(mine) - stats.shards_written
    stats.seconds = time.perf_counter() - start
    return stats


def open_store_writers(store_dir: Path, splits: dict, target_dir, target_config: dict, aux_layer_ids, target, features) -> dict[str, StoreWriter]:
    """One writer per prepared split under `store_dir`; each refuses a store made otherwise, before the target loads."""
    fingerprint = target_fingerprint(target_dir)
    return {
        name: StoreWriter.for_dataset(store_dir / name, ds, target_config, aux_layer_ids, target, features, fingerprint=fingerprint)
        for name, ds in splits.items()
    }


def capture_splits(model: nn.Module, splits: dict, writers: dict[str, StoreWriter], *, batch_tokens: int, world: World) -> None:
    """Capture every split into its writer (each rank its shards); rank 0 finalizes a split once all ranks are done."""
    for name, ds in splits.items():
        writer = writers[name]
        stats = capture_to_store(model, ds, writer, batch_tokens=batch_tokens, rank=world.rank, world_size=world.world_size)
        print(f"[rank {world.rank}] {name}: {stats.summary()}")
        barrier()
        if world.is_main:
            m = writer.finalize()
            print(f"{writer.root}: {m['num_samples']} samples, {m['num_tokens']} tokens, {len(m['shards'])} shards")
        barrier()
