"""The training loop: batch -> TTT unroll + loss (global batch mean, docs/design.md §4) -> backward -> step -> log."""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from functools import partial
from itertools import chain, repeat
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from eagle31.checkpoint import CheckpointManager
from eagle31.data.batch import FeatureBatch
from eagle31.distributed import Device, Precision, World, all_gather_objects, all_reduce_sum
from eagle31.errors import Eagle31Error, RunPreempted
from eagle31.kernels.ttt_attention import AttentionBackend
from eagle31.loss import (
    Divergence,
    DraftLoss,
    StepStats,
    TargetHead,
    depth_sampling,
    label_positions,
    step_scales,
    supervision_mask,
    ttt_loss,
    ttt_metrics,
    weighted_loss,
)
from eagle31.metrics_log import RunLogger
from eagle31.model import Eagle31Drafter, Visibility, segment_ids
from eagle31.optim import Anchor, MuonAdjustLR, Optimizer, Schedule, build_optimizer
from eagle31.preemption import StopSignals
from eagle31.sequence_parallel import SequenceGroup, SequenceShard, sequence_group, shard_batch
from eagle31.ttt import ttt_unroll


@dataclass
class TrainConfig:
    """The drafter's training loop: TTT unroll, loss, optimizer, schedule, checkpoints (eagle31.trainer)."""

    ttt_length: int = 7  # K: the TTT unroll's steps, i.e. how many draft positions each query is trained at
    ttt_decay: Optional[float] = 0.8  # w of sum_k w^k mean_k; null: one mean over every step's queries (P-EAGLE's)
    mask_out_of_vocab: bool = True  # drop the queries whose target argmax lies outside the draft vocabulary
    loss: DraftLoss = DraftLoss.kl  # what each query minimises against the target's distribution (docs/training.md)
    lk_eta: float = 3.0  # lk_hybrid: how fast the blend moves from KL to TV as acceptance grows (the paper's 3)
    # adamw; muon: torch.optim.Muon on the 2-D weight matrices, AdamW on the rest (norms, lm_head, mask_hidden)
    optimizer: Optimizer = Optimizer.adamw
    lr: float = 1e-4  # AdamW's peak learning rate, after warm-up
    weight_decay: float = 0.0  # AdamW's decoupled weight decay, on every parameter AdamW steps
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW's (beta1, beta2)
    muon_lr: float | None = None  # Muon's peak learning rate, before muon_adjust_lr scales it; null: lr
    muon_momentum: float = 0.95  # Muon's (Nesterov) momentum
    muon_weight_decay: float = 0.1  # Muon's decoupled weight decay, on the matrices Muon steps
    muon_ns_steps: int = 5  # Muon's Newton-Schulz iterations per step
    # Muon's lr scaling for an A x B matrix: match_rms_adamw x 0.2 sqrt(max(A, B)), original x sqrt(max(1, A / B))
    muon_adjust_lr: MuonAdjustLR = MuonAdjustLR.match_rms_adamw
    schedule: Schedule = Schedule.cosine  # after warm-up: cosine to lr / 10, linear to 0, or constant, at max_steps
    warmup_steps: int = 50  # optimizer steps of linear warm-up, then `schedule` until max_steps
    max_steps: int = 1000  # optimizer steps of the run (skipped non-finite steps count too)
    # L2-SP: adds anchor_weight x sum ||w - w0||^2 over the trained weights to the loss, w0 drafter.init_from's
    anchor_weight: float = 0.0
    # micro-batches per rank per optimizer step: a step's global batch is grad_accum x (world size /
    # sequence_parallel) micro-batches of up to features.tokens_per_batch tokens each, one loss mean over them
    grad_accum: int = 1
    max_grad_norm: float = 0.5  # clip the global gradient norm to this
    # P-EAGLE's COD sampling (speculators' 0.7 and 0.2): depth k >= 1 trains a share max(ratio^k, min) of its queries
    down_sample_ratio: Optional[float] = None
    down_sample_ratio_min: float = 0.2  # the floor of that share (down_sample_ratio's min)
    attention_kernel: AttentionBackend = AttentionBackend.auto  # the TTT attention's kernel (eagle31.kernels)
    activation_checkpointing: bool = False  # recompute activations in backward: less memory, more compute
    sequence_parallel: int = 1  # ranks that split each sequence (eagle31/sequence_parallel/); divides the world size
    compile: bool = False  # torch.compile the drafter's norms and MLP (GPU)
    device: Device = Device.auto  # auto: cuda when a GPU is visible, else cpu
    precision: Precision = Precision.auto  # compute dtype; auto: bf16 on GPU (fp32 master weights), fp32 on CPU
    log_every: int = 10  # steps between metrics.jsonl lines (loss, acceptance, tokens/s)
    eval_every: int = 200  # steps between held-out evaluations of the eval split (0: only at the end)
    save_every: int = 200  # steps between checkpoints (atomic, checksummed; resume=auto continues from one)
    keep_last: int = 2  # checkpoints kept on disk, the newest ones (at least 1)
    max_nonfinite_steps: int = 5  # non-finite losses in a row that stop the run (each one skips its step)
    # SIGTERM / SIGUSR1: finish the step, checkpoint, exit 143 within this many seconds (else exit at once)
    preempt_grace_s: float = 60.0
    # torchrun: a rank silent this long (dead, its node lost) stops the others with one line naming it (exit 8)
    rank_timeout_s: float = 180.0


class TrainingDiverged(Eagle31Error):
    """Too many non-finite losses in a row; the last good checkpoint is kept."""


class DrafterObjective(nn.Module):
    """The drafter and its TTT loss: the module FSDP wraps and a training step calls."""

    def __init__(self, drafter: Eagle31Drafter, train: TrainConfig):
        super().__init__()
        self.drafter = drafter
        self.unroll = partial(
            ttt_unroll,
            ttt_length=train.ttt_length,
            attention_kernel=train.attention_kernel,
            activation_checkpointing=train.activation_checkpointing,
        )
        self.loss = Divergence(train.loss, train.lk_eta)

    def forward(
        self,
        aux,
        input_ids,
        document_ids,
        final,
        supervised,
        argmax,
        step_scale,
        target: TargetHead,
        sequence: SequenceShard | None = None,
    ) -> StepStats:
        d = self.drafter
        states = self.unroll(d, aux, input_ids, document_ids=document_ids, sequence=sequence).states
        return ttt_loss(states, d.lm_head.weight, d.d2t, final, supervised, target, argmax, step_scale, self.loss)


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    nonfinite_streak: int = 0
    train_seconds: float = 0.0
    eval_due: bool = False  # `step`'s checkpoint was written before its evaluation: a resumed run evaluates first


def shard_for_training(objective: DrafterObjective, world: World, compute_dtype: torch.dtype) -> nn.Module:
    """FSDP2 on GPU or across processes; plain module for one CPU process."""
    if world.device.type == "cpu" and not world.distributed:
        return objective.to(world.device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(world.device.type, (world.world_size,))
    # the batch comes in the compute dtype already; the loss's float64 step weights must stay as they are
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    objective.to(world.device)
    # the frozen embedding stays out of the shards, whole on every rank in the compute dtype (what FSDP would gather
    # anyway): no fp32 master copy, no gathered copy (`eagle31.estimate`: 2 B per element instead of 4 / ranks + 2)
    embed = objective.drafter.embed_tokens
    embed.weight = nn.Parameter(embed.weight.detach().to(compute_dtype), requires_grad=False)
    fully_shard(objective, mesh=mesh, mp_policy=policy, ignored_params={embed.weight})
    return objective


def prepare_batch(
    batch: FeatureBatch, train: TrainConfig, target: TargetHead, device, dtype: torch.dtype, sequence: SequenceGroup,
    rule=Visibility(), draw: int | None = None,
) -> tuple[FeatureBatch, torch.Tensor, torch.Tensor, SequenceShard | None]:  # fmt: skip
    """(the micro-batch on `device`, or this rank's shard of it with its halo where `sequence` has a process group;
    its supervised queries [K, B, T]; the target's argmax; the shard or None). `draw`: the depth sampling's seed."""
    shard = None
    if sequence.group is None:
        b = batch.to(device, dtype=dtype)
    else:
        b, shard = shard_batch(batch, sequence, train.ttt_length, device, dtype, rule)
    segments = segment_ids(b.document_ids, None, b.input_ids.shape, device=b.input_ids.device)
    argmax = target.argmax(b.final, label_positions(b.loss_mask))
    in_vocab = target.in_draft[argmax.clamp(min=0)] & (argmax >= 0) if train.mask_out_of_vocab else None
    supervised = supervision_mask(b.loss_mask, segments, train.ttt_length, in_vocab)[:, :, : b.aux.shape[1]]
    if train.down_sample_ratio is not None and draw is not None:
        start = 0 if shard is None else shard.start
        supervised = depth_sampling(supervised, train.down_sample_ratio, train.down_sample_ratio_min, draw, start)
    return b, supervised, argmax, shard


class Trainer:
    def __init__(
        self,
        train: TrainConfig,
        world: World,
        run_dir: Path,
        drafter: Eagle31Drafter,
        target: TargetHead,
        train_loader,
        eval_loader,
        compute_dtype: torch.dtype,
        sequence: SequenceGroup | None = None,
    ):
        """`sequence`: this rank's place in the (data × sequence) mesh; default from `train.sequence_parallel`."""
        self.cfg = train
        self.visibility = drafter.visibility
        self.sequence = sequence or sequence_group(world, train.sequence_parallel)
        self.world = world
        self.target = target
        self.train_loader = train_loader
        self.eval_loader = eval_loader
        self.compute_dtype = compute_dtype
        if train.compile:
            drafter.compile_blocks()
        self.model = shard_for_training(DrafterObjective(drafter, train), world, compute_dtype)
        self.optimizers = build_optimizer(self.model.named_parameters(), train, world.device)
        # the weights the drafter starts from (drafter.init_from's: the pipeline loads them before the trainer)
        self.trained = [p for p in self.model.parameters() if p.requires_grad]
        self.anchor = Anchor(self.trained, train.anchor_weight) if train.anchor_weight > 0 else None
        self.checkpoints = CheckpointManager(Path(run_dir) / "checkpoints", world, keep_last=train.keep_last)
        self.state = TrainState()

    def _prepare(self, batch: FeatureBatch, draw: int | None = None):
        args = (self.cfg, self.target, self.world.device, self.compute_dtype, self.sequence, self.visibility, draw)
        return prepare_batch(batch, *args)

    def _forward(self, b: FeatureBatch, supervised, argmax, step_scale, shard: SequenceShard | None) -> StepStats:
        """step_scale [K]: the weights of the loss sums, from the global counts (`step_scales`)."""
        return self.model(
            b.aux, b.input_ids, b.document_ids, b.final, supervised, argmax, step_scale, self.target, shard
        )

    def _summed(self, stats: list[StepStats]) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sums [K], counters [4, K]) over the micro-batches of `stats` and every rank."""
        rows = [torch.cat([s.loss_sum.detach().double()[None], s.counters()]) for s in stats]  # [5, K] each
        # on the world's device, as every collective's tensor: NCCL refuses host memory
        summed = torch.zeros(5, self.cfg.ttt_length, dtype=torch.float64, device=self.world.device) + sum(rows)
        all_reduce_sum(summed)
        return summed[0], summed[1:]

    def train_step(self, micro_batches: list[FeatureBatch]) -> dict[str, float]:
        # the depth sampling's draw depends on the step and the micro-batch's index over the data ranks alone
        # (rank r's i-th is i * data_size + r): a resumed run, and one process taking every rank's, draws the same
        n, r = self.sequence.data_size, self.sequence.data_rank
        first = self.state.step * len(micro_batches) * n
        prepared = [self._prepare(b, first + i * n + r) for i, b in enumerate(micro_batches)]
        global_count = all_reduce_sum(sum(sup.sum(dim=(1, 2)) for _, sup, _, _ in prepared).double())
        scale = step_scales(global_count, self.cfg.ttt_decay)
        stats = []
        for i, (b, sup, argmax, shard) in enumerate(prepared):
            if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP: reduce once, after the last
                self.model.set_requires_gradient_sync(i == len(prepared) - 1)
            stats.append(self._forward(b, sup, argmax, scale, shard))
            loss = weighted_loss(stats[-1].loss_sum, global_count, self.cfg.ttt_decay)
            (loss * self.world.world_size).backward()  # FSDP averages gradients over ranks; we want their sum
        loss_sum, counters = self._summed(stats)
        total = float(weighted_loss(loss_sum, global_count, self.cfg.ttt_decay))
        anchor = {} if self.anchor is None else {"anchor": self.anchor.add_gradient()}  # L2-SP, before clipping
        norm = torch.nn.utils.clip_grad_norm_(self.trained, self.cfg.max_grad_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        finite = math.isfinite(total) and math.isfinite(grad_norm)
        if finite:
            self.optimizers.step()
        self.optimizers.zero_grad()
        self.optimizers.advance()  # a skipped step counts toward max_steps, so it moves the schedule too
        seen = [sum(b.num_tokens for b, *_ in prepared), sum(b.num_samples for b in micro_batches)]
        tokens, samples = all_reduce_sum(torch.tensor(seen, dtype=torch.float64, device=self.world.device)).tolist()
        return {
            "loss": total,
            "grad_norm": grad_norm,
            "finite": finite,
            "tokens": int(tokens),
            "samples": int(samples),
            **anchor,
            **ttt_metrics(counters),
        }

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out metrics over one pass of the eval loader (same loss and metrics as training)."""
        if self.eval_loader is None:
            return {}
        self.model.eval()
        self.eval_loader.rewind()
        stats = []
        for batch in self.eval_loader:
            b, sup, argmax, shard = self._prepare(batch)
            stats.append(self._forward(b, sup, argmax, step_scales(sup.sum(dim=(1, 2)), self.cfg.ttt_decay), shard))
        self.model.train()
        loss_sum, counters = self._summed(stats)
        return {"loss": float(weighted_loss(loss_sum, counters[0], self.cfg.ttt_decay)), **ttt_metrics(counters)}

    def save_checkpoint(self) -> Path:
        """Every rank's data position and consumed record (`data_ranks`; `data` is rank 0's) with the weights."""
        data = all_gather_objects(self.train_loader.state_dict())
        state = dict(trainer=asdict(self.state), scheduler=self.optimizers.state_dict(), data=data[0], data_ranks=data)
        return self.checkpoints.save(self.state.step, self.model, self.optimizers.optimizers, state)

    def restore(self, path: Path) -> None:
        saved = self.checkpoints.load(path, self.model, self.optimizers.optimizers)
        self.state = TrainState(**saved["trainer"])
        self.optimizers.load_state_dict(saved["scheduler"])
        ranks = saved.get("data_ranks", [])
        self.train_loader.load_state_dict(
            ranks[self.world.rank] if len(ranks) == self.world.world_size else saved["data"]
        )

    def fit(self, logger: RunLogger, stop: StopSignals | None = None) -> dict[str, float]:
        """Train to `max_steps`; return the final held-out metrics (`stop`: preemption, docs/reliability.md)."""
        cfg, state = self.cfg, self.state
        if state.eval_due and state.step < cfg.max_steps:
            self._log_evaluation(logger)
        stream = chain.from_iterable(repeat(self.train_loader))  # epochs; the loader keeps its position for checkpoints
        window: list[tuple[float, float, float]] = []  # (tokens, samples, wait_s) of each step since the last log
        window_start = time.perf_counter()
        while state.step < cfg.max_steps:
            t0 = time.perf_counter()
            micro = [next(stream) for _ in range(cfg.grad_accum)]
            waited = time.perf_counter() - t0  # for the features: the pool, the store or the in-process target
            result = self.train_step(micro)
            state.train_seconds += time.perf_counter() - t0
            state.nonfinite_streak = 0 if result["finite"] else state.nonfinite_streak + 1
            if not result["finite"]:
                warnings.warn(f"step {state.step + 1}: non-finite loss or gradient, step skipped", stacklevel=1)
                if state.nonfinite_streak >= cfg.max_nonfinite_steps:
                    raise TrainingDiverged(
                        f"{state.nonfinite_streak} non-finite steps in a row at step {state.step + 1}; "
                        f"the last good checkpoint is kept in {self.checkpoints.root}"
                    )
            state.step += 1
            state.tokens_seen += int(result["tokens"])
            window.append((result["tokens"], result["samples"], waited))
            if state.step % cfg.log_every == 0 or state.step == cfg.max_steps:
                logger.log(state.step, self._window_metrics(result, window, time.perf_counter() - window_start))
                window = []
                window_start = time.perf_counter()
            rate = result["tokens"] / max(time.perf_counter() - t0, 1e-9)
            logger.advance(
                state.step, {"loss": f"{result['loss']:.3f}", "tau": f"{result['tau_sim']:.2f}", "tok/s": f"{rate:.0f}"}
            )
            if state.step == cfg.max_steps:
                break
            evaluate_now = bool(cfg.eval_every) and state.step % cfg.eval_every == 0
            if by := self._stopped_by(stop):
                state.eval_due = evaluate_now  # the grace goes to the checkpoint; the resumed run evaluates
                saved = self.save_checkpoint()
                raise RunPreempted(
                    f"stopped by {by} at step {state.step}: checkpoint {saved} is complete; "
                    "rerun with resume=auto to continue"
                )
            if evaluate_now:
                self._log_evaluation(logger)
            if cfg.save_every and state.step % cfg.save_every == 0:
                self.save_checkpoint()
        state.eval_due = True  # a run resumed from the final checkpoint evaluates again, in place of what this one logs
        saved = self.save_checkpoint()
        self._stop_after_the_last_step(stop, saved)
        final = self._log_evaluation(logger)
        self._stop_after_the_last_step(stop, saved)
        return final

    def _log_evaluation(self, logger: RunLogger) -> dict[str, float]:
        metrics = self.evaluate()
        logger.log(self.state.step, {f"eval/{k}": v for k, v in metrics.items()})
        self.state.eval_due = False
        return metrics

    def _stop_after_the_last_step(self, stop: StopSignals | None, saved: Path) -> None:
        """A signal during the final checkpoint or evaluation: stop before the export (every rank, as after a step)."""
        if by := self._stopped_by(stop):
            raise RunPreempted(
                f"stopped by {by} after the last step ({self.state.step}): checkpoint {saved} is complete; rerun "
                "with resume=auto to evaluate and export"
            )

    def _stopped_by(self, stop: StopSignals | None) -> str | None:
        """What asked any rank to stop, or None: one all-reduce per step, so that every rank stops at this step."""
        if stop is None or not all_reduce_sum(torch.tensor([float(stop.requested)], device=self.world.device)).item():
            return None
        return stop.received.name if stop.received else "a signal that another rank received"

    def _window_metrics(self, result: dict, window: list, elapsed: float) -> dict[str, float]:
        """The last step's metrics, rates over the window of steps (docs/engine.md), (rank 0) the feature source's."""
        metrics = {k: v for k, v in result.items() if k not in ("finite", "tokens", "samples")}
        tokens, samples, wait_s = (sum(column) for column in zip(*window))
        metrics.update(
            **self.optimizers.lrs(),
            tokens_per_s=tokens / max(elapsed, 1e-9),
            tokens_seen=self.state.tokens_seen,
            samples_per_s=samples / max(elapsed, 1e-9),
            capacity_samples_per_s=samples / max(elapsed - wait_s, 1e-9),
            wait_s=wait_s / len(window),
        )
        logged = {f"train/{k}": v for k, v in metrics.items()}
        source_metrics = getattr(getattr(self.train_loader, "source", None), "metrics", None)
        if source_metrics is not None and self.world.is_main:
            logged.update(source_metrics())
        return logged

    def full_drafter_state(self) -> dict[str, torch.Tensor]:
        """The drafter's full state dict on CPU (gathered from every rank under FSDP)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k.removeprefix("drafter."): v for k, v in sd.items() if k.startswith("drafter.")}
