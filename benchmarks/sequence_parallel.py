"""Sequence parallelism on CPU (gloo): one training step's time, per-rank peak tensor bytes and the bytes
the shards exchange, with each sequence split over N = 1, 2, 4 processes, at one fixed T.

    python benchmarks/sequence_parallel.py [seq_len=4096] [sizes=1,2,4] [repeats=3] [attention=mla] \\
        [out=benchmarks/results/sequence_parallel.json]

Each N runs in N fresh processes (one thread each) of one sequence group: the trainer's own batch
preparation (`eagle31.trainer.prepare_batch`: shard, halo) and objective (the TTT unroll with its
gathered step-0 keys, the fused loss), forward and backward, activation checkpointing on, fp32.
The drafter is replicated, not FSDP-sharded: FSDP2's gradient reduce-scatter spans the whole world
whatever N is, so it is left out of both the time and the traffic. Per rank:

* step time: the slowest rank's wall time of a step (median over `repeats`, after one warm-up);
* peak tensor bytes: `benchmarks.measure.LiveTensorBytes` over one step (tensors the step makes);
* exchanged bytes: what the sequence group's collectives move per step, counted where eagle31 calls
  them (the halo and token metadata, the step-0 entries gathered, their gradients reduce-scattered;
  a recomputed step gathers again): bytes received by all-gathers plus bytes handed to
  reduce-scatters.

On a machine with fewer cores than N, the processes share cores: step time then measures the
extra work and the exchanges, not the speed-up (the result records the cores).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.measure import LiveTensorBytes  # noqa: E402
from benchmarks.report import write_result_and_table  # noqa: E402
from eagle31 import DrafterConfig, Eagle31Drafter  # noqa: E402
from eagle31.data.batch import FeatureBatch  # noqa: E402
from eagle31.distributed import World, all_reduce_sum  # noqa: E402
from eagle31.errors import ConfigError  # noqa: E402
from eagle31.loss import TargetHead, step_scales, weighted_loss  # noqa: E402
from eagle31.sequence_parallel import SequenceGroup, sequence_group  # noqa: E402
from eagle31.trainer import (  # noqa: E402
    DrafterObjective,
    TrainConfig,  # noqa: E402
    prepare_batch,
)
from eagle31.vocab import vocab_maps  # noqa: E402
from eagle31_cli import parse_key_values, wants_help  # noqa: E402

K = 7
# small drafters of the two kinds, in the Kimi K2.6 drafter's proportions (MLA: latents 1/4 of H)
SHAPES = {
    "mla": dict(
        attention="mla",
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=48,
        mla=dict(q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32),
    ),
    "llama": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32),
}


def drafter_config(attention: str, seq_len: int) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=256,
        intermediate_size=768,
        vocab_size=4096,
        draft_vocab_size=2048,
        target_num_layers=8,
        aux_layer_ids=(2, 4, 5),
        max_position_embeddings=seq_len,
        **SHAPES[attention],
    )


def build(cfg: DrafterConfig, seq_len: int) -> tuple[Eagle31Drafter, TargetHead, FeatureBatch]:
    """The same drafter, target head and batch on every rank: one packed row of four documents."""
    g = torch.Generator().manual_seed(0)
    drafter = Eagle31Drafter(cfg)
    torch.manual_seed(0)
    drafter.reset_parameters()
    draft_ids = torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values
    d2t, t2d = vocab_maps(draft_ids, cfg.vocab_size)
    embed, lm_head = (
        torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g),
        torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g),
    )
    drafter.init_from_target(embed, lm_head, d2t, t2d)
    docs = torch.arange(seq_len) * 4 // seq_len  # documents cross the shard edges at every N
    batch = FeatureBatch(
        input_ids=torch.randint(0, cfg.vocab_size, (1, seq_len), generator=g),
        loss_mask=torch.ones(1, seq_len, dtype=torch.long),
        document_ids=docs[None],
        aux=torch.randn(1, seq_len, cfg.fc_in_features, generator=g),
        final=torch.randn(1, seq_len, cfg.target_hidden_size, generator=g),
    )
    return drafter, TargetHead(lm_head, drafter.draft_token_ids()), batch


class Traffic:
    """Bytes the sequence group's collectives move (module docstring), counted around torch.distributed's calls."""

    NAMES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor")

    def __init__(self):
        self.bytes = 0
        for name in (n for n in self.NAMES if hasattr(dist, n)):
            setattr(dist, name, self._counted(getattr(dist, name)))

    def _counted(self, collective):
        def run(out, x, *args, **kwargs):
            self.bytes += (out if "gather" in collective.__name__ else x).nbytes
            return collective(out, x, *args, **kwargs)

        run.__name__ = collective.__name__
        return run


def training_step(
    spec: dict, world: World, group: SequenceGroup, dtype: torch.dtype = torch.float32
) -> Callable[[], torch.Tensor]:
    """The measured step (module docstring) on `world.device`, in `dtype` throughout (parameters too): it
    returns the step's loss. The sequence-parallel code path (shard, halo, gathered step-0 keys) runs
    wherever `group` has a process group, a group of one included."""
    cfg = drafter_config(spec["attention"], spec["seq_len"])
    drafter, head, batch = build(cfg, spec["seq_len"])
    drafter.to(world.device, dtype)
    head = TargetHead(head.weight.to(world.device, dtype), head.draft_ids)
    train = TrainConfig(
        ttt_length=K,
        activation_checkpointing=True,
        attention_kernel=spec.get("backend", "flash"),
        sequence_parallel=group.size,
    )
    objective = DrafterObjective(drafter, train)

    def step() -> torch.Tensor:
        b, sup, argmax, shard = prepare_batch(batch, train, head, world.device, dtype, group, drafter.visibility)
        count = all_reduce_sum(sup.sum(dim=(1, 2)).double())
        stats = objective(
            b.aux, b.input_ids, b.document_ids, b.final, sup, argmax, step_scales(count, train.ttt_decay), head, shard
        )
        loss = weighted_loss(stats.loss_sum, count, train.ttt_decay)
        loss.backward()
        return loss.detach()

    return step


def _rank(rank: int, size: int, port: int, spec: dict, results: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    distributed = size > 1
    if distributed:
        dist.init_process_group("gloo", rank=rank, world_size=size)
    world = World(rank=rank, world_size=size, local_rank=rank, device=torch.device("cpu"))
    step = training_step(spec, world, sequence_group(world, size))
    traffic = Traffic()
    step()  # warm-up; it also makes the gradients
    times = []
    for _ in range(spec["repeats"]):
        if distributed:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        times.append(_slowest(took, distributed))
    before = traffic.bytes
    with LiveTensorBytes() as tensors:
        step()
    row = {
        "rank": rank,
        "peak_tensor_bytes": tensors.peak,
        "exchanged_bytes_per_step": traffic.bytes - before,
        "step_s": statistics.median(times),
    }
    rows = [None] * size
    if distributed:
        dist.all_gather_object(rows, row)
        dist.destroy_process_group()
    else:
        rows = [row]
    if rank == 0:
        Path(results).write_text(json.dumps(rows))


def _slowest(took: torch.Tensor, distributed: bool) -> float:
    if distributed:
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(size: int, spec: dict, scratch: Path) -> dict:
    path = scratch / f"sequence_parallel_{size}.json"
    mp.spawn(_rank, args=(size, free_port(), spec, str(path)), nprocs=size, join=True)
    ranks = json.loads(path.read_text())
    path.unlink()
    return {
        "sequence_parallel": size,
        "step_s": ranks[0]["step_s"],
        "peak_tensor_bytes_per_rank": [r["peak_tensor_bytes"] for r in ranks],
        "exchanged_bytes_per_step_per_rank": [r["exchanged_bytes_per_step"] for r in ranks],
    }


def markdown(result: dict) -> str:
    spec = result["spec"]
    one = result["runs"][0]
    lines = [
        f"Sequence parallelism on CPU (gloo, 1 thread per process, {result['cpu_cores']} cores): "
        f"{spec['attention']} drafter H 256, T = {spec['seq_len']}, K = {K}, activation checkpointing, fp32; "
        f"`python benchmarks/sequence_parallel.py seq_len={spec['seq_len']} attention={spec['attention']}`.",
        "",
        "| N | step (s) | vs N=1 | peak tensor MiB per rank (max) | vs N=1 | exchanged MiB per step per rank (max) |",
        "|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        peak = max(run["peak_tensor_bytes_per_rank"])
        exchanged = max(run["exchanged_bytes_per_step_per_rank"])
        lines.append(
            f"| {run['sequence_parallel']} | {run['step_s']:.2f} | {run['step_s'] / one['step_s']:.2f} | "
            f"{peak / 2**20:.1f} | {peak / max(one['peak_tensor_bytes_per_rank']):.2f} | {exchanged / 2**20:.2f} |"
        )
    return "\n".join(lines) + "\n"


@dataclass
class SequenceParallelBench:
    """The command line's keys (module docstring)."""

    seq_len: int = 4096
    sizes: str = "1,2,4"
    repeats: int = 3
    attention: str = "mla"
    out: str = str(ROOT / "benchmarks" / "results" / "sequence_parallel.json")


def main(argv: list[str]) -> int:
    if wants_help(argv, __doc__):
        return 0
    try:
        args = parse_key_values(argv, SequenceParallelBench)
        if args.attention not in SHAPES:
            raise ConfigError(f"attention={args.attention!r}; choose one of {sorted(SHAPES)}")
        if not all(n.strip().isdigit() for n in args.sizes.split(",")):
            raise ConfigError(f"sizes must be comma-separated integers, got {args.sizes!r}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    spec = {"seq_len": args.seq_len, "repeats": args.repeats, "attention": args.attention}
    sizes = [int(n) for n in args.sizes.split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = []
    for size in sizes:
        runs.append(measure(size, spec, out.parent))
        print(json.dumps(runs[-1]), flush=True)
    result = {"spec": spec, "cpu_cores": os.cpu_count(), "torch": torch.__version__, "runs": runs}
    write_result_and_table(result, out, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
