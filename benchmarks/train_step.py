"""What the training-step benchmark measures: one full training step of a drafter shape.

* `BenchConfig`: a shape (a recipe name, or `tiny`), T, K and how to run (parsed from `key=value`);
* `EagleStep`: exactly `Trainer.train_step` — forward, backward, gradient clipping, AdamW — on
  one synthetic packed sequence (the peer's step is `benchmarks.peer.SpeculatorsStep`);
* `step_flops` (`eagle31.estimate`): the model FLOPs of one step, for tokens/s and MFU.

How it is timed and reported: `benchmarks.measure`, `benchmarks.report`.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.shapes import TINY, recipe_drafter
from eagle31.config import DrafterConfig
from eagle31.data.batch import FeatureBatch
from eagle31.errors import ConfigError
from eagle31.loss import TargetHead
from eagle31.model import Eagle31Drafter
from eagle31.vocab import vocab_maps


@dataclass
class BenchConfig:
    """One benchmark: a shape, a sequence length, K, and how to run it."""

    shape: str = "tiny"  # a recipe with a shipped target config (kimi_k26, llama31_8b, ...) or tiny
    seq_len: int = 1024  # T: tokens of the one packed sequence
    ttt_length: int = 7  # K
    peer: str = "none"  # none | speculators
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp32
    attention: str = "auto"  # ours: auto | flash | blockwise | reference
    activation_checkpointing: bool = False
    compile: bool = False  # torch.compile the drafter's norms and MLP (CUDA only)
    peer_attention: str = "auto"  # speculators': auto (simple_flex_attention on CUDA, sdpa on CPU) | sdpa | eager
    warmup: int = 2
    repeats: int = 5
    memory: bool = True  # measure peak memory
    peak_tflops: float = 0.0  # device peak for MFU; 0 = look it up (CUDA) or leave MFU out
    threads: int = 0  # CPU threads for torch; 0 = torch's default (on a shared machine 1 is steadier)
    seed: int = 0
    parallel: bool = False  # a parallel (P-EAGLE) drafter: its steps k >= 1 read the mask slots
    overrides: dict[str, Any] = field(default_factory=dict)  # DrafterConfig fields over the shape

    ARG_NAMES = {"T": "seq_len", "ttt": "ttt_length", "ckpt": "activation_checkpointing"}

    @classmethod
    def from_args(cls, argv: Sequence[str]) -> BenchConfig:
        """`key=value` arguments; `T`, `ttt` and `ckpt` abbreviate seq_len, ttt_length, activation_checkpointing."""
        known = {f.name: f for f in dataclasses.fields(cls) if f.name != "overrides"}
        names = {**{n: n for n in known}, **cls.ARG_NAMES}
        values: dict[str, Any] = {}
        for arg in argv:
            key, sep, value = arg.partition("=")
            if not sep or key not in names:
                raise ConfigError(f"unknown argument {arg!r}; expected key=value with key in {sorted(names)}")
            name = names[key]
            kind = str(known[name].type)
            try:
                if kind == "bool":
                    if value.lower() not in ("true", "false", "1", "0"):
                        raise ValueError(value)
                    values[name] = value.lower() in ("true", "1")
                elif kind == "int":
                    values[name] = int(value)
                elif kind == "float":
                    values[name] = float(value)
                else:
                    values[name] = value
            except ValueError:
                raise ConfigError(f"{key}={value!r}: expected a {kind}") from None
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        if self.shape != "tiny":
            recipe_drafter(self.shape)  # an unknown recipe, or one without a fixed shape, is refused here
        for name in ("seq_len", "ttt_length", "repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.warmup < 0 or self.threads < 0:
            raise ConfigError(f"warmup and threads must be >= 0, got {self.warmup} and {self.threads}")
        choices = {
            "peer": ("none", "speculators"),
            "device": ("auto", "cpu", "cuda"),
            "precision": ("auto", "bf16", "fp32"),
            "attention": ("auto", "flash", "blockwise", "reference"),
            "peer_attention": ("auto", "simple_flex_attention", "sdpa", "eager"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r}; choose one of {list(allowed)}")
        if self.compile and self.torch_device().type != "cuda":
            raise ConfigError("compile=true is for CUDA runs (on CPU torch.compile does not pay here)")

    # ------------------------------------------------------------------ derived

    def torch_device(self) -> torch.device:
        kind = self.device
        if kind == "auto":
            kind = "cuda" if torch.cuda.is_available() else "cpu"
        if kind == "cpu":
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise ConfigError("device=cuda but no CUDA device is available")
        return torch.device("cuda", torch.cuda.current_device())

    def compute_dtype(self) -> torch.dtype:
        precision = self.precision
        if precision == "auto":
            precision = "bf16" if self.torch_device().type == "cuda" else "fp32"
        return torch.bfloat16 if precision == "bf16" else torch.float32

    def drafter_config(self) -> DrafterConfig:
        """The recipe's drafter (or `TINY`), with `overrides`, and room for T + K positions."""
        cfg = DrafterConfig(**TINY) if self.shape == "tiny" else recipe_drafter(self.shape)
        cfg = dataclasses.replace(cfg, **self.overrides)
        if self.parallel:
            cfg = dataclasses.replace(cfg, parallel_drafting=True, mask_token_id=0)
        positions = max(cfg.max_position_embeddings, self.seq_len + self.ttt_length)
        return dataclasses.replace(cfg, max_position_embeddings=positions)

    def name(self) -> str:
        ckpt = ("-ckpt" if self.activation_checkpointing else "") + ("-parallel" if self.parallel else "")
        return f"{self.shape}-T{self.seq_len}-K{self.ttt_length}{ckpt}-{self.torch_device().type}"


# ----------------------------------------------------------------------------
# FLOPs


# ----------------------------------------------------------------------------
# synthetic inputs


def synthetic_batch(cfg: DrafterConfig, seq_len: int, seed: int = 0) -> FeatureBatch:
    """One packed sequence of one document, loss mask on everywhere; fp32 features, on CPU."""
    g = torch.Generator().manual_seed(seed)
    T = seq_len
    return FeatureBatch(
        input_ids=torch.randint(0, cfg.vocab_size, (1, T), generator=g),
        loss_mask=torch.ones(1, T, dtype=torch.long),
        document_ids=torch.zeros(1, T, dtype=torch.long),
        aux=torch.randn(1, T, cfg.fc_in_features, generator=g),
        final=torch.randn(1, T, cfg.target_hidden_size, generator=g),
    )


def random_vocab(cfg: DrafterConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(draft ids [Vd] ascending, d2t [Vd], t2d [V]): a random draft vocabulary."""
    g = torch.Generator().manual_seed(seed)
    draft_ids = torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values
    d2t, t2d = vocab_maps(draft_ids, cfg.vocab_size)
    return draft_ids, d2t, t2d


def random_target_lm_head(cfg: DrafterConfig, device, dtype, seed: int = 0) -> torch.Tensor:
    """[V, Ht] random target lm_head, made on `device` (the Kimi one is 1.2 B values)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.empty(cfg.vocab_size, cfg.target_hidden_size, device=device, dtype=dtype)
    return w.normal_(0.0, cfg.target_hidden_size**-0.5, generator=g)


# ----------------------------------------------------------------------------
# our step: exactly the trainer's


class EagleStep:
    """One `Trainer.train_step` (prepare → TTT unroll + loss → backward → clip → AdamW) on one batch.

    On CUDA the drafter is sharded with FSDP2 as in training (bf16 compute, fp32 master
    weights); a one-process group is created when none exists.
    """

    name = "eagle31"

    def __init__(self, bench: BenchConfig):
        from eagle31.distributed import World, ensure_single_process_group
        from eagle31.trainer import TrainConfig, Trainer

        cfg = bench.drafter_config()
        device, dtype = bench.torch_device(), bench.compute_dtype()
        torch.manual_seed(bench.seed)
        draft_ids, d2t, t2d = random_vocab(cfg, bench.seed)
        with torch.device(device):  # built in place: the Kimi drafter has 2.2 B values
            drafter = Eagle31Drafter(cfg)
        drafter.set_vocab(d2t, t2d)
        if bench.compile:
            drafter.compile_blocks()
        train = TrainConfig(
            ttt_length=bench.ttt_length,
            attention_kernel=bench.attention,
            activation_checkpointing=bench.activation_checkpointing,
            mask_out_of_vocab=False,  # random features: supervise every position, as real batches nearly do
            warmup_steps=1,
            max_steps=1_000_000,
        )
        if device.type == "cuda":
            ensure_single_process_group(device)
        head = TargetHead(random_target_lm_head(cfg, device, dtype, bench.seed), draft_ids.to(device))
        world = World(rank=0, world_size=1, local_rank=device.index or 0, device=device)
        self._run_dir = tempfile.TemporaryDirectory(prefix="eagle31-bench-")
        self.trainer = Trainer(train, world, Path(self._run_dir.name), drafter, head, None, None, dtype)
        # already on the device, as the peer's inputs are: a loader overlaps this copy in training
        self.batch = synthetic_batch(cfg, bench.seq_len, bench.seed).to(device, dtype)

    def __call__(self) -> None:
        self.trainer.train_step([self.batch])
