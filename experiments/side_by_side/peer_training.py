"""`speculators`' EAGLE-3 drafter (or its P-EAGLE, `PEagleDraftModel`, for a parallel drafter) trained on eagle31's
batches, in the loop its trainer runs.

Their `speculators.train.trainer.Trainer` cannot run on a CPU: it autocasts to the
accelerator's device type and falls back to "cuda" when there is none (`Trainer.__init__`),
and moves the model to `local_rank`, i.e. `cuda:0` (`Trainer.setup_model`) — speculators
0.9.0. So `SpeculatorsTraining` runs the steps of their `Trainer.train_epoch` itself:
model forward with their TTT unroll, mask and loss (`Eagle3DraftModel.forward`, the loss
from `speculators.losses.resolve_loss_config`, eager implementation: their fused one needs
Triton), zero_grad, backward, gradient clipping, optimizer step, scheduler step.

What is theirs: the model and its initialisation (`benchmarks.peer.speculators_drafter`: their
`Eagle3DraftModel`, `load_vocab_mappings`, `load_verifier_weights`), the batch layout (their
`CollateFn` with their `shift_batch`, which aligns tokens, features and loss mask their way),
the forward, the TTT unroll, the loss mask alignment and the loss, and the checkpoint
(`save_pretrained`). What is ours: the samples fed to their collate (the documents of each of
our packed batches, in our loader's order, so both sides see the same tokens in the same
order), the optimizer and its schedule (`eagle31.optim.build_optimizer` with the recipe's settings,
the same code as eagle31's side: `train.optimizer=muon train.schedule=linear` is their trainer's default),
the gradient-clipping norm (the recipe's, theirs is fixed at 1.0) and the loop around them.

Their loss mask, as their trainer builds it, is the sample's assistant mask: after `shift_batch`
their query (p, k) is supervised when `m[p+1+k] = 1`, one token earlier than the aligned
`m[p+2+k]` of docs/design.md §4, and regardless of the target's argmax (eagle31's
`mask_out_of_vocab`). `eagle31_loss_mask` is the mask that makes their (p, k) supervision
exactly eagle31's, to tell what the masks alone do (`SpeculatorsTraining(mask_head=...)`).

Their labels are `verifier_lm_head(verifier_norm(h))` of the target's last hidden state *before*
its final norm (what vLLM captures); our store keeps `final`, the norm's output. Their batch
gets `final / norm.weight`: a state whose RMS is 1 up to the norm's epsilon, so their norm
gives back `final` (to about 1e-6) and the labels are the same on both sides.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch

from eagle31.data.batch import FeatureBatch
from eagle31.errors import ConfigError
from eagle31.loss import DraftLoss, TargetHead, label_positions
from eagle31.optim import build_optimizer

# train.loss -> the name `speculators.losses.resolve_loss_config` knows
SPECULATORS_LOSS = {
    DraftLoss.kl: "kl_div",
    DraftLoss.tv: "tv",
    DraftLoss.lk_alpha: "nla",
    DraftLoss.lk_hybrid: "lk_hybrid",
    DraftLoss.ce: "ce",
}


def batch_documents(batch: FeatureBatch):
    """The documents of one packed `[1, T]` batch, in order: a boolean mask `[T]` each."""
    if batch.input_ids.shape[0] != 1:
        raise ValueError("the peers train on packed batches: features.batching must be pack")
    docs = batch.document_ids[0]
    for d in range(int(docs.max()) + 1):
        yield docs == d


def eagle31_loss_mask(batch: FeatureBatch, head: TargetHead | None) -> torch.Tensor:
    """[1, T] bool: the loss mask under which their query (p, k) is supervised exactly when eagle31's is.

    Their (p, k) reads the mask at its label's position q = p+1+k; eagle31 supervises it when
    m[q+1] = 1 (`label_positions`) and, with `head` (`mask_out_of_vocab`), the target's argmax at q
    is a draft token. A document's last position labels nothing in either.
    """
    mask = label_positions(batch.loss_mask)
    for at in batch_documents(batch):
        mask[0, at.nonzero()[-1]] = False  # q+1 is the next document's
    if head is not None:
        mask &= head.in_draft[head.argmax(batch.final.float(), mask).clamp(min=0)]
    return mask


def speculators_samples(
    batch: FeatureBatch, norm_weight: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> list[dict]:
    """The documents of one packed `[1, T]` batch as samples of their dataset (before `shift_batch`).

    norm_weight [Ht]: the target's final norm weight (see the module docstring); loss_mask [1, T]:
    the mask they train on, the batch's assistant mask (their trainer's) when None.
    """
    loss_mask = batch.loss_mask if loss_mask is None else loss_mask
    samples = []
    for at in batch_documents(batch):
        n = int(at.sum())
        samples.append(
            {
                "hidden_states": batch.aux[0, at],  # [n, 3*Ht]
                "input_ids": batch.input_ids[0, at],
                "verifier_last_hidden_states": batch.final[0, at].float() / norm_weight.float(),  # [n, Ht]
                "loss_mask": loss_mask[0, at].bool(),
                "lengths": torch.tensor([n]),
                "position_ids": torch.arange(n),
            }
        )
    return samples


class SpeculatorsTraining:
    """Train their drafter on our batches: `step(batch)` per optimizer step, `save(dir)` at the end.

    `save_checkpoint` / `restore` keep the model, the optimizers, the schedule, the loader's position and
    the step log in an `eagle31.checkpoint.CheckpointManager` (the trainer's atomic, checksummed
    checkpoints), so a killed run continues where it stopped with the same result.

    train: the recipe's `train` section (ttt_length, ttt_decay, the optimizer's and schedule's fields,
    max_steps, max_grad_norm, loss, lk_eta, mask_out_of_vocab; no anchor_weight); max_len: their
    collate's row length (our `features.tokens_per_batch`); mask_head: the target's head, to
    train on eagle31's supervision (`eagle31_loss_mask`) instead of their loss mask;
    compute_dtype: their features' dtype and, below fp32, their trainer's autocast (on the
    model's device; the batches are moved there).
    """

    def __init__(
        self,
        model,
        train,
        norm_weight: torch.Tensor,
        max_len: int,
        hidden_size: int,
        num_aux: int,
        mask_head: TargetHead | None = None,
        compute_dtype: torch.dtype = torch.float32,
    ):
        from speculators.losses import resolve_loss_config
        from speculators.models.eagle3.data import shift_batch
        from speculators.train.data import CollateFn

        if train.anchor_weight:
            raise ConfigError(
                f"train.anchor_weight={train.anchor_weight}: the speculators side starts from its own initialisation, "
                "with no drafter.init_from to anchor to"
            )
        self.model = model
        self.train_cfg = train
        self.norm_weight = norm_weight
        self.mask_head = mask_head
        self.device = next(model.parameters()).device
        self.compute_dtype = compute_dtype
        self.collate = CollateFn(max_len, hidden_size, num_aux, dtype=compute_dtype, preprocess=shift_batch)
        loss = resolve_loss_config(SPECULATORS_LOSS[DraftLoss(train.loss)], "eager")
        if train.loss == DraftLoss.lk_hybrid:  # their default eta is 3; pass the recipe's
            name, (fn, weight) = next(iter(loss.items()))
            loss = {name: (partial(fn, eta=float(train.lk_eta)), weight)}
        if model.config.speculators_model_type == "peagle":  # their P-EAGLE: COD-sampled depths, one mean
            ratio = train.down_sample_ratio
            self.call_kwargs = dict(
                num_depths=train.ttt_length,
                down_sample_ratio=1.0 if ratio is None else ratio,  # None: every depth whole
                down_sample_ratio_min=1.0 if ratio is None else train.down_sample_ratio_min,
                loss_config=loss,
            )
            self.accuracy = "position_{}_acc"
        else:
            self.call_kwargs = dict(ttt_steps=train.ttt_length, ttt_step_loss_decay=train.ttt_decay, loss_config=loss)
            self.accuracy = "full_acc_{}"
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizers = build_optimizer(model.named_parameters(), train, self.device)
        self.history: list[dict] = []

    def loss(self, batch: FeatureBatch) -> tuple[torch.Tensor, dict]:
        """Their loss of one packed batch (with its graph) and their metrics, as their trainer computes them."""
        loss_mask = None
        if self.mask_head is not None:
            loss_mask = eagle31_loss_mask(batch, self.mask_head if self.train_cfg.mask_out_of_vocab else None)
        collated = self.collate(speculators_samples(batch, self.norm_weight, loss_mask))
        # drops their error_records count
        inputs = {k: v.to(self.device, non_blocking=True) for k, v in collated.items() if isinstance(v, torch.Tensor)}
        self.model.train()
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32):
            _, loss, metrics = self.model(**inputs, **self.call_kwargs)
        return loss, metrics

    def step(self, batch: FeatureBatch) -> dict:
        """One optimizer step on one packed batch; their metrics (loss, per-step accuracies)."""
        loss, metrics = self.loss(batch)
        self.optimizers.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.train_cfg.max_grad_norm)
        self.optimizers.step()
        self.optimizers.advance()
        out = {"loss": float(loss.detach()), "grad_norm": float(grad_norm), "tokens": batch.num_tokens}
        for k in range(self.train_cfg.ttt_length):
            name = self.accuracy.format(k)
            total = float(metrics[f"{name}_total"])
            out[f"acc_{k}"] = float(metrics[f"{name}_sum"]) / total if total else None
        self.history.append(out)
        return out

    def save_checkpoint(self, checkpoints, loader, progress: dict) -> Path:
        """A checkpoint of `progress` (steps, tokens, seconds so far) and of everything `restore` needs."""
        state = {
            "progress": progress,
            "scheduler": self.optimizers.state_dict(),
            "data": loader.state_dict(),
            "history": self.history,
        }
        return checkpoints.save(progress["steps"], self.model, self.optimizers.optimizers, state)

    def restore(self, checkpoints, path: Path, loader) -> dict:
        """Model, optimizer, schedule, loader position and step log from `path`; returns its progress."""
        saved = checkpoints.load(path, self.model, self.optimizers.optimizers)
        self.optimizers.load_state_dict(saved["scheduler"])
        loader.load_state_dict(saved["data"])
        self.history = saved["history"]
        return saved["progress"]

    def save(self, directory: Path) -> Path:
        """Their checkpoint (`save_pretrained`: config.json + safetensors, the speculators layout) and our step log."""
        directory = Path(directory)
        self.model.save_pretrained(directory)
        (directory / "training_steps.jsonl").write_text("".join(json.dumps(h) + "\n" for h in self.history))
        return directory
