"""The training loop in-process: non-finite steps, logging, secrets."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from eagle31.distributed import World
from eagle31.loss import TargetHead
from eagle31.metrics_log import RunLogger, redact_secrets
from eagle31.optim import lr_lambda
from eagle31.trainer import TrainConfig, Trainer, TrainingDiverged
from tests.helpers import feature_batch, tiny_drafter

WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


class ListLoader:
    """A loader of fixed batches with the FeatureLoader position interface."""

    def __init__(self, batches):
        self.batches, self.position = batches, 0

    def __iter__(self):
        while self.position < len(self.batches):
            self.position += 1
            yield self.batches[self.position - 1]
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]

    def rewind(self):
        self.position = 0


def make_trainer(tmp_path, batches, **train):
    drafter = tiny_drafter(seed=0, dtype=torch.float32)
    settings = dict(ttt_length=2, warmup_steps=1, max_steps=4, log_every=1, eval_every=0, save_every=0)
    cfg = TrainConfig(**{**settings, **train})
    head = TargetHead(torch.randn(drafter.config.vocab_size, drafter.config.hidden_size), drafter.draft_token_ids())
    return Trainer(cfg, WORLD, tmp_path, drafter, head, ListLoader(batches), None, torch.float32)


def nan_and_good_batches():
    """A batch whose features are NaN (a non-finite step) and the same batch intact."""
    good = feature_batch(tiny_drafter(dtype=torch.float32).config, 12, seed=1)
    return dataclasses.replace(good, aux=torch.full_like(good.aux, float("nan"))), good


def logger(tmp_path, steps=4):
    return RunLogger(tmp_path, {}, total_steps=steps, start_step=0, is_main=True, wandb_mode="disabled", progress=False)


def test_nonfinite_steps_are_skipped_then_the_run_stops(tmp_path):
    bad, good = nan_and_good_batches()
    trainer = make_trainer(tmp_path, [bad], max_nonfinite_steps=3)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.warns(UserWarning, match="non-finite"), pytest.raises(TrainingDiverged, match="3 non-finite steps"):
        trainer.fit(logger(tmp_path))
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, before[n]), f"{n} changed on a skipped step"
    assert trainer.state.nonfinite_streak == 3


def test_a_finite_step_resets_the_streak_and_skipped_steps_still_move_the_schedule(tmp_path):
    bad, good = nan_and_good_batches()
    trainer = make_trainer(tmp_path, [bad, good], max_nonfinite_steps=2)
    with pytest.warns(UserWarning, match="non-finite"):
        trainer.fit(logger(tmp_path))
    assert trainer.state.step == 4 and trainer.state.nonfinite_streak == 0
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "train/loss" in x] == [1, 2, 3, 4]
    # steps 1 and 3 were skipped; the schedule still ends at max_steps, like the step count
    f = lr_lambda(trainer.cfg.warmup_steps, trainer.cfg.max_steps)
    assert [s.last_epoch for s in trainer.optimizers.schedulers] == [4]
    assert trainer.optimizers.lrs() == {"lr": pytest.approx(trainer.cfg.lr * f(4))}
    assert [x["train/lr"] for x in lines if "train/lr" in x] == pytest.approx(
        [trainer.cfg.lr * f(s) for s in (1, 2, 3, 4)]
    )


def test_secrets_are_redacted_from_logged_configs():
    cfg = {
        "logging": {"wandb": {"api_key": "abc123", "mode": "offline"}},
        "hub": {"token": "hf_xyz", "license": "mit"},
        "data": {"source": ["a"]},
    }
    red = redact_secrets(cfg)
    assert "abc123" not in json.dumps(red) and "hf_xyz" not in json.dumps(red)
    assert red["hub"]["license"] == "mit" and red["data"] == {"source": ["a"]}


def test_compile_flag_compiles_the_drafter_blocks(tmp_path):
    from eagle31.model import MLP, RMSNorm

    cfg = tiny_drafter(dtype=torch.float32).config
    trainer = make_trainer(tmp_path, [feature_batch(cfg, 8)], compile=True)
    blocks = [m for m in trainer.model.modules() if isinstance(m, (RMSNorm, MLP))]
    assert blocks and all(m._compiled_call_impl is not None for m in blocks)


@pytest.mark.parametrize("kind", ["tv", "lk_hybrid"])
def test_train_loss_reaches_the_fused_loss(kind, tmp_path, monkeypatch):
    """`train.loss` and `train.lk_eta` are what FusedDraftLoss's per-chunk divergence is asked for, in training and
    eval."""
    import eagle31.loss

    seen, original = [], eagle31.loss.loss_and_gradient
    monkeypatch.setattr(
        eagle31.loss, "loss_and_gradient", lambda loss, lp, z: seen.append(loss) or original(loss, lp, z)
    )
    _, good = nan_and_good_batches()
    trainer = make_trainer(tmp_path, [good], loss=kind, lk_eta=1.5)
    trainer.eval_loader = ListLoader([good])
    trained = trainer.train_step([good])
    evaluated = trainer.evaluate()
    assert seen and {(d.name, d.eta) for d in seen} == {(kind, 1.5)}
    assert trained["finite"] and evaluated["loss"] > 0
    if kind == "tv":  # TV of a query is at most 1: the weighted loss is at most sum_k w^k
        assert trained["loss"] <= 1 + trainer.cfg.ttt_decay


def _shard_rank(rank: int, init_file: str, run_dir: str) -> None:
    """One of two gloo ranks: a bf16 FSDP trainer of the tiny drafter, one training step."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        drafter = tiny_drafter(seed=0, dtype=torch.float32)
        embedding = drafter.embed_tokens.weight.detach().clone()
        world = World(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))
        cfg = TrainConfig(ttt_length=2, warmup_steps=1, max_steps=1, attention_kernel="blockwise")
        head = TargetHead(torch.randn(drafter.config.vocab_size, drafter.config.hidden_size), drafter.draft_token_ids())
        trainer = Trainer(cfg, world, Path(run_dir), drafter, head, ListLoader([]), None, torch.bfloat16)
        weight = trainer.model.drafter.embed_tokens.weight
        sharded = {n: isinstance(p, DTensor) for n, p in trainer.model.named_parameters()}
        result = trainer.train_step([feature_batch(drafter.config, 8, seed=1)])
        torch.save(
            {
                "embed_is_dtensor": sharded.pop("drafter.embed_tokens.weight"),
                "embed_dtype": str(weight.dtype),
                "embed_equal": torch.equal(weight, embedding.to(torch.bfloat16)),
                "embed_grad": weight.grad is not None,
                "others_sharded": all(sharded.values()),
                "finite": bool(result["finite"]),
            },
            Path(run_dir) / f"result.{rank}",
        )
        dist.barrier()  # leave together: a rank that tears gloo down while the other still talks to it aborts
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_keeps_the_frozen_embedding_whole_in_the_compute_dtype(tmp_path):
    """Under FSDP the target embedding is no shard: each rank holds it in bf16 (no fp32 master, no gathered
    copy), equal to the fp32 weight rounded, without a gradient, while the trainable weights are sharded;
    and a bf16 step runs (FSDP casts no input: the loss's float64 step weights stay exact)."""
    import torch.multiprocessing as mp

    mp.spawn(_shard_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    for rank in range(2):
        r = torch.load(tmp_path / f"result.{rank}", weights_only=True)
        assert r == {
            "embed_is_dtensor": False,
            "embed_dtype": "torch.bfloat16",
            "embed_equal": True,
            "embed_grad": False,
            "others_sharded": True,
            "finite": True,
        }, r


@pytest.mark.parametrize(
    "levers",
    [{}, {"optimizer": "muon", "schedule": "linear", "anchor_weight": 1.0}],
    ids=["adamw-cosine", "muon-linear-anchor"],
)
def test_a_run_resumed_from_its_step_2_checkpoint_ends_as_the_uninterrupted_run(levers, tmp_path):
    """Both optimizers' states (Muon's momentum, AdamW's moments), the schedules and the anchor's start come back
    from a checkpoint: four steps straight and two more from the step-2 checkpoint give the same weights."""
    batches = [feature_batch(tiny_drafter(dtype=torch.float32).config, 12, seed=s) for s in (1, 2)]
    (tmp_path / "straight").mkdir()
    (tmp_path / "resumed").mkdir()
    straight = make_trainer(tmp_path / "straight", batches, save_every=2, lr=1e-2, **levers)
    straight.fit(logger(tmp_path / "straight"))
    resumed = make_trainer(tmp_path / "resumed", batches, lr=1e-2, **levers)
    resumed.restore(straight.checkpoints.root / "step_00000002")
    assert resumed.state.step == 2
    resumed.fit(logger(tmp_path / "resumed"))
    assert [s.last_epoch for s in resumed.optimizers.schedulers] == [4] * len(resumed.optimizers.schedulers)
    a, b = straight.full_drafter_state(), resumed.full_drafter_state()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    lines = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert ("train/anchor" in lines[0]) == ("anchor_weight" in levers)
    assert ("train/muon_lr" in lines[0]) == ("optimizer" in levers)


MUON_FSDP = dict(optimizer="muon", anchor_weight=1.0, lr=1e-2, attention_kernel="blockwise")


def _muon_rank(rank: int, init_file: str, run_dir: str) -> None:
    """One of two gloo ranks: an FSDP trainer with Muon and the anchor, two steps on this rank's batch with a
    checkpoint after the first; a second trainer restores it and takes the second step again."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        world = World(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))
        cfg = TrainConfig(ttt_length=2, warmup_steps=1, max_steps=2, **MUON_FSDP)

        def trainer() -> Trainer:
            drafter = tiny_drafter(seed=0, dtype=torch.float32)
            head = TargetHead(
                torch.randn(drafter.config.vocab_size, drafter.config.hidden_size), drafter.draft_token_ids()
            )
            return Trainer(cfg, world, Path(run_dir), drafter, head, ListLoader([]), None, torch.float32)

        straight = trainer()
        batch = feature_batch(tiny_drafter(seed=0, dtype=torch.float32).config, 12, seed=1 + rank)
        matrices = straight.optimizers.by_name["muon"].param_groups[0]["params"]
        straight.train_step([batch])
        straight.state.step = 1
        checkpoint = straight.save_checkpoint()
        anchor = straight.train_step([batch])["anchor"]
        resumed = trainer()
        resumed.restore(checkpoint)
        resumed.train_step([batch])
        state, again = straight.full_drafter_state(), resumed.full_drafter_state()
        if rank == 0:
            result = {
                "state": state,
                "anchor": anchor,
                "dtensors": all(isinstance(p, DTensor) for p in matrices),
                "resumed_equal": all(torch.equal(state[k], again[k]) for k in state),
            }
            torch.save(result, Path(run_dir) / "fsdp.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_muon_and_the_anchor_under_fsdp_take_one_process_steps(tmp_path):
    """Two FSDP ranks (DTensor shards, Muon's Newton-Schulz iteration run as DTensor ops) against one process taking
    both ranks' batches, two steps: each weight's move agrees to a tenth of its size (Muon's bf16 iteration rounds
    otherwise when its products are split over ranks, up to 3% here; Newton-Schulz run on each shard alone would
    be 30-60% off) and the anchor's term to a percent. A sharded checkpoint of both optimizers, restored, takes
    the second step bit for bit."""
    import torch.multiprocessing as mp

    batches = [feature_batch(tiny_drafter(dtype=torch.float32).config, 12, seed=s) for s in (1, 2)]
    one = make_trainer(tmp_path, [], grad_accum=2, max_steps=2, **MUON_FSDP)
    start = {k: v.clone() for k, v in one.full_drafter_state().items()}
    results = [one.train_step(batches) for _ in range(2)]
    mp.spawn(_muon_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    fsdp = torch.load(tmp_path / "fsdp.pt", weights_only=True)
    assert fsdp["dtensors"] and fsdp["resumed_equal"]
    assert fsdp["anchor"] == pytest.approx(results[-1]["anchor"], rel=1e-2)
    ours = one.full_drafter_state()
    for name, weight in fsdp["state"].items():
        if weight.is_floating_point() and name != "embed_tokens.weight":  # d2t, t2d; the frozen embedding
            moved = (ours[name] - start[name]).norm()
            assert (weight - ours[name]).norm() <= 0.1 * moved, name
