"""Peak memory of a training step grows far less than quadratically in T (efficient path).

Each measurement runs in a fresh process and reads its peak resident set size
(`ru_maxrss`) before and after one forward + backward of the TTT unroll and
loss, so the figure includes every temporary the step allocates.
"""

import json
import subprocess
import sys

import pytest

STEP = r"""
import json, resource, sys, torch
from eagle31 import DrafterConfig, Eagle31Drafter, TargetHead, supervision_mask, ttt_loss, ttt_unroll, weighted_loss
torch.manual_seed(0)
T, attention = int(sys.argv[1]), sys.argv[2]
cfg = DrafterConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=128, vocab_size=512, draft_vocab_size=256, target_num_layers=8,
                    aux_layer_ids=(2, 4, 5), max_position_embeddings=16384)
m = Eagle31Drafter(cfg)
aux = torch.randn(1, T, cfg.fc_in_features); final = torch.randn(1, T, 64)
ids = torch.randint(0, 512, (1, T)); mask = torch.ones(1, T, dtype=torch.long)
head = TargetHead(torch.randn(512, 64), m.draft_token_ids())
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = ttt_unroll(m, aux, ids, ttt_length=3, attention=attention)
argmax = head.argmax(final)
sup = supervision_mask(mask, out.segments, 3, m.t2d[argmax])
stats = ttt_loss(out.states, m.lm_head.weight, m.d2t, final, sup, head, argmax)
weighted_loss(stats.loss_sum, stats.count, 0.8).backward()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_kib": after - before}))
"""


def peak_kib(T: int, attention: str) -> int:
    out = subprocess.run([sys.executable, "-c", STEP, str(T), attention], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_kib"]


@pytest.mark.slow
def test_efficient_step_memory_is_far_from_quadratic():
    small, large = peak_kib(2048, "auto"), peak_kib(8192, "auto")
    ratio = large / small
    print(f"peak memory T=2048: {small / 1024:.1f} MiB, T=8192: {large / 1024:.1f} MiB, ratio {ratio:.2f} (quadratic: 16)")
    assert ratio < 6, ratio


@pytest.mark.slow
def test_reference_attention_is_quadratic_for_contrast():
    small, large = peak_kib(1024, "reference"), peak_kib(2048, "reference")
    assert large / small > 2.5  # doubling T roughly quadruples the explicit score tensors
