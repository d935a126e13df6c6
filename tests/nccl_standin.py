"""NCCL's device rule, enforced on a CPU machine.

NCCL takes device tensors only: `ProcessGroupNCCL` checks every tensor a
collective is handed (`check_gpu_single_tensor`) and raises
`ValueError("Tensors must be CUDA and dense")` for a host tensor, and
"Tensors must be contiguous" for a strided one. gloo takes anything, so a CPU
run cannot see a collective that would break on GPUs.

On a CPU machine host memory *is* the world's device, so the device of a
tensor cannot tell the two apart; where it came from can. `DevicePlacement`
(a `TorchFunctionMode`) marks every tensor that reached the world's device the
way it would on a GPU:

- a factory (`torch.tensor`, `torch.zeros`, ...) or `Tensor.to` given that device;
- the result of an operation with at least one marked tensor input (an op on
  device tensors runs and returns there);

and leaves unmarked what would stay in host memory: factories without a
device, tensors read from files or NumPy, `Tensor.cpu()`. An explicit
`device="cpu"` counts as the world's device here (the one thing the stand-in
cannot tell apart).

`install(world_device)` wraps `torch.distributed`'s collectives (the API that
eagle31 calls, and that DCP's object collectives use inside): any unmarked or
non-contiguous tensor is refused with NCCL's own error, then gloo runs the
collective. Autograd runs a custom `Function`'s backward without the torch-function modes of the
thread that called `backward()`, so `install` also enters the mode around every such backward
(`BackwardCFunction.apply`), marking the incoming gradients (on a GPU they live where their
tensors do): a collective in a backward (a reduce-scatter of gathered keys' gradients) is checked
too. DTensor's functional collectives (FSDP2, full state dicts) are not
checked: they run below this mode, on local tensors that PyTorch places by the
mesh's device itself. Used by `tests/nccl_worker.py` under torchrun.
"""

from __future__ import annotations

import collections
import functools
import sys

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map_only

MARK = "_on_world_device"
CHECKED: collections.Counter = collections.Counter()  # collective name -> tensors checked
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
)
# torch >= 2.13's names of all_gather_into_tensor and reduce_scatter_tensor: checked where eagle31 calls them,
# not where torch calls them itself (FSDP2's reduce-scatter of gradients, in autograd's final callbacks)
PUBLIC_ONLY = ("all_gather_single", "reduce_scatter_single")


def check_tensor(t: torch.Tensor, where: str) -> None:
    """ProcessGroupNCCL's check_gpu_single_tensor, with the world's device standing in for CUDA."""
    CHECKED[where] += 1
    if not getattr(t, MARK, False) or t.is_sparse:
        raise ValueError(
            f"Tensors must be CUDA and dense ({where} was handed a tensor in host memory, shape {tuple(t.shape)})"
        )
    if not t.is_contiguous():
        raise ValueError(f"Tensors must be contiguous ({where})")


def _tensors(tree) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _mark(tree) -> None:
    def mark(t):
        setattr(t, MARK, True)
        return t

    tree_map_only(torch.Tensor, mark, tree)


def _names_device(value, device: torch.device) -> bool:
    if isinstance(value, (str, torch.device, int)) and not isinstance(value, bool):
        try:
            return torch.device(value).type == device.type
        except (RuntimeError, TypeError):
            return False
    return False


class DevicePlacement(TorchFunctionMode):
    """Marks the tensors that live on the world's device (see the module docstring)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        out = func(*args, **kwargs)
        if name == "cpu":  # a copy in host memory, as on a GPU (the mode is off inside this handler)
            return out.clone() if out is args[0] else out
        if name in ("numpy", "device"):
            return out
        if name.endswith("_") and not name.startswith("__") or name.startswith("__i"):
            return out  # in place: the tensor stays where it was
        if name == "to":
            moves = [a for a in (*args[1:], kwargs.get("device")) if _names_device(a, self.device)]
            if moves:
                _mark(out)
                return out
        if "device" in kwargs and kwargs["device"] is not None:
            if _names_device(kwargs["device"], self.device):
                _mark(out)
            return out
        if any(getattr(t, MARK, False) for t in _tensors((args, kwargs))):
            _mark(out)
        return out


def _checked(name: str, collective):
    @functools.wraps(collective)
    def run(*args, **kwargs):
        for t in _tensors((args, kwargs)):
            check_tensor(t, f"torch.distributed.{name}")
        return collective(*args, **kwargs)

    return run


def _checked_outside_torch(name: str, collective):
    checked = _checked(name, collective)

    @functools.wraps(collective)
    def run(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return collective(*args, **kwargs) if caller.startswith("torch.") else checked(*args, **kwargs)

    return run


def follow_into_backward(device: torch.device) -> None:
    """Custom autograd backwards run under `DevicePlacement(device)`, their incoming gradients marked."""
    backward = torch.autograd.function.BackwardCFunction
    apply = backward.apply

    def placed(self, *grads):
        _mark(grads)
        with DevicePlacement(device):
            return apply(self, *grads)

    backward.apply = placed


def install(device: torch.device) -> DevicePlacement:
    """Refuse host tensors in every collective from now on; returns the entered mode."""
    follow_into_backward(device)
    for name in COLLECTIVES:
        wrapped = _checked(name, getattr(c10d, name))
        setattr(c10d, name, wrapped)  # torch's own object collectives call these by module global
        setattr(dist, name, wrapped)
    for name in (n for n in PUBLIC_ONLY if hasattr(dist, n)):
        setattr(dist, name, _checked_outside_torch(name, getattr(dist, name)))
    mode = DevicePlacement(device)
    mode.__enter__()
    return mode
