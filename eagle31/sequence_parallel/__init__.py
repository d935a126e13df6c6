"""Sequence parallelism (`train.sequence_parallel = N`): each rank a shard of the sequence (docs/design.md §4)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from eagle31.data.batch import TOKEN_COLUMNS, FeatureBatch
from eagle31.distributed import World
from eagle31.errors import ConfigError
from eagle31.kernels.causal import NOT_A_BAND, CausalMask
from eagle31.model import Visibility, segment_ids


@dataclass(frozen=True)
class SequenceGroup:
    """This rank in the data × sequence mesh; `group`: its sequence group (None: unsplit; one rank: still sharded)."""

    size: int
    rank: int
    data_rank: int
    data_size: int
    group: dist.ProcessGroup | None = None


def sequence_group(world: World, size: int) -> SequenceGroup:
    """The (data × sequence) mesh of `train.sequence_parallel = size` over `world`."""
    if size < 1 or world.world_size % size:
        raise ConfigError(f"train.sequence_parallel={size} must be >= 1 and divide the world size {world.world_size}")
    if size == 1:
        return SequenceGroup(1, 0, world.rank, world.world_size)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(world.device.type, (world.world_size // size, size), mesh_dim_names=("data", "sequence"))
    sequence, data = mesh["sequence"], mesh["data"]
    return SequenceGroup(size, sequence.get_local_rank(), data.get_local_rank(), data.size(), sequence.get_group())


def shard_length(T: int, size: int, ttt_length: int) -> int:
    """Positions per shard of a T-position batch: every shard holds at least the next one's halo (K + 1)."""
    return max(math.ceil(T / size), ttt_length + 1)


def pad_positions(batch: FeatureBatch, T: int) -> FeatureBatch:
    """`batch` right-padded to T positions: padding (document -1, loss mask 0, zero features)."""
    n = T - batch.input_ids.shape[1]
    if n == 0:
        return batch

    def pad(x, value):
        return torch.cat([x, x.new_full((x.shape[0], n, *x.shape[2:]), value)], dim=1)

    columns = {name: pad(getattr(batch, name), column.pad) for name, column in TOKEN_COLUMNS.items()}
    return replace(
        batch, **columns, document_ids=pad(batch.document_ids, -1), aux=pad(batch.aux, 0), final=pad(batch.final, 0)
    )


def all_gather_shards(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """x [d0, ...] of every rank of the sequence group -> [N, d0, ...], in rank order."""
    out = torch.empty((group.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the name before torch 2.13
    gather(out, x.contiguous(), group=group.group)
    return out.unflatten(0, (group.size, x.shape[0]))


def reduce_scatter_shards(parts: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """parts [N, d0, ...] on every rank -> the sum over ranks of parts[rank], [d0, ...]."""
    out = torch.empty(parts.shape[1:], dtype=parts.dtype, device=parts.device)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, parts.flatten(0, 1).contiguous(), group=group.group)
    return out


class _GatherShards(torch.autograd.Function):
    """x [B, Ts, ...] of every rank -> [B, end - first, ...], positions first..end-1; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, group: SequenceGroup, first: int, end: int):
        parts = all_gather_shards(x, group)  # [N, B, Ts, ...]
        ctx.group, ctx.shape, ctx.first, ctx.end = group, x.shape, first, end
        return parts.movedim(0, 1).flatten(1, 2)[:, first:end]

    @staticmethod
    def backward(ctx, grad):
        g, (B, Ts, *rest) = ctx.group, ctx.shape
        full = grad.new_zeros((B, g.size * Ts, *rest), dtype=torch.promote_types(grad.dtype, torch.float32))
        full[:, ctx.first : ctx.end] = grad
        return reduce_scatter_shards(full.unflatten(1, (g.size, Ts)).movedim(1, 0), g).to(grad.dtype), None, None, None


@dataclass
class SequenceShard:
    """This rank's shard of a micro-batch beyond its rows: `start`, its first row's position; key_segments [B, start +
    Ts - first_key], the runs of the keys its queries may attend from `first_key` (0, or start - W + 1)."""

    group: SequenceGroup
    start: int
    key_segments: torch.Tensor
    first_key: int = 0

    def gather(self, entry: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """This shard's step-0 entry, each [B, Ts, ...] -> that of positions first_key..end-1, gathered."""
        end = self.first_key + self.key_segments.shape[1]
        return tuple(_GatherShards.apply(t, self.group, self.first_key, end) for t in entry)


def shard_batch(
    batch: FeatureBatch, group: SequenceGroup, ttt_length: int, device, dtype, rule=Visibility()
) -> tuple[FeatureBatch, SequenceShard]:
    """This rank's shard of `batch` on `device` (features in `dtype`), its `SequenceShard`: `aux` its Ts positions, the
    token columns, document ids and final states with the halo (Ts + K + 1); `num_tokens` its own real tokens."""
    halo = ttt_length + 1
    Ts = shard_length(batch.input_ids.shape[1], group.size, ttt_length)
    padded = pad_positions(batch, group.size * Ts)
    start, end = group.rank * Ts, (group.rank + 1) * Ts
    rows = slice(start, end)
    own = FeatureBatch(
        **{name: getattr(padded, name)[:, rows] for name in TOKEN_COLUMNS}, document_ids=padded.document_ids[:, rows],
        aux=padded.aux[:, rows], final=padded.final[:, rows],
    ).to(device, dtype=dtype)  # fmt: skip
    B = own.input_ids.shape[0]
    meta = torch.stack([*(getattr(own, name) for name in TOKEN_COLUMNS), own.document_ids.long()])  # [C + 1, B, Ts]
    *columns, docs = all_gather_shards(meta, group).movedim(0, 2).flatten(2, 3)  # each [B, N * Ts]
    heads = all_gather_shards(own.final[:, :halo], group)  # [N, B, K + 1, Ht]

    def with_halo(x, fill):  # [B, N * Ts] -> this shard's rows and the next K + 1, padding past the end
        return torch.cat([x, x.new_full((B, halo), fill)], dim=1)[:, start : end + halo]

    next_final = heads[group.rank + 1] if group.rank + 1 < group.size else torch.zeros_like(heads[0])
    shard = FeatureBatch(
        **{name: with_halo(x, column.pad) for (name, column), x in zip(TOKEN_COLUMNS.items(), columns)},
        document_ids=with_halo(docs, -1),
        aux=own.aux, final=torch.cat([own.final, next_final], dim=1),
        num_tokens=int((padded.document_ids[:, rows] >= 0).sum()), num_samples=batch.num_samples,
    )  # fmt: skip
    reach = CausalMask(rule, 0).reach(group.size * Ts)  # a band: no query of the shard sees a key before it
    first = max(0, start - reach + 1) if reach is not None and reach != NOT_A_BAND else 0
    key_segments = segment_ids(docs[:, first:end], None, (B, end - first), device=docs.device)
    return shard, SequenceShard(group, start, key_segments, first)
