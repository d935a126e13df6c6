"""Peak memory of the training step (the CPU proxy of the long-context goal): linear in T, lowered by activation checkpointing.

Each figure is `eagle31.bench.cpu_step_peak_bytes`: two full trainer steps (TTT unroll, loss,
backward, AdamW) of a small drafter on one packed sequence, in a fresh process, as the rise of
its resident set over the built model — every temporary the step allocates counts.
"""

import functools

import pytest

from eagle31.bench import BenchConfig, cpu_step_peak_bytes

SMALL = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
    vocab_size=512, draft_vocab_size=256,
)  # fmt: skip


@functools.cache
def peak_bytes(T: int, checkpointing: bool = True, attention: str = "auto") -> int:
    bench = BenchConfig(
        shape="tiny", seq_len=T, ttt_length=3, overrides=SMALL, activation_checkpointing=checkpointing, attention=attention,
        threads=1,  # steadier than two on a busy machine
    )  # fmt: skip
    return cpu_step_peak_bytes("eagle31", bench)


@pytest.mark.slow
def test_step_memory_grows_linearly_with_sequence_length():
    short, long = peak_bytes(4096), peak_bytes(16384)
    ratio = long / short
    print(f"peak T=4096: {short / 2**20:.0f} MiB, T=16384: {long / 2**20:.0f} MiB, ratio {ratio:.2f} (linear 4, quadratic 16)")
    assert ratio <= 4.4
    assert long < 16384 * 16384 * 4  # less than a single fp32 T x T score matrix of one head


@pytest.mark.slow
def test_activation_checkpointing_lowers_step_memory():
    with_ckpt, without = peak_bytes(16384), peak_bytes(16384, checkpointing=False)
    print(f"peak T=16384: {with_ckpt / 2**20:.0f} MiB with activation checkpointing, {without / 2**20:.0f} MiB without")
    assert with_ckpt < 0.8 * without


@pytest.mark.slow
def test_reference_attention_is_quadratic_for_contrast():
    """The measurement sees quadratic growth where there is some: the explicit-scores attention."""
    small, large = peak_bytes(1024, False, "reference"), peak_bytes(2048, False, "reference")
    assert large / small > 2.5  # doubling T roughly quadruples the explicit score tensors
