"""eagle31.memory_trace: the training step run on the meta device, its bytes counted by storage; the lines beyond."""

import pytest
import torch

from eagle31 import loss, ttt
from eagle31.config import DrafterConfig
from eagle31.kernels import causal as kernels
from eagle31.kernels.causal import CausalMask, FlashCausal
from eagle31.kernels.flash_cuda import flash_cuda_call_bytes
from eagle31.memory_trace import StepMemory, StepTrace, trace_step
from eagle31.model import Visibility, segment_ids
from eagle31.sequence_parallel.query_tail import QueryTail

META = torch.device("meta")
TINY = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    draft_vocab_size=256,
    max_position_embeddings=1 << 16,
    target_num_layers=8,
    aux_layer_ids=(2, 4, 5),
)


def test_a_storage_counts_once_while_a_tensor_holds_it():
    before = torch.empty(1000, device=META)  # made before: its views and in-place results are not new bytes
    with StepTrace() as trace:
        before.mul_(2)
        view = before[:10]
        x = torch.empty(1000, device=META)  # 4000 B
        y = x.view(10, 100)  # the same storage
        z = x + 1  # another 4000 B
        assert (trace.live, trace.peak) == (8000, 8000)
        del x
        assert trace.live == 8000  # y still holds the storage
        del y, z
        assert trace.live == 0 and trace.peak == 8000
    assert view.numel() == 10


def test_index_values_travel_beside_meta_tensors_and_shape_what_needs_them():
    """nonzero, unique and tolist read values: the trace knows them for integer tensors made of known ones, and
    refuses, naming the operation, where they come from meta floats."""
    with StepTrace() as trace:
        documents = torch.tensor([[0, 0, 1, 1, 1]]).to(META)
        runs = segment_ids(documents, None, documents.shape, device=META)
        assert runs.is_meta and trace.value(runs).tolist() == [[1, 1, 2, 2, 2]]
        assert runs.nonzero().shape == (5, 2) and (runs == 2).sum().item() == 3
        assert torch.unique_consecutive(runs.cpu(), return_counts=True)[1].tolist() == [2, 3]
        scores = torch.empty(5000, device=META)  # large floats carry no values
        with pytest.raises(RuntimeError, match="does not know the input values aten.nonzero"):
            (scores > 0).nonzero()


def test_a_flash_call_counted_as_on_cuda_holds_the_kernels_bytes():
    """On the meta device FlashCausal runs its CPU path; counted as on CUDA, the call holds what was held when it began
    plus `flash_cuda_call_bytes`, and after it what both paths return."""
    q = torch.empty(1, 64, 4, 16, device=META, dtype=torch.bfloat16)
    k, v = torch.empty_like(q), torch.empty_like(q)
    runs = torch.ones(1, 64, dtype=torch.long)
    with StepTrace(cuda=True) as trace:
        segments = runs.to(META)
        held = trace.live
        out, lse, ctx = FlashCausal.forward(q, k, v, segments, 0.25, CausalMask(Visibility(), 0))
        assert trace.peak == held + flash_cuda_call_bytes(False, q, k, v)
        assert trace.live == held + out.nbytes + lse.nbytes
    with StepTrace(cuda=False) as cpu:
        FlashCausal.forward(q, k, v, runs.to(META), 0.25, CausalMask(Visibility(), 0))
    assert cpu.peak != trace.peak


@pytest.mark.parametrize(
    "overrides, checkpointing, split",
    [
        ({}, True, 1),
        pytest.param({"sliding_window": 96}, False, 1, marks=pytest.mark.slow),
        pytest.param({}, True, 2, marks=pytest.mark.slow),
    ],
    ids=["checkpointed", "window", "split-2"],
)
def test_the_lines_past_the_fit_lengths_are_the_traced_step(overrides, checkpointing, split, monkeypatch):
    """Blocks shrunk (the chain's, the MLP's, the loss's chunks) so that a short step runs every loop steadily: the
    planes through the traces at (T0, P0), (T1, P0), (T0, P1) give, at twice T1 and every query supervised, the
    bytes a trace of that step holds."""
    monkeypatch.setattr(kernels, "BLOCK_BUDGET", 1 << 14)
    monkeypatch.setattr(ttt, "FEED_FORWARD_BUDGET", 1 << 15)
    monkeypatch.setattr(loss, "_LOGITS_BUDGET", 1 << 13)
    cfg = DrafterConfig(**TINY, **overrides)
    options = dict(activation_checkpointing=checkpointing, dtype=torch.float32, device="cpu", sequence_parallel=split)
    memory = StepMemory(cfg, 2, **options)
    assert memory.supervised_counts() == (66, 98)  # two and three chunks of 32 label rows
    T = 2 * memory.fit_lengths()[1]
    exact = trace_step(cfg, T, 2, **options)
    assert memory.at(T) == (exact.peak, exact.features)


@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 300}], ids=["unwindowed", "window"])
def test_two_blocks_of_each_shape_stand_for_a_shards_whole_prefix(overrides, monkeypatch):
    """The last of 4 ranks attends the keys of the 3 before it in many blocks; unwindowed, the trace runs two of each
    shape (`QueryTail.blocks`) and holds the bytes the whole loop does; a window's blocks all run."""
    monkeypatch.setattr(kernels, "BLOCK_BUDGET", 1 << 14)  # blocks of 128 keys, 32 queries
    cfg = DrafterConfig(**TINY, **overrides)
    options = dict(activation_checkpointing=True, dtype=torch.float32, device="cpu", sequence_parallel=4)
    masked = QueryTail._masked
    calls = []
    monkeypatch.setattr(QueryTail, "_masked", staticmethod(lambda *args: calls.append(1) or masked(*args)))
    steady = trace_step(cfg, 2048, 2, **options)
    steady_calls = len(calls)
    monkeypatch.setattr(QueryTail, "blocks", QueryTail.prefix_blocks)  # every block
    whole = trace_step(cfg, 2048, 2, **options)
    assert (steady.peak, steady.features, steady.held_features) == (whole.peak, whole.features, whole.held_features)
    if overrides:
        assert steady_calls == len(calls) - steady_calls  # a window's blocks differ in what they mask
    else:
        assert 0 < 10 * steady_calls < len(calls) - steady_calls
