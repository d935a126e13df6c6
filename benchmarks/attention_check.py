"""The fused attention paths against the reference attention, where they run (CUDA, or CPU).

CI has no GPU, so the CUDA flash path (`torch.ops.aten._flash_attention_forward/_backward`,
varlen over packed documents) is exercised only here, on a GPU machine:

    private_op_problems(device)            # [] when the private ops have the signatures we call
    check_attention_parity(cfg, device, dtype)   # forward and every gradient vs the reference

The private ops are not a stable API (their arguments changed between torch releases), so their
signatures are compared with what `eagle31.kernels.causal.FlashCausal` passes before anything calls
them; a mismatch names the op instead of failing inside the kernel.
"""

from __future__ import annotations

import math

import torch

from eagle31.config import DrafterConfig
from eagle31.estimate import head_dims
from eagle31.kernels.ttt_attention import reference_attention, ttt_attention
from eagle31.model import Visibility, segment_ids

# Positional argument types and number of results of each private op, as FlashCausal calls it;
# each also takes the keywords of KEYWORDS (the CUDA ops their window arguments, the CPU ops a mask).
KEYWORDS = {"cuda": {"scale", "window_size_left", "window_size_right"}, "cpu": {"scale", "attn_mask"}}
PRIVATE_OPS = {
    "cuda": {
        "_flash_attention_forward": (
            (
                "Tensor",
                "Tensor",
                "Tensor",
                "Optional[Tensor]",
                "Optional[Tensor]",
                "int",
                "int",
                "float",
                "bool",
                "bool",
            ),
            5,
        ),
        "_flash_attention_backward": (("Tensor",) * 8 + ("int", "int", "float", "bool", "Tensor", "Tensor"), 3),
    },
    "cpu": {
        "_scaled_dot_product_flash_attention_for_cpu": (("Tensor", "Tensor", "Tensor", "float", "bool"), 2),
        "_scaled_dot_product_flash_attention_for_cpu_backward": (("Tensor",) * 6 + ("float", "bool"), 3),
    },
}


def private_op_problems(device: torch.device) -> list[str]:
    """Why the fused path cannot run on `device` with this torch: one line per op; [] when it can."""
    problems = []
    for name, (positional, results) in PRIVATE_OPS.get(device.type, {}).items():
        op = getattr(torch.ops.aten, name, None)
        if op is None or not hasattr(op, "default"):
            problems.append(f"torch {torch.__version__} has no torch.ops.aten.{name}")
            continue
        schema = op.default._schema
        got = tuple(str(a.type) for a in schema.arguments if not a.kwarg_only)
        keywords = {a.name for a in schema.arguments if a.kwarg_only}
        if got != positional or not KEYWORDS[device.type] <= keywords or len(schema.returns) != results:
            problems.append(f"torch {torch.__version__}: aten.{name} is `{schema}`, not the signature eagle31 calls")
    return problems


def attention_dims(cfg: DrafterConfig) -> tuple[int, int, int, int]:
    """(query heads, key/value heads, q·k head dim, value head dim) of the drafter's attention, as its kind
    says (`eagle31.attention`): an MLA drafter attends with one key/value head per query head and a
    q·k head dim (nope + rope parts) that differs from the value head dim.
    """
    return cfg.num_attention_heads, cfg.num_key_value_heads, *head_dims(cfg)


def check_attention_parity(
    cfg: DrafterConfig,
    device: torch.device,
    dtype: torch.dtype,
    seq_len: int = 300,
    backends: tuple[str, ...] | None = None,
) -> dict:
    """Fused backends against `reference_attention`: forward and gradients of every input.

    One row of `seq_len` tokens: two packed documents, padding at the end, and the j = 3 chain
    keys of a step k = 3 query, at the drafter's heads and head dims; a drafter with a sliding window is
    checked with a window of at most seq_len // 3 positions, so that it cuts the documents (the kernels
    take the same path for any window that does). Inputs are rounded to
    `dtype` once; the reference runs in fp32 on the same values. `backends`: default all fused
    ones that take `dtype` on `device`. Raises RuntimeError when a backend disagrees; returns
    {backend: {tensor: max error relative to the largest value}}.
    """
    g = torch.Generator(device="cpu").manual_seed(0)
    nh, nkv, d_qk, d_v = attention_dims(cfg)
    T, j = seq_len, 3

    def rand(heads, dim):
        x = torch.randn(1, T, heads, dim, generator=g)
        # an MLA drafter zero-pads its values to the q·k head dim for the kernels (eagle31.attention.mla)
        return torch.nn.functional.pad(x, (0, d_qk - dim)).to(dtype).to(device)

    # q, k0, v0, j chain keys, j chain values
    inputs = [rand(nh, d_qk), rand(nkv, d_qk), rand(nkv, d_v)]
    inputs += [rand(nkv, d_qk) for _ in range(j)] + [rand(nkv, d_v) for _ in range(j)]
    doc = torch.zeros(1, T, dtype=torch.long)
    doc[0, T // 3 :] = 1
    doc[0, T - T // 5 :] = -1  # padding
    segments = segment_ids(doc.to(device), None, (1, T), device=device)
    dout = rand(nh, d_v)
    names = ["out", "dq", "dk0", "dv0"] + [f"dchain_k{i}" for i in range(j)] + [f"dchain_v{i}" for i in range(j)]
    window = None if cfg.sliding_window is None else max(j + 1, min(cfg.sliding_window, T // 3))

    def run(backend, tensors):
        leaves = [t.detach().requires_grad_() for t in tensors]
        q, k0, v0, chain = leaves[0], leaves[1], leaves[2], leaves[3:]
        if backend == "reference":
            out = reference_attention(q, k0, v0, chain[:j], chain[j:], segments, Visibility(window))
        else:
            out = ttt_attention(q, k0, v0, list(zip(chain[:j], chain[j:])), segments, backend, rule=Visibility(window))
        grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
        return [out.detach().float()] + [x.float() for x in grads]

    expected = run("reference", [t.float() for t in inputs])
    tol = 1e-4 if dtype == torch.float32 else 5e-2  # bf16 rounding stays well below; a wrong mask gives O(1)
    report = {}
    for backend in fused_backends(device, dtype) if backends is None else backends:
        got = run(backend, inputs)
        errors = {
            n: float((a - b).abs().max() / b.abs().max().clamp(min=1e-6)) for n, a, b in zip(names, got, expected)
        }
        report[backend] = errors
        bad = {n: e for n, e in errors.items() if not math.isfinite(e) or e > tol}
        if bad:
            raise RuntimeError(
                f"attention backend {backend!r} disagrees with the reference on {device} ({dtype}): {bad}"
            )
    return report


def fused_backends(device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """The backends worth checking: flash where PyTorch's fused kernel takes `dtype`, blockwise always."""
    if device.type == "cpu" or dtype in (torch.bfloat16, torch.float16):
        return ("flash", "blockwise")
    return ("blockwise",)
