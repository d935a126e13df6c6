"""SpecForge's side of the side-by-side (experiments/side_by_side/specforge_training.py): the TTT forward of
SpecForge 0.2.0's own `OnlineEagle3Model` (run in its venv) equals eagle31's with the same weights,
so both sides do the same work per step; and what we hand its offline reader."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import tiny_drafter
from tests.peers import specforge_python

ENTRY_DIR = Path(__file__).resolve().parents[2] / "experiments" / "side_by_side"

# Their model with the state we wrote, their TTT forward on our batch (input ids and target shifted
# by their `specforge.utils.padding`, as `TargetHead.preprocess` does); the logits of every step
# recorded at `compute_logits`, their per-step losses, and the gradients of their step-weighted
# loss (`Eagle3TrainStrategy`'s 0.8^k).
THEIR_FORWARD = """
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
sys.path.insert(0, sys.argv[2])
import specforge_entry
import specforge.algorithms.eagle3.model as eagle3_model
from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
from specforge.utils import padding

work = Path(sys.argv[1])
eagle3_model.LogSoftmaxLoss = specforge_entry.ReferenceKLLoss  # their Triton kernel cannot run on a CPU
config = LlamaConfig(**json.loads((work / "draft_config.json").read_text()))
draft = LlamaForCausalLMEagle3(config, attention_backend="sdpa").float()
draft.load_state_dict(load_file(work / "weights.safetensors"), strict=True)
batch = load_file(work / "batch.safetensors")
logits = []
compute_logits = draft.compute_logits
draft.compute_logits = lambda h: logits.append(compute_logits(h)) or logits[-1]
model = eagle3_model.OnlineEagle3Model(draft, length=int(sys.argv[3]), attention_backend="sdpa")
ids = batch["input_ids"]
plosses = model(
    input_ids=padding(ids, left=False), attention_mask=torch.ones_like(ids),
    target=padding(batch["target"], left=False), loss_mask=batch["loss_mask"][..., None], hidden_states=batch["aux"],
)[0]
sum(0.8**k * p for k, p in enumerate(plosses)).backward()
out = {f"logits_{k}": l.detach().contiguous() for k, l in enumerate(logits)}
out.update({f"grad.{n}": p.grad.contiguous() for n, p in draft.named_parameters() if p.grad is not None})
save_file(out, work / "theirs.safetensors")
print(json.dumps({"plosses": [float(p) for p in plosses]}))
"""


@pytest.mark.slow
def test_their_ttt_forward_equals_ours_with_the_same_weights(tmp_path):
    """Step k's logits at every position, K = 3: their unroll (pre-norm feedback, RoPE at p + k, the
    step-0 causal keys plus the query's own chain) is eagle31's with norm_output=false; their loss is
    the KL at their alignment computed on our logits, and so are its gradients."""
    from eagle31.ttt import ttt_unroll
    from experiments.side_by_side.specforge_training import draft_config

    python = specforge_python()  # skipped without its venv, failing under CI=true
    K, T = 3, 12
    drafter = tiny_drafter(dtype=torch.float32, fc_norm=True, norm_output=False)
    cfg = drafter.config
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(1, T, cfg.fc_in_features, generator=g) * 2
    input_ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    target = torch.randn(1, T, cfg.vocab_size, generator=g) * 3  # the target's logits over its vocabulary
    (tmp_path / "draft_config.json").write_text(json.dumps(draft_config(cfg)))
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, tmp_path / "weights.safetensors")
    loss_mask = torch.ones(1, T, dtype=torch.long)
    loss_mask[0, -1] = 0  # as their `normalize_offline_sample` leaves every document
    save_file(
        {"aux": aux, "input_ids": input_ids, "target": target, "loss_mask": loss_mask}, tmp_path / "batch.safetensors"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(
        [str(python), "-c", THEIR_FORWARD, str(tmp_path), str(ENTRY_DIR), str(K)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**env, "SPECFORGE_DEVICE": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    theirs = load_file(tmp_path / "theirs.safetensors")
    plosses = json.loads(proc.stdout.strip().splitlines()[-1])["plosses"]

    out = ttt_unroll(drafter, aux, input_ids, ttt_length=K, attention_kernel="reference")
    ours = [drafter.lm_head(s) for s in out.states]  # lm_head(norm(o_k)) [1, T, Vd]
    assert sum(name.startswith("logits_") for name in theirs) == K
    for k in range(K):
        torch.testing.assert_close(theirs[f"logits_{k}"], ours[k].detach(), rtol=1e-5, atol=1e-5)
    # their loss at step k: KL from the target's draft-vocabulary softmax at position p + 1 + k (their
    # shift), over all T rows; rows past the end and target tokens outside the draft vocabulary masked
    t2d = drafter.t2d.bool()
    total = 0
    for k in range(K):
        p_target = torch.softmax(target[0, :, t2d], -1)  # [T, Vd]
        rows = torch.arange(T) + 1 + k
        valid = (rows < T) & t2d[target[0].argmax(-1)[rows.clamp(max=T - 1)]]
        logp = torch.log_softmax(ours[k][0], -1)
        kl = (-(p_target[rows.clamp(max=T - 1)] * logp).sum(-1) * valid).sum() / T
        assert plosses[k] == pytest.approx(float(kl.detach()), rel=1e-5, abs=1e-6)
        total = total + 0.8**k * kl
    total.backward()
    grads = {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}
    assert {"fc.weight", "lm_head.weight", "midlayer.self_attn.q_proj.weight", "fc_norm.0.weight"} <= grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(theirs[f"grad.{name}"], grad, rtol=1e-4, atol=1e-6)


def test_features_are_one_file_per_document_in_our_order(tmp_path):
    """Each document of a packed batch becomes one offline file with the keys their reader needs."""
    from eagle31.data.batch import FeatureBatch
    from experiments.side_by_side.specforge_training import write_features

    def packed(lengths, start):
        T = sum(lengths)
        docs = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
        return FeatureBatch(
            input_ids=torch.arange(start, start + T)[None],
            loss_mask=(torch.arange(T) % 2)[None],
            document_ids=docs,
            aux=torch.randn(1, T, 6),
            final=torch.randn(1, T, 2),
        )

    batches = [packed([3, 2], 0), packed([4], 100)]
    lengths, n = write_features(batches, tmp_path)
    assert (lengths, n) == ([3, 2, 4], 2)
    files = sorted(tmp_path.glob("*.ckpt"))
    assert [f.name for f in files] == ["00000000.ckpt", "00000001.ckpt", "00000002.ckpt"]
    second = torch.load(files[1], weights_only=True)
    assert set(second) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
    torch.testing.assert_close(second["input_ids"], torch.tensor([3, 4]))
    assert second["hidden_state"].shape == (1, 2, 2) and second["aux_hidden_state"].shape == (1, 2, 6)
    assert second["hidden_state"].dtype == torch.bfloat16  # their TargetHead's dtype
    torch.testing.assert_close(second["hidden_state"][0].float(), batches[0].final[0, 3:5].bfloat16().float())
    torch.testing.assert_close(second["aux_hidden_state"][0], batches[0].aux[0, 3:5], rtol=0, atol=0)
    assert torch.load(files[2], weights_only=True)["input_ids"].tolist() == [100, 101, 102, 103]
