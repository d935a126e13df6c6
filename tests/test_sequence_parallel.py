"""Sequence parallelism (eagle31/sequence_parallel/): N ranks sharing each sequence train exactly as one.

Four gloo processes (torch.multiprocessing) run the trainer with the sequence split 4 ways (data 1 ×
sequence 4) and on a 2 × 2 mesh (data 2 × sequence 2); one process runs the same global batches
unsplit. Loss, every gradient of every step and the weights after the optimizer steps agree to fp32
rounding, for the Llama and MLA drafters (and a sliding-window one), activation checkpointing on and
off, with packed documents that cross the shard edges, a length no N divides (padded) and padding at
the end; the keys before a shard are made in blocks of 3 positions, so several blocks merge.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from eagle31.data.batch import FeatureBatch
from eagle31.distributed import World
from eagle31.engine.transport import free_ports
from eagle31.errors import ConfigError
from eagle31.loss import TargetHead
from eagle31.sequence_parallel import SequenceGroup, sequence_group, shard_length
from eagle31.sequence_parallel.query_tail import QueryTail
from eagle31.trainer import TrainConfig, Trainer
from tests.helpers import random_batch, tiny_drafter
from tests.test_trainer import ListLoader

K = 3
STEPS = 3
MLA = dict(
    attention="mla",
    num_key_value_heads=4,
    head_dim=10,
    mla=dict(q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5),
)
# W = 4 < the shard length 6: a shard gathers only the step-0 keys of the 3 positions before it, and the
# deeper steps see fewer of them (step 2: 2)
# "parallel": a P-EAGLE drafter with a window, trained with depth sampling and one pooled mean (its recipe)
DRAFTERS = {
    "llama": {},
    "mla": MLA,
    "window": dict(sliding_window=4),
    "parallel": dict(parallel_drafting=True, mask_token_id=5, sliding_window=4),
}
CASES = [(name, ckpt) for name in ("llama", "mla") for ckpt in (False, True)] + [("window", True), ("parallel", False)]


def batches(cfg) -> list[FeatureBatch]:
    """Two micro-batches: one packed row of 21 positions (documents over the shard edges, padding at the end),
    and two padded rows of 13."""
    aux, final, ids, mask = random_batch(cfg, 1, 21, seed=5, dtype=torch.float32)
    packed = FeatureBatch(ids, mask, torch.tensor([[0] * 5 + [1] * 9 + [2] * 4 + [-1] * 3]), aux, final)
    aux, final, ids, mask = random_batch(cfg, 2, 13, seed=6, dtype=torch.float32)
    docs = torch.tensor([[0] * 13, [0] * 8 + [-1] * 5])
    return [packed, FeatureBatch(ids, mask * (docs >= 0), docs, aux, final)]


def run(world: World, drafter_name: str, ckpt: bool, sequence: int, tmp) -> dict:
    """STEPS optimizer steps over the two batches (split over the data axis): losses, gradients, weights."""
    drafter = tiny_drafter(seed=0, dtype=torch.float32, **DRAFTERS[drafter_name])
    cfg = drafter.config
    head = TargetHead(
        torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(9)),
        drafter.draft_token_ids(),
    )
    group = sequence_group(world, sequence)
    mine = batches(cfg)[group.data_rank :: group.data_size]
    train = TrainConfig(
        ttt_length=K,
        warmup_steps=1,
        max_steps=STEPS,
        lr=1e-2,
        max_grad_norm=1e9,
        activation_checkpointing=ckpt,
        attention_kernel="flash",
        sequence_parallel=sequence,
        grad_accum=len(mine),
        **(dict(down_sample_ratio=0.7, ttt_decay=None) if cfg.parallel_drafting else {}),
        log_every=1,
        eval_every=0,
        save_every=0,
    )
    trainer = Trainer(train, world, tmp, drafter, head, ListLoader(mine), None, torch.float32, group)
    grads = []

    def record(*_):
        full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
        grads.append({n: full(p.grad).clone() for n, p in trainer.model.named_parameters() if p.grad is not None})

    trainer.optimizers.by_name["adamw"].register_step_pre_hook(record)
    stream = itertools.chain.from_iterable(itertools.repeat(trainer.train_loader))  # epochs, as `Trainer.fit` reads
    losses = [trainer.train_step([next(stream) for _ in range(train.grad_accum)])["loss"] for _ in range(STEPS)]
    return {"losses": losses, "grads": grads, "weights": trainer.full_drafter_state()}


def worker(rank: int, world_size: int, port: int, tmp: str, meshes: list[int]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1"
    )
    torch.set_num_threads(1)
    QueryTail.prefix_block = staticmethod(
        lambda nh, d: 3
    )  # the keys before a shard in several blocks (this process only)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    world = World(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"))
    results = {(name, ckpt, n): run(world, name, ckpt, n, f"{tmp}/{rank}") for name, ckpt in CASES for n in meshes}
    if rank == 0:
        torch.save(results, f"{tmp}/results.pt")
    dist.barrier()  # leave together: a rank that tears gloo down while another still talks to it aborts
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("sp")
    mp.spawn(worker, args=(4, free_ports(1)[0], str(tmp), [4, 2]), nprocs=4, join=True)
    return torch.load(tmp / "results.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("drafter, ckpt", CASES)
@pytest.mark.parametrize("sequence", [4, 2], ids=["data1xsequence4", "data2xsequence2"])
def test_a_split_sequence_trains_as_the_whole_one(sharded, drafter, ckpt, sequence, tmp_path):
    one = run(World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")), drafter, ckpt, 1, tmp_path)
    got = sharded[(drafter, ckpt, sequence)]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
    assert len(got["grads"]) == len(one["grads"]) == STEPS
    for step, (g, e) in enumerate(zip(got["grads"], one["grads"])):
        assert g.keys() == e.keys()
        # after an AdamW step, rounding in a near-zero gradient element becomes a weight difference of up
        # to lr times its relative error (the update is about lr * g / |g|): later steps get a wider atol
        atol = 1e-5 if step == 0 else 1e-4
        for n in e:
            torch.testing.assert_close(
                g[n],
                e[n],
                rtol=1e-4,
                atol=atol * float(e[n].abs().max()),
                msg=lambda m, step=step, n=n: f"step {step} {n}: {m}",
            )
    for n, w in one["weights"].items():
        torch.testing.assert_close(got["weights"][n], w, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def test_the_shard_length_pads_to_a_multiple_and_holds_the_halo():
    assert shard_length(21, 4, 3) == 6  # 24 positions, padded
    assert shard_length(24, 4, 3) == 6
    assert shard_length(5, 4, 3) == 4  # shorter than N (K + 1): padded to 4 x 4


def test_a_sequence_parallel_size_that_does_not_divide_the_world_is_refused():
    world = World(rank=0, world_size=6, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="train.sequence_parallel=4 must be >= 1 and divide the world size 6"):
        sequence_group(world, 4)
    with pytest.raises(ConfigError, match="train.sequence_parallel=0"):
        sequence_group(world, 0)


def _gather_backward_rank(rank: int, port: int, tmp: str) -> None:
    """fp64 shards of 2 ranks gathered (cut to 5 of 6 positions), weighted and summed: the gradient of each shard."""
    from eagle31.sequence_parallel import _GatherShards

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = SequenceGroup(2, rank, 0, 1, dist.group.WORLD)
    x = torch.randn(1, 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    weight = torch.randn(
        1, 5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(7)
    )  # the same on both ranks
    (_GatherShards.apply(x, group, 0, 5) * weight).sum().backward()
    torch.save(x.grad, f"{tmp}/grad{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_gradient_of_gathered_shards_keeps_its_dtype(tmp_path):
    """fp64 gradients come back in fp64, not rounded through fp32 (which would hide fp64 parity errors below ~5e-8)."""
    mp.spawn(_gather_backward_rank, args=(free_ports(1)[0], str(tmp_path)), nprocs=2, join=True)
    weight = torch.randn(1, 5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    both = 2 * torch.cat(
        [weight, torch.zeros(1, 1, 2, dtype=torch.float64)], dim=1
    )  # each rank's rows, summed over the 2 ranks
    for rank in range(2):
        grad = torch.load(tmp_path / f"grad{rank}.pt", weights_only=True)
        assert grad.dtype == torch.float64 and torch.equal(grad, both[:, 3 * rank : 3 * rank + 3]), rank
