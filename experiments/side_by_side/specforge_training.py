"""SpecForge 0.2.0's EAGLE-3 drafter trained by its own trainer from features eagle31 captured.

SpecForge pins torch 2.11.0, transformers 5.8.1 and sglang 0.5.14, so it runs in a venv of its
own (`.ci/specforge_venv.sh`: the wheel --no-deps, CPU torch 2.13.0 — not their pinned torch —,
their pinned transformers, and the packages its offline training path imports; sglang is
imported only by their online capture, never on this path). `train_specforge` writes their
inputs and runs `experiments/side_by_side/specforge_entry.py` with that venv's interpreter, which runs
`specforge train` and `specforge export --to hf`.

What is theirs: the whole training run — config validation, the offline reader and their
sampler's document order (shuffled per epoch with the recipe's seed), their padding collator
and per-sample normalisation (`normalize_offline_sample`, which masks each document's last
position), the target head and its one-token shift (`TargetHead.preprocess`, logits in bf16),
the draft model and its initialisation (`LlamaForCausalLMEagle3`, the target's embedding,
frozen), the TTT forward with its mask alignment (`OnlineEagle3Model.forward`), the loss and
its normalisation (KL over all B*T rows, LK variants from `specforge.core.lk_loss`), the step
weights (0.8^k, fixed in `Eagle3TrainStrategy`), the optimizer (`BF16Optimizer`: AdamW with
torch's default betas (0.9, 0.999) and no weight decay, fp32 master weights), the warm-up +
cosine schedule (to zero), DDP on gloo, the checkpoint and the export. One substitution: their
KL is a Triton kernel that cannot run on a CPU ("0 active drivers"); their pure-torch reference
of the same loss runs instead (`experiments/side_by_side/specforge_entry.py`).

What is ours: the features (each document of our train split, in the order of one epoch of our
loader, as one `.ckpt` file: input ids, loss mask, `hidden_state` = the store's `final` (the
target's last state after its norm, what their `TargetHead` projects, in bf16 as that head
computes), `aux_hidden_state` = the store's aux features), the draft vocabulary (our d2t / t2d),
the drafter's shape, and the recipe's settings mapped onto their config (`run_config`):
`train.lr`, `train.max_steps` (also their schedule's length), `train.warmup_steps` (as their
`warmup_ratio`), `train.max_grad_norm`, `train.ttt_length`, `train.loss` (kl; lk_alpha and
lk_hybrid as their `lk_loss_type` alpha and lambda, `train.lk_eta` as their `kl_decay`), `seed`
and `data.max_len`; fp32 weights (their default is bf16) and the thread count of our side. The
documents per step (`training.batch_size`) are our packed batches' mean, so both sides see about
the same tokens per step; `report.json` has the tokens their sampler fed. A killed run starts
over from step 0 (the features are kept).

SpecForge 0.2.0 feeds the pre-norm state back to the next TTT step (`OnlineEagle3Model.forward`
assigns the layer's output; their `norm_output` only decides whether `lm_head` sees
`norm(o)`), so it trains EAGLE-3 feedback: the recipe must say `drafter.norm_output=false`
(with `fc_norm` as the recipe says). Their decoder layer keeps the residual before the norm
(`norm_before_residual=false`) and has no `norm_before_fc`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.peer import peers_dir
from eagle31.errors import ConfigError
from eagle31.io import atomic_write_json, atomic_write_text
from eagle31.loss import DraftLoss
from eagle31.optim import Optimizer, Schedule
from experiments.side_by_side.peer_training import batch_documents

SPECFORGE_VERSION = "0.2.0"
ENTRY = Path(__file__).resolve().with_name("specforge_entry.py")
# train.loss -> (their training.lk_loss_type); tv and ce have no SpecForge counterpart
SPECFORGE_LOSS = {DraftLoss.kl: None, DraftLoss.lk_alpha: "alpha", DraftLoss.lk_hybrid: "lambda"}
SPECFORGE_STEP_DECAY = 0.8  # `Eagle3TrainStrategy(ploss_decay=0.8)`, not a config field
RUN_ID = "specforge"


def specforge_venv() -> Path:
    return peers_dir() / f"specforge-{SPECFORGE_VERSION}"


def specforge_python() -> Path:
    """The interpreter of SpecForge's venv, or a one-line error naming the script that builds it."""
    venv = specforge_venv()
    python = venv / "bin" / "python"
    if not (venv / ".eagle31-ready").is_file() or not python.is_file():
        raise ConfigError(f"no SpecForge {SPECFORGE_VERSION} venv at {venv}: run `bash .ci/specforge_venv.sh`")
    return python


def check_specforge_recipe(recipe) -> None:
    """What SpecForge 0.2.0 cannot train, refused before anything runs."""
    d, train = recipe.drafter, recipe.train
    if d.norm_output:
        raise ConfigError(
            "drafter.norm_output=true: SpecForge 0.2.0 feeds the pre-norm state back to the next TTT step "
            "(OnlineEagle3Model.forward); compare with drafter.norm_output=false"
        )
    if d.norm_before_fc or d.norm_before_residual:
        raise ConfigError("drafter.norm_before_fc / norm_before_residual: SpecForge's EAGLE-3 layer has neither")
    if DraftLoss(train.loss) not in SPECFORGE_LOSS:
        raise ConfigError(
            f"train.loss={train.loss}: SpecForge 0.2.0 trains EAGLE-3 with kl, lk_alpha or lk_hybrid only"
        )
    if train.ttt_decay != SPECFORGE_STEP_DECAY:
        raise ConfigError(f"train.ttt_decay={train.ttt_decay}: SpecForge weights TTT step k by 0.8^k, fixed")
    if train.weight_decay:
        raise ConfigError(f"train.weight_decay={train.weight_decay}: SpecForge's optimizer has no weight decay")
    if train.optimizer != Optimizer.adamw:
        raise ConfigError(f"train.optimizer={train.optimizer}: SpecForge 0.2.0's optimizer is AdamW")
    if train.schedule != Schedule.cosine:
        raise ConfigError(f"train.schedule={train.schedule}: SpecForge 0.2.0 runs its own warm-up + cosine schedule")
    if train.anchor_weight:
        raise ConfigError(f"train.anchor_weight={train.anchor_weight}: SpecForge 0.2.0's loss has no anchor")


def write_features(loader, directory: Path) -> tuple[list[int], int]:
    """One epoch of `loader` as SpecForge offline files `<i>.ckpt` (one per document, in our order).

    Returns the documents' lengths (file order) and the number of our batches in the epoch.
    """
    directory.mkdir(parents=True, exist_ok=True)
    lengths, batches = [], 0
    for batch in loader:
        batches += 1
        for at in batch_documents(batch):
            sample = {
                "input_ids": batch.input_ids[0, at].clone(),  # [n]
                "loss_mask": batch.loss_mask[0, at].clone(),  # [n], 1 = assistant token
                "hidden_state": batch.final[0, at][None]
                .to(torch.bfloat16)
                .clone(),  # [1, n, Ht]: their TargetHead is bf16
                "aux_hidden_state": batch.aux[0, at][None].clone(),  # [1, n, 3*Ht], the store's dtype
            }
            torch.save(sample, directory / f"{len(lengths):08d}.ckpt")
            lengths.append(int(at.sum()))
    return lengths, batches


def target_view(target_dir: Path, directory: Path) -> tuple[Path, str]:
    """The target's files linked into `directory`, with the weight index their `TargetHead` needs.

    Returns the directory and the lm_head key (the embedding's when the target ties them).
    """
    from safetensors import safe_open

    directory.mkdir(parents=True, exist_ok=True)
    for file in target_dir.iterdir():
        link = directory / file.name
        if not link.exists():
            link.symlink_to(file.resolve())
    index = next(iter(directory.glob("*.index.json")), None)
    if index is None:
        weight_map = {}
        for file in sorted(directory.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                weight_map.update({key: file.name for key in f.keys()})
        index = directory / "model.safetensors.index.json"
        atomic_write_json(index, {"metadata": {}, "weight_map": weight_map})
    keys = json.loads(index.read_text())["weight_map"]
    return directory, "lm_head.weight" if "lm_head.weight" in keys else "model.embed_tokens.weight"


def draft_config(drafter) -> dict:
    """Their `LlamaForCausalLMEagle3` config for our drafter's shape (aux ids in their "output of layer k" form)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": drafter.hidden_size,
        "intermediate_size": drafter.intermediate_size,
        "num_attention_heads": drafter.num_attention_heads,
        "num_key_value_heads": drafter.num_key_value_heads,
        "head_dim": drafter.head_dim,
        "rms_norm_eps": drafter.rms_norm_eps,
        "hidden_act": drafter.hidden_act,
        "rope_parameters": drafter.rope_parameters,
        "max_position_embeddings": drafter.max_position_embeddings,
        "vocab_size": drafter.vocab_size,
        "draft_vocab_size": drafter.draft_vocab_size,
        "target_hidden_size": drafter.target_hidden_size,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "fc_norm": drafter.fc_norm,
        "norm_output": True,  # theirs: lm_head reads norm(o); the next step still gets o
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in drafter.aux_layer_ids]},
    }


def run_config(recipe, work: Path, target: Path, lm_head_key: str, batch_size: int, epochs: int) -> dict:
    """Their run config (`specforge.config.Config`) with the recipe's settings."""
    train = recipe.train
    return {
        "run_id": RUN_ID,
        "output_dir": str(work / "checkpoints"),
        "model": {
            "target_model_path": str(target),
            "draft_model_config": str(work / "draft_config.json"),
            "vocab_mapping_path": str(work / "vocab_mapping.pt"),
            "lm_head_key": lm_head_key,
            "torch_dtype": "float32",
        },
        "data": {
            "hidden_states_path": str(work / "features"),
            "max_length": recipe.data.max_len,
            "dataloader_num_workers": 0,
        },
        "training": {
            "max_steps": train.max_steps,
            "total_steps": train.max_steps,
            "num_epochs": epochs,
            "batch_size": batch_size,
            "accumulation_steps": 1,
            "fsdp_sharding": "NO_SHARD",  # one rank: their DDP wrapper
            "learning_rate": train.lr,
            "lr_scheduler": "cosine",
            # their warm-up is int(ratio * total): the half step keeps it at warmup_steps under rounding
            "warmup_ratio": min(1.0, (train.warmup_steps + 0.5) / train.max_steps),
            "max_grad_norm": train.max_grad_norm,
            "ttt_length": train.ttt_length,
            "attention_backend": "sdpa",  # flex attention has no CPU backward
            "lk_loss_type": SPECFORGE_LOSS[DraftLoss(train.loss)],
            "kl_scale": 1.0,
            "kl_decay": float(train.lk_eta),
            "save_interval": 0,  # their last checkpoint only: a killed run starts over
            "log_interval": 1,
            "seed": recipe.seed,
        },
    }


def train_specforge(recipe, plan, train_loader, d2t: torch.Tensor, t2d: torch.Tensor, drafter) -> dict:
    """Their trainer on our features; writes `drafter/` (their HF export) and `training_steps.jsonl` under the run
    dir."""
    python = specforge_python()
    check_specforge_recipe(recipe)
    work = plan.run_dir / "specforge"
    ready = work / "features.json"
    if not ready.is_file():  # written once: a rerun reuses them
        lengths, batches = write_features(train_loader, work / "features")
        atomic_write_json(ready, {"lengths": lengths, "batches": batches})
    features = json.loads(ready.read_text())
    lengths = features["lengths"]
    batch_size = max(1, round(len(lengths) / features["batches"]))  # our packed batches' mean documents
    epochs = math.ceil(recipe.train.max_steps / max(1, len(lengths) // batch_size))
    target, lm_head_key = target_view(plan.target_dir, work / "target")
    atomic_write_json(work / "draft_config.json", draft_config(drafter))
    torch.save({"d2t": d2t, "t2d": t2d}, work / "vocab_mapping.pt")
    atomic_write_text(
        work / "run.json", json.dumps(run_config(recipe, work, target, lm_head_key, batch_size, epochs), indent=2)
    )
    if (work / "checkpoints").exists():  # a killed run starts over (its features are kept)
        print(f"restart: specforge seed {recipe.seed} (an earlier run did not finish)", file=sys.stderr)
        shutil.rmtree(work / "checkpoints")
    drafter_dir = plan.run_dir / "drafter"
    inputs = {
        "run_config": str(work / "run.json"),
        "run_id": RUN_ID,
        "output_dir": str(work / "checkpoints"),
        "max_steps": recipe.train.max_steps,
        "draft_config": str(work / "draft_config.json"),
        "vocab_mapping": str(work / "vocab_mapping.pt"),
        "target_dir": str(target),
        "drafter_dir": str(drafter_dir),
        "lengths": lengths,
        "batch_size": batch_size,
        "seed": recipe.seed,
    }
    atomic_write_json(work / "inputs.json", inputs)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(SPECFORGE_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())  # the threads eagle31's side trains with
    proc = subprocess.run([str(python), str(ENTRY), str(work)], capture_output=True, text=True, env=env)
    (work / "specforge.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(
            f"SpecForge's trainer failed (exit {proc.returncode}), see {work / 'specforge.log'}:\n{proc.stderr[-3000:]}"
        )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    steps = [{k: v for k, v in s.items() if not k.startswith("perf/")} for s in result["step_log"]]
    atomic_write_text(drafter_dir / "training_steps.jsonl", "".join(json.dumps(s) + "\n" for s in steps))
    return {
        "steps": result["steps"],
        "tokens_seen": result["tokens_seen"],
        "train_time_s": result["train_time_s"],
        "documents_per_step": batch_size,
        "last_step": steps[-1] if steps else None,
    }
