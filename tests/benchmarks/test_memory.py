"""Peak memory of the training step (the CPU proxy of the long-context goal): linear in T, lowered by activation
checkpointing.

Each figure is `benchmarks.measure.step_tensor_peak_bytes`: two full trainer steps (TTT unroll, loss,
backward, AdamW) of a small drafter on one packed sequence, as the peak of the bytes its tensors
hold above the built model (`LiveTensorBytes`) — every tensor the step makes counts, and nothing
the allocator keeps or other processes do: repeated runs, in this process or a fresh one, give the
same bytes (docs/performance.md), so the margins below are the model's, not the machine's.
"""

import functools

import pytest
import torch

from benchmarks.measure import LiveTensorBytes, cpu_step_peak_bytes, step_tensor_peak_bytes
from benchmarks.train_step import BenchConfig

SMALL = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    draft_vocab_size=256,
)
# the same width with MLA attention (eagle31.attention.mla): q·k head dim 24, v head dim 16
MLA_TINY = dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
SMALL_MLA = dict(SMALL, attention="mla", num_key_value_heads=4, head_dim=24, mla=MLA_TINY)
# Kimi K2.6's full vocabulary (Vd = V = 163840, as the published MLA drafter) on the MLA drafter
DRAFTERS = {
    "llama": SMALL,
    "mla": SMALL_MLA,
    "mla_full_vocab": dict(SMALL_MLA, vocab_size=163840, draft_vocab_size=163840),
}


def bench(T: int, checkpointing: bool = True, attention: str = "auto", drafter: str = "llama") -> BenchConfig:
    return BenchConfig(
        shape="tiny",
        seq_len=T,
        ttt_length=3,
        overrides=DRAFTERS[drafter],
        activation_checkpointing=checkpointing,
        attention=attention,
        threads=1,
    )


@functools.cache
def peak_bytes(T: int, checkpointing: bool = True, attention: str = "auto", drafter: str = "llama") -> int:
    return step_tensor_peak_bytes("eagle31", bench(T, checkpointing, attention, drafter))


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
    """The growth of the peak from T = 2048 to 4096 against that from 1024 to 2048: 2 when linear
    (measured 2.000 for both drafters), 4 for a T^2 part; the fixed part cancels out."""
    p1, p2, p4 = (peak_bytes(T, drafter=drafter) for T in (1024, 2048, 4096))
    ratio = (p4 - p2) / (p2 - p1)
    peaks = " / ".join(f"{p / 2**20:.1f}" for p in (p1, p2, p4))
    print(f"{drafter} peak T=1024/2048/4096: {peaks} MiB, growth ratio {ratio:.3f}")
    assert ratio <= 2.2
    assert p4 < 4096 * 4096 * 4  # less than a single fp32 T x T score matrix of one head


@pytest.mark.slow
def test_activation_checkpointing_lowers_step_memory():
    with_ckpt, without = peak_bytes(4096), peak_bytes(4096, checkpointing=False)
    print(f"peak T=4096: {with_ckpt / 2**20:.1f} MiB with activation checkpointing, {without / 2**20:.1f} MiB without")
    # measured 41.6 vs 100.5 MiB (0.41), the same bytes on every repeat: the margin is for the model changing, not noise
    assert with_ckpt < 0.5 * without


@pytest.mark.slow
def test_reference_attention_is_quadratic_for_contrast():
    """The measurement sees quadratic growth where there is some: the explicit-scores attention."""
    small, large = peak_bytes(512, False, "reference"), peak_bytes(1024, False, "reference")
    assert large / small > 2.5  # measured 3.63: doubling T roughly quadruples the explicit score tensors


@pytest.mark.slow
def test_full_vocabulary_loss_never_holds_the_logits():
    """Vd = V = 163840: the chunked lm_head + KL adds far less per token than [T, V] fp32 logits would.

    The peak has a fixed part (the lm_head, its gradient and Adam state at V rows, one chunk of
    rows x V), so the test compares the growth of the peak between two lengths, both past one
    chunk (102 rows), with the growth of one logits tensor.
    """
    V, short, long = 163840, 128, 256
    grown = peak_bytes(long, drafter="mla_full_vocab") - peak_bytes(short, drafter="mla_full_vocab")
    logits_grown = (long - short) * V * 4
    logits = f"[T, V] fp32 logits +{logits_grown / 2**20:.0f} MiB"
    print(f"full vocabulary, T {short} -> {long}: peak +{grown / 2**20:.1f} MiB; {logits}")
    assert grown < logits_grown / 4


@pytest.mark.slow
def test_a_fresh_process_counts_the_same_bytes():
    """The in-process count is the fresh process's count, to the byte."""
    assert cpu_step_peak_bytes("eagle31", bench(1024)) == peak_bytes(1024)
