"""The NCCL stand-in (tests/nccl_standin.py) refuses what NCCL refuses and passes what it takes."""

import pytest
import torch
from torch import nn

from tests.nccl_standin import DevicePlacement, check_tensor

WORLD = torch.device("cpu")


@pytest.fixture
def placement():
    with DevicePlacement(WORLD) as mode:
        yield mode


def test_a_tensor_made_without_a_device_is_refused_like_nccl_refuses_host_memory(placement):
    with pytest.raises(ValueError, match="Tensors must be CUDA and dense"):
        check_tensor(torch.tensor(3.0, dtype=torch.float64), "all_reduce")
    with pytest.raises(ValueError, match="Tensors must be CUDA and dense"):
        check_tensor(torch.zeros(4).double() + 1, "all_reduce")  # derived from host tensors only
    with pytest.raises(ValueError, match="Tensors must be CUDA and dense"):
        check_tensor(torch.zeros(4, device=WORLD).cpu(), "all_reduce")  # brought back to the host


def test_tensors_placed_on_the_world_device_and_their_results_pass(placement):
    check_tensor(torch.tensor(3.0, device=WORLD), "all_reduce")
    moved = torch.arange(6).to(WORLD)
    check_tensor(moved, "all_reduce")
    check_tensor(sum(x.sum() for x in (moved, torch.ones(2))).double(), "all_reduce")  # mixed: runs on the device
    layer = nn.Linear(3, 2).to(WORLD)
    check_tensor(layer(torch.ones(1, 3)), "all_gather")


def test_a_strided_device_tensor_is_refused(placement):
    with pytest.raises(ValueError, match="contiguous"):
        check_tensor(torch.zeros(4, 4, device=WORLD).t(), "all_reduce")


def test_a_custom_backward_places_like_its_forward(monkeypatch):
    """Autograd drops the torch-function modes in a custom Function's backward; the stand-in follows it there."""
    from tests.nccl_standin import follow_into_backward

    monkeypatch.setattr(
        torch.autograd.function.BackwardCFunction, "apply", torch.autograd.function.BackwardCFunction.apply
    )
    follow_into_backward(WORLD)
    seen = []

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            check_tensor(grad.contiguous(), "reduce_scatter_single")  # the incoming gradient is where its tensor is
            check_tensor(torch.zeros(3, device=grad.device), "reduce_scatter_single")
            with pytest.raises(ValueError, match="host memory"):
                check_tensor(torch.zeros(3), "reduce_scatter_single")
            seen.append(True)
            return grad * 2

    with DevicePlacement(WORLD):
        x = torch.ones(3, device=WORLD, requires_grad=True)
        Double.apply(x).sum().backward()
    assert seen == [True]
