"""Peak memory of the training step (the CPU proxy of the long-context goal): linear in T, lowered by activation checkpointing.

Each figure is `benchmarks.measure.cpu_step_peak_bytes`: two full trainer steps (TTT unroll, loss,
backward, AdamW) of a small drafter on one packed sequence, in a fresh process, as the peak of the
bytes its tensors hold above the built model (`LiveTensorBytes`) — every tensor the step makes
counts, and nothing the allocator keeps or other processes do: repeated runs give the same bytes
(docs/performance.md), so the margins below are the model's, not the machine's.
"""

import functools

import pytest
import torch

from benchmarks.measure import LiveTensorBytes, cpu_step_peak_bytes
from benchmarks.train_step import BenchConfig

SMALL = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
    vocab_size=512, draft_vocab_size=256,
)  # fmt: skip
# the same width with MLA attention (eagle31.mla): q·k head dim 24, v head dim 16
SMALL_MLA = dict(
    SMALL, attention="mla", num_key_value_heads=4, head_dim=24, q_lora_rank=32, kv_lora_rank=16,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
)  # fmt: skip
# Kimi K2.6's full vocabulary (Vd = V = 163840, as the published MLA drafter) on the MLA drafter
DRAFTERS = {"llama": SMALL, "mla": SMALL_MLA, "mla_full_vocab": dict(SMALL_MLA, vocab_size=163840, draft_vocab_size=163840)}


@functools.cache
def peak_bytes(T: int, checkpointing: bool = True, attention: str = "auto", drafter: str = "llama") -> int:
    bench = BenchConfig(
        shape="tiny", seq_len=T, ttt_length=3, overrides=DRAFTERS[drafter], activation_checkpointing=checkpointing, attention=attention,
        threads=1,  # steadier than two on a busy machine
    )  # fmt: skip
    return cpu_step_peak_bytes("eagle31", bench)


def test_live_tensor_bytes_counts_each_storage_once_while_a_tensor_holds_it():
    before = torch.ones(1000)  # made before: its in-place results and views are not new memory
    with LiveTensorBytes() as live:
        before.mul_(2)
        view = before[:10]
        x = torch.empty(1000)  # 4000 B
        y = x.view(10, 100)  # the same storage
        z = x + 1  # another 4000 B
        assert (live.live, live.peak) == (8000, 8000)
        del x
        assert live.live == 8000  # y still holds the storage
        del y, z
        assert live.live == 0 and live.peak == 8000
        live.reset_peak()
        w = torch.zeros(10)
        assert live.peak == 40
    assert view.numel() == 10 and w.numel() == 10


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["llama", "mla"])
def test_step_memory_grows_linearly_with_sequence_length(drafter):
    short, long = peak_bytes(4096, drafter=drafter), peak_bytes(16384, drafter=drafter)
    ratio = long / short
    print(f"{drafter} peak T=4096: {short / 2**20:.0f} MiB, T=16384: {long / 2**20:.0f} MiB, ratio {ratio:.2f} (linear 4, quadratic 16)")
    assert ratio <= 4.4
    assert long < 16384 * 16384 * 4  # less than a single fp32 T x T score matrix of one head


@pytest.mark.slow
def test_activation_checkpointing_lowers_step_memory():
    with_ckpt, without = peak_bytes(16384), peak_bytes(16384, checkpointing=False)
    print(f"peak T=16384: {with_ckpt / 2**20:.0f} MiB with activation checkpointing, {without / 2**20:.0f} MiB without")
    # measured 168 vs 407 MiB (0.41), the same bytes on every repeat: the margin is for the model changing, not noise
    assert with_ckpt < 0.5 * without


@pytest.mark.slow
def test_reference_attention_is_quadratic_for_contrast():
    """The measurement sees quadratic growth where there is some: the explicit-scores attention."""
    small, large = peak_bytes(1024, False, "reference"), peak_bytes(2048, False, "reference")
    assert large / small > 2.5  # doubling T roughly quadruples the explicit score tensors


@pytest.mark.slow
def test_full_vocabulary_loss_never_holds_the_logits():
    """Vd = V = 163840: the chunked lm_head + KL adds far less per token than [T, V] fp32 logits would.

    The peak has a fixed part (the lm_head, its gradient and Adam state at V rows), so the test
    compares the growth of the peak between two lengths with the growth of one logits tensor.
    """
    V, short, long = 163840, 512, 1536
    grown = peak_bytes(long, drafter="mla_full_vocab") - peak_bytes(short, drafter="mla_full_vocab")
    logits_grown = (long - short) * V * 4
    print(f"full vocabulary, T {short} -> {long}: peak +{grown / 2**20:.0f} MiB; [T, V] fp32 logits +{logits_grown / 2**20:.0f} MiB")
    assert grown < logits_grown / 4


def test_live_tensor_bytes_peak_without_what_is_excluded():
    excluded = [0]
    with LiveTensorBytes(excluded=lambda: excluded[0]) as live:
        a = torch.empty(100)  # 400 B, then left out (as the memory model leaves out gradients)
        excluded[0] = 400
        b = torch.empty(50)  # 200 B
        assert live.peak == 600 and live.peak_without == 400  # 400 before it was excluded, 200 after
        c = torch.empty(100)
        assert live.peak_without == 600
    assert a.numel() + b.numel() + c.numel() == 250
